"""Tests for walshkv.ops.hadamard: fast Walsh-Hadamard transform and its references."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.ops.hadamard import fwht, hadamard_matrix, is_power_of_two, random_signs

POWERS = [2**k for k in range(9)]  # 1 .. 256
NOT_POWERS = [(3, 2, 4), (48, 32, 64), (96, 64, 128), (100, 64, 128)]


@pytest.mark.parametrize("n", POWERS)
def test_fwht_matches_naive_matrix_float64(n: int) -> None:
    x = torch.randn(2, 3, 5, n, dtype=torch.float64)
    expected = x @ hadamard_matrix(n)
    torch.testing.assert_close(fwht(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", POWERS)
def test_fwht_matches_naive_matrix_float32(n: int) -> None:
    x = torch.randn(2, 3, 5, n, dtype=torch.float32)
    expected = (x.double() @ hadamard_matrix(n)).float()
    torch.testing.assert_close(fwht(x), expected, rtol=0, atol=1e-5)


def test_fwht_known_values() -> None:
    torch.testing.assert_close(fwht(torch.tensor([1.0, 0.0, 0.0, 0.0])), torch.full((4,), 0.5))
    torch.testing.assert_close(fwht(torch.tensor([1.0, 1.0])), torch.tensor([math.sqrt(2.0), 0.0]))
    torch.testing.assert_close(fwht(torch.tensor([[3.0]])), torch.tensor([[3.0]]))


@pytest.mark.parametrize("n", POWERS)
def test_fwht_self_inverse_float32(n: int) -> None:
    x = torch.randn(2, 3, 5, n)
    assert (fwht(fwht(x)) - x).abs().max() <= 1e-5


@pytest.mark.parametrize("n", POWERS)
def test_fwht_self_inverse_float64(n: int) -> None:
    x = torch.randn(2, 3, 5, n, dtype=torch.float64)
    assert (fwht(fwht(x)) - x).abs().max() <= 1e-12


@pytest.mark.parametrize("n", POWERS)
def test_fwht_preserves_norm(n: int) -> None:
    x = torch.randn(2, 3, 5, n, dtype=torch.float64)
    torch.testing.assert_close(fwht(x).norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", POWERS)
def test_hadamard_matrix_is_orthonormal_and_symmetric(n: int) -> None:
    H = hadamard_matrix(n)
    assert H.shape == (n, n)
    assert H.dtype == torch.float64
    torch.testing.assert_close(H @ H.T, torch.eye(n, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(H, H.T, rtol=0, atol=0)
    # Every entry is +-1/sqrt(n); the first row and column are all positive (Sylvester order).
    torch.testing.assert_close(H.abs(), torch.full((n, n), 1 / math.sqrt(n), dtype=torch.float64))
    assert bool((H[0] > 0).all()) and bool((H[:, 0] > 0).all())


def test_hadamard_matrix_entries_follow_popcount_rule() -> None:
    n = 16
    H = hadamard_matrix(n)
    for i in range(n):
        for j in range(n):
            sign = -1.0 if bin(i & j).count("1") % 2 else 1.0
            assert H[i, j].item() == pytest.approx(sign / 4.0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_hadamard_matrix_dtype(dtype: torch.dtype) -> None:
    assert hadamard_matrix(8, dtype=dtype).dtype == dtype


@pytest.mark.parametrize(
    ("dtype", "atol"),
    [(torch.float16, 1e-2), (torch.bfloat16, 5e-2), (torch.float32, 1e-5), (torch.float64, 1e-12)],
)
def test_fwht_preserves_dtype_and_shape(dtype: torch.dtype, atol: float) -> None:
    x = torch.randn(2, 3, 5, 64).to(dtype)
    y = fwht(x)
    assert y.dtype == dtype
    assert y.shape == x.shape
    expected = x.double() @ hadamard_matrix(64)
    assert (y.double() - expected).abs().max() <= atol * max(1.0, float(expected.abs().max()))


def test_fwht_does_not_modify_input() -> None:
    x = torch.randn(4, 32)
    before = x.clone()
    fwht(x)
    assert torch.equal(x, before)


def test_fwht_non_contiguous_input() -> None:
    base = torch.randn(32, 6, 16)
    x = base.transpose(0, 2)  # [16, 6, 32], last dim not contiguous
    assert not x.is_contiguous()
    torch.testing.assert_close(fwht(x), fwht(x.contiguous()), rtol=0, atol=0)


def test_fwht_empty_leading_dims() -> None:
    y = fwht(torch.zeros(2, 0, 64))
    assert y.shape == (2, 0, 64)


@pytest.mark.parametrize(("n", "lower", "upper"), NOT_POWERS)
def test_fwht_rejects_non_power_of_two(n: int, lower: int, upper: int) -> None:
    with pytest.raises(ValueError, match="power") as info:
        fwht(torch.randn(2, n))
    message = str(info.value)
    assert str(n) in message
    assert f"{lower} and {upper}" in message


@pytest.mark.parametrize(("n", "lower", "upper"), NOT_POWERS)
def test_hadamard_matrix_rejects_non_power_of_two(n: int, lower: int, upper: int) -> None:
    with pytest.raises(ValueError, match="power") as info:
        hadamard_matrix(n)
    assert f"{lower} and {upper}" in str(info.value)


def test_fwht_rejects_empty_last_dimension() -> None:
    with pytest.raises(ValueError, match="power"):
        fwht(torch.zeros(3, 0))


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, True), (2, True), (64, True), (1024, True), (0, False), (-4, False), (3, False), (48, False), (100, False)],
)
def test_is_power_of_two(n: int, expected: bool) -> None:
    assert is_power_of_two(n) is expected


@pytest.mark.parametrize("n", [1, 8, 64, 128])
def test_random_signs_are_plus_minus_one(n: int) -> None:
    s = random_signs(n, seed=3)
    assert s.shape == (n,)
    assert s.dtype == torch.float32
    assert bool(((s == 1) | (s == -1)).all())


def test_random_signs_deterministic_per_seed() -> None:
    torch.testing.assert_close(random_signs(128, 7), random_signs(128, 7), rtol=0, atol=0)
    assert not torch.equal(random_signs(128, 7), random_signs(128, 8))
    # Both signs actually occur.
    s = random_signs(128, 7)
    assert bool((s == 1).any()) and bool((s == -1).any())


def test_random_signs_leave_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    random_signs(64, 5)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128, 256, 512, 1024])
def test_hadamard_transform_matches_fwht(n):
    from walshkv.ops import hadamard_transform

    x = torch.randn(2, 3, 5, n)
    assert torch.allclose(hadamard_transform(x), fwht(x), atol=1e-5)
    assert torch.allclose(hadamard_transform(hadamard_transform(x)), x, atol=1e-5)
    assert hadamard_transform(x.double()).dtype == torch.float64
