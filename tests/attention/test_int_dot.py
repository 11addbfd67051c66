"""The CPU kernel's integer scores for 4-bit K codes (int4 under any rotation, q4_0) against the reference.

With ``int_dot`` the kernel never unpacks K to floats: the query is split into three int8 parts and the codes' byte
dot products are summed exactly in int32 (``IQuery`` in attention/cpu_kernel_idot.h). These tests hold it to the
float path's tolerance over head sizes that fill no whole code vector, GQA groups, batches, lengths that end
mid-tile, bf16 queries, and the queries it hands back to the float path (too small to split).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from walshkv.attention import cpu, decode_attention
from walshkv.codecs.registry import parse_codec

pytestmark = pytest.mark.skipif(not cpu.kernel_available(), reason="the CPU kernel cannot be built here")

PAIRS = [("rot+int4", "rot+int4"), ("int4", "int8"), ("q4_0", "q4_0"), ("q4_0", "q8_0"), ("rrot:7+int4", "int3")]


def _case(kspec: str, vspec: str, d: int, hq: int, kv: int, t: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc = parse_codec(kspec), parse_codec(vspec)
    k = 3 * torch.randn(2, kv, t, d, generator=gen)
    v = torch.randn(2, kv, t, d, generator=gen)
    q = 2 * torch.randn(2, hq, 1, d, generator=gen)
    return q, kc.encode(k), vc.encode(v), kc, vc


def _float_path(q, pk, pv, kc, vc, monkeypatch):
    with monkeypatch.context() as m:
        m.setenv("WALSHKV_CPU_INT_DOT", "0")
        assert not cpu.int_dot_scores()
        return decode_attention(q, pk, pv, kc, vc, backend="cpu")


def _has_byte_dot_products() -> bool:
    """Whether this CPU has the byte dot products the kernel's integer path needs, from its own flags (not the
    kernel's): AVX-512BW where the kernel is built for AVX-512 (``-march=native`` on an AVX-512F CPU), else AVX2."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: torch's reading of the ISA
        return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    flags = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return "avx512bw" in flags if "avx512f" in flags else "avx2" in flags


def test_the_integer_path_is_built_where_the_isa_has_byte_dot_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """Built, and used, exactly where the CPU has byte dot products (on every other CPU: the float path)."""
    kernel = cpu.load_kernel()
    expected = _has_byte_dot_products()
    assert kernel.int_dot_compiled is expected
    monkeypatch.setenv("WALSHKV_CPU_INT_DOT", "1")
    assert cpu.int_dot_scores() is expected
    monkeypatch.setenv("WALSHKV_CPU_INT_DOT", "0")  # the switch to the float path
    assert cpu.int_dot_scores() is False


def _fits(kspec: str, d: int) -> bool:  # q4_0: head_dim a multiple of 32; the rotations: a power of two
    return not (kspec.startswith("q4_0") and d % 32) and not ("rot" in kspec and d & (d - 1))


@pytest.mark.parametrize(
    ("kspec", "vspec", "d"),
    [(k, v, d) for k, v in PAIRS for d in (32, 48, 64, 80, 96, 128, 256) if _fits(k, d) and _fits(v, d)],
)
def test_head_sizes(kspec: str, vspec: str, d: int, monkeypatch: pytest.MonkeyPatch) -> None:
    q, pk, pv, kc, vc = _case(kspec, vspec, d, 6, 2, 77)
    want = decode_attention(q, pk, pv, kc, vc, backend="reference")
    got = decode_attention(q, pk, pv, kc, vc, backend="cpu")
    torch.testing.assert_close(got, want, atol=3e-5, rtol=0)
    torch.testing.assert_close(got, _float_path(q, pk, pv, kc, vc, monkeypatch), atol=3e-5, rtol=0)


@pytest.mark.parametrize("kspec", ["rot+int4", "q4_0"])
@pytest.mark.parametrize("ratio", [1, 3, 6, 7])
@pytest.mark.parametrize("t", [1, 15, 33, 1029])
def test_groups_and_lengths(kspec: str, ratio: int, t: int) -> None:
    q, pk, pv, kc, vc = _case(kspec, "int4", 64, 2 * ratio, 2, t, seed=t + ratio)
    want = decode_attention(q, pk, pv, kc, vc, backend="reference")
    torch.testing.assert_close(decode_attention(q, pk, pv, kc, vc, backend="cpu"), want, atol=3e-5, rtol=0)
    got16 = decode_attention(q.to(torch.bfloat16), pk, pv, kc, vc, backend="cpu")
    want16 = decode_attention(q.to(torch.bfloat16), pk, pv, kc, vc, backend="reference")
    torch.testing.assert_close(got16.float(), want16.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("kspec", ["int4", "q4_0"])
@pytest.mark.parametrize("qscale", [0.0, 1e-37, 1e-6, 1e4])
def test_query_magnitudes(kspec: str, qscale: float) -> None:
    """A zero query (uniform weights), one too small to split (the float path), and large ones."""
    q, pk, pv, kc, vc = _case(kspec, "int4", 64, 3, 1, 200)
    q = q / q.abs().amax() * qscale
    want = decode_attention(q, pk, pv, kc, vc, backend="reference", scale=1.0)
    got = decode_attention(q, pk, pv, kc, vc, backend="cpu", scale=1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=3e-5, rtol=1e-5)
