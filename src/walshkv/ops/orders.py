"""Coefficient orders for Walsh-Hadamard coefficients (length ``n``, a power of two).

An order is a permutation ``perm`` of ``0..n-1``: position ``j`` of the reordered vector holds
natural-order (Sylvester/Hadamard) coefficient ``perm[j]``, i.e. ``reordered = y[..., perm]``.

* ``natural``: Hadamard order, the identity.
* ``sequency``: Walsh order, rows sorted by their number of sign changes (0, 1, 2, ...).
* ``squarefree``: indices with μ(i) != 0 first, then the rest, each ascending; index 0 (DC)
  counts as non-squarefree, which moves DC to the back (faithful to the VHT2 document).
* ``squarefree-dc``: the same but DC kept first.
* ``variance``: by descending per-coefficient variance measured on calibration text.
"""

from __future__ import annotations

import torch

from walshkv.ops.hadamard import _check_size, hadamard_matrix
from walshkv.ops.numtheory import squarefree_indices

__all__ = ["ORDERS", "coefficient_order", "sequency_of_rows", "variance_order"]

ORDERS = ("natural", "sequency", "squarefree", "squarefree-dc", "variance")


def sequency_of_rows(n: int) -> torch.Tensor:
    """Number of sign changes along each row of the natural-order Hadamard matrix."""
    h = hadamard_matrix(n) > 0
    return (h[:, 1:] != h[:, :-1]).sum(dim=1)


def coefficient_order(name: str, n: int) -> torch.Tensor:
    """The permutation (``long [n]``) for a fixed order; ``variance`` needs :func:`variance_order`."""
    _check_size(n, "coefficient count")
    if name == "natural":
        return torch.arange(n)
    if name == "sequency":
        return torch.argsort(sequency_of_rows(n), stable=True)
    if name in ("squarefree", "squarefree-dc"):
        sf = squarefree_indices(n)
        rest = [i for i in range(n) if i not in set(sf)]
        if name == "squarefree-dc":
            rest.remove(0)
            return torch.tensor([0, *sf, *rest])
        return torch.tensor([*sf, *rest])
    if name == "variance":
        raise ValueError("order=variance is measured on calibration text: pass --calib-text (or calibration=...)")
    raise ValueError(f"unknown coefficient order {name!r}; choose one of {', '.join(ORDERS)}")


def variance_order(variance: torch.Tensor) -> torch.Tensor:
    """Permutation sorting coefficients by descending variance (ties by index)."""
    return torch.argsort(-variance.to(torch.float64), stable=True)
