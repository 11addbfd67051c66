"""Keys stored before RoPE (``prerope+``): what a kernel does to a decoded key row before the dot product.

``prerope+[center+][eq+][rot+...]CORE`` stores ``CORE(R(A(undo_rope(k) - mu)))``. Its decoded key at
position ``p`` is ``rope_p(A⁻¹ Rᵀ c + mu)``, with ``c`` what the core decodes. Unlike the other wrappers,
RoPE depends on the key's position, so it cannot be moved onto the query once per step (``q·rope_p(z) =
rope_p⁻¹(q)·z``: a different query per key). What a kernel can do instead, and what
:class:`KeyTransform` describes, is to turn each decoded row (in the kernel's buffer order, row factor
applied) into the pre-RoPE key with one small matrix per kv head, add the mean, and rotate the row by its
position's angles, in registers, once per kv head: the group's query heads then share it. In symbols,
for a buffer row ``b``::

    z = b @ mt[h] + mu[h]                                  # [d], pre-RoPE key (A⁻¹, rotations, order folded)
    key = [z1 * cos_p - z2 * sin_p, z2 * cos_p + z1 * sin_p]   # z = [z1, z2], halves of head_dim

with ``cos_p, sin_p = cos(p * inv_freq) * scaling, sin(p * inv_freq) * scaling`` (:func:`rope_half_tables`,
float32 angles as the model computes them). ``mt[h]`` costs ``L x d`` multiply-adds per key: the price of
``eq+`` under ``prerope+``. Without ``eq+`` the same matrix is the core's inverse rotation, a Walsh-Hadamard
matrix with sign flips (:func:`hadamard_factors`), which the CPU kernel applies as a fast Walsh-Hadamard
transform instead: ``d log2 d`` additions per key.

The tables are cached per RoPE table and grown by doubling, so a decode step costs no trigonometry; their
size is ``positions x head_dim`` floats (8 MiB at 32k tokens and head_dim 64), reported by
:func:`rope_cache_nbytes`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from walshkv.attention.peeling import peel, peel_equalizer
from walshkv.codecs.base import Codec
from walshkv.codecs.center import Centered
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.rotation import Rotated
from walshkv.ops.hadamard import hadamard_matrix
from walshkv.ops.rope import RopeTable

__all__ = [
    "KeyTransform",
    "hadamard_factors",
    "key_transform",
    "rope_cache_nbytes",
    "rope_half_tables",
    "split_prerope",
]


@dataclass(frozen=True)
class PreRopeParts:
    """A ``prerope+`` K codec taken apart: RoPE table, mean, ``eq+`` inverse, rotations and the core codec."""

    table: RopeTable
    mu: torch.Tensor | None  # [kv_heads, d] pre-RoPE mean that decoding adds back (center+), or None
    eq_inverse: torch.Tensor | None  # [kv_heads, d, d] A⁻¹, or None
    rots: list[Rotated]  # outermost first
    core: Codec


def split_prerope(codec: Codec) -> PreRopeParts | None:
    """Take a bound ``prerope+`` K codec apart, or ``None`` if ``codec`` is not ``prerope+``.

    Raises:
        ValueError: a ``prerope+`` codec that is not bound to a layer (no RoPE table or mean).
    """
    if not isinstance(codec, PreRope):
        return None
    table = codec._table()
    inner = codec.inner
    mu = inner.plain_offset().to(torch.float32) if isinstance(inner, Centered) else None
    eq_inverse, rest = peel_equalizer(inner)
    rots, core = peel(rest)
    return PreRopeParts(table, mu, None if eq_inverse is None else eq_inverse.to(torch.float32), rots, core)


@dataclass(frozen=True)
class KeyTransform:
    """Per kv head: buffer row ``b`` -> pre-RoPE key ``b @ mt[h] + mu[h]``; then RoPE at the key's position.

    ``mt``: ``[kv_heads, L, d]`` float32 (``L``: the kernel's decoded row length); ``mu``: ``[kv_heads, d]``
    float32 (zeros without ``center+``); ``table``: the layer's RoPE; ``start``: the position of packed
    token 0 (sink tokens come before it).
    """

    mt: torch.Tensor
    mu: torch.Tensor
    table: RopeTable
    start: int

    def tables(self, n_tokens: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[start + n_tokens, d / 2]`` (at least; index by absolute position)."""
        return rope_half_tables(self.table, self.start + n_tokens, device)


def key_transform(parts: PreRopeParts, basis: torch.Tensor | None, kv_heads: int, start: int) -> KeyTransform:
    """The :class:`KeyTransform` of a ``prerope+`` codec read through a kernel whose buffer has ``basis``.

    Args:
        parts: :func:`split_prerope` of the K codec.
        basis: ``[d, L]`` (buffer row ``b`` stands for the core vector ``b @ basis.T``), ``None`` = identity.
        kv_heads: the cache's kv heads (the mean and ``eq+`` are per head).
        start: position of the first packed token.

    Raises:
        ValueError: a mean or ``eq+`` transform made for another number of kv heads.
    """
    d = parts.table.head_dim
    m = basis.T.to(torch.float32) if basis is not None else torch.eye(d)  # [L, d]: row j = core vector of e_j
    for r in reversed(parts.rots):  # innermost rotation is undone first
        m = r.unrotate(m)
    if parts.eq_inverse is not None:
        if parts.eq_inverse.shape[0] != kv_heads:
            raise ValueError(
                f"the K codec's eq+ transform has {parts.eq_inverse.shape[0]} kv heads, the cache {kv_heads}: pass "
                "the codec of the layer whose cache this is"
            )
        mt = torch.einsum("ld,hed->hle", m, parts.eq_inverse)  # rows: A⁻¹ (core vector)
    else:
        mt = m.expand(kv_heads, *m.shape)
    if parts.mu is not None and parts.mu.shape[0] != kv_heads:
        raise ValueError(
            f"the K codec's mean has {parts.mu.shape[0]} kv heads, the cache {kv_heads}: pass the codec of the "
            "layer whose cache this is"
        )
    mu = parts.mu if parts.mu is not None else torch.zeros(kv_heads, d)
    return KeyTransform(mt.contiguous(), mu.contiguous(), parts.table, int(start))


def hadamard_factors(mt: torch.Tensor, rtol: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(r, c)`` ``[kv_heads, d]`` with ``mt[h] = diag(r[h]) H diag(c[h])`` (``H`` the unnormalised ``d x d``
    Sylvester Hadamard matrix), or ``None`` if ``mt`` is not of that form.

    Every ``prerope+`` spec without ``eq+`` maps its decoded rows through the core's and the wrappers' Walsh-Hadamard
    rotations only (``tq``'s signed WHT, ``rot+``'s WHT, at most one of them with sign flips), which is this form:
    a kernel then maps a key with a fast Walsh-Hadamard transform, ``d log2 d`` additions, instead of ``d x d``
    multiply-adds (``z = fwht(b * r) * c``). ``eq+``'s dense ``A⁻¹``, or two stacked rotations with different
    signs, are not of this form.

    Args:
        mt: ``[kv_heads, L, d]`` float32 (:attr:`KeyTransform.mt`).
        rtol: largest entry error allowed, relative to the largest entry.
    """
    _, length, d = mt.shape
    if length != d or d < 2 or d & (d - 1):
        return None
    m = mt.to(torch.float64)
    c = m[:, 0, :]  # H's first row and column are all +1, so with r[0] = 1: c = mt[0, :], r = mt[:, 0] / c[0]
    if bool((c[:, 0] == 0).any()):
        return None
    r = m[:, :, 0] / c[:, :1]
    h = hadamard_matrix(d) * math.sqrt(d)
    want = r[:, :, None] * h[None] * c[:, None, :]
    if not bool(((want - m).abs() <= rtol * m.abs().amax()).all()):
        return None
    return r.to(torch.float32).contiguous(), c.to(torch.float32).contiguous()


_lock = threading.Lock()
_TABLES: dict[tuple[bytes, float, str], tuple[torch.Tensor, torch.Tensor]] = {}


def rope_half_tables(table: RopeTable, n: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[N, d / 2]`` float32 for positions ``0 .. N - 1``, ``N >= n`` (cached, grown by doubling).

    The same values as :meth:`walshkv.ops.rope.RopeTable.cos_sin` (whose two halves are equal).
    """
    key = (table.inv_freq.to(torch.float32).numpy().tobytes(), float(table.scaling), str(device))
    have = _TABLES.get(key)
    if have is not None and have[0].shape[0] >= n:
        return have
    with _lock:
        have = _TABLES.get(key)
        if have is not None and have[0].shape[0] >= n:
            return have
        size = max(1024, 1 << max(0, int(n - 1).bit_length()))
        pos = torch.arange(size, device=device, dtype=torch.float32)
        freqs = pos[:, None] * table.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        out = ((freqs.cos() * table.scaling).contiguous(), (freqs.sin() * table.scaling).contiguous())
        _TABLES[key] = out
        return out


def rope_cache_nbytes() -> int:
    """Bytes held by the cached RoPE tables (side data next to the cache, not part of it)."""
    return sum(c.numel() * c.element_size() + s.numel() * s.element_size() for c, s in _TABLES.values())
