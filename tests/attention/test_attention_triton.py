"""Tests for the Triton decode-attention backend (walshkv.attention.triton_decode), on the CPU.

``TRITON_INTERPRET=1`` is set below before anything imports triton, so the kernel runs through Triton's
interpreter on CPU tensors (the backend reads the variable at each call, so it also applies to the
other test modules of the same session). Every case is compared with ``backend="reference"``; sizes are
tiny because the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the importorskip below)

import pytest
import torch

pytest.importorskip("triton")

from test_attention import ATOL, _equalized, _kv, _query, _tq_views  # the CPU backends' tests share their data helpers

from walshkv.attention import decode as attn
from walshkv.attention import triton_decode as at
from walshkv.attention.decode import BACKENDS, decode_attention, decode_attention_reference
from walshkv.attention.reference import reference_partial
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.spec import parse_codec

CODECS = ["int2", "int3", "int4", "int8", "q4_0", "q8_0", "rot+int4", "rrot:7+int4", "vht2:5,5,4,3", "vht2:3"]
CODECS += ["tq:3.5", "tq:4", "tq:1.5", "tq:8", "tq:3:codebook=beta"]
MIXED = [("rot+int4", "int8"), ("q8_0", "rrot:7+int4"), ("int5", "q4_0"), ("int4", "int2"), ("int6", "int7")]
MIXED += [("vht2:5,5,4,3:order=sequency", "vht2:1"), ("vht2:4,3:sk=40", "vht2:8,2,7"), ("rot+vht2:6,4", "int4")]
MIXED += [("tq:4", "tq:2.5"), ("rot+int4", "tq:6.5"), ("tq:5.5", "vht2:3")]


def _cache(kspec: str, vspec: str, b: int, kv: int, t: int, d: int, seed: int) -> tuple[Codec, Codec, Packed, Packed]:
    kc, vc = parse_codec(kspec), parse_codec(vspec)
    k, v = _kv(b, kv, t, d, seed)
    return kc, vc, kc.encode(k), vc.encode(v)


def _check(q: torch.Tensor, pk, pv, kc, vc, **kw) -> None:
    out = decode_attention(q, pk, pv, kc, vc, backend="triton", **kw)
    want = decode_attention_reference(q, pk, pv, kc, vc, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL[q.dtype], rtol=0)


def test_backend_listed() -> None:
    assert "triton" in BACKENDS and at.triton_available() and at.triton_interpret()


@pytest.mark.parametrize("spec", CODECS)
def test_codecs_match_reference(spec: str) -> None:
    kc, vc, pk, pv = _cache(spec, spec, 2, 2, 37, 64, seed=3)
    _check(_query(2, 6, 64), pk, pv, kc, vc)


@pytest.mark.parametrize(("kspec", "vspec"), MIXED)
def test_mixed_k_v_codecs(kspec: str, vspec: str) -> None:
    kc, vc, pk, pv = _cache(kspec, vspec, 2, 2, 37, 64, seed=4)
    _check(_query(2, 6, 64), pk, pv, kc, vc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ratio", [1, 3, 7])
@pytest.mark.parametrize("t", [1, 37, 130])
def test_dtypes_gqa_lengths(t: int, ratio: int, dtype: torch.dtype) -> None:
    specs = ("vht2:5,5,4,3", "vht2:3") if t == 37 else ("rot+int4", "int8")
    kc, vc, pk, pv = _cache(*specs, 2, 2, t, 64, seed=t + ratio)
    _check(_query(2, 2 * ratio, 64, dtype), pk, pv, kc, vc)


def test_vht2_calibrated() -> None:
    from test_attention import _Variances

    calib = _Variances(64)
    k, v = _kv(1, 2, 40, 64, seed=22)
    kc = parse_codec("vht2:auto@3.5").bind(1, "k", calib)
    vc = parse_codec("vht2:4,3:order=variance").bind(1, "v", calib)
    _check(_query(1, 4, 64), kc.encode(k), vc.encode(v), kc, vc)


@pytest.mark.parametrize("spec", ["rot+int4", "q4_0"])
@pytest.mark.parametrize("r", [1, 5])
def test_full_precision_window(spec: str, r: int) -> None:
    kc, vc, pk, pv = _cache(spec, "int4", 2, 2, 37, 64, seed=7)
    wk, wv = _kv(2, 2, r, 64, seed=8)
    _check(_query(2, 6, 64), pk, pv, kc, vc, window_k=wk, window_v=wv.to(torch.bfloat16))


def test_window_only_and_empty_packed() -> None:
    wk, wv = _kv(1, 3, 4, 64, seed=9)
    q = _query(1, 9, 64)
    _check(q, None, None, parse_codec("int4"), parse_codec("int4"), window_k=wk, window_v=wv)
    kc, vc, pk, pv = _cache("int4", "int4", 1, 3, 0, 64, seed=9)
    _check(q, pk, pv, kc, vc, window_k=wk, window_v=wv)


def test_scale_and_strided_packed_views() -> None:
    kc, vc, pk, pv = _cache("rot+int4", "q8_0", 3, 2, 120, 64, seed=10)
    rows = torch.tensor([2, 0])
    pk2 = pk.slice_seq(13, 110).index_batch(rows).slice_seq(1, None)
    pv2 = pv.slice_seq(13, 110).index_batch(rows).slice_seq(1, None)
    assert not pk2.tensors["codes"].is_contiguous()
    _check(_query(2, 4, 64), pk2, pv2, kc, vc, scale=0.05)


def test_tq_segments_with_their_own_strides() -> None:
    kc, vc, pk, pv = _tq_views("tq:3.5", "tq:2.5")
    _check(_query(2, 4, 64), pk, pv, kc, vc, scale=0.05)


@pytest.mark.parametrize("d", [40, 96])
def test_odd_head_dims_and_small_blocks(d: int) -> None:
    """head_dim not a power of two (masked lanes), and several blocks per call with block_n=16."""
    kc, vc, pk, pv = _cache("int3", "int4", 1, 2, 53, d, seed=d)
    q = _query(1, 4, d)
    _check(q, pk, pv, kc, vc)
    qk = q.reshape(1, 2, 2, d).float() / d**0.5
    m, l_sum, acc = at.fused_decode_triton(qk, pk, pv, kc, vc, block_n=16)
    rm, rl, racc = reference_partial(qk, pk, pv, kc, vc, chunk=1024)
    torch.testing.assert_close(m, rm, atol=1e-5, rtol=0)
    torch.testing.assert_close(acc / l_sum.unsqueeze(-1), racc / rl.unsqueeze(-1), atol=2e-5, rtol=0)


def test_eq_wrapper() -> None:
    kc, vc = _equalized("tq:3.5", 2, 64, seed=1), _equalized("rot+int4", 2, 64, seed=2)
    k, v = _kv(1, 2, 40, 64, seed=5)
    _check(_query(1, 6, 64), kc.encode(k), vc.encode(v), kc, vc)
    assert at.triton_supports(kc, 64)


def test_supports() -> None:
    for spec in [*CODECS, "int5", "int6", "int7", "center+rot+int4"]:
        assert at.triton_supports(parse_codec(spec), 64), spec
    assert at.triton_supports(parse_codec("vht2:5,5,4,3"), 64)
    for spec in ["vzc", "fp16", "q4_1", "vht2:auto@3.5"]:  # (auto: bands unknown until calibrated)
        assert not at.triton_supports(parse_codec(spec), 64), spec
    assert not at.triton_supports(parse_codec("q4_0"), 48)


def test_auto_on_cpu_does_not_pick_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args, **kwargs):
        raise AssertionError("auto must not use the Triton kernel on CPU tensors")

    monkeypatch.setattr(attn, "fused_decode_triton", boom)
    kc, vc, pk, pv = _cache("int4", "int4", 1, 1, 5, 64, seed=12)
    q = _query(1, 2, 64)
    torch.testing.assert_close(
        decode_attention(q, pk, pv, kc, vc), decode_attention_reference(q, pk, pv, kc, vc), atol=2e-5, rtol=0
    )


def test_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    kc, vc, pk, pv = _cache("rot+int4", "int4", 2, 2, 10, 64, seed=16)
    q = _query(2, 4, 64)
    bad_v = parse_codec("vzc")
    with pytest.raises(ValueError, match=r"does not read 'vzc'.*int2\.\.int8, q4_0, q8_0, vht2"):
        decode_attention(q, pk, bad_v.encode(torch.randn(2, 2, 10, 64)), kc, bad_v, backend="triton")
    with pytest.raises(ValueError, match="one decode step"):  # input errors first
        decode_attention(torch.randn(2, 4, 2, 64), pk, pv, kc, vc, backend="triton")
    with pytest.raises(ValueError, match="auto, reference, cpu, triton"):
        decode_attention(q, pk, pv, kc, vc, backend="cuda")
    with pytest.raises(ValueError, match="does not match codec"):  # packed fields checked as for the reference
        decode_attention(q, pk, pv, parse_codec("int8"), vc, backend="triton")
    monkeypatch.setattr(attn, "triton_available", lambda: False)
    with pytest.raises(ValueError, match="needs the triton package"):
        decode_attention(q, pk, pv, kc, vc, backend="triton")
    monkeypatch.undo()
    monkeypatch.delenv("TRITON_INTERPRET")  # read at call time
    with pytest.raises(ValueError, match=r"needs CUDA tensors.*TRITON_INTERPRET=1"):
        decode_attention(q, pk, pv, kc, vc, backend="triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        at.fused_decode_triton(q.reshape(2, 2, 2, 64), pk, pv, parse_codec("int4"), vc)
    with pytest.raises(ValueError, match="does not read 'vzc"):
        at.fused_decode_triton(q.reshape(2, 2, 2, 64), pk, pv, parse_codec("int4"), bad_v)
