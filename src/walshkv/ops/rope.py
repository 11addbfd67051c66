"""Rotary position embedding (RoPE) tables, applied and undone on ``[batch, kv_heads, seq, head_dim]`` keys.

Hugging Face's channel order: channel ``i`` pairs with ``i + head_dim/2`` (``rotate_half``). RoPE at
position ``p`` is ``k' = k cos(p θ) + rotate_half(k) sin(p θ)``, with cos and sin scaled by the table's
``scaling`` (1 for plain RoPE); it is undone by ``k = (k' cos - rotate_half(k') sin) / scaling²``. The
angles are computed as the model computes them (float32 ``position * inv_freq``), so a round trip is
exact up to float rounding.

``prerope+`` codecs (:mod:`walshkv.codecs.prerope`) quantize K before RoPE with these tables, which
calibration reads off the model's own rotary module (:func:`rope_tables`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from walshkv.identity import head_dim_of

__all__ = ["RopeRows", "RopeTable", "apply_rope", "rope_averaged", "rope_tables", "turn", "undo_rope"]


@dataclass(frozen=True)
class RopeTable:
    """One layer's RoPE: ``inv_freq`` ``[head_dim / 2]`` (float32) and the cos/sin ``scaling``."""

    inv_freq: torch.Tensor
    scaling: float = 1.0

    @property
    def head_dim(self) -> int:
        return 2 * self.inv_freq.numel()

    def cos_sin(self, start: int, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[length, head_dim]`` (float32) for positions ``start .. start + length - 1``."""
        freqs = rope_angles(self, torch.arange(start, start + length, device=device, dtype=torch.float32))
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling


class RopeRows:
    """A table's cos and sin rows for a window of positions, computed once and then sliced, for :func:`undo_rope`.

    A decoding cache encodes one key at a time at increasing positions; each call would otherwise build the
    rows afresh (``arange``, ``cos``, ``sin``, ...). The rows are elementwise functions of the position, so a
    row computed in a longer window is the same row. The sin rows come with the sign of ``rotate_half`` folded
    in (``[-sin, sin]`` halves), so that ``rotate_half(x) * sin == x.roll(head_dim / 2) * folded`` (exactly: a
    sign flip commutes with rounding).

    Args:
        table: the layer's RoPE table.
        window: positions per window (a block longer than that is not cached).
    """

    def __init__(self, table: RopeTable, window: int = 256) -> None:
        self.table = table
        self.window = window
        self._rows: dict[torch.device, tuple[int, torch.Tensor, torch.Tensor]] = {}

    def get(self, start: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(cos, folded sin)`` ``[length, head_dim]`` for positions ``start ...``, or ``None`` if not cached."""
        if length > self.window or start + self.window > _EXACT_POSITIONS:
            return None
        hit = self._rows.get(device)
        if hit is None or not hit[0] <= start <= hit[0] + self.window - length:
            cos, sin = self.table.cos_sin(start, self.window, device)
            half = cos.shape[-1] // 2
            hit = self._rows[device] = (start, cos, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        at = start - hit[0]
        return hit[1][at : at + length], hit[2][at : at + length]


#: float32 holds every position below this exactly (so a window's rows do not depend on where it starts).
_EXACT_POSITIONS = 1 << 24


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _check(x: torch.Tensor, table: RopeTable) -> None:
    if x.dim() != 4 or x.shape[-1] != table.head_dim:
        raise ValueError(
            f"RoPE table for head_dim {table.head_dim} cannot rotate a tensor of shape {tuple(x.shape)}; "
            "expected [batch, kv_heads, seq, head_dim] (a calibration made for another model?)"
        )


def apply_rope(x: torch.Tensor, table: RopeTable, start: int = 0) -> torch.Tensor:
    """Rotate ``x`` ``[batch, kv_heads, seq, head_dim]`` to positions ``start, start + 1, ...`` (float32)."""
    _check(x, table)
    cos, sin = table.cos_sin(start, x.shape[-2], x.device)
    xf = x.to(torch.float32)
    return xf * cos + _rotate_half(xf) * sin


def undo_rope(x: torch.Tensor, table: RopeTable, start: int = 0, rows: RopeRows | None = None) -> torch.Tensor:
    """Inverse of :func:`apply_rope`: keys after RoPE at positions ``start, ...`` back to before it (float32).

    ``rows`` (for ``table``) caches the cos/sin rows between calls; the result is the same, bit for bit.
    """
    _check(x, table)
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    cached = None if rows is None else rows.get(start, x.shape[-2], x.device)
    if cached is None:
        cos, sin = table.cos_sin(start, x.shape[-2], x.device)
        return (xf * cos - _rotate_half(xf) * sin) / (table.scaling**2)
    cos, folded = cached
    out = xf * cos - xf.roll(x.shape[-1] // 2, -1) * folded
    scale = table.scaling**2
    return out if scale == 1.0 else out / scale  # dividing by 1 is exact


def rope_angles(table: RopeTable, positions: torch.Tensor) -> torch.Tensor:
    """The model's rotary angles ``[n, head_dim / 2]`` (float32 ``position * inv_freq``, one column per rotary pair)
    at ``positions`` ``[n]``, on their device: what :func:`turn` rotates by."""
    inv = table.inv_freq.to(device=positions.device, dtype=torch.float32)
    return positions.to(torch.float32)[:, None] * inv[None, :]


def turn(x: torch.Tensor, table: RopeTable, positions: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[..., n, head_dim]`` turned by RoPE's rotation (unscaled) to ``positions`` ``[n]``, or back (float32).

    The angles are the model's (float32 ``position * inv_freq``); unlike :func:`apply_rope` each row has its own
    position and the table's ``scaling`` is left to the caller.
    """
    if x.shape[-1] != table.head_dim or positions.dim() != 1 or positions.numel() != x.shape[-2]:
        raise ValueError(
            f"RoPE table for head_dim {table.head_dim} cannot turn a tensor of shape {tuple(x.shape)} to "
            f"{tuple(positions.shape)} positions; expected [..., n, head_dim] and n positions"
        )
    freqs = rope_angles(table, positions.to(x.device))
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    return xf * cos - _rotate_half(xf) * sin if inverse else xf * cos + _rotate_half(xf) * sin


def rope_averaged(m: torch.Tensor, inv_freq: torch.Tensor, length: int | None) -> torch.Tensor:
    """``mean over p < length of R(p) m R(p)ᵀ`` for a second moment ``m`` ``[..., d, d]`` before RoPE (float64).

    In complex form (pair ``j`` is channel ``j`` and ``j + d/2``, ``z = x + i y``; RoPE multiplies ``z_j`` by
    ``e^{i p θ_j}``), ``E[z_j z̄_k]`` turns with ``θ_j - θ_k`` and ``E[z_j z_k]`` with ``θ_j + θ_k``; the mean of
    ``e^{i p ω}`` over the positions is a geometric series. ``length=None``: the limit of a long context (only
    ``ω = 0`` survives: channel pairs of different frequencies decorrelate).

    Args:
        m: second moments ``[..., head_dim, head_dim]`` of vectors before RoPE.
        inv_freq: the table's inverse frequencies ``[head_dim / 2]``.
        length: positions averaged over (``>= 1``), or ``None`` for the limit.

    Returns:
        ``[..., head_dim, head_dim]`` float64.
    """
    if length is not None and length < 1:
        raise ValueError(f"rope_averaged needs length >= 1 positions (or None for the limit), got {length}")
    m = m.to(torch.float64)
    h = m.shape[-1] // 2
    if inv_freq.numel() != h:
        raise ValueError(f"inv_freq has {inv_freq.numel()} frequencies; a {m.shape[-1]}-wide moment needs {h}")
    th = inv_freq.to(torch.float64)
    xx, xy, yx, yy = m[..., :h, :h], m[..., :h, h:], m[..., h:, :h], m[..., h:, h:]
    gam = torch.complex(xx + yy, yx - xy)
    pi = torch.complex(xx - yy, yx + xy)

    def mean_phase(w: torch.Tensor) -> torch.Tensor:
        if length is None:
            return (w.abs() < 1e-15).to(torch.complex128)
        e1 = torch.exp(1j * w.to(torch.complex128))
        el = torch.exp(1j * length * w.to(torch.complex128))
        small = (1 - e1).abs() < 1e-12
        out = (1 - el) / (length * torch.where(small, torch.ones_like(e1), 1 - e1))
        return torch.where(small, torch.ones_like(out), out)

    gam = gam * mean_phase(th[:, None] - th[None, :])
    pi = pi * mean_phase(th[:, None] + th[None, :])
    top = torch.cat([((gam + pi) / 2).real, ((pi - gam) / 2).imag], dim=-1)
    bottom = torch.cat([((gam + pi) / 2).imag, ((gam - pi) / 2).real], dim=-1)
    return torch.cat([top, bottom], dim=-2)


def _rotary_module(model: Any) -> Any | None:
    for _, module in model.named_modules():
        if type(module).__name__.endswith("RotaryEmbedding"):
            return module
    return None


def rope_tables(model: Any) -> list[RopeTable] | None:
    """Every layer's RoPE table, read off the model's rotary module, or ``None`` if it has none.

    gemma3 keeps one table per layer type (``sliding_attention``: local base, ``full_attention``: global);
    a PrimePE-modified table (:mod:`walshkv_research.primepe`) is read as modified.

    Raises:
        ValueError: partial rotary embeddings (rotary dim smaller than head_dim), not supported.
    """
    rotary = _rotary_module(model)
    if rotary is None:
        return None
    cfg = model.config.get_text_config(decoder=True)
    layers = cfg.num_hidden_layers
    per_type = "layer_type" in inspect.signature(rotary.forward).parameters
    tables: list[RopeTable] = []
    for i in range(layers):
        prefix = f"{cfg.layer_types[i]}_" if per_type else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            return None
        scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0) or 1.0)
        tables.append(RopeTable(inv_freq.detach().to("cpu", torch.float32).clone(), scaling))
    head_dim = head_dim_of(cfg)
    if tables and tables[0].head_dim != head_dim:
        raise ValueError(
            f"partial rotary embeddings are not supported (rotary dim {tables[0].head_dim}, head_dim {head_dim})"
        )
    return tables
