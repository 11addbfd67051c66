"""The codec matrix's "fused == reference" column: every entry a fused kernel reads, on that kernel.

For each entry of the shared matrix (``tests/codecs/matrix.py``, bound as the contract binds it, with
``CalibrationStub``) whose codec ``cpu_supports`` / ``triton_supports``, random K/V
``[batch, kv_heads, seq, head_dim]`` (GQA: three or two query heads per kv head) are encoded with it and
``decode_attention`` on the fused backend is compared with ``backend="reference"`` over the same packed
cache. The entry's codec encodes both K and V, so the kernel's K and V paths both read it.

Tolerances are those of tests/attention/test_attention.py (CPU) and test_attention_triton.py (Triton):
float32 query, outputs of magnitude ~1. While the fused call runs the reference's partial is forbidden, so a
kernel that falls back to it (no compiler, a codec quietly dropped from the plan) fails instead of comparing
the reference with itself. :func:`test_the_kernels_read_every_codec_they_document` checks which entries are
in the column at all.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

# the shared matrix lives beside the contract (tests/codecs/matrix.py, imported there as "matrix")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))

from matrix import MATRIX, CalibrationStub, Entry
from test_attention import ATOL, _kv, _query

from walshkv.attention import cpu_supports, decode_attention, triton_supports
from walshkv.attention import decode as attn
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.registry import parse_codec

KV_HEADS = 2  # CalibrationStub's kv heads: the eq+ transforms are per kv head

#: The core codecs the kernels document (CPU_SUPPORTED, TRITON_SUPPORTED) and the wrappers they read through.
KERNEL_CODECS = {"int2", "int3", "int4", "int5", "int6", "int7", "int8", "q4_0", "q8_0", "vht2", "tq", "tcq"}
PEELED = {"rot", "rrot", "center", "eq", "eqd", "eqr"}
#: What one kernel reads beyond those.
EXTRA_CODECS = {"cpu": {"iq4_nl"}, "triton": set()}
EXTRA_WRAPPERS = {"cpu": {"prerope", "ropeblock"}, "triton": {"prerope"}}
#: Shapes of spec the matrix must keep at least one kernel-read entry of.
SHAPES = {
    "intB": r"int[2-8]",
    "rot+intB": r"r?rot(:\d+)?\+int[2-8]",
    "q4_0": r".*q4_0",
    "q8_0": r"q8_0",
    "vht2": r"vht2(:.*)?",
    "tq": r"tq:.*",
    "tcq": r"tcq:.*",
    "center+": r"center\+.*",
    "eq+": r"(center\+)?eq\+.*",
    "prerope+": r"prerope\+.*",
}

# (atol, rtol): test_codecs_match_sdpa and its kin; test_center_wrapper_is_peeled; test_eq_wrapper_maps_...
CPU_TOL = {"plain": (2e-5, 1e-4), "center": (2e-5, 0.0), "eq": (5e-5, 1e-4)}
TRITON_TOL = (ATOL[torch.float32], 0.0)  # test_attention_triton._check, eq+ included

HAS_COMPILER = any(shutil.which(c) for c in ("c++", "g++", "clang++"))
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _codec(entry: Entry) -> Codec:
    return parse_codec(entry.spec).bind(1, entry.kind, CalibrationStub(entry.head_dim, KV_HEADS))


def _family(entry: Entry) -> str:
    wraps = {w.split(":")[0] for w in entry.spec.split("+")[:-1]}
    return "eq" if "eq" in wraps else "center" if "center" in wraps else "plain"


def _documented(entry: Entry, kernel: str = "cpu") -> bool:
    *wraps, base = entry.spec.split("+")
    codecs, peeled = KERNEL_CODECS | EXTRA_CODECS[kernel], PEELED | EXTRA_WRAPPERS[kernel]
    return base.split(":")[0] in codecs and all(w.split(":")[0] in peeled for w in wraps)


def _v_codec(entry: Entry, k_codec: Codec) -> Codec:
    """The V codec paired with an entry: the entry's own, or for a K-only (prerope+) entry its core on V."""
    if not entry.positional:
        return k_codec
    rest = entry.spec.split("+", 1)[1].split("+")  # the K frame off, then center+ and eqr+ (K only)
    spec = "+".join(w for w in rest if w != "center" and not w.startswith("eqr"))
    return parse_codec(spec).bind(1, "v", CalibrationStub(entry.head_dim, KV_HEADS))


def _cache(entry: Entry, b: int, t: int, seed: int) -> tuple[Codec, Codec, Packed, Packed]:
    codec = _codec(entry)
    v_codec = _v_codec(entry, codec)
    k, v = _kv(b, KV_HEADS, t, entry.head_dim, seed)
    return codec, v_codec, codec.encode(k), v_codec.encode(v)


@pytest.fixture
def forbid_reference(monkeypatch: pytest.MonkeyPatch):
    """Call it to make any later use of the reference's partial (a silent fallback) fail."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a fused backend fell back to the reference path")

    return lambda: monkeypatch.setattr(attn, "reference_partial", forbidden)


CPU_ENTRIES = [e for e in MATRIX if cpu_supports(_codec(e), e.head_dim)]
TRITON_ENTRIES = [e for e in MATRIX if triton_supports(_codec(e), e.head_dim)]


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler: the CPU kernel cannot be built")
@pytest.mark.parametrize("entry", CPU_ENTRIES, ids=lambda e: e.id)
def test_cpu_kernel_matches_the_reference(entry: Entry, forbid_reference) -> None:
    codec, v_codec, pk, pv = _cache(entry, 2, 300, seed=31)  # 300 tokens: nine whole tiles of 32 and a partial one
    q = _query(2, 3 * KV_HEADS, entry.head_dim)
    want = decode_attention(q, pk, pv, codec, v_codec, backend="reference")
    forbid_reference()
    atol, rtol = CPU_TOL[_family(entry)]
    for backend in ("cpu", "auto"):  # auto must pick the kernel too
        out = decode_attention(q, pk, pv, codec, v_codec, backend=backend)
        assert out.shape == q.shape and out.dtype == q.dtype
        torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("entry", TRITON_ENTRIES, ids=lambda e: e.id)
def test_triton_kernel_matches_the_reference(entry: Entry, forbid_reference, monkeypatch: pytest.MonkeyPatch) -> None:
    codec, v_codec, pk, pv = _cache(entry, 1, 37, seed=32)  # tiny: the interpreter is slow
    q = _query(1, 2 * KV_HEADS, entry.head_dim)
    want = decode_attention(q, pk, pv, codec, v_codec, backend="reference")
    forbid_reference()
    calls: list[int] = []
    for name in ("fused_decode_triton", "fused_decode_triton_prerope"):
        kernel = getattr(attn, name)
        monkeypatch.setattr(attn, name, lambda *a, _k=kernel, **kw: calls.append(1) or _k(*a, **kw))
    out = decode_attention(q, pk, pv, codec, v_codec, backend="triton")
    assert calls, "backend='triton' did not run the Triton kernel"
    torch.testing.assert_close(out, want, atol=TRITON_TOL[0], rtol=TRITON_TOL[1])


def test_the_kernels_read_every_codec_they_document() -> None:
    """An entry whose codec the kernels document must be read by them, not sent to the reference."""
    for name, kernel in (("cpu", cpu_supports), ("triton", triton_supports)):
        documented = [e for e in MATRIX if _documented(e, name)]
        got = {e.id for e in MATRIX if kernel(_codec(e), e.head_dim)}
        missing = [e.id for e in documented if e.id not in got]
        assert not missing, f"{name}_supports is False for {missing}: these would silently run on the reference"
        extra = sorted(got - {e.id for e in documented})
        assert not extra, f"{name}_supports reads {extra}: add them to KERNEL_CODECS/PEELED (and the docs)"
    documented = [e for e in MATRIX if _documented(e, "cpu")]
    shapes = [s for s, pattern in SHAPES.items() if not any(re.fullmatch(pattern, e.spec) for e in documented)]
    assert not shapes, f"tests/codecs/matrix.py has no kernel-read entry of the form {shapes}"
