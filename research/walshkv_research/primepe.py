"""PrimePE: composite- or prime-tiered RoPE frequency factors blended into a model's rotary embedding.

What the VHT2 document describes, and exactly what is implemented here (``n = head_dim / 2`` rotary
pairs, ``theta_i`` the model's own inverse frequency of pair ``i``, descending in ``i``):

1. **Lattice.** ``n`` integers drawn from three tiers: local ``[4, 101]``, mid ``(101, 1009]``, long
   ``(1009, 8209]``, with ``round(0.25 n)``, ``round(0.33 n)`` and the rest (about 42%) of the pairs
   (rounding half up). ``composite`` draws composite integers, ``prime`` primes, each "sampled evenly
   within the tier": the sorted candidates of the tier at indices ``round(linspace(0, len - 1, count))``
   (a tier with one sample takes its smallest candidate). The lattice is ascending.
2. **Rescale.** The lattice is min-max rescaled, linearly, onto the model's frequency range
   ``[min theta, max theta]``: ``r = min theta + (L - min L) / (max L - min L) * (max theta - min theta)``.
3. **Blend.** ``b_i = (1 - alpha) theta_i + alpha r_i``; the factor is ``f_i = b_i / theta_i``.
   ``geometric`` uses ``r = theta``: every factor is exactly 1 (the identity control).

Ambiguities, and the choices made:

* **Pairing.** The description does not say which lattice value goes with which rotary pair. Taken
  literally (``pairing="published"``, the default), the ascending lattice meets the descending
  frequencies: the first pair (highest frequency) gets the lowest lattice frequency and the last pair
  the highest. That reproduces what a review of the published code found, factors from about 0.8 to
  ``0.2 * base`` at alpha 0.2 (about 10^3 for base 10^4, 10^5 for Llama-3's 5 * 10^5).
  ``pairing="matched"`` reverses the lattice so that both run the same way (factors stay near 1): the
  reading under which the scheme is a gentle perturbation.
* **Convention.** The document's docstring assumes the factor multiplies the frequency
  (``convention="multiply"``: ``theta'_i = theta_i * f_i``); llama.cpp's ``rope_freqs`` tensor divides
  the rotation angle (``convention="divide"``: angle ``p * theta_i / f_i``, so ``theta'_i = theta_i / f_i``).
  With the published pairing the two are opposite extremes: multiply turns the slowest pairs into the
  fastest, divide slows them further. Both are applied and measured.
* Models with several rotary tables (gemma3: local and global) get factors computed from each table's
  own frequencies.

The factors can be applied to a loaded Hugging Face model (:func:`rope_factors_applied`, which restores
the model on exit) or exported as a GGUF ``rope_freqs.weight`` tensor (:func:`write_rope_freqs`), the
per-pair divisor that llama.cpp applies to the angle (a model GGUF carries it as the optional
``rope_freqs`` tensor; this file holds it on its own, to be merged into a model file).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from walshkv.constants import Keys
from walshkv.export.gguf_file import gguf_writer

__all__ = [
    "CONVENTIONS",
    "GENERATORS",
    "PAIRINGS",
    "TIERS",
    "RopeFreqs",
    "frequency_factors",
    "lattice",
    "read_rope_freqs",
    "rope_factors_applied",
    "rotary_tables",
    "tier_counts",
    "write_rope_freqs",
]

#: ``(low, high, share)``: tier bounds (inclusive) and the share of rotary pairs drawn from it; the
#: last tier takes whatever the first two leave.
TIERS: tuple[tuple[int, int, float], ...] = ((4, 101, 0.25), (102, 1009, 0.33), (1010, 8209, 0.42))
GENERATORS = ("geometric", "composite", "prime")
CONVENTIONS = ("multiply", "divide")
PAIRINGS = ("published", "matched")
_TENSOR = Keys.Rope.FREQS_TENSOR


def _check(name: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def tier_counts(n: int) -> tuple[int, int, int]:
    """Rotary pairs drawn from the local, mid and long tiers for ``n`` pairs (``round(0.25 n)``,
    ``round(0.33 n)``, the rest), rounding half up."""
    if n < 1:
        raise ValueError(f"need at least one rotary pair, got {n}")
    local = _round_half_up(TIERS[0][2] * n)
    mid = min(_round_half_up(TIERS[1][2] * n), n - local)
    return local, mid, n - local - mid


def _is_prime_table(limit: int) -> np.ndarray:
    sieve = np.ones(limit + 1, dtype=bool)
    sieve[:2] = False
    for p in range(2, math.isqrt(limit) + 1):
        if sieve[p]:
            sieve[p * p :: p] = False
    return sieve


def lattice(generator: str, n: int) -> torch.Tensor:
    """The ascending lattice integers for ``n`` rotary pairs.

    Args:
        generator: ``composite`` or ``prime`` (``geometric`` has no lattice).
        n: rotary pairs (``head_dim / 2``).

    Returns:
        ``[n]`` int64, ascending.
    """
    _check("generator", generator, GENERATORS[1:])
    prime = _is_prime_table(TIERS[-1][1])
    values: list[int] = []
    for (low, high, _), count in zip(TIERS, tier_counts(n), strict=True):
        pool = [k for k in range(low, high + 1) if (prime[k] if generator == "prime" else not prime[k])]
        if count > len(pool):
            raise ValueError(f"tier [{low}, {high}] has {len(pool)} {generator} integers, {count} needed")
        if count:
            idx = [_round_half_up(x) for x in np.linspace(0, len(pool) - 1, count)]
            values += [pool[i] for i in idx]
    return torch.tensor(values, dtype=torch.int64)


def frequency_factors(inv_freq: torch.Tensor, generator: str, alpha: float, pairing: str = "published") -> torch.Tensor:
    """Per-pair factors ``f_i = ((1 - alpha) theta_i + alpha r_i) / theta_i`` (see the module docstring).

    Args:
        inv_freq: ``[n]`` the model's inverse frequencies ``theta_i`` (positive, any order).
        generator: one of :data:`GENERATORS`.
        alpha: blend weight in ``[0, 1]`` (0: identity).
        pairing: ``published`` (ascending lattice against the model's order) or ``matched``.

    Returns:
        ``[n]`` float64 factors.
    """
    _check("generator", generator, GENERATORS)
    _check("pairing", pairing, PAIRINGS)
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    theta = inv_freq.detach().to(torch.float64).flatten().cpu()
    if theta.numel() < 1 or not bool(torch.isfinite(theta).all()) or bool((theta <= 0).any()):
        raise ValueError("inv_freq must be a non-empty vector of positive finite frequencies")
    if generator == "geometric":
        return torch.ones_like(theta)
    lat = lattice(generator, theta.numel()).to(torch.float64)
    lo, hi = float(theta.min()), float(theta.max())
    span = float(lat.max() - lat.min())
    r = torch.full_like(theta, lo) if span == 0 else lo + (lat - lat.min()) / span * (hi - lo)
    if pairing == "matched":
        r = r.flip(0) if bool(theta[0] >= theta[-1]) else r
    elif bool(theta[0] < theta[-1]):  # published: ascending lattice against a descending table
        r = r.flip(0)
    return ((1.0 - alpha) * theta + alpha * r) / theta


def rotary_tables(model: Any) -> list[tuple[str, torch.nn.Module, str]]:
    """Every rotary inverse-frequency buffer of a Hugging Face model as ``(qualified name, module, buffer)``.

    Buffers named ``*inv_freq`` count (``inv_freq``; gemma3's ``sliding_attention_inv_freq`` and
    ``full_attention_inv_freq``); the ``*original_inv_freq`` copies are left alone.
    """
    found = []
    for mod_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf_name.endswith("inv_freq") and "original" not in buf_name and buf is not None:
                found.append((f"{mod_name}.{buf_name}" if mod_name else buf_name, module, buf_name))
    if not found:
        raise ValueError("this model has no rotary inv_freq buffer: PrimePE needs a RoPE model")
    return found


@contextlib.contextmanager
def rope_factors_applied(
    model: Any, generator: str, alpha: float, convention: str = "divide", pairing: str = "published"
) -> Iterator[dict[str, torch.Tensor]]:
    """Apply PrimePE factors to every rotary table of ``model`` inside the ``with`` block.

    ``multiply`` sets ``inv_freq <- inv_freq * f``; ``divide`` (llama.cpp) sets ``inv_freq <- inv_freq / f``.
    The original buffers are restored on exit, also after an exception.

    Yields:
        ``{buffer name: [n] float64 factors}``.
    """
    _check("convention", convention, CONVENTIONS)
    saved: list[tuple[torch.nn.Module, str, torch.Tensor]] = []
    factors: dict[str, torch.Tensor] = {}
    try:
        for qual, module, buf in rotary_tables(model):
            old = getattr(module, buf)
            f = frequency_factors(old, generator, alpha, pairing)
            new = old.to(torch.float64).cpu() * (f if convention == "multiply" else 1.0 / f)
            saved.append((module, buf, old))
            setattr(module, buf, new.to(dtype=old.dtype, device=old.device))
            factors[qual] = f
        yield factors
    finally:
        for module, buf, old in saved:
            setattr(module, buf, old)


@dataclass
class RopeFreqs:
    """A ``rope_freqs`` file read back: ``divisor`` is what llama.cpp divides each pair's angle by."""

    divisor: torch.Tensor
    meta: dict[str, Any]


def write_rope_freqs(
    path: str | Path, factors: torch.Tensor, convention: str, meta: dict[str, Any] | None = None
) -> Path:
    """Write factors as a GGUF holding one F32 tensor ``rope_freqs.weight`` of ``n`` values.

    llama.cpp computes the angle of pair ``i`` at position ``p`` as ``p * theta_i / rope_freqs[i]``: the
    file holds ``f`` for ``convention="divide"`` and ``1 / f`` for ``"multiply"``, so that llama.cpp
    reproduces the convention the factors were measured under. ``meta`` (strings and numbers) is stored
    under ``walshkv.rope.``, with the convention.
    """
    _check("convention", convention, CONVENTIONS)
    f = factors.detach().to(torch.float64).flatten().cpu()
    if f.numel() < 1 or not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
        raise ValueError("factors must be a non-empty vector of positive finite numbers")
    divisor = f if convention == "divide" else 1.0 / f
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with gguf_writer(path, Keys.Rope.FREQS_ARCH) as writer:  # an error or a full disk leaves an old file as it was
        writer.add_string(Keys.Rope.CONVENTION, convention)
        writer.add_string(Keys.Rope.TENSOR_MEANING, "llama.cpp divides the angle of pair i by rope_freqs[i]")
        for key, value in (meta or {}).items():
            name = Keys.Rope.PREFIX + key
            if isinstance(value, bool) or value is None:
                writer.add_string(name, str(value))
            elif isinstance(value, int):
                writer.add_int64(name, value)
            elif isinstance(value, float):
                writer.add_float64(name, value)
            else:
                writer.add_string(name, str(value))
        writer.add_tensor(_TENSOR, divisor.to(torch.float32).numpy().astype(np.float32))
    return path


def read_rope_freqs(path: str | Path) -> RopeFreqs:
    """Read a ``rope_freqs`` GGUF back; errors name the problem (missing, not GGUF, truncated, no tensor)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no rope_freqs file at {path}: write one with `walshkv rope factors -o FILE`")
    fix = "regenerate it with `walshkv rope factors -o FILE`"
    with open(path, "rb") as fh:
        if fh.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (bad magic); {fix}")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/IndexError/... on bad or truncated files
        raise ValueError(f"{path} is truncated or damaged ({type(exc).__name__}: {exc}); {fix}") from exc
    tensors = {t.name: t for t in reader.tensors}
    if _TENSOR not in tensors:
        raise ValueError(f"{path} has no {_TENSOR} tensor (found: {', '.join(tensors) or 'none'}); {fix}")
    t = tensors[_TENSOR]
    if t.tensor_type != gguf.GGMLQuantizationType.F32:
        raise ValueError(f"{path}: {_TENSOR} is {t.tensor_type.name}, expected F32; {fix}")
    data = torch.from_numpy(np.array(t.data, dtype=np.float32).copy()).flatten()
    expected = int(np.prod([int(x) for x in t.shape]))
    if data.numel() != expected or path.stat().st_size < int(t.data_offset) + 4 * expected:
        raise ValueError(f"{path} is truncated: {_TENSOR} should hold {expected} values; {fix}")
    if not bool(torch.isfinite(data).all()) or bool((data <= 0).any()):
        raise ValueError(f"{path}: {_TENSOR} holds non-positive or non-finite values")
    meta: dict[str, Any] = {}
    for key, fld in reader.fields.items():
        if key.startswith(Keys.Rope.PREFIX):
            part = fld.parts[fld.data[0]]
            meta[key.removeprefix(Keys.Rope.PREFIX)] = (
                bytes(part).decode("utf-8") if fld.types[0] == gguf.GGUFValueType.STRING else part.tolist()[0]
            )
    return RopeFreqs(data, meta)
