"""The shipped presets' codecs in the fused decode kernels: every part of a preset spec against the reference.

The presets store K before RoPE behind a mean and an ``eq+`` transform (``prerope+center+eq+tq:B``), V as ``tq:B``,
and keep ``sink:1:`` tokens in fp16 (which join the full-precision window at decode); smollm2-135m's
``walshkv:4.5`` stores K as ``center+rot+iq4_nl``. Each K part alone and together, fp32 and bf16 queries, GQA
groups 1/3/6/7, batch 2, lengths that are no multiple of any block, packed tokens starting after a sink.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import decode as attn
from walshkv.attention import decode_attention
from walshkv.codecs.registry import parse_codec

KV, D = 2, 64
K_SPECS = (
    "prerope+tq:3.5",
    "prerope+center+tq:3.5",
    "prerope+eq+tq:3.5",
    "prerope+center+eq+tq:3.5",
    "prerope+center+eq+tq:3",
    "center+eq+tq:3",
    "center+rot+iq4_nl",
    "iq4_nl",
    "prerope+center+rot+iq4_nl",  # without eq+: the kernel maps keys by a fast Walsh-Hadamard transform
    "prerope+center+rrot+iq4_nl",
    "prerope+center+tq:4.5",
)
V_SPECS = ("tq:3", "tq:2.5", "tq:4", "eq+tq:3")

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler: the CPU kernel cannot be built",
)


def _bound(spec: str, kind: str):
    return parse_codec(spec).bind(1, kind, CalibrationStub(D, KV))


@pytest.mark.parametrize("kspec", K_SPECS)
@pytest.mark.parametrize("group", [1, 3, 6, 7])
def test_preset_parts_in_the_cpu_kernel(kspec, group, monkeypatch):
    vspec = V_SPECS[K_SPECS.index(kspec) % len(V_SPECS)]
    kc, vc = _bound(kspec, "k"), _bound(vspec, "v")
    gen = torch.Generator().manual_seed(group)
    n, start = 101, 1  # three whole tiles of 32 and a partial one, after one sink token
    k, v = torch.randn(2, KV, n, D, generator=gen), torch.randn(2, KV, n, D, generator=gen)
    pk, pv = kc.encode(k, start), vc.encode(v, start)
    sink_k, sink_v = torch.randn(2, KV, 1, D, generator=gen), torch.randn(2, KV, 1, D, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, KV * group, 1, D, generator=gen).to(dtype)
        kw = {"window_k": sink_k, "window_v": sink_v, "start": start}
        want = decode_attention(q, pk, pv, kc, vc, backend="reference", **kw)
        # the fused path must not fall back to the reference (it would be correct, and slow)
        with monkeypatch.context() as m:
            m.setattr(attn, "reference_partial", lambda *a, **k: pytest.fail("the CPU kernel fell back"))
            got = decode_attention(q, pk, pv, kc, vc, backend="cpu", **kw)
        assert got.dtype == dtype
        tol = 3e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_positions_matter_to_prerope_keys():
    """Reading a prerope+ cache at the wrong start position gives another answer (the test above would notice)."""
    kc, vc = _bound("prerope+center+eq+tq:3.5", "k"), _bound("tq:3", "v")
    k = torch.randn(1, KV, 40, D)
    pk, pv = kc.encode(k, 5), vc.encode(k)
    q = torch.randn(1, KV, 1, D)
    right = decode_attention(q, pk, pv, kc, vc, start=5)
    wrong = decode_attention(q, pk, pv, kc, vc, start=6)
    assert (right - wrong).abs().max() > 1e-3
    with pytest.raises(ValueError, match="start must be a position"):
        decode_attention(q, pk, pv, kc, vc, start=-1)


_HAD_CASES = [
    (kspec, d)
    for kspec in ("prerope+center+tq:3.5", "prerope+rot+iq4_nl", "prerope+center+eq+tq:3.5")
    for d in (8, 16, 32, 64, 128, 256)  # 8 and 256: the generic path on AVX2
    if not ("iq4_nl" in kspec and d < 32)  # iq4_nl blocks hold 32 values
]


@pytest.mark.parametrize(("kspec", "head_dim"), _HAD_CASES)
def test_prerope_keys_without_eq_take_the_hadamard_path(kspec, head_dim):
    """A prerope+ K without eq+ maps its rows by the core's Walsh-Hadamard rotation with sign flips: the kernel then
    runs a fast Walsh-Hadamard transform per key (d log2 d additions) instead of the d x d matrix, with the same
    result as the reference; eq+'s dense transform keeps the matrix."""
    from walshkv.attention import cpu

    cal = CalibrationStub(head_dim, KV)
    kc, vc = parse_codec(kspec).bind(1, "k", cal), parse_codec("tq:3").bind(1, "v", cal)
    gen = torch.Generator().manual_seed(head_dim)
    k, v = torch.randn(1, KV, 70, head_dim, generator=gen), torch.randn(1, KV, 70, head_dim, generator=gen)
    pk, pv = kc.encode(k, 2), vc.encode(v, 2)
    q = torch.randn(1, KV * 3, 1, head_dim, generator=gen)
    cpu._KPOST.clear()
    want = decode_attention(q, pk, pv, kc, vc, backend="reference", start=2)
    got = decode_attention(q, pk, pv, kc, vc, backend="cpu", start=2)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=0)
    fast = [arrays[2] is not None for arrays in cpu._KPOST.values()]
    assert fast == ([False] if "eq+" in kspec else [True])


def test_hadamard_factors_find_signed_walsh_hadamard_matrices_only():
    from walshkv.attention.keys import hadamard_factors
    from walshkv.ops.hadamard import hadamard_matrix

    d = 32
    h = hadamard_matrix(d).float() * d**0.5
    r = torch.where(torch.rand(2, d) < 0.5, -1.0, 1.0)
    c = torch.where(torch.rand(2, d) < 0.5, -1.0, 1.0) * 0.3
    mt = r[:, :, None] * h[None] * c[:, None, :]
    got = hadamard_factors(mt)
    assert got is not None
    torch.testing.assert_close(got[0][:, :, None] * h[None] * got[1][:, None, :], mt)
    assert hadamard_factors(mt + 1e-3 * torch.randn_like(mt)) is None  # eq+'s dense matrix
    assert hadamard_factors(torch.eye(d).expand(2, d, d)) is None  # identity: no rotation at all
    assert hadamard_factors(mt[:, :16]) is None  # L != d
    assert hadamard_factors(torch.zeros(2, 24, 24)) is None  # no power of two


_AMX_CASES = [
    ("prerope+center+eq+tq:3", "tq:2.5", 32),
    ("prerope+center+eq+tq:3.5", "tq:3", 64),
    ("prerope+center+eq+tq:3", "tq:2.5", 128),
    ("prerope+eq+int4", "int4", 48),  # L = 48: the tile unit's K dimension padded to 64
    ("prerope+center+eq+int8", "int8", 80),  # row length 80 -> 96, RoPE's half not a whole vector
]


@pytest.mark.parametrize(("kspec", "vspec", "head_dim"), _AMX_CASES)
def test_eq_key_map_on_amx_tiles_and_in_fp32_match_the_reference(kspec, vspec, head_dim, monkeypatch):
    """eq+'s dense per-key map runs on AMX tiles where the CPU has them (bf16 hi + lo parts, three products summed
    in fp32) and as fp32 multiply-adds elsewhere or with WALSHKV_CPU_AMX=0: both agree with the reference to
    float rounding. On a CPU without AMX only the fp32 side runs (the AMX side is checked where AMX exists)."""
    from walshkv.attention import cpu

    cal = CalibrationStub(head_dim, KV)
    kc, vc = parse_codec(kspec).bind(1, "k", cal), parse_codec(vspec).bind(1, "v", cal)
    gen = torch.Generator().manual_seed(head_dim)
    n = 173  # five whole tiles of 32 and a partial one of 13: row blocks of 16 with stale rows
    k, v = torch.randn(2, KV, n, head_dim, generator=gen), torch.randn(2, KV, n, head_dim, generator=gen)
    pk, pv = kc.encode(k, 3), vc.encode(v, 3)
    q = torch.randn(2, KV * 3, 1, head_dim, generator=gen)
    want = decode_attention(q, pk, pv, kc, vc, backend="reference", start=3)
    monkeypatch.setenv("WALSHKV_CPU_AMX", "0")
    assert not cpu.amx_key_map() and cpu.prerope_key_map(kc, vc, head_dim, KV) == "matrix"
    torch.testing.assert_close(decode_attention(q, pk, pv, kc, vc, backend="cpu", start=3), want, atol=3e-5, rtol=0)
    monkeypatch.delenv("WALSHKV_CPU_AMX")
    kernel = cpu.load_kernel()
    has_amx = bool(kernel.amx_compiled) and bool(kernel.amx_ready())
    assert cpu.amx_key_map() == has_amx
    assert cpu.prerope_key_map(kc, vc, head_dim, KV) == ("matrix-amx" if has_amx else "matrix")
    torch.testing.assert_close(decode_attention(q, pk, pv, kc, vc, backend="cpu", start=3), want, atol=3e-5, rtol=0)


@pytest.mark.parametrize(
    ("kspec", "vspec"),
    [
        ("prerope+center+eq+tq:3.5", "tq:3"),
        ("prerope+center+eq+tq:3", "tq:2.5"),
        ("prerope+center+rot+iq4_nl", "tq:4"),
        ("prerope+center+eqd+tq:3.5", "tq:3"),
        ("center+rot+iq4_nl", "tq:4"),
        ("rot+int4", "int4"),
        ("q4_0", "q8_0"),
        ("tq:4.5", "tq:2.5"),
    ],
)
def test_the_kernels_tile_decode_matches_the_codecs(kspec, vspec):
    """A prefill tile's keys and values decoded by the C++ kernel (walshkv.attention.cpu.decode_chunk_cpu) are the
    codecs' own decode of the slice: prerope+ keys mapped and rotated to their positions, the rest in the model's
    basis; a non-prerope center+ K differs by its mean alone (the same shift of every score, which softmax ignores)."""
    from walshkv.attention.cpu import decode_chunk_cpu

    cal = CalibrationStub(D, KV)
    kc, vc = parse_codec(kspec).bind(1, "k", cal), parse_codec(vspec).bind(1, "v", cal)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(2, KV, 90, D, generator=gen), torch.randn(2, KV, 90, D, generator=gen)
    pk, pv = kc.encode(k, 1), vc.encode(v, 1)
    got = decode_chunk_cpu(pk, pv, kc, vc, 1, 13, 77)
    assert got is not None
    want_k = kc.decode(pk.slice_seq(13, 77), 1 + 13).float()
    want_v = vc.decode(pv.slice_seq(13, 77), 1 + 13).float()
    torch.testing.assert_close(got[1], want_v, atol=2e-5, rtol=0)
    diff = got[0] - want_k
    if kspec.startswith("center+"):
        diff = diff - diff[:, :, :1]  # the mean: one vector per head
    assert diff.abs().max() <= 1e-5 * max(1.0, float(want_k.abs().max())), kspec  # fp32 (or AMX bf16x3) rounding
    with pytest.raises(ValueError, match=r"tokens 80\.\.95"):
        decode_chunk_cpu(pk, pv, kc, vc, 1, 80, 95)
    eq_outside = parse_codec("center+eq+tq:3").bind(1, "k", cal)
    assert decode_chunk_cpu(eq_outside.encode(k), pv, eq_outside, vc, 0, 0, 10) is None  # the codecs decode it
