"""Tests for walshkv.ops.orders: permutations of Walsh-Hadamard coefficients."""

from __future__ import annotations

import functools

import pytest
import torch

from walshkv.ops.hadamard import hadamard_matrix
from walshkv.ops.numtheory import squarefree_indices
from walshkv.ops.orders import ORDERS, coefficient_order, sequency_of_rows, variance_order

SIZES = [2**k for k in range(2, 9)]  # 4 .. 256
FIXED = [name for name in ORDERS if name != "variance"]


@functools.cache
def _hadamard(n: int) -> torch.Tensor:
    return hadamard_matrix(n)


def _sign_changes(rows: torch.Tensor) -> list[int]:
    """Sign changes along each row: neighbours whose product is negative."""
    return (rows[:, 1:] * rows[:, :-1] < 0).sum(dim=1).tolist()


def _bit_reverse(i: int, bits: int) -> int:
    return int(format(i, f"0{bits}b")[::-1], 2) if bits else 0


def test_fixed_orders_are_the_documented_ones() -> None:
    assert FIXED == ["natural", "sequency", "squarefree", "squarefree-dc"]
    assert ORDERS[-1] == "variance"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("name", FIXED)
def test_every_order_is_a_permutation(name: str, n: int) -> None:
    perm = coefficient_order(name, n)
    assert perm.dtype == torch.long
    assert perm.shape == (n,)
    assert sorted(perm.tolist()) == list(range(n))


@pytest.mark.parametrize("n", SIZES)
def test_natural_is_identity(n: int) -> None:
    assert torch.equal(coefficient_order("natural", n), torch.arange(n))


@pytest.mark.parametrize("n", SIZES)
def test_sequency_rows_have_0_to_n_minus_1_sign_changes(n: int) -> None:
    perm = coefficient_order("sequency", n)
    assert _sign_changes(_hadamard(n)[perm]) == list(range(n))
    assert sequency_of_rows(n).tolist() == _sign_changes(_hadamard(n))


@pytest.mark.parametrize("n", SIZES)
def test_sequency_is_bit_reversed_gray_code(n: int) -> None:
    """Walsh (sequency) index k sits at natural index bitreverse(gray(k))."""
    bits = n.bit_length() - 1
    expected = [_bit_reverse(k ^ (k >> 1), bits) for k in range(n)]
    assert coefficient_order("sequency", n).tolist() == expected


def test_sequency_small_by_hand() -> None:
    assert coefficient_order("sequency", 4).tolist() == [0, 2, 3, 1]
    assert coefficient_order("sequency", 8).tolist() == [0, 4, 6, 2, 3, 7, 5, 1]


def test_squarefree_orders_by_hand() -> None:
    sf = [1, 2, 3, 5, 6, 7, 10, 11, 13, 14, 15]
    assert coefficient_order("squarefree", 16).tolist() == [*sf, 0, 4, 8, 9, 12]
    assert coefficient_order("squarefree-dc", 16).tolist() == [0, *sf, 4, 8, 9, 12]


@pytest.mark.parametrize("n", SIZES)
def test_squarefree_orders_structure(n: int) -> None:
    sf = squarefree_indices(n)
    others = [i for i in range(n) if i not in sf]
    assert others[0] == 0  # DC is the first of the non-squarefree indices
    assert coefficient_order("squarefree", n).tolist() == sf + others
    assert coefficient_order("squarefree-dc", n).tolist() == [0, *sf, *others[1:]]


def test_squarefree_puts_dc_right_after_the_squarefree_block() -> None:
    perm = coefficient_order("squarefree", 128).tolist()
    assert perm.index(0) == 78
    assert perm[:78] == squarefree_indices(128)


def test_variance_without_calibration_raises() -> None:
    with pytest.raises(ValueError, match="--calib-text"):
        coefficient_order("variance", 64)


def test_unknown_order_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown coefficient order 'zigzag'") as err:
        coefficient_order("zigzag", 64)
    for name in ORDERS:
        assert name in str(err.value)


@pytest.mark.parametrize("n", [0, 3, 48, 100])
def test_non_power_of_two_is_refused(n: int) -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        coefficient_order("natural", n)


def test_variance_order_descending() -> None:
    var = torch.tensor([0.5, 3.0, 0.1, 2.0, 7.0])
    perm = variance_order(var)
    assert perm.tolist() == [4, 1, 3, 0, 2]
    assert torch.all(var[perm][:-1] >= var[perm][1:])


def test_variance_order_ties_are_stable() -> None:
    var = torch.tensor([1.0, 2.0, 1.0, 2.0, 1.0, 0.0, 2.0])
    assert variance_order(var).tolist() == [1, 3, 6, 0, 2, 4, 5]
    assert variance_order(torch.ones(64)).tolist() == list(range(64))


def test_variance_order_is_a_permutation_of_random_profiles() -> None:
    var = torch.rand(128, dtype=torch.float64)
    perm = variance_order(var)
    assert sorted(perm.tolist()) == list(range(128))
    assert torch.equal(var[perm], var.sort(descending=True).values)
    # float16 / float32 inputs are ranked the same way
    assert torch.equal(variance_order(var.float()), perm)
