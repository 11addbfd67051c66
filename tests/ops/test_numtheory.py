"""Tests for walshkv.ops.numtheory: Möbius, squarefree indices, Mertens, Redheffer."""

from __future__ import annotations

import pytest
import torch

from walshkv.ops.numtheory import (
    is_squarefree,
    mertens,
    mobius,
    mobius_table,
    redheffer_matrix,
    squarefree_indices,
)


def _naive_mobius(n: int) -> int:
    """μ(n) by trial division (n >= 1)."""
    sign, k, p = 1, n, 2
    while p * p <= k:
        if k % p == 0:
            k //= p
            if k % p == 0:
                return 0
            sign = -sign
        p += 1
    return -sign if k > 1 else sign


def _exact_det(a: torch.Tensor) -> int:
    """Exact determinant of an integer matrix: fraction-free (Bareiss) elimination."""
    m = [[int(v) for v in row] for row in a.tolist()]
    n, sign, prev = len(m), 1, 1
    for k in range(n - 1):
        if m[k][k] == 0:
            swap = next((r for r in range(k + 1, n) if m[r][k] != 0), None)
            if swap is None:
                return 0
            m[k], m[swap] = m[swap], m[k]
            sign = -sign
        for i in range(k + 1, n):
            for j in range(k + 1, n):
                m[i][j] = (m[i][j] * m[k][k] - m[i][k] * m[k][j]) // prev
        prev = m[k][k]
    return sign * m[n - 1][n - 1]


@pytest.mark.parametrize(
    ("k", "mu"),
    [(1, 1), (2, -1), (3, -1), (4, 0), (5, -1), (6, 1), (8, 0), (9, 0), (10, 1), (12, 0), (30, -1), (210, 1)],
)
def test_mobius_hand_values(k: int, mu: int) -> None:
    assert mobius(k) == mu


def test_mobius_of_zero_is_zero_by_convention() -> None:
    assert mobius(0) == 0
    assert mobius_table(0) == [0]
    assert not is_squarefree(0)


def test_mobius_table_matches_naive_factorisation() -> None:
    table = mobius_table(500)
    assert len(table) == 501
    assert table[0] == 0
    assert table[1:] == [_naive_mobius(k) for k in range(1, 501)]
    assert [mobius(k) for k in (97, 121, 330, 500)] == [table[k] for k in (97, 121, 330, 500)]


def test_is_squarefree() -> None:
    assert [k for k in range(1, 21) if is_squarefree(k)] == [1, 2, 3, 5, 6, 7, 10, 11, 13, 14, 15, 17, 19]


def test_negative_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        mobius(-1)
    with pytest.raises(ValueError, match=">= 0"):
        mobius_table(-3)


@pytest.mark.parametrize(
    ("n", "m"),
    [(1, 1), (2, 0), (3, -1), (4, -1), (5, -2), (10, -1), (100, 1), (1000, 2)],
)
def test_mertens_known_values(n: int, m: int) -> None:
    assert mertens(n) == m


def test_mertens_is_running_sum_of_mobius() -> None:
    running = 0
    for n in range(1, 201):
        running += _naive_mobius(n)
        assert mertens(n) == running
    assert mertens(0) == 0


def test_squarefree_counts_and_no_dc() -> None:
    assert len(squarefree_indices(64)) == 39
    assert len(squarefree_indices(128)) == 78
    for n in (1, 2, 4, 16, 64, 128, 256):
        idx = squarefree_indices(n)
        assert 0 not in idx
        assert idx == sorted(idx)
        assert idx == [i for i in range(1, n) if _naive_mobius(i) != 0]
    assert squarefree_indices(16) == [1, 2, 3, 5, 6, 7, 10, 11, 13, 14, 15]
    assert squarefree_indices(0) == []
    assert squarefree_indices(1) == []


def test_redheffer_matrix_by_hand() -> None:
    expected = torch.tensor(
        [[1, 1, 1, 1], [1, 1, 0, 1], [1, 0, 1, 0], [1, 0, 0, 1]],
        dtype=torch.float64,
    )
    assert torch.equal(redheffer_matrix(4), expected)
    assert redheffer_matrix(7).dtype == torch.float64
    with pytest.raises(ValueError, match=">= 1"):
        redheffer_matrix(0)


def test_redheffer_determinant_is_mertens_float() -> None:
    for n in range(1, 101):
        det = float(torch.linalg.det(redheffer_matrix(n)))
        assert abs(det - round(det)) < 1e-6, (n, det)  # the float determinant is not shaky
        assert round(det) == mertens(n), n


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 10, 17, 30, 64, 100])
def test_redheffer_determinant_is_mertens_exact(n: int) -> None:
    assert _exact_det(redheffer_matrix(n)) == mertens(n)


def test_exact_det_helper_agrees_with_float_det() -> None:
    gen = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5, 8):
        a = torch.randint(-3, 4, (n, n), generator=gen).to(torch.float64)
        assert _exact_det(a) == round(float(torch.linalg.det(a)))
    assert _exact_det(torch.tensor([[0.0, 1.0], [1.0, 0.0]])) == -1  # needs a row swap
