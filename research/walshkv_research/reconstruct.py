"""Reconstruction of signals from a kept fraction of their coefficients in an orthonormal basis.

Pure math on ``[vectors, d]`` tensors (float64 throughout); the bases come from
:mod:`walshkv_research.bases`. Modes:

* ``"topk"``: per vector, keep the ``k`` largest-magnitude coefficients;
* ``"fixed"``: keep the same ``k`` positions for every vector, those of largest mean energy;
* ``"signs"``: one bit per coefficient plus one amplitude per vector (the RMS of its coefficients);
* ``"signs+amp"``: one bit per coefficient plus one amplitude per coefficient position (mean ``|c|``).

``k`` is counted relative to the signal length ``d`` (:func:`kept_count`), so every basis stores the same
number of coefficients at a given fraction; a padded basis (``n > d``) is therefore not exact at
fraction 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch

from walshkv_research.bases import Basis, make_basis

__all__ = [
    "MODES",
    "SIGN_MODES",
    "SYNTHETIC_KINDS",
    "correlation",
    "kept_count",
    "reconstruct",
    "reconstruction_table",
    "relative_mse",
    "synthetic_signals",
]

MODES: tuple[str, ...] = ("topk", "fixed", "signs", "signs+amp")
"""Reconstruction modes accepted by :func:`reconstruct`."""

SIGN_MODES: tuple[str, ...] = ("signs", "signs+amp")
"""Modes that ignore the kept fraction (every coefficient keeps its sign)."""

SYNTHETIC_KINDS: tuple[str, ...] = ("prime-harmonic", "chirp", "noise")
"""Signal kinds accepted by :func:`synthetic_signals`."""


def kept_count(fraction: float, d: int) -> int:
    """Number of coefficients kept at ``fraction`` of a signal of length ``d``.

    ``round(fraction * d)`` (halves round up), at least 1, exactly ``d`` at ``fraction == 1``. The count
    is relative to the SIGNAL length ``d``, not to the basis size ``n``: every basis stores the same
    number of coefficients at a given fraction. A padded basis (``n > d``, e.g. the default Vilenkin
    basis, 75 coefficients for ``d = 64``) therefore keeps only ``d`` of its ``n`` coefficients at
    ``fraction == 1`` and is not exact there; that is the real cost of padding.

    Args:
        fraction: kept fraction, in ``(0, 1]``.
        d: signal length, ``>= 1``.

    Returns:
        ``k`` with ``1 <= k <= d``.

    Raises:
        ValueError: if ``fraction`` is outside ``(0, 1]`` (or NaN) or ``d < 1``.
    """
    if d < 1:
        raise ValueError(f"the signal length d must be >= 1, got {d}")
    if not (0.0 < fraction <= 1.0):  # also rejects NaN
        raise ValueError(f"the kept fraction must be in (0, 1], got {fraction}")
    return max(1, min(d, math.floor(fraction * d + 0.5)))


def _check_signals(x: torch.Tensor, what: str = "x") -> None:
    if x.dim() != 2:
        raise ValueError(f"{what} must have shape [vectors, d], got {tuple(x.shape)}")
    if x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{what} must hold at least one vector of length >= 1, got shape {tuple(x.shape)}")
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{what} contains NaN or Inf values")


def _sign(c: torch.Tensor) -> torch.Tensor:
    """``+1`` where ``c >= 0``, ``-1`` elsewhere: a true one-bit sign (zero maps to ``+1``)."""
    return torch.where(c >= 0, 1.0, -1.0).to(c.dtype)


def _top_positions_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the ``k`` largest ``scores`` along the last dim (ties: lower index first)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    mask = torch.zeros_like(scores, dtype=torch.bool)
    return mask.scatter(-1, order, True)


def reconstruct(x: torch.Tensor, basis: Basis, fraction: float | None, mode: str) -> torch.Tensor:
    """Reconstruct ``x`` from part (or a sign code) of its coefficients in ``basis``.

    Modes:

    * ``"topk"``: per vector, keep the ``k = kept_count(fraction, d)`` coefficients of largest
      magnitude, zero the rest, inverse transform.
    * ``"fixed"``: keep the same ``k`` positions for every vector: the ``k`` of largest mean energy
      (mean of ``c^2`` over the vectors passed in).
    * ``"signs"``: every coefficient becomes ``sign(c) * a_v`` with one amplitude per vector, ``a_v`` the
      RMS of that vector's ``n`` coefficients (so each vector keeps its energy). ``fraction`` is ignored.
    * ``"signs+amp"``: every coefficient ``i`` becomes ``sign(c_i) * a_i`` with ``a_i`` the mean of
      ``|c_i|`` over the vectors passed in (an amplitude profile, one per position). ``fraction`` is
      ignored.

    In the sign modes a zero coefficient gets sign ``+1`` (a one-bit code has no zero symbol).
    Ties in the ``k`` selections go to the lower coefficient index.

    Args:
        x: ``[vectors, d]`` signals, any float dtype, finite.
        basis: basis with ``basis.d == d``.
        fraction: kept fraction in ``(0, 1]`` for ``"topk"`` / ``"fixed"``; ignored (may be None) for the
            sign modes.
        mode: one of :data:`MODES`.

    Returns:
        ``x_hat``, ``[vectors, d]`` float64.

    Raises:
        ValueError: unknown mode, bad shape, NaN/Inf input, or a fraction outside ``(0, 1]``.
    """
    if mode not in MODES:
        raise ValueError(f"unknown reconstruction mode {mode!r}; allowed modes: {', '.join(MODES)}")
    _check_signals(x)
    if x.shape[1] != basis.d:
        raise ValueError(f"basis {basis.name!r} is for length {basis.d}, but x has length {x.shape[1]}")
    c = basis.forward(x)  # [vectors, n]
    if mode == "signs":
        amplitude = c.pow(2).mean(dim=-1, keepdim=True).sqrt()  # [vectors, 1]
        return basis.inverse(_sign(c) * amplitude)
    if mode == "signs+amp":
        amplitude = c.abs().mean(dim=0, keepdim=True)  # [1, n]
        return basis.inverse(_sign(c) * amplitude)
    if fraction is None:
        raise ValueError(f"mode {mode!r} needs a kept fraction in (0, 1], got None")
    k = kept_count(fraction, basis.d)
    if mode == "topk":
        mask = _top_positions_mask(c.abs(), k)
    else:  # fixed
        mask = _top_positions_mask(c.pow(2).mean(dim=0), k).expand_as(c)
    return basis.inverse(torch.where(mask, c, torch.zeros_like(c)))


def _pair(x: torch.Tensor, x_hat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != x_hat.shape:
        raise ValueError(f"x and x_hat must have the same shape, got {tuple(x.shape)} and {tuple(x_hat.shape)}")
    if x.dim() == 0:
        raise ValueError("x must have at least one dimension")
    d = x.shape[-1]
    return x.to(torch.float64).reshape(-1, d), x_hat.to(torch.float64).reshape(-1, d)


def correlation(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """Mean over vectors of the Pearson correlation between ``x`` and ``x_hat``.

    A vector is skipped when either side has (numerically) zero variance: its centred norm is at most
    ``1e-12`` times its norm (so a constant or all-zero vector, or rounding noise on one, is skipped).

    Args:
        x: ``[vectors, d]`` (any ``[..., d]``; leading dims are flattened).
        x_hat: same shape as ``x``.

    Returns:
        The mean correlation, or ``nan`` when every vector was skipped.
    """
    a, b = _pair(x, x_hat)
    scale_a, scale_b = a.norm(dim=-1), b.norm(dim=-1)
    a = a - a.mean(dim=-1, keepdim=True)
    b = b - b.mean(dim=-1, keepdim=True)
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    valid = (na > 1e-12 * scale_a) & (nb > 1e-12 * scale_b)
    if not bool(valid.any()):
        return math.nan
    r = (a[valid] * b[valid]).sum(dim=-1) / (na[valid] * nb[valid])
    return float(r.mean())


def relative_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    """``sum ||x - x_hat||^2 / sum ||x||^2`` over all vectors.

    Args:
        x: ``[vectors, d]`` (any shape; must match ``x_hat``).
        x_hat: same shape as ``x``.

    Returns:
        The relative squared error; ``0.0`` when both are all zero, ``inf`` when only ``x`` is.
    """
    a, b = _pair(x, x_hat)
    err = float((a - b).pow(2).sum())
    ref = float(a.pow(2).sum())
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref


def _primes_up_to(m: int) -> list[int]:
    return [p for p in range(2, m + 1) if all(p % q for q in range(2, math.isqrt(p) + 1))]


def synthetic_signals(kind: str, vectors: int, d: int, seed: int = 0) -> torch.Tensor:
    """Deterministic synthetic test signals, ``t = 0 .. d-1``.

    Kinds:

    * ``"prime-harmonic"``: ``sum_{p prime, p <= d/2} sin(2 pi p t / d + phi_p) / p`` with phases
      ``phi_p`` uniform in ``[0, 2 pi)``, drawn per vector and prime. Exactly sparse in the real DFT
      basis (two coefficients per prime, one for ``p = d/2``). Needs ``d >= 4``.
    * ``"chirp"``: ``cos(2 pi (f0 t + 0.5 r t^2 / d) / d + phi)``, frequencies in cycles per vector
      length: the instantaneous frequency ``f0 + r t / d`` sweeps from ``f0`` (uniform in ``[0, d/8)``)
      to ``d/2`` at ``t = d`` (``r = d/2 - f0``); ``phi`` uniform in ``[0, 2 pi)``.
    * ``"noise"``: i.i.d. standard normal.

    Args:
        kind: one of :data:`SYNTHETIC_KINDS`.
        vectors: number of vectors, ``>= 1``.
        d: signal length, ``>= 1``.
        seed: seed of the ``torch.Generator``; the same seed gives the same signals.

    Returns:
        ``[vectors, d]`` float64.

    Raises:
        ValueError: unknown kind, ``vectors < 1``, ``d < 1`` (``d < 4`` for ``"prime-harmonic"``).
    """
    if kind not in SYNTHETIC_KINDS:
        raise ValueError(f"unknown synthetic signal kind {kind!r}; allowed kinds: {', '.join(SYNTHETIC_KINDS)}")
    if vectors < 1 or d < 1:
        raise ValueError(f"need vectors >= 1 and d >= 1, got vectors={vectors}, d={d}")
    gen = torch.Generator().manual_seed(seed)
    t = torch.arange(d, dtype=torch.float64)
    if kind == "noise":
        return torch.randn(vectors, d, generator=gen, dtype=torch.float64)
    if kind == "prime-harmonic":
        primes = _primes_up_to(d // 2)
        if not primes:
            raise ValueError(f"prime-harmonic needs d >= 4 (a prime p <= d/2), got d={d}")
        p = torch.tensor(primes, dtype=torch.float64)  # [P]
        phase = 2.0 * math.pi * torch.rand(vectors, len(primes), 1, generator=gen, dtype=torch.float64)
        waves = torch.sin(2.0 * math.pi * p[:, None] * t / d + phase) / p[:, None]  # [vectors, P, d]
        return waves.sum(dim=1)
    # chirp
    f0 = (d / 8.0) * torch.rand(vectors, 1, generator=gen, dtype=torch.float64)
    phase = 2.0 * math.pi * torch.rand(vectors, 1, generator=gen, dtype=torch.float64)
    r = d / 2.0 - f0
    return torch.cos(2.0 * math.pi * (f0 * t + 0.5 * r * t * t / d) / d + phase)


def reconstruction_table(
    x: torch.Tensor,
    bases: Iterable[str],
    fractions: Sequence[float],
    modes: Sequence[str],
) -> list[dict[str, object]]:
    """Correlation and relative MSE of every (basis, mode, fraction) reconstruction of ``x``.

    Loops basis, then mode, then fraction. The sign modes ignore the fraction and give one row each
    (``fraction`` and ``kept`` None).

    Args:
        x: ``[vectors, d]`` signals.
        bases: basis names for :func:`walshkv_research.bases.make_basis` at ``d = x.shape[-1]``.
        fractions: kept fractions in ``(0, 1]`` for ``"topk"`` / ``"fixed"``.
        modes: modes from :data:`MODES`.

    Returns:
        Rows ``{"basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse"}``,
        ``basis`` the canonical name (e.g. ``"vilenkin:3x5x5"``) and ``coefficients`` its size ``n``.

    Raises:
        ValueError: unknown mode or basis, bad fraction, bad input (checked before any work).
    """
    modes = list(modes)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"unknown reconstruction mode {mode!r}; allowed modes: {', '.join(MODES)}")
    for f in fractions:
        kept_count(f, 1)
    _check_signals(x)
    d = x.shape[-1]
    built = [make_basis(name, d) for name in bases]
    rows: list[dict[str, object]] = []
    for basis in built:
        for mode in modes:
            settings: list[float | None] = [None] if mode in SIGN_MODES else list(fractions)
            for f in settings:
                x_hat = reconstruct(x, basis, f, mode)
                rows.append(
                    {
                        "basis": basis.name,
                        "mode": mode,
                        "fraction": f,
                        "kept": None if f is None else kept_count(f, d),
                        "coefficients": basis.n,
                        "correlation": correlation(x, x_hat),
                        "relative_mse": relative_mse(x, x_hat),
                    }
                )
    return rows
