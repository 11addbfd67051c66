"""The Triton kernel for keys stored before RoPE (``fused_decode_triton_prerope``), on the CPU.

``TRITON_INTERPRET=1`` is set before triton is imported, so the kernel runs through Triton's interpreter
on CPU tensors. Codecs are bound as the codec matrix binds them (``tests/codecs/matrix.py``,
``CalibrationStub``: RoPE table, pre-RoPE mean and ``eq+`` transforms for two kv heads). Every case is
compared with attention in float64 over the whole cache decoded by the codecs themselves
(``k_codec.decode(packed_k, start)``, ``v_codec.decode(packed_v)``). Sizes are small: the interpreter is slow.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the importorskip below)

import pytest
import torch

pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))

from matrix import CalibrationStub

from walshkv.attention import triton_decode as at
from walshkv.attention.peeling import peel
from walshkv.attention.reference import unrotate
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.registry import parse_codec

KV_HEADS = 2  # CalibrationStub's kv heads
D = 64
TOL = 1e-4  # float32 kernel against float64 attention, outputs of magnitude ~1


def _bind(spec: str, kind: str, d: int = D) -> Codec:
    return parse_codec(spec).bind(1, kind, CalibrationStub(d, KV_HEADS))  # type: ignore[arg-type]


def _data(b: int, t: int, g: int, seed: int, d: int = D) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query ``[b, kv, g, d]`` (softmax scale applied), K and V ``[b, kv, t, d]``."""
    gen = torch.Generator().manual_seed(seed)
    k = 1.5 * torch.randn(b, KV_HEADS, t, d, generator=gen) + 0.5  # an offset for center+ to remove
    v = torch.randn(b, KV_HEADS, t, d, generator=gen)
    q = torch.randn(b, KV_HEADS, g, d, generator=gen) / math.sqrt(d)
    return q, k, v


def _expected(
    q: torch.Tensor, pk: Packed, pv: Packed, kc: Codec, vc: Codec, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention over the decoded cache: the scores' max ``[b, kv, g]`` and the output ``[b, kv, g, d]``."""
    k = kc.decode(pk, start).to(torch.float64)
    v = vc.decode(pv).to(torch.float64)
    s = q.to(torch.float64) @ k.transpose(-1, -2)  # [b, kv, g, t]
    return s.amax(-1), torch.softmax(s, -1) @ v


def _run(
    kspec: str, vspec: str, b: int, t: int, g: int, start: int, seed: int, block_n: int | None = None, d: int = D
) -> float:
    """Run the kernel on a fresh cache, check it against :func:`_expected`; the max output error."""
    kc, vc = _bind(kspec, "k", d), _bind(vspec, "v", d)
    q, k, v = _data(b, t, g, seed, d)
    pk, pv = kc.encode(k, start), vc.encode(v)
    v_rots, v_core = peel(vc)
    assert at.triton_supports_prerope(kc, d)
    m, l_sum, acc = at.fused_decode_triton_prerope(q, pk, pv, kc, v_core, start, block_n=block_n)
    assert m.shape == l_sum.shape == (b, KV_HEADS, g) and acc.shape == (b, KV_HEADS, g, d)
    assert m.dtype == l_sum.dtype == acc.dtype == torch.float32
    out = unrotate(acc, v_rots) / l_sum.unsqueeze(-1)
    want_m, want = _expected(q, pk, pv, kc, vc, start)
    torch.testing.assert_close(m.double(), want_m, atol=TOL, rtol=0)
    err = (out.double() - want).abs().max().item()
    assert err < TOL, f"{kspec}/{vspec} t={t} g={g} start={start}: max error {err:.2e}"
    return err


#: (K, V, group, length, start): lengths not a multiple of the block (64 tokens at head_dim 64)
CASES = list(
    itertools.product(["prerope+tq:4", "prerope+center+eq+tq:3.5"], ["tq:3", "tq:2.5"], [1, 3], [37, 70], [0, 3])
)


@pytest.mark.parametrize(("kspec", "vspec", "g", "t", "start"), CASES)
def test_matches_float64_attention(kspec: str, vspec: str, g: int, t: int, start: int) -> None:
    _run(kspec, vspec, 2, t, g, start, seed=t + g + start)


@pytest.mark.parametrize(
    ("kspec", "vspec"),
    [
        ("prerope+center+rot+int4", "rot+int8"),  # rotation wrappers folded into the key matrix, V unrotated
        ("prerope+center+q8_0", "q4_0"),
        ("prerope+eq+vht2:5,5,4,3", "vht2:3"),
    ],
)
def test_other_core_formats_and_small_blocks(kspec: str, vspec: str) -> None:
    """The key matrix for every buffer basis (identity, WHT coefficients), several blocks of 16 tokens."""
    _run(kspec, vspec, 1, 37, 3, start=5, seed=11, block_n=16)


def test_far_positions_and_masked_half() -> None:
    """Positions past the first cached table (grown on demand); head_dim 96 (halves of 48, masked lanes)."""
    _run("prerope+center+eq+tq:3.5", "tq:3", 1, 21, 4, start=3000, seed=5)
    _run("prerope+center+int4", "int6", 2, 45, 2, start=7, seed=6, d=96)


def test_supports() -> None:
    kc = _bind("prerope+center+eq+tq:3.5", "k")
    assert at.triton_supports_prerope(kc, D)
    assert not at.triton_supports_prerope(kc, 32)  # the RoPE table's head_dim is 64
    assert not at.triton_supports_prerope(parse_codec("prerope+tq:4"), D)  # not bound: no RoPE table
    assert not at.triton_supports_prerope(_bind("tq:4", "k"), D)  # not prerope+
    assert not at.triton_supports_prerope(_bind("prerope+q5_0", "k"), D)  # a core the kernel does not read


def test_refusals() -> None:
    kc, vc = _bind("prerope+tq:4", "k"), _bind("tq:3", "v")
    q, k, v = _data(1, 5, 1, seed=0)
    pk, pv = kc.encode(k), vc.encode(v)
    with pytest.raises(ValueError, match="not a prerope"):
        at.fused_decode_triton_prerope(q, pk, pv, vc, vc, 0)
    with pytest.raises(ValueError, match="does not read"):
        at.fused_decode_triton_prerope(q, pk, pv, kc, _bind("q5_0", "v"), 0)
    with pytest.raises(ValueError, match="start"):
        at.fused_decode_triton_prerope(q, pk, pv, kc, vc, -1)
    with pytest.raises(ValueError, match="tokens"):
        at.fused_decode_triton_prerope(q, pk, pv.slice_seq(0, 4), kc, vc, 0)
