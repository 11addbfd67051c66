"""A layer's packed store: appending blocks of :class:`~walshkv.codecs.Packed` tokens without re-copying.

A layer keeps one allocation per side (K, V), ``[batch, num_kv_heads, capacity, ...]`` per field, and a
prefix view of it that holds the tokens written so far. :func:`append_packed` writes a block in place
when it fits; when it does not, the store grows to :data:`GROWTH` times what it needs, rounded up to
:data:`GRANULE` tokens, and the held tokens are copied once.
"""

from __future__ import annotations

import math

import torch

from walshkv.codecs.base import Packed

__all__ = ["GRANULE", "GROWTH", "append_packed", "cat_packed", "is_prefix", "seq_len"]

#: When a write does not fit, a layer's packed store grows to this factor of what it needs (so at most
#: 1/9 of a grown store is unused); capacities are multiples of GRANULE tokens.
GROWTH = 1.125
GRANULE = 64


def seq_len(t: torch.Tensor | None) -> int:
    """Tokens in ``t`` (``[batch, heads, seq, head_dim]``), 0 for ``None``."""
    return 0 if t is None else t.shape[-2]


def cat_packed(a: Packed | None, b: Packed | None) -> Packed | None:
    """``a`` then ``b`` along the sequence, either of them possibly ``None``."""
    if a is None:
        return b
    if b is None:
        return a
    return Packed.cat([a, b])


def is_prefix(view: Packed, store: Packed) -> bool:
    """True if every field of ``view`` starts where ``store``'s does, with the same layout."""
    if view.tensors.keys() != store.tensors.keys():
        return False
    for name, t in store.tensors.items():
        v = view.tensors[name]
        if v.data_ptr() != t.data_ptr() or v.stride() != t.stride() or v.shape[:2] != t.shape[:2]:
            return False
        if v.shape[3:] != t.shape[3:] or v.dtype != t.dtype or v.device != t.device:
            return False
    return True


def append_packed(
    store: Packed | None, view: Packed | None, new: Packed | None, reserve: int = 0, growth: float = GROWTH
) -> tuple[Packed | None, Packed | None]:
    """Append ``new`` to the tokens ``view`` holds, in place when ``store`` has room.

    Args:
        store: the layer's allocation (``[batch, heads, capacity, ...]`` per field), or ``None``.
        view: the tokens held so far (a prefix of ``store`` when they live in it), or ``None``.
        new: the block to append, or ``None``.
        reserve: allocate at least this many tokens the first time (``max_cache_len``).
        growth: when the block does not fit, the new capacity is at least ``growth`` x the old one.

    Returns:
        ``(store, view)``: the (possibly new) allocation and the tokens held, a prefix view of it.

    A block that does not fit allocates a new store and copies the held tokens once, instead of a
    ``torch.cat`` of the whole cache at every step: fewer copies, and far fewer freed blocks of
    growing sizes, which is what fragments the C heap and raised peak memory with context length.
    """
    if new is None:
        return store, view
    used = 0 if view is None else view.seq_len
    need = used + new.seq_len
    fits = store is not None and (view is None or is_prefix(view, store)) and store.seq_len >= need
    if fits and store is not None:
        fits = store._first().shape[:2] == new._first().shape[:2] and all(
            store.tensors[k].dtype == t.dtype and store.tensors[k].shape[3:] == t.shape[3:]
            for k, t in new.tensors.items()
        )
    if not fits:
        old_cap = store.seq_len if store is not None else 0
        if reserve >= need and old_cap < reserve:
            cap = reserve  # what the caller said the sequence will reach: allocated once, exactly
        else:
            cap = max(need, math.ceil(old_cap * growth) if growth > 1 else 0)
            if growth > 1:
                cap = -(-cap // GRANULE) * GRANULE
        fresh = Packed(_allocate(new, cap, reserved=cap == reserve), new.head_dim, new.dtype)
        if view is not None and used:
            for k, t in view.tensors.items():
                fresh.tensors[k][:, :, :used].copy_(t)
        store = fresh
    assert store is not None
    for k, t in new.tensors.items():
        store.tensors[k][:, :, used:need].copy_(t)
    return store, store.slice_seq(0, need)


def _allocate(new: Packed, cap: int, *, reserved: bool) -> dict[str, torch.Tensor]:
    """Fields like ``new``'s with room for ``cap`` tokens; an allocation that fails says how much and why.

    Raises:
        ValueError: ``max_cache_len`` asked for more than the machine can give (nothing was stored).
        MemoryError: growing the store for the tokens written failed (the machine is out of memory).
    """
    nbytes = sum(t[:, :, :1].numel() * t.element_size() for t in new.tensors.values()) * cap
    try:
        return {k: t.new_empty((*t.shape[:2], cap, *t.shape[3:])) for k, t in new.tensors.items()}
    except (RuntimeError, MemoryError) as err:
        if reserved:
            raise ValueError(
                f"max_cache_len={cap:,} reserves {nbytes / 2**30:,.1f} GiB for each of this layer's K and V "
                f"stores, more than this machine can allocate ({type(err).__name__}); pass the longest sequence the "
                "cache will hold, or max_cache_len=None (the store then grows as tokens arrive)"
            ) from err
        raise MemoryError(
            f"the cache store needs {nbytes / 2**30:,.2f} GiB more for {cap:,} tokens of one layer's K or V and the "
            f"allocation failed ({err}); free memory, use fewer bits, or hold a shorter sequence"
        ) from err
