"""Tests for the rotation wrappers rot+SPEC and rrot[:SEED]+SPEC."""

from __future__ import annotations

import pytest
import torch

from walshkv.codecs.base import Codec
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import parse_codec
from walshkv.ops.hadamard import fwht, random_signs

SHAPE = (2, 3, 17, 64)


def mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x.double() - y.double()) ** 2).mean())


def roundtrip(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x))


@pytest.mark.parametrize(
    ("seed", "spec"), [(None, "rot+int4"), (0, "rrot+int4"), (7, "rrot:7+int4"), (-2, "rrot:-2+int4")]
)
def test_spec_strings(seed: int | None, spec: str) -> None:
    assert Rotated(IntCodec(4), seed=seed).spec == spec


def test_rot_int8_error_is_small() -> None:
    x = torch.randn(SHAPE)
    codec = Rotated(IntCodec(8))
    rel = mse(x, roundtrip(codec, x)) / float((x**2).mean())
    assert rel < 2e-4


def test_rot_fp32_is_lossless() -> None:
    x = torch.randn(SHAPE)
    codec = Rotated(FloatCodec("fp32"))
    y = roundtrip(codec, x)
    assert y.dtype == x.dtype
    assert float((y - x).abs().max()) <= 1e-5
    # What is stored is the Walsh-Hadamard transform of the input.
    stored = codec.encode(x).tensors["values"]
    assert float((stored - fwht(x)).abs().max()) <= 1e-5


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_rotate_is_inverted_by_unrotate(seed: int | None) -> None:
    codec = Rotated(FloatCodec("fp32"), seed=seed)
    x = torch.randn(SHAPE)
    assert float((codec.unrotate(codec.rotate(x)) - x).abs().max()) <= 1e-5
    assert float((codec.rotate(codec.unrotate(x)) - x).abs().max()) <= 1e-5


def test_plain_rotation_is_self_inverse() -> None:
    codec = Rotated(FloatCodec("fp32"))
    x = torch.randn(SHAPE)
    assert float((codec.rotate(codec.rotate(x)) - x).abs().max()) <= 1e-5
    # rot+rot+fp32 stores H(H(x)) == x.
    stored = parse_codec("rot+rot+fp32").encode(x).tensors["values"]
    assert float((stored - x).abs().max()) <= 1e-5


@pytest.mark.parametrize("seed", [0, 7])
def test_rrot_is_hadamard_of_sign_flipped_input(seed: int) -> None:
    x = torch.randn(SHAPE)
    codec = Rotated(FloatCodec("fp32"), seed=seed)
    torch.testing.assert_close(codec.rotate(x), fwht(x * random_signs(64, seed)), rtol=0, atol=1e-5)


def test_rrot_codes_differ_but_decode_close() -> None:
    x = torch.randn(SHAPE)
    codecs = {spec: parse_codec(spec) for spec in ("rot+int4", "rrot+int4", "rrot:7+int4")}
    packs = {spec: codec.encode(x) for spec, codec in codecs.items()}
    codes = {spec: p.tensors["codes"] for spec, p in packs.items()}
    assert not torch.equal(codes["rot+int4"], codes["rrot+int4"])
    assert not torch.equal(codes["rot+int4"], codes["rrot:7+int4"])
    assert not torch.equal(codes["rrot+int4"], codes["rrot:7+int4"])
    for spec, codec in codecs.items():
        rel = mse(x, codec.decode(packs[spec])) / float((x**2).mean())
        assert rel < 0.03, spec


def test_rrot_is_deterministic_across_instances() -> None:
    x = torch.randn(SHAPE)
    a = parse_codec("rrot:7+int4").encode(x)
    b = parse_codec("rrot:7+int4").encode(x)
    for name in a.tensors:
        assert torch.equal(a.tensors[name], b.tensors[name])
    # A codec's decode does not depend on which instance encoded.
    torch.testing.assert_close(parse_codec("rrot:7+int4").decode(a), parse_codec("rrot:7+int4").decode(b))


@pytest.mark.parametrize("inner", ["int2", "int3", "int4", "int8", "fp16", "bf16", "fp32"])
@pytest.mark.parametrize("wrapper", ["rot", "rrot", "rrot:7"])
def test_rotation_adds_no_bytes(wrapper: str, inner: str) -> None:
    base = parse_codec(inner)
    rotated = parse_codec(f"{wrapper}+{inner}")
    for head_dim in (16, 64, 128):
        assert rotated.layout(head_dim) == base.layout(head_dim)
        assert rotated.bytes_per_vector(head_dim) == base.bytes_per_vector(head_dim)
        assert rotated.bits_per_element(head_dim) == base.bits_per_element(head_dim)
    x = torch.randn(2, 3, 5, 64)
    assert rotated.encode(x).nbytes() == base.encode(x).nbytes()


@pytest.mark.parametrize("spec", ["rot+int4", "rrot+int4", "rrot:7+int3"])
def test_rotation_helps_with_outlier_channel(spec: str) -> None:
    x = torch.randn(2, 4, 64, 64)
    x[..., 5] += 20.0
    inner = parse_codec(spec.split("+")[-1])
    plain = mse(x, roundtrip(inner, x))
    rotated = mse(x, roundtrip(parse_codec(spec), x))
    assert rotated < 0.5 * plain


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("spec", ["rot+int4", "rrot:3+fp16"])
def test_decode_dtype_and_shape(spec: str, dtype: torch.dtype) -> None:
    x = torch.randn(1, 2, 3, 32).to(dtype)
    codec = parse_codec(spec)
    y = roundtrip(codec, x)
    assert y.dtype == dtype
    assert y.shape == x.shape


@pytest.mark.parametrize("head_dim", [48, 96, 100])
@pytest.mark.parametrize("spec", ["rot+int4", "rrot+int4", "rrot:7+fp16"])
def test_non_power_of_two_head_dim_raises(spec: str, head_dim: int) -> None:
    codec = parse_codec(spec)
    with pytest.raises(ValueError, match=r"power.of.two") as info:
        codec.check_head_dim(head_dim)
    assert spec in str(info.value)
    with pytest.raises(ValueError, match=r"power.of.two"):
        codec.encode(torch.randn(1, 2, 3, head_dim))
    # The inner codec alone is fine with this head size.
    parse_codec(spec.split("+")[-1]).encode(torch.randn(1, 2, 3, head_dim))


@pytest.mark.parametrize("head_dim", [1, 2, 16, 64, 128, 256])
def test_power_of_two_head_dims_accepted(head_dim: int) -> None:
    codec = parse_codec("rot+int8")
    codec.check_head_dim(head_dim)
    x = torch.randn(1, 1, 2, head_dim)
    assert roundtrip(codec, x).shape == x.shape


def test_inner_fp16_overflow_checked_after_rotation() -> None:
    # Peak 40000 fits fp16, but the rotated first coefficient is 40000 * sqrt(64) = 320000.
    x = torch.full((1, 1, 1, 64), 40000.0)
    FloatCodec("fp16").encode(x)
    with pytest.raises(ValueError, match="bf16"):
        parse_codec("rot+fp16").encode(x)
    y = roundtrip(parse_codec("rot+bf16"), x)
    torch.testing.assert_close(y, x, rtol=2e-2, atol=0)


def test_rotation_does_not_modify_input() -> None:
    x = torch.randn(SHAPE)
    before = x.clone()
    parse_codec("rrot:5+int4").encode(x)
    assert torch.equal(x, before)
