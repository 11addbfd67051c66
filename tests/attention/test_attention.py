"""Tests for walshkv.attention: decode attention straight from packed K/V codes.

Every backend is compared with torch's scaled_dot_product_attention over the *decoded* cache
(``codec.decode(packed)``), which is what attention sees today; the fused paths must agree with it
to float32 rounding (then the query dtype's own rounding).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

from walshkv.attention import cpu as attention_cpu
from walshkv.attention import decode as attn
from walshkv.attention.cpu_formats import cpu_plan
from walshkv.attention.decode import BACKENDS as ALL_BACKENDS
from walshkv.attention.decode import decode_attention, decode_attention_reference
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import parse_codec

#: CPU backends; the Triton backend runs under its interpreter in tests/attention/test_attention_triton.py
BACKENDS = tuple(b for b in ALL_BACKENDS if b != "triton")

CPU_CODECS = ["int2", "int3", "int4", "int5", "int6", "int7", "int8", "rot+int4", "rot+int3", "rrot:7+int4", "q4_0"]
CPU_CODECS += ["q8_0", "vht2:5,5,4,3", "vht2:3", "vht2:5,5,4,3:order=sequency"]
# tq: whole and half widths (two code tensors), 1 to 8 bits, both codebooks, a seed, under a rotation
CPU_CODECS += ["tq:3.5", "tq:4", "tq:2.5", "tq:1", "tq:5.5", "tq:6.5", "tq:8", "tq:3:codebook=beta", "tq:4.5:seed=9"]
CPU_CODECS += ["rot+tq:3"]
D128 = ("int3", "rot+int4", "q8_0", "int6", "tq:3.5", "tq:6.5", "tq:3:codebook=beta")
MIXED = [("rot+int4", "int3"), ("rot+int4", "rot+int3"), ("int8", "q4_0"), ("q8_0", "rrot:7+int4"), ("int2", "int5")]
MIXED += [("vht2:5,5,4,3", "vht2:3"), ("rot+int4", "vht2:2"), ("vht2:6,4,3:order=squarefree", "int4")]
MIXED += [("tq:4", "tq:2.5"), ("rot+int4", "tq:3"), ("tq:3.5", "q4_0")]
# vht2 layouts: 1- and 8-bit bands, a skeleton (sk), uneven bands, every order that needs no calibration
VHT2_VARIANTS = ["vht2:1", "vht2:8,1", "vht2:4,3:sk=40", "vht2:2,7,5,6,3", "vht2:5,5,4,3:order=squarefree-dc"]
VHT2_VARIANTS += ["rot+vht2:4", "vht2:" + ",".join(["3"] * 32)]
# absolute tolerance on outputs of magnitude ~1, by query (= output) dtype
ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}


def _kv(b: int, kv: int, t: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return 1.5 * torch.randn(b, kv, t, d, generator=gen), torch.randn(b, kv, t, d, generator=gen)


def _query(b: int, hq: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, hq, 1, d, generator=gen).to(dtype)


def _expected(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: tuple[torch.Tensor, torch.Tensor] | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Float SDPA over decoded (and window) tokens, in float32."""
    if window is not None:
        k, v = torch.cat([k, window[0]], dim=2), torch.cat([v, window[1]], dim=2)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True, scale=scale)


def _run(backend: str, q: torch.Tensor, pk, pv, kc, vc, **kw) -> torch.Tensor:
    if backend == "reference":
        return decode_attention_reference(q, pk, pv, kc, vc, chunk=256, **kw)
    return decode_attention(q, pk, pv, kc, vc, backend=backend, **kw)


def _encode(spec: str, x: torch.Tensor) -> tuple[Codec, Packed]:
    codec = parse_codec(spec)
    return codec, codec.encode(x)


# ---- agreement with SDPA on the decoded cache --------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("spec", CPU_CODECS)
def test_codecs_match_sdpa(spec: str, backend: str) -> None:
    d = 128 if spec in D128 else 64
    k, v = _kv(2, 2, 1029, d, seed=3)
    codec, pk = _encode(spec, k)
    pv = codec.encode(v)
    q = _query(2, 6, d)
    out = _run(backend, q, pk, pv, codec, codec)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, _expected(q, codec.decode(pk), codec.decode(pv)), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("spec", VHT2_VARIANTS)
def test_vht2_layouts_match_sdpa(spec: str, d: int, backend: str) -> None:
    k, v = _kv(2, 2, 301, d, seed=4)
    codec, pk = _encode(spec, k)
    pv = codec.encode(v)
    q = _query(2, 6, d)
    out = _run(backend, q, pk, pv, codec, codec)
    torch.testing.assert_close(out, _expected(q, codec.decode(pk), codec.decode(pv)), atol=2e-5, rtol=1e-4)


class _Variances:
    """A stand-in calibration: per-(kind, layer) WHT coefficient variances ``[kv_heads, d]``."""

    def __init__(self, d: int) -> None:
        self.d = d

    def variance(self, kind: str, layer_idx: int, basis: str) -> torch.Tensor:
        assert basis == "wht"
        gen = torch.Generator().manual_seed(layer_idx + (kind == "v"))
        return torch.rand(2, self.d, generator=gen) ** 4 + 1e-3


@pytest.mark.parametrize("spec", ["vht2:auto@3.5", "vht2:5,5,4,3:order=variance"])
def test_vht2_calibrated_layers(spec: str) -> None:
    """Calibrated vht2 (bands and order per layer): each bound codec gets its own kernel plan."""
    calib = _Variances(64)
    k, v = _kv(1, 2, 200, 64, seed=21)
    q = _query(1, 6, 64)
    outs = []
    for layer in (0, 1):
        kc = parse_codec(spec).bind(layer, "k", calib)
        vc = parse_codec(spec).bind(layer, "v", calib)
        pk, pv = kc.encode(k), vc.encode(v)
        assert attention_cpu.cpu_supports(kc, 64)
        out = decode_attention(q, pk, pv, kc, vc, backend="cpu")
        torch.testing.assert_close(out, _expected(q, kc.decode(pk), vc.decode(pv)), atol=2e-5, rtol=1e-4)
        outs.append(out)
    assert not torch.equal(outs[0], outs[1])
    assert not attention_cpu.cpu_supports(parse_codec(spec), 64)  # unbound: the bands are not known yet


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(("kspec", "vspec"), MIXED)
def test_mixed_k_v_codecs(kspec: str, vspec: str, backend: str) -> None:
    k, v = _kv(2, 1, 300, 64, seed=5)
    kc, pk = _encode(kspec, k)
    vc, pv = _encode(vspec, v)
    q = _query(2, 7, 64)
    out = _run(backend, q, pk, pv, kc, vc)
    torch.testing.assert_close(out, _expected(q, kc.decode(pk), vc.decode(pv)), atol=2e-5, rtol=1e-4)


def test_cache_spec_pair_rot_int4_int3() -> None:
    from walshkv.codecs.spec import parse_cache_spec

    spec = parse_cache_spec("rot+int4/int3")
    k, v = _kv(2, 3, 37, 64, seed=6)
    pk, pv = spec.k.encode(k), spec.v.encode(v)
    q = _query(2, 9, 64)
    want = _expected(q, spec.k.decode(pk), spec.v.decode(pv))
    for backend in BACKENDS:
        torch.testing.assert_close(
            decode_attention(q, pk, pv, spec.k, spec.v, backend=backend), want, atol=2e-5, rtol=0
        )


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ratio", [1, 3, 7])
@pytest.mark.parametrize("t", [1, 37, 1029])
def test_dtypes_gqa_lengths(t: int, ratio: int, dtype: torch.dtype, backend: str) -> None:
    kv = 2
    k, v = _kv(2, kv, t, 64, seed=t + ratio)
    kc, pk = _encode("rot+int4" if t != 37 else "vht2:5,5,4,3", k)
    vc, pv = _encode("rot+int3" if t != 37 else "vht2:3", v)
    q = _query(2, kv * ratio, 64, dtype)
    out = _run(backend, q, pk, pv, kc, vc)
    assert out.dtype == dtype and out.shape == q.shape
    want = _expected(q, kc.decode(pk), vc.decode(pv))
    torch.testing.assert_close(out.float(), want, atol=ATOL[dtype], rtol=0)


@pytest.mark.parametrize(
    ("spec", "backend"),
    [(s, b) for s in ("rrot:7+int4", "q4_0", "int5", "vht2:5,5,4,3", "tq:3.5") for b in BACKENDS],
)
@pytest.mark.parametrize("r", [1, 5])
def test_full_precision_window(spec: str, r: int, backend: str) -> None:
    k, v = _kv(2, 2, 37, 64, seed=7)
    wk, wv = _kv(2, 2, r, 64, seed=8)
    codec, pk = _encode(spec, k)
    pv = codec.encode(v)
    q = _query(2, 6, 64, torch.float16)
    out = _run(backend, q, pk, pv, codec, codec, window_k=wk, window_v=wv.to(torch.bfloat16))
    want = _expected(q, codec.decode(pk), codec.decode(pv), window=(wk, wv.to(torch.bfloat16)))
    torch.testing.assert_close(out.float(), want, atol=ATOL[torch.float16], rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_only(backend: str) -> None:
    wk, wv = _kv(1, 3, 4, 64, seed=9)
    q = _query(1, 9, 64)
    out = decode_attention(q, None, None, "int4", "int4", window_k=wk, window_v=wv, backend=backend)
    torch.testing.assert_close(out, _expected(q, wk, wv), atol=2e-5, rtol=0)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_scale_and_strided_packed_views(backend: str) -> None:
    k, v = _kv(3, 2, 200, 64, seed=10)
    codec, pk = _encode("rot+int4", k)
    pv = codec.encode(v)
    # a sequence slice and a batch selection: non-contiguous views of the stored fields
    rows = torch.tensor([2, 0])
    pk3 = pk.slice_seq(13, 150).index_batch(rows).slice_seq(1, None)
    pv3 = pv.slice_seq(13, 150).index_batch(rows).slice_seq(1, None)
    assert not pk3.tensors["codes"].is_contiguous()
    q = _query(2, 4, 64)
    out = _run(backend, q, pk3, pv3, codec, codec, scale=0.05)
    want = _expected(q, codec.decode(pk3), codec.decode(pv3), scale=0.05)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def _tq_views(kspec: str, vspec: str) -> tuple[Codec, Codec, Packed, Packed]:
    """A tq:B.5 cache whose two code tensors have different strides: a strided view and a compact copy."""
    k, v = _kv(3, 2, 120, 64, seed=24)
    kc, pk = _encode(kspec, k)
    vc, pv = _encode(vspec, v)
    rows = torch.tensor([2, 0])
    views = []
    for p in (pk, pv):
        p2 = p.slice_seq(13, 110).index_batch(rows).slice_seq(1, None)
        tensors = dict(p2.tensors)
        tensors["codes_lo"] = tensors["codes_lo"].contiguous()
        assert not tensors["codes_hi"].is_contiguous()
        views.append(Packed(tensors, p2.head_dim, p2.dtype))
    return kc, vc, views[0], views[1]


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_tq_segments_with_their_own_strides(backend: str) -> None:
    kc, vc, pk, pv = _tq_views("tq:3.5", "tq:2.5")
    q = _query(2, 4, 64)
    out = _run(backend, q, pk, pv, kc, vc, scale=0.05)
    torch.testing.assert_close(out, _expected(q, kc.decode(pk), vc.decode(pv), scale=0.05), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("d", [13, 72, 100])
def test_cpu_odd_head_dims(d: int) -> None:
    for spec in ("int2", "int3", "int4", "int7", "int8"):
        k, v = _kv(1, 1, 40, d, seed=d)
        codec, pk = _encode(spec, k)
        pv = codec.encode(v)
        q = _query(1, 2, d)
        out = decode_attention(q, pk, pv, codec, codec, backend="cpu")
        torch.testing.assert_close(out, _expected(q, codec.decode(pk), codec.decode(pv)), atol=2e-5, rtol=1e-4)


def test_center_wrapper_is_peeled() -> None:
    bias = torch.randn(2, 64)
    kc = Centered(Rotated(IntCodec(4)), bias=bias)
    vc = parse_codec("rot+int4")
    k, v = _kv(1, 2, 50, 64, seed=11)
    pk, pv = kc.encode(k), vc.encode(v)
    q = _query(1, 4, 64)
    want = _expected(q, kc.decode(pk), vc.decode(pv))
    assert attention_cpu.cpu_supports(kc, 64)
    for backend in BACKENDS:
        torch.testing.assert_close(decode_attention(q, pk, pv, kc, vc, backend=backend), want, atol=2e-5, rtol=0)


def _equalized(inner: str, kv: int, d: int, seed: int) -> Codec:
    gen = torch.Generator().manual_seed(seed)
    a = torch.eye(d) + torch.randn(kv, d, d, generator=gen) / (2 * math.sqrt(d))  # well conditioned
    return Equalized(parse_codec(inner), a)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("kspec", "vspec"), [("center+eq+tq:3.5", "eq+tq:3"), ("eq+rot+int4", "int4")])
def test_eq_wrapper_maps_the_query_and_the_output_once(kspec: str, vspec: str, backend: str) -> None:
    """eq+X is read as X's cache: A⁻ᵀ on the query, A⁻¹ on the V sum, both per kv head."""

    def build(spec: str, seed: int) -> Codec:
        if spec.startswith("center+"):
            return Centered(_equalized(spec.removeprefix("center+eq+"), 3, 64, seed), bias=torch.randn(3, 64))
        return _equalized(spec.removeprefix("eq+"), 3, 64, seed) if spec.startswith("eq+") else parse_codec(spec)

    kc, vc = build(kspec, 1), build(vspec, 2)
    k, v = _kv(2, 3, 300, 64, seed=21)
    wk, wv = _kv(2, 3, 2, 64, seed=22)
    pk, pv = kc.encode(k), vc.encode(v)
    q = _query(2, 9, 64)
    assert attention_cpu.cpu_supports(kc, 64) and attention_cpu.cpu_supports(vc, 64)
    out = _run(backend, q, pk, pv, kc, vc, window_k=wk, window_v=wv)
    want = _expected(q, kc.decode(pk), vc.decode(pv), window=(wk, wv))
    torch.testing.assert_close(out, want, atol=5e-5, rtol=1e-4)


def test_eq_wrapper_errors() -> None:
    k, v = _kv(1, 3, 20, 64, seed=23)
    kc = _equalized("tq:4", 3, 64, 3)
    pk, pv = kc.encode(k), kc.encode(v)
    with pytest.raises(ValueError, match="kv heads"):  # the transform of a layer with another head count
        decode_attention(_query(1, 4, 64), _slice_heads(pk, 2), _slice_heads(pv, 2), kc, kc)
    with pytest.raises(ValueError, match="not bound"):
        decode_attention(_query(1, 9, 64), pk, pv, parse_codec("eq+tq:4"), "tq:4")


def _slice_heads(p: Packed, n: int) -> Packed:
    return Packed({name: t[:, :n] for name, t in p.tensors.items()}, p.head_dim, p.dtype)


# ---- how the work is done ----------------------------------------------------------------------------


def test_reference_decodes_in_chunks_and_never_unrotates_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    orig = IntCodec._decode

    def spy(self: IntCodec, packed: Packed) -> torch.Tensor:
        seen.append(packed.seq_len)
        return orig(self, packed)

    def forbidden(self: Rotated, packed: Packed) -> torch.Tensor:
        raise AssertionError("the cache was unrotated")

    monkeypatch.setattr(IntCodec, "_decode", spy)
    monkeypatch.setattr(Rotated, "_decode", forbidden)
    codec = parse_codec("rot+int4")
    k, v = _kv(1, 1, 1029, 64, seed=12)
    pk, pv = codec.encode(k), codec.encode(v)
    q = _query(1, 3, 64)
    decode_attention_reference(q, pk, pv, codec, codec, chunk=256)
    assert max(seen) <= 256 and sum(seen) == 2 * 1029


def test_auto_dispatch(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    orig = attn.fused_decode_cpu

    def spy(*args, **kwargs):
        calls.append("cpu")
        return orig(*args, **kwargs)

    monkeypatch.setattr(attn, "fused_decode_cpu", spy)
    k, v = _kv(1, 1, 33, 64, seed=13)
    q = _query(1, 1, 64)
    for spec, fused in (("rot+int4", True), ("q8_0", True), ("vht2:5,5,4,3", True), ("tq:3.5", True), ("vzc", False)):
        calls.clear()
        codec, pk = _encode(spec, k)
        out = decode_attention(q, pk, codec.encode(v), codec, codec)
        assert calls == (["cpu"] if fused else [])
        assert out.shape == q.shape
        calls.clear()
        decode_attention(q, pk, codec.encode(v), codec, codec, backend="reference")
        assert calls == []


def test_missing_compiler_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr(cpp_extension, "load_inline", no_compiler)
    monkeypatch.setattr(attention_cpu, "_kernel", None)
    monkeypatch.setattr(attention_cpu, "_kernel_failed", False)
    codec = parse_codec("int4")
    k, v = _kv(1, 1, 20, 64, seed=14)
    pk, pv = codec.encode(k), codec.encode(v)
    q = _query(1, 2, 64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out1 = decode_attention(q, pk, pv, codec, codec, backend="cpu")
        out2 = decode_attention(q, pk, pv, codec, codec)
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "falling back" in str(caught[0].message)
    want = _expected(q, codec.decode(pk), codec.decode(pv))
    torch.testing.assert_close(out1, want, atol=2e-5, rtol=0)
    torch.testing.assert_close(out2, want, atol=2e-5, rtol=0)


def test_softmax_is_stable_for_large_scores() -> None:
    codec = parse_codec("int8")
    k, v = _kv(1, 1, 600, 64, seed=15)
    pk, pv = codec.encode(k * 40), codec.encode(v)
    q = _query(1, 2, 64) * 40  # scores in the thousands: exp would overflow without the running max
    want = _expected(q, codec.decode(pk), codec.decode(pv))
    for backend in ("reference", "cpu"):
        out = _run(backend, q, pk, pv, codec, codec)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


# ---- errors -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_cache() -> tuple[Codec, Packed, Packed]:
    codec = parse_codec("rot+int4")
    k, v = _kv(2, 2, 10, 64, seed=16)
    return codec, codec.encode(k), codec.encode(v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("q_shape", "match"),
    [
        ((2, 4, 64), "shape"),
        ((2, 4, 2, 64), "one decode step"),
        ((2, 4, 1, 32), "head_dim mismatch"),
        ((2, 5, 1, 64), "multiple of num_kv_heads"),
        ((3, 4, 1, 64), "batch mismatch"),
    ],
)
def test_bad_query_shapes(small_cache, q_shape, match: str, backend: str) -> None:
    codec, pk, pv = small_cache
    with pytest.raises(ValueError, match=match):
        decode_attention(torch.randn(*q_shape), pk, pv, codec, codec, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_query(small_cache, bad: float, backend: str) -> None:
    codec, pk, pv = small_cache
    q = torch.randn(2, 4, 1, 64)
    q[1, 2, 0, 5] = bad
    with pytest.raises(ValueError, match="NaN"):
        decode_attention(q, pk, pv, codec, codec, backend=backend)


def test_other_errors(small_cache) -> None:
    codec, pk, pv = small_cache
    q = torch.randn(2, 4, 1, 64)
    with pytest.raises(ValueError, match="auto, reference, cpu"):
        decode_attention(q, pk, pv, codec, codec, backend="cuda")
    with pytest.raises(ValueError, match=r"does not read 'vzc'.*int2\.\.int8, q4_0, q8_0, iq4_nl, vht2"):
        vc = parse_codec("vzc")
        decode_attention(q, pk, vc.encode(torch.randn(2, 2, 10, 64)), codec, vc, backend="cpu")
    with pytest.raises(ValueError, match="does not match codec 'rot\\+int3'"):
        decode_attention_reference(q, pk, pv, parse_codec("rot+int3"), codec)
    with pytest.raises(ValueError, match="should be uint8"):
        decode_attention(q, pk, pv, parse_codec("int3"), codec, backend="cpu")
    with pytest.raises(ValueError, match="tokens but packed V"):
        decode_attention(q, pk, pv.slice_seq(0, 5), codec, codec)
    with pytest.raises(ValueError, match="float32, bfloat16 or float16"):
        decode_attention(q.double(), pk, pv, codec, codec)
    with pytest.raises(ValueError, match="window_k"):
        decode_attention(q, pk, pv, codec, codec, window_k=torch.randn(2, 2, 3, 64), window_v=torch.randn(2, 2, 2, 64))
    with pytest.raises(ValueError, match="both window_k and window_v"):
        decode_attention(q, pk, pv, codec, codec, window_k=torch.randn(2, 2, 3, 64))
    with pytest.raises(ValueError, match="nothing to attend to"):
        decode_attention(q, None, None, codec, codec)
    with pytest.raises(ValueError, match="nothing to attend to"):
        decode_attention(q, pk.slice_seq(0, 0), pv.slice_seq(0, 0), codec, codec)
    with pytest.raises(ValueError, match="chunk"):
        decode_attention_reference(q, pk, pv, codec, codec, chunk=0)
    with pytest.raises(ValueError, match="scale must be finite"):
        decode_attention(q, pk, pv, codec, codec, scale=math.inf)


def test_parallel_ranges_merge() -> None:
    """With several threads the kernel cuts the tokens into ranges and merges them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for spec in ("rot+int4", "q8_0"):
            k, v = _kv(1, 1, 1029, 64, seed=17)
            codec, pk = _encode(spec, k)
            pv = codec.encode(v)
            q = _query(1, 3, 64)
            out = decode_attention(q, pk, pv, codec, codec, backend="cpu")
            torch.testing.assert_close(out, _expected(q, codec.decode(pk), codec.decode(pv)), atol=2e-5, rtol=1e-4)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not any(shutil.which(c) for c in ("c++", "g++", "clang++")), reason="no C++ compiler")
def test_kernel_builds_where_a_compiler_exists() -> None:
    assert attention_cpu.kernel_available()


# ---- a block frame's step: a score bias per key, a query per block of keys, a table added to the keys -----


def _fused_case(spec: str, b: int, h: int, t: int, d: int, seed: int):  # type: ignore[no-untyped-def]
    """``(codec, packed K, packed V, CPU plan)`` for random K/V ``[b, h, t, d]``, scale ``d ** -0.5``."""
    k, v = _kv(b, h, t, d, seed=seed)
    codec, pk = _encode(spec, k)
    plan = cpu_plan(codec, codec, d, d**-0.5)
    assert plan is not None
    return codec, pk, codec.encode(v), plan


def _block_attention(q, keys, vals, block, scale, bias=None):  # type: ignore[no-untyped-def]
    """Float64 attention of query block ``i`` (``q [b, h, n_blocks, g, d]``) over keys ``i G .. (i + 1) G - 1``
    (``keys``, ``vals`` ``[b, h, t, d]``), plus ``bias [b, h, g, t]``: ``[b, h, g, d]``."""
    t = keys.shape[2]
    q_per_key = q.to(torch.float64).repeat_interleave(block, dim=2)[:, :, :t]  # [b, h, t, g, d]
    s = torch.einsum("bhtgd,bhtd->bhgt", q_per_key, keys.to(torch.float64)) * scale
    if bias is not None:
        s = s + bias.to(torch.float64)
    return torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), vals.to(torch.float64))


@pytest.mark.parametrize("spec", ["tcq:3.5:norm=8:tables=2", "rot+int4", "q8_0"])
def test_fused_cpu_bias_is_added_to_each_scaled_score(spec: str) -> None:
    b, h, g, t, d = 2, 2, 3, 77, 64  # t not a multiple of the kernel's tile
    codec, pk, pv, plan = _fused_case(spec, b, h, t, d, seed=21)
    scale = d**-0.5
    q = _query(b, h * g, d).reshape(b, h, g, d)
    bias = torch.randn(b, h, g, t, generator=torch.Generator().manual_seed(5))
    res = attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=bias)
    assert res is not None
    _, l_sum, acc = res
    out = acc / l_sum[..., None]
    keys, vals = codec.decode(pk).to(torch.float64), codec.decode(pv).to(torch.float64)
    s = torch.einsum("bhgd,bhtd->bhgt", q.to(torch.float64), keys) * scale + bias.to(torch.float64)
    want = torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), vals)
    torch.testing.assert_close(out.to(torch.float64), want, atol=2e-5, rtol=1e-4)
    # a bias that is a view with other strides gives the same answer
    wide = torch.zeros(b, h, g, t + 5)
    wide[..., :t] = bias
    _, l2, acc2 = attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=wide[..., :t])
    torch.testing.assert_close(acc2 / l2[..., None], out)


def test_fused_cpu_bias_refuses_bad_shapes_and_values() -> None:
    _, pk, pv, plan = _fused_case("int4", 1, 1, 16, 64, seed=22)
    q = _query(1, 2, 64).reshape(1, 1, 2, 64)
    with pytest.raises(ValueError, match=r"float32 \[batch, kv_heads, group, seq_len\] = \[1, 1, 2, 16\]"):
        attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=torch.zeros(1, 1, 2, 15))
    with pytest.raises(ValueError, match="float32"):
        attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=torch.zeros(1, 1, 2, 16, dtype=torch.float64))
    bad = torch.zeros(1, 1, 2, 16)
    bad[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=bad)


# ---- one query per block of keys (a block frame's query, turned back and mapped once per block) -------------


@pytest.mark.parametrize(("spec", "block"), [("tcq:3.5:norm=8:tables=2", 16), ("rot+int4", 40), ("q8_0", 64)])
def test_fused_cpu_query_block_scores_each_block_with_its_query(spec: str, block: int) -> None:
    b, h, g, t, d = 2, 2, 3, 77, 64  # t not a multiple of the block or the tile; block 40 straddles tiles
    codec, pk, pv, plan = _fused_case(spec, b, h, t, d, seed=23)
    scale = d**-0.5
    nb = -(-t // block)
    q = torch.randn(b, h, nb, g, d, generator=torch.Generator().manual_seed(6))
    bias = torch.randn(b, h, g, t, generator=torch.Generator().manual_seed(7))
    res = attention_cpu.fused_decode_cpu(q, plan, pk, pv, bias=bias, query_block=block)
    assert res is not None
    _, l_sum, acc = res
    out = acc / l_sum[..., None]
    want = _block_attention(q, codec.decode(pk), codec.decode(pv), block, scale, bias)
    torch.testing.assert_close(out.to(torch.float64), want, atol=2e-5, rtol=1e-4)
    # one block as long as the cache is the ordinary one-query step
    _, l1, acc1 = attention_cpu.fused_decode_cpu(q[:, :, :1], plan, pk, pv, query_block=t)
    _, l0, acc0 = attention_cpu.fused_decode_cpu(q[:, :, 0], plan, pk, pv)
    torch.testing.assert_close(acc1 / l1[..., None], acc0 / l0[..., None], atol=1e-6, rtol=1e-5)


def test_fused_cpu_query_block_refuses_bad_shapes() -> None:
    _, pk, pv, plan = _fused_case("int4", 1, 1, 16, 64, seed=24)
    with pytest.raises(ValueError, match="2 query blocks; 16 keys in blocks of 4 from offset 0 need 4"):
        attention_cpu.fused_decode_cpu(torch.zeros(1, 1, 2, 2, 64), plan, pk, pv, query_block=4)
    with pytest.raises(ValueError, match=r"q must be \[batch, kv_heads, n_blocks, group, head_dim\]"):
        attention_cpu.fused_decode_cpu(torch.zeros(1, 1, 2, 64), plan, pk, pv, query_block=4)
    with pytest.raises(ValueError, match="query_block must be 0 or a block of keys >= 1"):
        attention_cpu.fused_decode_cpu(torch.zeros(1, 1, 2, 64), plan, pk, pv, query_block=-1)


@pytest.mark.parametrize(
    ("spec", "block", "g", "d"),
    [("tcq:3.5:norm=8:tables=2", 16, 3, 64), ("rot+int4", 40, 1, 128), ("q8_0", 64, 7, 64), ("tq:3", 32, 6, 256)],
)
def test_fused_cpu_key_table_adds_each_offsets_row_to_its_keys(spec: str, block: int, g: int, d: int) -> None:
    b, h, t = 2, 2, 77  # GQA 1, 3, 6, 7; head_dim 64, 128, 256
    codec, pk, pv, plan = _fused_case(spec, b, h, t, d, seed=25)
    scale = d**-0.5
    nb = -(-t // block)
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(b, h, nb, g, d, generator=gen)
    table = torch.randn(h, block, d, generator=gen)
    bias = torch.randn(b, h, g, t, generator=gen)
    res = attention_cpu.fused_decode_cpu(q, plan, pk, pv, query_block=block, key_table=table, bias=bias)
    assert res is not None
    _, l_sum, acc = res
    keys = codec.decode(pk).to(torch.float64) + table[:, torch.arange(t) % block].to(torch.float64)[None]
    want = _block_attention(q, keys, codec.decode(pv), block, scale, bias)
    torch.testing.assert_close((acc / l_sum[..., None]).to(torch.float64), want, atol=2e-5, rtol=1e-4)


def test_fused_cpu_key_table_refuses_bad_shapes_and_values() -> None:
    _, pk, pv, plan = _fused_case("int4", 1, 1, 16, 64, seed=26)
    q = torch.zeros(1, 1, 4, 2, 64)
    table = torch.zeros(1, 4, 64)
    with pytest.raises(ValueError, match="key_table needs query_block"):
        attention_cpu.fused_decode_cpu(q[:, :, 0], plan, pk, pv, key_table=table)
    with pytest.raises(ValueError, match=r"\[kv_heads, query_block, head_dim\] = \[1, 4, 64\]"):
        attention_cpu.fused_decode_cpu(q, plan, pk, pv, query_block=4, key_table=table[:, :3])
    bad = table.clone()
    bad[0, 1, 2] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        attention_cpu.fused_decode_cpu(q, plan, pk, pv, query_block=4, key_table=bad)
    skew = dataclasses.replace(plan, k_buffer_orthogonal=False)  # a buffer the table cannot be mapped onto
    with pytest.raises(ValueError, match="orthogonal map of the head"):
        attention_cpu.fused_decode_cpu(q, skew, pk, pv, query_block=4, key_table=table)
