"""Tests for walshkv.ops.quant: symmetric RTN with one fp16 scale per vector."""

from __future__ import annotations

import itertools

import pytest
import torch

from walshkv.ops.quant import (
    FP16_MAX,
    check_finite,
    dequantize_symmetric,
    quantize_symmetric,
    symmetric_qmax,
)

BITS = list(range(2, 9))


def roundtrip(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes, scale = quantize_symmetric(x, bits)
    return codes, scale, dequantize_symmetric(codes, scale, bits)


@pytest.mark.parametrize(("bits", "qmax"), [(2, 1), (3, 3), (4, 7), (5, 15), (6, 31), (7, 63), (8, 127)])
def test_symmetric_qmax(bits: int, qmax: int) -> None:
    assert symmetric_qmax(bits) == qmax


@pytest.mark.parametrize("bits", [0, 1, 9, 16])
def test_symmetric_qmax_rejects_bad_bits(bits: int) -> None:
    with pytest.raises(ValueError, match=r"2\.\.8"):
        symmetric_qmax(bits)


@pytest.mark.parametrize("bits", [1, 9])
def test_quantize_rejects_bad_bits(bits: int) -> None:
    with pytest.raises(ValueError):
        quantize_symmetric(torch.randn(4, 8), bits)


@pytest.mark.parametrize("bits", BITS)
def test_shapes_dtypes_and_code_range(bits: int) -> None:
    x = torch.randn(2, 3, 5, 64) * 3
    codes, scale, xhat = roundtrip(x, bits)
    qmax = symmetric_qmax(bits)
    assert codes.dtype == torch.uint8
    assert codes.shape == x.shape
    assert int(codes.min()) >= 0
    assert int(codes.max()) <= 2 * qmax
    # The absmax element of each vector maps to an end code.
    assert bool((codes.to(torch.int32) - qmax).abs().amax(dim=-1).eq(qmax).all())
    assert scale.dtype == torch.float16
    assert scale.shape == (2, 3, 5, 1)
    assert xhat.dtype == torch.float32
    assert xhat.shape == x.shape


@pytest.mark.parametrize("bits", BITS)
def test_per_vector_error_bound(bits: int) -> None:
    x = torch.randn(4, 8, 64) * 2
    _, scale, xhat = roundtrip(x, bits)
    s = scale.to(torch.float32)  # the stored fp16 scale
    assert bool(((x - xhat).abs() <= 0.5 * s * (1 + 1e-3)).all())


@pytest.mark.parametrize("bits", BITS)
def test_scale_is_absmax_over_qmax(bits: int) -> None:
    x = torch.randn(16, 64)
    _, scale = quantize_symmetric(x, bits)
    expected = x.abs().amax(dim=-1, keepdim=True) / symmetric_qmax(bits)
    torch.testing.assert_close(scale.to(torch.float32), expected, rtol=1e-3, atol=0)


@pytest.mark.parametrize("bits", BITS)
def test_negation_mirrors_codes(bits: int) -> None:
    x = torch.randn(8, 32)
    codes, scale = quantize_symmetric(x, bits)
    neg_codes, neg_scale = quantize_symmetric(-x, bits)
    assert torch.equal(neg_scale, scale)
    assert torch.equal(neg_codes.to(torch.int32), 2 * symmetric_qmax(bits) - codes.to(torch.int32))


def test_error_shrinks_with_bits() -> None:
    x = torch.randn(64, 64)
    errors = [float(((x - roundtrip(x, b)[2]) ** 2).mean()) for b in BITS]
    assert all(a > b for a, b in itertools.pairwise(errors))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_accepts_other_float_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(4, 32).to(dtype)
    codes, scale, xhat = roundtrip(x, 4)
    assert codes.dtype == torch.uint8
    assert scale.dtype == torch.float16
    assert xhat.dtype == torch.float32
    assert bool(((x.float() - xhat).abs() <= 0.5 * scale.float() * (1 + 1e-3)).all())


@pytest.mark.parametrize("bits", BITS)
def test_all_zero_vectors(bits: int) -> None:
    x = torch.zeros(3, 64)
    x[1] = torch.randn(64)  # one ordinary vector among zero ones
    codes, scale, xhat = roundtrip(x, bits)
    qmax = symmetric_qmax(bits)
    assert scale[0].item() == 0.0 and scale[2].item() == 0.0
    assert bool((codes[0] == qmax).all()) and bool((codes[2] == qmax).all())
    assert torch.equal(xhat[0], torch.zeros(64)) and torch.equal(xhat[2], torch.zeros(64))
    assert bool(torch.isfinite(xhat).all())
    assert float(xhat[1].abs().max()) > 0


def test_large_values_within_fp16_scale_range() -> None:
    x = torch.randn(2, 64)
    x[0, 5] = 1e6  # int8 scale ~7874, representable in fp16
    x[1, 9] = -1e6
    _, scale, xhat = roundtrip(x, 8)
    assert bool(torch.isfinite(scale).all())
    assert scale.float().max().item() == pytest.approx(1e6 / 127, rel=1e-3)
    assert bool(((x - xhat).abs() <= 0.5 * scale.float() * (1 + 1e-3)).all())
    assert xhat[0, 5].item() == pytest.approx(1e6, rel=1e-3)


@pytest.mark.parametrize(("bits", "value"), [(8, 1e7), (4, 1e6), (2, 1e5)])
def test_scale_overflowing_fp16_raises(bits: int, value: float) -> None:
    x = torch.randn(2, 64)
    x[1, 3] = value
    with pytest.raises(ValueError, match="fp16"):
        quantize_symmetric(x, bits)


def test_scale_at_fp16_max_is_accepted() -> None:
    x = torch.zeros(1, 8)
    x[0, 0] = FP16_MAX  # int2: scale == absmax == 65504, the largest finite fp16
    _, scale, xhat = roundtrip(x, 2)
    assert scale.item() == FP16_MAX
    assert xhat[0, 0].item() == FP16_MAX


@pytest.mark.parametrize("bits", BITS)
def test_tiny_values_stay_finite(bits: int) -> None:
    x = torch.randn(4, 64) * 1e-9
    _, scale, xhat = roundtrip(x, bits)
    assert bool(torch.isfinite(scale).all())
    assert bool(torch.isfinite(xhat).all())
    assert float((x - xhat).abs().max()) <= 1e-8


@pytest.mark.parametrize("absmax", [1e-4, 1e-5])
def test_error_bound_with_subnormal_fp16_scale(absmax: float) -> None:
    x = torch.linspace(-absmax, absmax, 64)
    _, scale, xhat = roundtrip(x, 8)
    assert bool(((x - xhat).abs() <= 0.5 * scale.float() * (1 + 1e-3)).all())


def test_check_finite_passes_finite() -> None:
    check_finite(torch.randn(3, 4))
    check_finite(torch.tensor([FP16_MAX, -1e30]))


def test_check_finite_names_counts() -> None:
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    x[1, 1] = float("nan")
    x[2, 2] = float("inf")
    x[3, 3] = float("-inf")
    x[3, 4] = float("inf")
    with pytest.raises(ValueError, match="2 NaN and 3 Inf") as info:
        check_finite(x, what="keys")
    assert "keys" in str(info.value)


@pytest.mark.parametrize(("bad", "expected"), [(float("nan"), "1 NaN and 0 Inf"), (float("inf"), "0 NaN and 1 Inf")])
def test_check_finite_single_bad_value(bad: float, expected: str) -> None:
    x = torch.zeros(5)
    x[2] = bad
    with pytest.raises(ValueError, match=expected):
        check_finite(x)
