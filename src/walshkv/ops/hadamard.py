"""Orthonormal fast Walsh-Hadamard transform (reference, pure torch).

The transform acts on the last dimension of any tensor whose size there is a
power of two. It uses the Sylvester ("natural", Hadamard) ordering and the
orthonormal scaling ``1/sqrt(n)``, so it is its own inverse: ``fwht(fwht(x)) == x``.
"""

from __future__ import annotations

import functools
import math

import torch

__all__ = [
    "fwht",
    "hadamard_matrix",
    "hadamard_transform",
    "is_power_of_two",
    "random_signs",
    "signed_hadamard",
    "signs_for",
]

# Up to this size a dense matmul with the cached matrix beats the butterflies on CPU (BLAS).
_DENSE_MAX = 256
_DENSE_CACHE: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def is_power_of_two(n: int) -> bool:
    """Return True if ``n`` is a positive power of two (1, 2, 4, ...)."""
    return n > 0 and (n & (n - 1)) == 0


def _check_size(n: int, what: str = "last dimension") -> None:
    if not is_power_of_two(n):
        lower = 1 << (n.bit_length() - 1) if n > 0 else 1
        raise ValueError(
            f"the Walsh-Hadamard transform needs a power-of-two size, but the {what} is {n}; "
            f"nearest powers of two are {lower} and {lower * 2}. Use a codec without 'rot+'/'rrot+' "
            "for this head size."
        )


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal fast Walsh-Hadamard transform over the last dimension.

    O(n log n) butterflies in Sylvester order, scaled by ``n ** -0.5``. Computed in
    float32 (or float64 if ``x`` is float64) and returned in ``x.dtype``.

    Args:
        x: Tensor ``[..., n]`` with ``n`` a power of two, e.g. K/V of shape
            ``[batch, num_kv_heads, seq_len, head_dim]``.

    Returns:
        Tensor of the same shape and dtype as ``x``.

    Raises:
        ValueError: if ``n`` is not a power of two.
    """
    n = x.shape[-1]
    _check_size(n)
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = x.to(work_dtype).reshape(-1, n)
    h = 1
    while h < n:
        y = y.view(-1, n // (2 * h), 2, h)
        a = y[:, :, 0, :]
        b = y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2)
        h *= 2
    return (y.reshape(x.shape) * (1.0 / math.sqrt(n))).to(x.dtype)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """Same result as :func:`fwht`, computed the fastest way for the size.

    For ``n <= 256`` a matmul with the cached dense orthonormal matrix (BLAS makes that
    about ten times faster than the butterflies on CPU at n = 64); larger sizes use
    :func:`fwht`. Returns float32 (float64 for float64 input).

    Args:
        x: Tensor ``[..., n]``, ``n`` a power of two.
    """
    n = x.shape[-1]
    if n > _DENSE_MAX:
        return fwht(x)
    _check_size(n)
    work_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    return (x if x.dtype == work_dtype else x.to(work_dtype)) @ _dense(n, work_dtype, x.device)


def _dense(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The cached orthonormal Hadamard matrix of size ``n`` (read-only)."""
    key = (n, dtype, device)
    h = _DENSE_CACHE.get(key)
    if h is None:
        h = _DENSE_CACHE[key] = hadamard_matrix(n, dtype).to(device)
    return h


_SIGNED_CACHE: dict[tuple[int, int, torch.device], torch.Tensor] = {}
#: Byte alignment of a fresh tensor's data, per device type where the signs are folded into the matrix (the CPU,
#: where a decoding step's op overhead is the cost; torch's CPU allocator aligns to 64 bytes).
_FRESH_ALIGN = {"cpu": 64}


def signed_hadamard(x: torch.Tensor, seed: int) -> torch.Tensor | None:
    """The cached ``diag(s) H`` (``s = signs_for(n, seed)``) for ``x``'s size and device, where it serves ``x``.

    ``x @ signed_hadamard(x, seed)`` equals ``hadamard_transform(x * s)`` bit for bit: flipping a sign is exact
    and commutes with rounding, so every product ``x_k (s_k h_kj)`` is the product ``(x_k s_k) h_kj``, and the
    matmul sums the same terms in the same order (it sees operands of the same shape, strides and alignment as
    the fresh tensor ``x * s``). Returns ``None`` where that does not hold: ``x`` not float32, not contiguous or
    not at a fresh tensor's alignment, or a size that :func:`hadamard_transform` does not take by matmul; the
    caller then multiplies by the signs. (Signs applied after the transform cannot be folded in this way: the
    sign of an exactly zero sum would change.)
    """
    n = x.shape[-1]
    if n > _DENSE_MAX or x.dtype != torch.float32 or not is_power_of_two(n) or not x.is_contiguous():
        return None
    device = x.device
    align = _FRESH_ALIGN.get(device.type)
    if align is None or x.data_ptr() % align:
        return None
    key = (n, seed, device)
    m = _SIGNED_CACHE.get(key)
    if m is None:
        m = _SIGNED_CACHE[key] = (signs_for(n, seed, device)[:, None] * _dense(n, torch.float32, device)).contiguous()
    return m


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The orthonormal Sylvester Hadamard matrix ``H_n / sqrt(n)`` (a naive reference).

    Entry ``(i, j)`` is ``(-1) ** popcount(i & j) / sqrt(n)``; ``fwht(x) == x @ H``.

    Args:
        n: size, a power of two.
        dtype: dtype of the result.

    Returns:
        Tensor ``[n, n]``, symmetric and orthogonal.
    """
    _check_size(n, "requested size")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester: H_2n = [[H, H], [H, -H]]
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return (h / math.sqrt(n)).to(dtype)


def random_signs(n: int, seed: int) -> torch.Tensor:
    """Seeded random ±1 vector of length ``n`` (float32), for randomized Hadamard rotations."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (n,), generator=gen) * 2 - 1).to(torch.float32)


@functools.lru_cache(maxsize=64)
def _cached_signs(n: int, seed: int, device: torch.device) -> torch.Tensor:
    return random_signs(n, seed).to(device)


def signs_for(n: int, seed: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`random_signs` cached per (n, seed, device); treat the result as read-only."""
    return _cached_signs(n, seed, torch.device(device))
