"""Tests for the float (fp16/bf16/fp32) and integer (int2..int8) codecs and Packed."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated

FLOAT_SPECS = ["fp16", "bf16", "fp32"]
INT_SPECS = [f"int{b}" for b in range(2, 9)]
ALL_SPECS = FLOAT_SPECS + INT_SPECS
SHAPE = (2, 3, 17, 64)
LAYOUT_MSG = re.escape("[batch, num_kv_heads, seq_len, head_dim]")


def make(spec: str) -> Codec:
    if spec.startswith("rot+"):
        return Rotated(make(spec[len("rot+") :]))
    if spec.startswith("int"):
        return IntCodec(int(spec[3:]))
    return FloatCodec(spec)


def rel_mse(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(((x.double() - y.double()) ** 2).mean() / (x.double() ** 2).mean())


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_spec_attribute(spec: str) -> None:
    assert make(spec).spec == spec
    assert repr(make(spec)) == f"{type(make(spec)).__name__}({spec!r})"


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_nbytes_matches_layout(spec: str) -> None:
    codec = make(spec)
    packed = codec.encode(torch.randn(SHAPE))
    b, h, s, d = SHAPE
    assert packed.nbytes() == b * h * s * codec.bytes_per_vector(d)
    layout = codec.layout(d)
    assert set(packed.tensors) == set(layout)
    for name, field in layout.items():
        t = packed.tensors[name]
        assert t.shape == (b, h, s, *field.shape)
        assert t.dtype == field.dtype
    assert (packed.batch_size, packed.num_heads, packed.seq_len, packed.head_dim) == SHAPE


@pytest.mark.parametrize(
    ("spec", "bits"),
    [
        ("int2", 2.25),
        ("int3", 3.25),
        ("int4", 4.25),
        ("int5", 5.25),
        ("int6", 6.25),
        ("int7", 7.25),
        ("int8", 8.25),
        ("fp16", 16.0),
        ("bf16", 16.0),
        ("fp32", 32.0),
    ],
)
def test_bits_per_element_head_dim_64(spec: str, bits: float) -> None:
    assert make(spec).bits_per_element(64) == bits


@pytest.mark.parametrize(
    ("spec", "head_dim", "nbytes"),
    [("int4", 64, 34), ("int3", 64, 26), ("int3", 48, 20), ("int3", 100, 40), ("int3", 17, 9), ("fp16", 48, 96)],
)
def test_bytes_per_vector(spec: str, head_dim: int, nbytes: int) -> None:
    codec = make(spec)
    assert codec.bytes_per_vector(head_dim) == nbytes
    assert codec.bits_per_element(head_dim) == pytest.approx(8 * nbytes / head_dim)


@pytest.mark.parametrize(("spec", "code_bytes"), [("int2", 16), ("int3", 24), ("int4", 32), ("int5", 40), ("int8", 64)])
def test_int_codes_are_packed_uint8(spec: str, code_bytes: int) -> None:
    packed = make(spec).encode(torch.randn(SHAPE))
    codes = packed.tensors["codes"]
    assert codes.dtype == torch.uint8
    assert codes.shape[-1] == code_bytes
    scale = packed.tensors["scale"]
    assert scale.dtype == torch.float16
    assert scale.shape == (*SHAPE[:3], 1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("spec", ALL_SPECS)
def test_decode_returns_input_dtype_and_shape(spec: str, dtype: torch.dtype) -> None:
    codec = make(spec)
    x = torch.randn(1, 2, 5, 32).to(dtype)
    packed = codec.encode(x)
    assert packed.dtype == dtype
    y = codec.decode(packed)
    assert y.dtype == dtype
    assert y.shape == x.shape


def test_error_decreases_with_bits() -> None:
    x = torch.randn(SHAPE)
    errors = [rel_mse(x, make(spec).decode(make(spec).encode(x))) for spec in INT_SPECS]
    assert all(a > b for a, b in itertools.pairwise(errors)), errors
    assert errors[-1] < 1e-4  # int8
    assert errors[0] < 0.75  # int2 ({-1, 0, +1} * scale) still beats decoding zeros (1.0)


@pytest.mark.parametrize("spec", INT_SPECS)
def test_int_error_bound_per_vector(spec: str) -> None:
    codec = make(spec)
    x = torch.randn(SHAPE)
    packed = codec.encode(x)
    err = (codec.decode(packed) - x).abs()
    assert bool((err <= 0.5 * packed.tensors["scale"].float() * (1 + 1e-3)).all())


@pytest.mark.parametrize("head_dim", [1, 5, 17, 100])
@pytest.mark.parametrize("spec", ["int3", "int5", "int7"])
def test_int_odd_head_dims(spec: str, head_dim: int) -> None:
    codec = make(spec)
    x = torch.randn(1, 2, 3, head_dim)
    packed = codec.encode(x)
    assert packed.nbytes() == 6 * codec.bytes_per_vector(head_dim)
    assert codec.decode(packed).shape == x.shape
    assert bool(((codec.decode(packed) - x).abs() <= 0.5 * packed.tensors["scale"].float() * (1 + 1e-3)).all())


def test_int2_levels() -> None:
    codec = make("int2")
    packed = codec.encode(torch.randn(SHAPE))
    y = codec.decode(packed)
    s = packed.tensors["scale"].float()
    assert bool(((y == 0) | (y == s) | (y == -s)).all())


def test_fp32_is_exact() -> None:
    x = torch.randn(SHAPE)
    codec = make("fp32")
    assert torch.equal(codec.decode(codec.encode(x)), x)


@pytest.mark.parametrize(("spec", "dtype"), [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_codecs_equal_a_cast(spec: str, dtype: torch.dtype) -> None:
    x = torch.randn(SHAPE)
    codec = make(spec)
    assert torch.equal(codec.decode(codec.encode(x)), x.to(dtype).to(torch.float32))


def test_fp16_overflow_raises() -> None:
    x = torch.randn(SHAPE)
    x[0, 1, 2, 3] = 1e5
    with pytest.raises(ValueError, match="bf16"):
        make("fp16").encode(x)


@pytest.mark.parametrize("spec", ["bf16", "fp32"])
def test_wide_float_codecs_accept_large_values(spec: str) -> None:
    x = torch.randn(SHAPE)
    x[0, 1, 2, 3] = 1e5
    y = make(spec).decode(make(spec).encode(x))
    assert y[0, 1, 2, 3].item() == pytest.approx(1e5, rel=1e-2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("spec", [*ALL_SPECS, "rot+int4", "rot+fp16"])
def test_non_finite_input_raises(spec: str, bad: float) -> None:
    x = torch.randn(1, 2, 3, 16)
    x[0, 1, 2, 5] = bad
    with pytest.raises(ValueError, match="NaN"):
        make(spec).encode(x)


@pytest.mark.parametrize("shape", [(3, 17, 64), (64,), (1, 2, 3, 4, 64)])
@pytest.mark.parametrize("spec", ["fp16", "int4", "rot+int4"])
def test_wrong_rank_raises(spec: str, shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=LAYOUT_MSG):
        make(spec).encode(torch.randn(shape))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8, torch.bool])
@pytest.mark.parametrize("spec", ["fp32", "int4"])
def test_non_float_dtype_raises(spec: str, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="float"):
        make(spec).encode(torch.zeros(1, 2, 3, 16, dtype=dtype))


def test_non_tensor_raises() -> None:
    with pytest.raises(TypeError, match=r"torch\.Tensor"):
        make("int4").encode([[[[1.0, 2.0]]]])  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", [*INT_SPECS, *(f"rot+{s}" for s in INT_SPECS)])
def test_zero_vectors_decode_to_zeros(spec: str) -> None:
    codec = make(spec)
    x = torch.randn(2, 2, 4, 64)
    x[0, 1] = 0.0
    x[1, :, 2] = 0.0
    y = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[0, 1], torch.zeros(4, 64))
    assert torch.equal(y[1, :, 2], torch.zeros(2, 64))
    assert torch.equal(codec.decode(codec.encode(torch.zeros(1, 1, 3, 64))), torch.zeros(1, 1, 3, 64))


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_encode_does_not_modify_input(spec: str) -> None:
    x = torch.randn(1, 2, 3, 64)
    before = x.clone()
    make(spec).encode(x)
    assert torch.equal(x, before)


@pytest.mark.parametrize("bits", [0, 1, 9])
def test_int_codec_rejects_bad_bits(bits: int) -> None:
    with pytest.raises(ValueError, match=r"2\.\.8"):
        IntCodec(bits)


def test_float_codec_rejects_unknown_name() -> None:
    with pytest.raises(ValueError, match="fp16"):
        FloatCodec("fp8")


@pytest.mark.parametrize("spec", ["fp16", "int4"])
def test_check_head_dim_rejects_non_positive(spec: str) -> None:
    make(spec).check_head_dim(1)
    with pytest.raises(ValueError, match="positive"):
        make(spec).check_head_dim(0)


# --- Packed container operations ------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["fp16", "int3", "int4", "int8", "rot+int4"])
def test_packed_cat(spec: str) -> None:
    codec = make(spec)
    a = codec.encode(torch.randn(2, 3, 5, 64))
    b = codec.encode(torch.randn(2, 3, 7, 64))
    joined = Packed.cat([a, b])
    assert joined.seq_len == 12
    assert joined.nbytes() == a.nbytes() + b.nbytes()
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(a), codec.decode(b)], dim=2))
    three = Packed.cat([a, b, a])
    assert three.seq_len == 17
    assert Packed.cat([a]) is a


@pytest.mark.parametrize("spec", ["fp16", "int3", "int4", "rot+int4"])
def test_packed_slice_seq(spec: str) -> None:
    codec = make(spec)
    x = torch.randn(2, 3, 10, 64)
    packed = codec.encode(x)
    full = codec.decode(packed)
    part = packed.slice_seq(2, 5)
    assert part.seq_len == 3
    assert torch.equal(codec.decode(part), full[:, :, 2:5])
    assert torch.equal(codec.decode(packed.slice_seq(None, 4)), full[:, :, :4])
    assert torch.equal(codec.decode(packed.slice_seq(7)), full[:, :, 7:])
    # Vectors are coded independently: encoding a slice stores the same bytes.
    direct = codec.encode(x[:, :, 2:5])
    for name, t in direct.tensors.items():
        assert torch.equal(t, part.tensors[name])


@pytest.mark.parametrize("spec", ["fp16", "int3", "int4"])
def test_packed_index_batch(spec: str) -> None:
    codec = make(spec)
    packed = codec.encode(torch.randn(3, 2, 4, 64))
    full = codec.decode(packed)
    index = torch.tensor([2, 0])
    picked = packed.index_batch(index)
    assert picked.batch_size == 2
    assert torch.equal(codec.decode(picked), full[index])


@pytest.mark.parametrize("spec", ["fp16", "int3", "int4"])
def test_packed_repeat_batch(spec: str) -> None:
    codec = make(spec)
    packed = codec.encode(torch.randn(3, 2, 4, 64))
    full = codec.decode(packed)
    repeated = packed.repeat_batch(2)
    assert repeated.batch_size == 6
    assert repeated.nbytes() == 2 * packed.nbytes()
    decoded = codec.decode(repeated)
    assert torch.equal(decoded, full.repeat_interleave(2, dim=0))
    assert torch.equal(decoded[0], decoded[1]) and torch.equal(decoded[4], full[2])


def test_packed_to_and_properties() -> None:
    codec = make("int4")
    packed = codec.encode(torch.randn(2, 3, 4, 64, dtype=torch.float16))
    moved = packed.to("cpu")
    assert moved.head_dim == 64 and moved.dtype == torch.float16
    assert (moved.batch_size, moved.num_heads, moved.seq_len) == (2, 3, 4)
    assert torch.equal(codec.decode(moved), codec.decode(packed))


@pytest.mark.parametrize("spec", ["int4", "int3"])
def test_int_encode_empty_sequence(spec: str) -> None:
    codec = make(spec)
    packed = codec.encode(torch.randn(2, 3, 0, 64))
    assert packed.seq_len == 0
    assert codec.decode(packed).shape == (2, 3, 0, 64)
