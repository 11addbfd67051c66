"""Orthonormal real bases for reconstruction experiments (pure math, float64).

A :class:`Basis` is an orthonormal ``[n, n]`` matrix whose rows are the basis vectors, applied to
signals of length ``d <= n``. When ``n > d`` the signal is zero-padded to ``n`` before the transform
and the inverse keeps the first ``d`` samples.

Names accepted by :func:`make_basis`:

* ``"walsh"``: orthonormal Walsh-Hadamard in Sylvester (natural) order; ``d`` a power of two.
* ``"dct"``: orthonormal DCT-II.
* ``"fourier"``: the real orthonormal DFT basis of ``R^d``, rows ordered by frequency: the constant
  row, then ``cos`` and ``sin`` for ``k = 1, 2, ...``, then the Nyquist row when ``d`` is even.
* ``"identity"``: the standard basis.
* ``"vilenkin:R1xR2x...xRm"``: a real Vilenkin-Chrestenson basis, the Kronecker product of the real
  DFT bases (as for ``"fourier"``) of sizes ``R1 .. Rm``; ``n = R1 * ... * Rm >= d``. With all radices 2
  it is exactly the Sylvester Walsh-Hadamard matrix.
* ``"vilenkin"``: radices 3 and 5 only (no factor 2, so never Walsh), chosen as the smallest product
  ``n >= d`` (e.g. ``d = 64 -> 3x5x5``, ``128 -> 3x3x3x5``, ``256 -> 3x5x5x5``), radices ascending.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass

import torch

from walshkv.ops.hadamard import hadamard_matrix, is_power_of_two

__all__ = [
    "BASIS_NAMES",
    "Basis",
    "default_bases",
    "default_vilenkin_radices",
    "make_basis",
    "real_dft_matrix",
]

BASIS_NAMES: tuple[str, ...] = ("walsh", "dct", "fourier", "vilenkin", "identity")
"""Plain basis names accepted by :func:`make_basis` (besides ``"vilenkin:R1x...xRm"``)."""

_ALLOWED = "'walsh', 'dct', 'fourier', 'vilenkin', 'vilenkin:R1xR2x...xRm' (each Ri >= 2), 'identity'"


@dataclass(frozen=True, eq=False)
class Basis:
    """An orthonormal real basis applied to signals of length ``d``.

    Instances are shared through a cache: never modify ``matrix`` in place. Equality is identity
    (comparing tensors field by field is ambiguous).

    Attributes:
        name: canonical name, e.g. ``"dct"`` or ``"vilenkin:3x5x5"``.
        d: signal length.
        n: number of coefficients, ``n >= d``.
        matrix: ``[n, n]`` float64, orthonormal rows (``matrix @ matrix.T == I``).
    """

    name: str
    d: int
    n: int
    matrix: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Coefficients of ``x``: ``c = pad(x) @ matrix.T``.

        Args:
            x: ``[..., d]``, any float dtype; zero-padded to ``n`` when ``n > d``.

        Returns:
            ``[..., n]`` float64.

        Raises:
            ValueError: if the last dimension is not ``d``.
        """
        if x.shape[-1] != self.d:
            raise ValueError(
                f"basis {self.name!r} expects signals of length {self.d}, got last dimension {x.shape[-1]}"
            )
        x = x.to(torch.float64)
        if self.n > self.d:
            x = torch.nn.functional.pad(x, (0, self.n - self.d))
        return x @ self.matrix.to(x.device).T

    def inverse(self, c: torch.Tensor) -> torch.Tensor:
        """Signal from coefficients: ``(c @ matrix)[..., :d]``.

        Args:
            c: ``[..., n]`` coefficients (any float dtype).

        Returns:
            ``[..., d]`` float64, the first ``d`` samples of the length-``n`` synthesis.

        Raises:
            ValueError: if the last dimension is not ``n``.
        """
        if c.shape[-1] != self.n:
            raise ValueError(f"basis {self.name!r} has {self.n} coefficients, got last dimension {c.shape[-1]}")
        c = c.to(torch.float64)
        return (c @ self.matrix.to(c.device))[..., : self.d]


def real_dft_matrix(d: int) -> torch.Tensor:
    """The real orthonormal DFT basis of ``R^d``, rows ordered by frequency.

    Rows: ``1/sqrt(d)``; for ``k = 1 .. ceil(d/2) - 1`` the pair ``sqrt(2/d) cos(2 pi k t/d)``,
    ``sqrt(2/d) sin(2 pi k t/d)``; and, when ``d`` is even, the Nyquist row ``(-1)^t / sqrt(d)``.

    Args:
        d: size, ``>= 1``.

    Returns:
        ``[d, d]`` float64 orthonormal matrix.
    """
    if d < 1:
        raise ValueError(f"the real DFT basis needs d >= 1, got {d}")
    t = torch.arange(d, dtype=torch.float64)
    rows = [torch.full((d,), 1.0 / math.sqrt(d), dtype=torch.float64)]
    for k in range(1, (d + 1) // 2):
        angle = 2.0 * math.pi * k * t / d
        rows.append(math.sqrt(2.0 / d) * torch.cos(angle))
        rows.append(math.sqrt(2.0 / d) * torch.sin(angle))
    if d % 2 == 0 and d > 1:
        rows.append((1.0 - 2.0 * (t % 2)) / math.sqrt(d))
    return torch.stack(rows)


def _dct_matrix(d: int) -> torch.Tensor:
    """Orthonormal DCT-II: row ``k`` is ``s_k cos(pi (t + 1/2) k / d)``, ``s_0 = sqrt(1/d)``, else ``sqrt(2/d)``."""
    t = torch.arange(d, dtype=torch.float64)
    k = torch.arange(d, dtype=torch.float64)[:, None]
    m = math.sqrt(2.0 / d) * torch.cos(math.pi * (t + 0.5) * k / d)
    m[0] /= math.sqrt(2.0)
    return m


def _vilenkin_matrix(radices: tuple[int, ...]) -> torch.Tensor:
    m = torch.ones(1, 1, dtype=torch.float64)
    for r in radices:
        m = torch.kron(m, real_dft_matrix(r))
    return m


def _is_3_5_smooth(n: int) -> bool:
    if n < 2:
        return False
    for p in (3, 5):
        while n % p == 0:
            n //= p
    return n == 1


def default_vilenkin_radices(d: int) -> tuple[int, ...]:
    """Radices (3s then 5s, ascending) of the smallest ``n >= max(d, 2)`` with no prime factor but 3 and 5.

    Found by a brute-force search upward from ``d`` (e.g. 64 -> (3, 5, 5), 128 -> (3, 3, 3, 5),
    256 -> (3, 5, 5, 5)).

    Args:
        d: signal length, ``>= 1``.

    Returns:
        The radices, ascending; their product is the basis size ``n``.
    """
    if d < 1:
        raise ValueError(f"vilenkin needs a length d >= 1, got {d}")
    n = max(d, 2)
    while not _is_3_5_smooth(n):
        n += 1
    radices: list[int] = []
    for p in (3, 5):
        while n % p == 0:
            radices.append(p)
            n //= p
    return tuple(radices)


def _parse_radices(name: str, spec: str) -> tuple[int, ...]:
    parts = spec.split("x")
    try:
        radices = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(
            f"cannot parse the radices of {name!r}: expected 'vilenkin:R1xR2x...xRm' with integers Ri >= 2; "
            f"allowed names: {_ALLOWED}"
        ) from None
    if any(r < 2 for r in radices):
        raise ValueError(f"every Vilenkin radix must be >= 2, got {name!r}; allowed names: {_ALLOWED}")
    return radices


def _radix4_variant(d: int) -> str | None:
    """``vilenkin:4x...x4`` (or ``2x4x...x4``) of product exactly ``d``; None unless ``d`` is a power of two >= 4."""
    if d < 4 or not is_power_of_two(d):
        return None
    log2 = d.bit_length() - 1
    radices = ["2"] * (log2 % 2) + ["4"] * (log2 // 2)
    return "vilenkin:" + "x".join(radices)


def default_bases(d: int) -> list[str]:
    """The basis names a reconstruction study at length ``d`` uses by default.

    ``["walsh", "dct", "fourier", "vilenkin", <radix-4 Vilenkin>, "identity"]``, where the radix-4
    variant has product exactly ``d`` (64 -> ``vilenkin:4x4x4``, 128 -> ``vilenkin:2x4x4x4``,
    256 -> ``vilenkin:4x4x4x4``). ``"walsh"`` and the radix-4 variant appear only when ``d`` is a power
    of two (the radix-4 variant only for ``d >= 4``).

    Args:
        d: signal length, ``>= 1``.

    Returns:
        Names accepted by :func:`make_basis` for this ``d``.
    """
    if d < 1:
        raise ValueError(f"the signal length must be >= 1, got {d}")
    names = ["walsh"] if is_power_of_two(d) else []
    names += ["dct", "fourier", "vilenkin"]
    radix4 = _radix4_variant(d)
    if radix4 is not None:
        names.append(radix4)
    names.append("identity")
    return names


@functools.lru_cache(maxsize=128)
def _cached_basis(kind: str, radices: tuple[int, ...], d: int) -> Basis:
    if kind == "walsh":
        return Basis("walsh", d, d, hadamard_matrix(d, torch.float64))
    if kind == "dct":
        return Basis("dct", d, d, _dct_matrix(d))
    if kind == "fourier":
        return Basis("fourier", d, d, real_dft_matrix(d))
    if kind == "identity":
        return Basis("identity", d, d, torch.eye(d, dtype=torch.float64))
    name = "vilenkin:" + "x".join(str(r) for r in radices)
    m = _vilenkin_matrix(radices)
    return Basis(name, d, m.shape[0], m)


def make_basis(name: str, d: int) -> Basis:
    """Build (or fetch from the cache) the basis ``name`` for signals of length ``d``.

    Args:
        name: one of :data:`BASIS_NAMES` or ``"vilenkin:R1xR2x...xRm"`` (case and surrounding
            whitespace ignored).
        d: signal length, ``>= 1``.

    Returns:
        The :class:`Basis`; ``n == d`` except for Vilenkin bases whose radix product exceeds ``d``.

    Raises:
        ValueError: for an unknown name, a non-power-of-two ``d`` with ``"walsh"``, malformed radices,
            or radices whose product is below ``d``; the message lists the allowed names.
    """
    try:
        d = operator.index(d)
    except TypeError:
        raise ValueError(f"the signal length d must be an integer >= 1, got {d!r}") from None
    if d < 1:
        raise ValueError(f"the signal length d must be an integer >= 1, got {d}")
    key = name.strip().lower().replace(" ", "")
    if key == "walsh":
        if not is_power_of_two(d):
            raise ValueError(f"walsh needs a power-of-two length, got {d}; allowed names: {_ALLOWED}")
        return _cached_basis("walsh", (), d)
    if key in ("dct", "fourier", "identity"):
        return _cached_basis(key, (), d)
    if key == "vilenkin":
        return _cached_basis("vilenkin", default_vilenkin_radices(d), d)
    if key.startswith("vilenkin:"):
        radices = _parse_radices(name, key.removeprefix("vilenkin:"))
        n = math.prod(radices)
        if n < d:
            raise ValueError(
                f"{name!r} has n = {n} coefficients, fewer than the signal length d = {d}: the product of the "
                f"radices must be at least {d} (the default 'vilenkin' would use "
                f"{'x'.join(str(r) for r in default_vilenkin_radices(d))})"
            )
        return _cached_basis("vilenkin", radices, d)
    raise ValueError(f"unknown basis {name!r}; allowed names: {_ALLOWED}")
