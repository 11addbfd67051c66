"""The small number theory behind the squarefree orders: Möbius, squarefree, Mertens, Redheffer."""

from __future__ import annotations

import torch

__all__ = ["is_squarefree", "mertens", "mobius", "mobius_table", "redheffer_matrix", "squarefree_indices"]


def mobius_table(n: int) -> list[int]:
    """``[μ(0), μ(1), ..., μ(n)]`` by a linear sieve; ``μ(0)`` is defined here as 0.

    μ(k) = 0 if k has a squared prime factor, else (-1)^(number of prime factors); μ(1) = 1.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    mu = [1] * (n + 1)
    mu[0] = 0
    is_comp = [False] * (n + 1)
    primes: list[int] = []
    for i in range(2, n + 1):
        if not is_comp[i]:
            primes.append(i)
            mu[i] = -1
        for p in primes:
            if i * p > n:
                break
            is_comp[i * p] = True
            if i % p == 0:
                mu[i * p] = 0
                break
            mu[i * p] = -mu[i]
    return mu


def mobius(k: int) -> int:
    """Möbius function μ(k) for k >= 1 (μ(0) = 0 by this module's convention)."""
    if k < 0:
        raise ValueError(f"μ is defined for k >= 0, got {k}")
    return mobius_table(k)[k]


def is_squarefree(k: int) -> bool:
    """True if no prime square divides ``k`` (k >= 1); 0 counts as not squarefree."""
    return mobius(k) != 0


def mertens(n: int) -> int:
    """Mertens function M(n) = sum of μ(k) for k = 1..n."""
    return sum(mobius_table(n)[1:])


def squarefree_indices(n: int) -> list[int]:
    """Indices ``i`` in ``0..n-1`` with μ(i) != 0 (index 0 excluded, as in the VHT2 document)."""
    mu = mobius_table(max(n - 1, 0))
    return [i for i in range(n) if mu[i] != 0]


def redheffer_matrix(n: int) -> torch.Tensor:
    """The n x n Redheffer matrix: A[i][j] = 1 if j == 1 or i divides j (1-based); det(A) = M(n)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    a = torch.zeros(n, n, dtype=torch.float64)
    for i in range(1, n + 1):
        for j in range(1, n + 1):
            if j == 1 or j % i == 0:
                a[i - 1, j - 1] = 1.0
    return a
