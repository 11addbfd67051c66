"""``CompressedCache``: a transformers ``Cache`` that stores packed codes.

This is the only module that touches transformers' cache API. Layout of every
tensor: ``[batch, num_kv_heads, seq_len, head_dim]``.

Each layer holds :class:`~walshkv.codecs.Packed` K and V (packed ``uint8`` codes and
their scales) and, only if ``residual > 0`` was asked for, a full-precision window of
the most recent ``residual`` tokens; with a ``sink:N:`` spec, full-attention layers also keep
their first ``N`` tokens in fp16. ``update()`` quantizes on write: the incoming
block is encoded and appended first, and attention receives the *decoded* K/V, so the
current block is seen compressed too (tokens in the residual window excepted). The
window's bytes count in :meth:`CompressedCache.nbytes` and
:meth:`CompressedCache.bits_per_element`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from walshkv.codecs.base import Packed
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, LayeredCacheSpec, parse_cache_spec

__all__ = [
    "FUSED_ATTENTION",
    "CompressedCache",
    "CompressedLayer",
    "CompressedSlidingWindowLayer",
    "KiviLayer",
    "context_state",
    "enable_fused_attention",
    "fused_attention",
    "hf_cache_nbytes",
    "make_cache",
    "make_hf_cache",
]


#: The attention implementation name :func:`enable_fused_attention` registers with transformers.
FUSED_ATTENTION = "walshkv_fused"


def _cat_packed(a: Packed | None, b: Packed | None) -> Packed | None:
    if a is None:
        return b
    if b is None:
        return a
    return Packed.cat([a, b])


#: When a write does not fit, a layer's packed store grows to this factor of what it needs (so at most
#: 1/9 of a grown store is unused); capacities are multiples of _GRANULE tokens.
_GROWTH = 1.125
_GRANULE = 64


def _is_prefix(view: Packed, store: Packed) -> bool:
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


def _append_packed(
    store: Packed | None, view: Packed | None, new: Packed | None, reserve: int = 0, growth: float = _GROWTH
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
    fits = store is not None and (view is None or _is_prefix(view, store)) and store.seq_len >= need
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
                cap = -(-cap // _GRANULE) * _GRANULE
        fresh = Packed(
            {k: t.new_empty((*t.shape[:2], cap, *t.shape[3:])) for k, t in new.tensors.items()},
            new.head_dim,
            new.dtype,
        )
        if view is not None and used:
            for k, t in view.tensors.items():
                fresh.tensors[k][:, :, :used].copy_(t)
        store = fresh
    assert store is not None
    for k, t in new.tensors.items():
        store.tensors[k][:, :, used:need].copy_(t)
    return store, store.slice_seq(0, need)


def _marker(layer: CompressedLayer, like: torch.Tensor) -> torch.Tensor:
    """An empty ``[batch, heads, 0, head_dim]`` tensor that tells :func:`fused_attention` which layer to read."""
    marker = like.new_empty((*like.shape[:2], 0, like.shape[-1]))
    marker.walshkv_layer = layer  # type: ignore[attr-defined]
    return marker


def _seq(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.shape[-2]


_FP16 = FloatCodec("fp16")  # sink tokens: its encode refuses NaN/Inf and values fp16 cannot hold


def _cat_sink(have: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    return new if have is None else torch.cat([have, new], dim=-2)


class CompressedLayer(CacheLayerMixin):
    """One full-attention layer of a :class:`CompressedCache`.

    Token order: sink tokens (the first ``sink``, fp16), then packed tokens, then the window.

    Attributes:
        packed_k, packed_v: compressed tokens (``None`` before the first write).
        keys, values: the full-precision window ``[batch, num_kv_heads, r, head_dim]``,
            ``r <= residual`` (empty when ``residual == 0``).
        sink_k, sink_v: the first ``s <= sink`` tokens in fp16, ``[batch, num_kv_heads, s, head_dim]``
            (``None`` when ``sink == 0`` or before the first write).
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, spec: CacheSpec | str, residual: int = 0, sink: int | None = None) -> None:
        super().__init__()
        if residual < 0:
            raise ValueError(f"residual must be >= 0 tokens, got {residual}")
        self.spec = parse_cache_spec(spec)
        self.residual = residual
        self.sink = self.spec.sink if sink is None else sink
        if self.sink < 0:
            raise ValueError(f"sink must be >= 0 tokens, got {self.sink}")
        self.sink_k: torch.Tensor | None = None
        self.sink_v: torch.Tensor | None = None
        self.fused = False  # set by CompressedCache(..., fused=True) on full-attention layers
        self.packed_k: Packed | None = None
        self.packed_v: Packed | None = None
        self._store_k: Packed | None = None  # the allocations packed_k / packed_v are prefix views of
        self._store_v: Packed | None = None
        self.reserve = 0  # tokens to allocate on the first write (CompressedCache(max_cache_len=...))
        self.cumulative_length = 0

    # ---- transformers API -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.spec.k.check_head_dim(key_states.shape[-1])
        self.spec.v.check_head_dim(value_states.shape[-1])
        self.device = key_states.device
        self.dtype = key_states.dtype
        shape_k = (*key_states.shape[:2], 0, key_states.shape[-1])
        shape_v = (*value_states.shape[:2], 0, value_states.shape[-1])
        self.keys = key_states.new_zeros(shape_k)
        self.values = value_states.new_zeros(shape_v)
        self.is_initialized = True

    def _check_block(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        if key_states.dim() != 4 or value_states.dim() != 4:
            raise ValueError(
                "K and V blocks must be [batch, num_kv_heads, seq_len, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.shape[:3] != value_states.shape[:3]:
            raise ValueError(
                f"K {tuple(key_states.shape)} and V {tuple(value_states.shape)} disagree on "
                "batch, heads or sequence length"
            )
        if self.is_initialized and self._stored_length() > 0:
            have = tuple(self.keys.shape[:2])
            if tuple(key_states.shape[:2]) != have or key_states.shape[-1] != self.keys.shape[-1]:
                raise ValueError(
                    f"new block {tuple(key_states.shape)} does not match the cached "
                    f"[batch, heads, *, head_dim] = [{have[0]}, {have[1]}, *, {self.keys.shape[-1]}]"
                )

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode the new block, append it, and return the decoded K/V for attention.

        Args:
            key_states: ``[batch, num_kv_heads, new_tokens, head_dim]`` (after RoPE).
            value_states: same shape as ``key_states`` (head_dim may differ).

        Returns:
            ``(keys, values)``: every visible token, decoded from the packed store (or
            taken from the full-precision window), ``[batch, num_kv_heads, seq, head_dim]``.
        """
        self._check_block(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_tokens = key_states.shape[-2]
        n_sink = min(self.sink - _seq(self.sink_k), n_tokens) if self.sink else 0
        sink_k, sink_v = self.sink_k, self.sink_v
        if n_sink > 0:  # checked (NaN, fp16 overflow) before anything changes, like the encoded part
            sink_k = _cat_sink(sink_k, _FP16.encode(key_states[:, :, :n_sink]).tensors["values"])
            sink_v = _cat_sink(sink_v, _FP16.encode(value_states[:, :, :n_sink]).tensors["values"])
            key_states, value_states = key_states[:, :, n_sink:], value_states[:, :, n_sink:]
        window_k = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        window_v = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        n_encode = max(0, window_k.shape[-2] - self.residual)
        # positions (for prerope+): tokens dropped by a sliding window, then sink, packed, window in order
        packed_pos = self.cumulative_length - self._stored_length() + _seq(sink_k)
        new_pos = packed_pos + (0 if self.packed_k is None else self.packed_k.seq_len)
        # Encode first: a refused block (NaN, overflow) raises here and leaves the layer as it was.
        new_k = self._encode_k(window_k[:, :, :n_encode], new_pos) if n_encode else None
        new_v = self.spec.v.encode(window_v[:, :, :n_encode]) if n_encode else None

        self.sink_k, self.sink_v = sink_k, sink_v
        if self.fused:  # attention reads the packed codes itself (fused_attention): hand it markers
            out_k, out_v = _marker(self, key_states), _marker(self, value_states)
        else:
            stored = ((self.packed_k, packed_pos), (new_k, new_pos))
            parts_k = [self._decode_k(p, at) for p, at in stored if p is not None]
            parts_v = [self.spec.v.decode(p) for p in (self.packed_v, new_v) if p is not None]
            head_k, head_v = self.sink_tokens(window_k.dtype)
            out_k = torch.cat([*head_k, *parts_k, window_k[:, :, n_encode:]], dim=-2)
            out_v = torch.cat([*head_v, *parts_v, window_v[:, :, n_encode:]], dim=-2)

        growth = 1.0 if self.is_sliding else _GROWTH  # (a sliding window drops its oldest tokens anyway)
        self._store_k, self.packed_k = _append_packed(self._store_k, self.packed_k, new_k, self.reserve, growth)
        self._store_v, self.packed_v = _append_packed(self._store_v, self.packed_v, new_v, self.reserve, growth)
        self.keys = window_k[:, :, n_encode:].contiguous()
        self.values = window_v[:, :, n_encode:].contiguous()
        self.cumulative_length += n_tokens
        self._after_update()
        return out_k, out_v

    def _encode_k(self, x: torch.Tensor, start: int) -> Packed:
        """Encode keys at positions ``start, ...`` (positions matter to ``prerope+`` codecs only)."""
        if isinstance(self.spec.k, PreRope):
            return self.spec.k.encode_at(x, start)  # type: ignore[attr-defined]
        return self.spec.k.encode(x)

    def _decode_k(self, packed: Packed, start: int) -> torch.Tensor:
        if isinstance(self.spec.k, PreRope):
            return self.spec.k.decode_at(packed, start)  # type: ignore[attr-defined]
        return self.spec.k.decode(packed)

    def sink_tokens(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fp16 sink tokens as attention reads them: ``([K], [V])``, or ``([], [])`` if there are none.

        K is shifted like the codec's decoded K (``center+`` leaves its calibrated mean subtracted).
        """
        if self.sink_k is None or self.sink_k.shape[-2] == 0:
            return [], []
        k = self.sink_k.to(torch.float32)
        offset = getattr(self.spec.k, "plain_offset", None)
        if offset is not None:
            k = k - offset().to(k.device)[None, :, None, :]
        return [k.to(dtype)], [self.sink_v.to(dtype)]  # type: ignore[union-attr]

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token as attention reads it (sink, decoded packed codes, window), ``[b, h, seq, d]``."""
        dtype = self.keys.dtype
        head_k, head_v = self.sink_tokens(dtype)
        start = self.cumulative_length - self._stored_length() + _seq(self.sink_k)
        parts_k = [self._decode_k(self.packed_k, start).to(dtype)] if self.packed_k is not None else []
        parts_v = [self.spec.v.decode(self.packed_v).to(dtype)] if self.packed_v is not None else []
        return torch.cat([*head_k, *parts_k, self.keys], dim=-2), torch.cat([*head_v, *parts_v, self.values], dim=-2)

    def _after_update(self) -> None:
        """Hook for sliding layers to drop tokens that left the window."""

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._stored_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self._stored_length()

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.sink_k = self.sink_v = None
        self.packed_k = self.packed_v = None
        self._store_k = self._store_v = None
        self.keys = self.values = None
        self.cumulative_length = 0
        self.is_initialized = False

    def _keep(self, start: int, stop: int) -> None:
        """Keep stored tokens ``start:stop`` (indices over sink, packed, then window)."""
        n_sink = _seq(self.sink_k)
        if n_sink:
            lo, hi = min(start, n_sink), min(stop, n_sink)
            self.sink_k, self.sink_v = self.sink_k[:, :, lo:hi], self.sink_v[:, :, lo:hi]  # type: ignore[index]
            start, stop = max(start - n_sink, 0), max(stop - n_sink, 0)
        n_packed = 0 if self.packed_k is None else self.packed_k.seq_len
        if self.packed_k is not None and self.packed_v is not None:
            lo, hi = min(start, n_packed), min(stop, n_packed)
            self.packed_k = self.packed_k.slice_seq(lo, hi) if hi > lo else None
            self.packed_v = self.packed_v.slice_seq(lo, hi) if hi > lo else None
        lo, hi = max(start - n_packed, 0), max(stop - n_packed, 0)
        self.keys = self.keys[:, :, lo:hi]
        self.values = self.values[:, :, lo:hi]

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens (negative, as in transformers 5).

        A positive value is the legacy form: the length to keep.
        """
        if not self.is_initialized:
            return
        length = self._stored_length()
        keep = tokens_to_remove if tokens_to_remove > 0 else length + tokens_to_remove
        keep = max(0, min(length, keep))
        if keep == length:
            return
        self._keep(0, keep)
        self.cumulative_length -= length - keep

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if not self.is_initialized:
            return
        self._map_batch(lambda p: p.index_batch(beam_idx), lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self._map_batch(lambda p: p.repeat_batch(repeats), lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.is_initialized:
            return
        idx = torch.as_tensor(indices, device=self.keys.device)
        if idx.dtype == torch.bool:
            idx = idx.nonzero().flatten()
        self._map_batch(lambda p: p.index_batch(idx), lambda t: t.index_select(0, idx))

    def offload(self) -> None:
        self._map_batch(lambda p: p.to("cpu"), lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self) -> None:
        if self.is_initialized and self.keys.device != self.device:
            self._map_batch(lambda p: p.to(self.device), lambda t: t.to(self.device, non_blocking=True))

    # ---- accounting ---------------------------------------------------------------------
    def _map_batch(self, on_packed, on_tensor) -> None:
        self._store_k = self._store_v = None  # the mapped tokens are new tensors; the next write re-allocates
        if self.packed_k is not None and self.packed_v is not None:
            self.packed_k = on_packed(self.packed_k)
            self.packed_v = on_packed(self.packed_v)
        if self.keys is not None:
            self.keys = on_tensor(self.keys)
            self.values = on_tensor(self.values)
        if self.sink_k is not None:
            self.sink_k = on_tensor(self.sink_k)
            self.sink_v = on_tensor(self.sink_v)

    def _stored_length(self) -> int:
        n = 0 if self.packed_k is None else self.packed_k.seq_len
        return _seq(self.sink_k) + n + _seq(self.keys)

    def nbytes(self) -> int:
        """Bytes actually held: packed fields plus the full-precision window and sink tokens."""
        total = sum(p.nbytes() for p in (self.packed_k, self.packed_v) if p is not None)
        for t in (self.keys, self.values, self.sink_k, self.sink_v):
            if t is not None:
                total += t.numel() * t.element_size()
        return total

    def reserved_nbytes(self) -> int:
        """Bytes allocated: :meth:`nbytes` plus the unused capacity of the packed stores.

        A store grows by 1/8 when a write does not fit (or is allocated at ``max_cache_len`` tokens
        at once), so up to 1/9 of it can be unused; :meth:`nbytes` counts only the tokens held.
        """
        total = self.nbytes()
        for store, view in ((self._store_k, self.packed_k), (self._store_v, self.packed_v)):
            if store is not None and view is not None and _is_prefix(view, store):
                total += store.nbytes() - view.nbytes()
        return total

    def layout_nbytes(self) -> int:
        """Bytes the layout says this layer holds, computed from token counts and codecs."""
        if not self.is_initialized:
            return 0
        batch, heads, _, dk = self.keys.shape
        dv = self.values.shape[-1]
        n_packed = 0 if self.packed_k is None else self.packed_k.seq_len
        per_token = self.spec.k.bytes_per_vector(dk) + self.spec.v.bytes_per_vector(dv)
        window = _seq(self.keys) * (dk + dv) * self.keys.element_size()
        sink = _seq(self.sink_k) * (dk + dv) * 2  # fp16
        return batch * heads * (n_packed * per_token + window + sink)

    def bit_counts(self) -> tuple[float, int, float, int]:
        """``(k_bits, k_elements, v_bits, v_elements)`` held, from the layouts."""
        if not self.is_initialized:
            return 0.0, 0, 0.0, 0
        tokens = self.packed_k.seq_len if self.packed_k is not None else 0
        rows = self.keys.shape[0] * self.keys.shape[1]
        n_sink = _seq(self.sink_k)
        out: list[float] = []
        for codec, t in ((self.spec.k, self.keys), (self.spec.v, self.values)):
            d = t.shape[-1]
            window = t.shape[2] * d * t.element_size() * 8
            out.append(rows * (tokens * codec.bytes_per_vector(d) * 8 + window + n_sink * d * 16))
            out.append(rows * (tokens + t.shape[2] + n_sink) * d)
        return out[0], int(out[1]), out[2], int(out[3])

    def num_elements(self) -> int:
        """K and V elements stored (tokens x heads x batch x head_dim, K and V)."""
        if not self.is_initialized:
            return 0
        batch, heads = self.keys.shape[:2]
        return batch * heads * self._stored_length() * (self.keys.shape[-1] + self.values.shape[-1])


class CompressedSlidingWindowLayer(CompressedLayer):
    """A sliding-window attention layer: keeps the last ``sliding_window - 1`` tokens.

    As transformers' ``DynamicSlidingWindowLayer``, ``update`` returns every token the
    current block can see (old window plus the block), then drops what left the window.
    """

    is_sliding = True

    def __init__(self, spec: CacheSpec | str, sliding_window: int, residual: int = 0) -> None:
        super().__init__(spec, residual, sink=0)  # sink tokens leave a sliding window like any other
        self.sliding_window = sliding_window

    def _after_update(self) -> None:
        length = self._stored_length()
        keep = self.sliding_window - 1
        if length > keep:
            self._keep(length - keep, length)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_offset = max(self.cumulative_length - self.sliding_window + 1, 0)
        if self.cumulative_length >= self.sliding_window:
            return self.sliding_window - 1 + query_length, kv_offset
        return self.cumulative_length + query_length, kv_offset

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        if self.cumulative_length >= self.sliding_window:
            raise RuntimeError(
                "cannot crop a sliding-window layer after it has slid (tokens already dropped); "
                "crop before the context reaches the sliding window, or use a fresh cache"
            )
        super().crop(tokens_to_remove)


class KiviLayer(CompressedLayer):
    """A full-attention layer for KIVI codecs (``kivi2``, ``kivi4``): token-grouped K.

    ``packed_k`` holds K groups (its sequence dimension counts groups of G tokens, quantized per
    channel); ``packed_v`` holds V per token; ``keys``/``values`` are the fp16 window of the most
    recent ``R .. R+G-1`` tokens (counted in the bits). See :mod:`walshkv.codecs.kivi`.
    """

    is_croppable = False

    def __init__(self, spec: CacheSpec | str) -> None:
        super().__init__(spec, 0, sink=0)
        self.kivi_k = self.spec.k.bind(0, "k")
        self.kivi_v = self.spec.v.bind(0, "v")
        self.group, self.window = self.kivi_k.group, self.kivi_k.residual

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.keys = self.keys.to(torch.float16)
        self.values = self.values.to(torch.float16)

    def _packed_tokens(self) -> int:
        return 0 if self.packed_v is None else self.packed_v.seq_len

    def _stored_length(self) -> int:
        return self._packed_tokens() + _seq(self.keys)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_block(key_states, value_states)
        from walshkv.codecs.base import check_kv

        check_kv(key_states, "K")
        check_kv(value_states, "V")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out_dtype = key_states.dtype
        window_k = torch.cat([self.keys, key_states.to(torch.float16)], dim=-2)
        window_v = torch.cat([self.values, value_states.to(torch.float16)], dim=-2)
        n_groups = max(0, window_k.shape[-2] - self.window) // self.group
        n = n_groups * self.group
        new_k = self.kivi_k.encode_block(window_k[:, :, :n].float()) if n else None
        new_v = self.kivi_v.encode_block(window_v[:, :, :n].float()) if n else None
        parts_k = [self.kivi_k.decode_block(p) for p in (self.packed_k, new_k) if p is not None]
        parts_v = [self.kivi_v.decode_block(p) for p in (self.packed_v, new_v) if p is not None]
        out_k = torch.cat([p.to(out_dtype) for p in parts_k] + [window_k[:, :, n:].to(out_dtype)], dim=-2)
        out_v = torch.cat([p.to(out_dtype) for p in parts_v] + [window_v[:, :, n:].to(out_dtype)], dim=-2)
        self.packed_k = _cat_packed(self.packed_k, new_k)
        self.packed_v = _cat_packed(self.packed_v, new_v)
        self.keys = window_k[:, :, n:].contiguous()
        self.values = window_v[:, :, n:].contiguous()
        self.cumulative_length += key_states.shape[-2]
        return out_k, out_v

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("KIVI caches cannot be cropped (K is quantized in groups of tokens); use a fresh cache")

    def layout_nbytes(self) -> int:
        if not self.is_initialized:
            return 0
        batch, heads, win, d = self.keys.shape
        groups = 0 if self.packed_k is None else self.packed_k.seq_len
        k_group = sum(f.nbytes for f in self.kivi_k.layout(d).values())
        v_token = sum(f.nbytes for f in self.kivi_v.layout(d).values())
        return batch * heads * (groups * k_group + self._packed_tokens() * v_token + 2 * win * d * 2)

    def bit_counts(self) -> tuple[float, int, float, int]:
        if not self.is_initialized:
            return 0.0, 0, 0.0, 0
        batch, heads, win, d = self.keys.shape
        rows = batch * heads
        groups = 0 if self.packed_k is None else self.packed_k.seq_len
        k_group = sum(f.nbytes for f in self.kivi_k.layout(d).values())
        v_token = sum(f.nbytes for f in self.kivi_v.layout(d).values())
        elements = rows * self._stored_length() * d
        k_bits = 8.0 * rows * (groups * k_group + win * d * 2)
        v_bits = 8.0 * rows * (self._packed_tokens() * v_token + win * d * 2)
        return k_bits, elements, v_bits, elements


_SLIDING_TYPES = ("sliding_attention", "chunked_attention")


class CompressedCache(Cache):
    """A transformers ``Cache`` whose layers hold packed K/V codes.

    Args:
        spec: a cache spec (``"rot+int4"``, ``"rot+int4/int3"``, ...) or a :class:`CacheSpec`.
        config: the model's config. With it, sliding-window layers (e.g. gemma3) keep
            only their window and the head size is checked up front. Without it,
            every layer is a full-attention layer created on first use.
        residual: keep the most recent ``residual`` tokens of each layer in full
            precision (default 0: every token is compressed before attention).
        fused: attention reads the packed codes directly (no float copy of the cache): decode steps
            through :func:`walshkv.ops.attention.decode_attention` (the fused CPU kernel where it reads
            the codecs), prefill through :func:`walshkv.ops.attention_chunked.chunked_attention`. Needs
            ``enable_fused_attention(model)`` first (the model's attention then asks the cache). Same
            quantization, so the same results as the default path up to float rounding. Layers whose
            K codec is ``prerope+`` (K stored before RoPE) are not fused: they decode, then run SDPA.
        max_cache_len: tokens to allocate in each full-attention layer's packed store on the first
            write (e.g. prompt + new tokens), so that the store never grows by copying. Without it a
            store grows by 1/8 whenever a write does not fit. Either way the cache holds only
            packed codes; :meth:`reserved_nbytes` reports the allocation, :meth:`nbytes` the tokens held.

    Example:
        >>> cache = CompressedCache("rot+int4", config=model.config)  # doctest: +SKIP
        >>> out = model.generate(**inputs, cache=cache, max_new_tokens=50)  # doctest: +SKIP
        >>> cache.nbytes(), cache.bits_per_element()  # doctest: +SKIP
    """

    def __init__(
        self,
        spec: str | CacheSpec = "rot+int4",
        config: Any = None,
        *,
        residual: int = 0,
        calibration: Any = None,
        fused: bool = False,
        max_cache_len: int | None = None,
    ) -> None:
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive number of tokens (or None), got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        parsed = parse_cache_spec(spec)
        if isinstance(parsed, HFCacheSpec):
            raise ValueError(
                f"{parsed.spec} is Hugging Face's QuantizedCache, not a walshkv codec: build it with "
                "walshkv.cache.make_cache(spec, config)"
            )
        self.cache_spec = parsed
        self.residual = residual
        self.calibration = calibration
        self.fused = fused
        if fused and (config is None or getattr(config, "_attn_implementation", None) != FUSED_ATTENTION):
            raise ValueError(
                "fused=True needs the model's attention to read the packed cache: call "
                "walshkv.cache.enable_fused_attention(model) first and pass config=model.config"
            )
        if residual < 0:
            raise ValueError(f"residual must be >= 0 tokens, got {residual}")
        if self.cache_spec.needs_calibration and calibration is None:
            self.cache_spec.bind(0, None)  # raises the message that names the fix
        if config is None:
            super().__init__(layer_class_to_replicate=self._next_layer)
            return
        text_config = config.get_text_config(decoder=True)
        head_dim = getattr(text_config, "head_dim", None) or (
            text_config.hidden_size // text_config.num_attention_heads
        )
        self.cache_spec.check_head_dim(head_dim)
        if isinstance(self.cache_spec, LayeredCacheSpec):
            self.cache_spec.check_layers(text_config.num_hidden_layers)
        if calibration is not None:
            calibration.check_matches(text_config.num_hidden_layers, text_config.num_key_value_heads, head_dim)
        layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
        layers: list[CacheLayerMixin] = []
        kivi = isinstance(self.cache_spec.k, KiviCodec)
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True)):
            spec_i = self.cache_spec.bind(idx, calibration)
            if kivi:
                if layer_type != "full_attention":
                    raise ValueError(f"{self.cache_spec.spec} supports full-attention layers only, not {layer_type!r}")
                layers.append(KiviLayer(spec_i))
            elif layer_type == "full_attention":
                layers.append(CompressedLayer(spec_i, residual, self.cache_spec.sink))
                # the kernels do not re-apply RoPE to keys stored before it: prerope+ layers decode, then SDPA
                layers[-1].fused = fused and not isinstance(spec_i.k, PreRope)
                layers[-1].reserve = max_cache_len or 0
            elif layer_type in _SLIDING_TYPES:
                layers.append(CompressedSlidingWindowLayer(spec_i, kwargs["sliding_window"], residual))
            else:
                raise ValueError(
                    f"CompressedCache supports full_attention and {'/'.join(_SLIDING_TYPES)} layers; "
                    f"this model has a {layer_type!r} layer"
                )
        super().__init__(layers=layers)

    def _next_layer(self) -> CompressedLayer:
        """Layers created on first use (no config): bound to their index in order."""
        spec = self.cache_spec.bind(len(self.layers), self.calibration)
        if isinstance(spec.k, KiviCodec):
            return KiviLayer(spec)
        layer = CompressedLayer(spec, self.residual, self.cache_spec.sink)
        layer.reserve = self.max_cache_len or 0
        return layer

    @classmethod
    def from_preset(
        cls,
        model: Any,
        name: str = "walshkv:4.5",
        *,
        calibration: Any = None,
        residual: int = 0,
        fused: bool = False,
        max_cache_len: int | None = None,
    ) -> CompressedCache:
        """A cache for ``model`` with the preset ``name`` (``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5``).

        Args:
            model: a transformers model (its ``config`` is used).
            name: the preset.
            calibration: what the preset needs, normally the file of ``walshkv calibrate --preset NAME``
                (``walshkv.export.read_kv_mean_center(path)``) or ``collect_kv_stats(...)``; a file
                written for this preset by ``walshkv recommend`` also chooses the spec.
            residual: full-precision window of recent tokens (0: every token compressed).
            fused: attention reads the packed codes (after :func:`enable_fused_attention`), as for
                :class:`CompressedCache`.
            max_cache_len: tokens to allocate per layer on the first write, as for :class:`CompressedCache`.

        The resolved :class:`walshkv.presets.Preset` is kept as ``cache.preset``.
        """
        from walshkv.presets import resolve_preset

        preset = resolve_preset(name, calibration)
        cache = cls(
            preset.spec,
            config=model.config,
            residual=residual,
            calibration=calibration,
            fused=fused,
            max_cache_len=max_cache_len,
        )
        cache.preset = preset
        return cache

    @classmethod
    def from_model(cls, model: Any, spec: str | CacheSpec = "rot+int4", *, residual: int = 0) -> CompressedCache:
        """Build a cache for ``model`` (uses ``model.config``)."""
        return cls(spec, config=model.config, residual=residual)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except (ValueError, TypeError) as err:
            raise type(err)(f"layer {layer_idx} ({self.cache_spec.spec}): {err}") from err

    def _compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def nbytes(self) -> int:
        """Bytes actually held by every layer (packed fields and any full-precision window)."""
        return sum(layer.nbytes() for layer in self._compressed_layers())

    def reserved_nbytes(self) -> int:
        """Bytes allocated by every layer: :meth:`nbytes` plus unused store capacity (at most 1/9 of it
        after growth; ``max_cache_len`` reserves its tokens up front)."""
        return sum(layer.reserved_nbytes() for layer in self._compressed_layers())

    def layout_nbytes(self) -> int:
        """Bytes the codecs' layouts imply for the tokens held (should equal :meth:`nbytes`)."""
        return sum(layer.layout_nbytes() for layer in self._compressed_layers())

    def num_elements(self) -> int:
        """K and V elements held, over all layers."""
        return sum(layer.num_elements() for layer in self._compressed_layers())

    def bits_per_element(self) -> float:
        """Stored bits per K/V element, from the codecs' layouts (window included)."""
        n = self.num_elements()
        return 8.0 * self.layout_nbytes() / n if n else float("nan")

    def bits_per_element_kv(self) -> tuple[float, float]:
        """``(bits_k, bits_v)`` from each layer's codecs, averaged over the elements held."""
        kb = ke = vb = ve = 0.0
        for layer in self._compressed_layers():
            a, b, c, d = layer.bit_counts()
            kb, ke, vb, ve = kb + a, ke + b, vb + c, ve + d
        return (kb / ke if ke else float("nan"), vb / ve if ve else float("nan"))

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would take for the same tokens (2 bytes per element)."""
        return 2 * self.num_elements()


# ---- Hugging Face QuantizedCache as a peer ----------------------------------------------------------


def _held_bytes(obj: Any, float_bytes: int) -> int:
    """Bytes of every tensor inside ``obj``; floating tensors counted at ``float_bytes`` per element."""
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor:  # quanto's packed tensor subclasses
            names, _ = obj.__tensor_flatten__()
            return sum(_held_bytes(getattr(obj, n), float_bytes) for n in names)
        wide_float = obj.is_floating_point() and obj.element_size() >= 2  # float8 codes count as stored
        size = float_bytes if wide_float else obj.element_size()
        return obj.numel() * size
    if isinstance(obj, dict):
        return sum(_held_bytes(v, float_bytes) for v in obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(_held_bytes(v, float_bytes) for v in obj)
    return 0


def make_hf_cache(spec: HFCacheSpec, config: Any) -> Cache:
    """Hugging Face's ``QuantizedCache`` for ``spec``, with walshkv's byte accounting attached.

    Raises:
        ImportError: the backend's package is missing (the message names the pip command).
        ValueError: the model has sliding-window layers (transformers' QuantizedCache refuses them).
    """
    from transformers.cache_utils import QuantizedCache

    package = spec.pip_package
    if package is not None:
        import importlib.util

        module = "optimum.quanto" if spec.backend == "quanto" else "hqq"
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ImportError(
                f"{spec.spec} needs the {package!r} package: pip install 'walshkv[hf]' (or pip install {package})"
            )
    kwargs: dict[str, Any] = {}
    if spec.backend != "fp8":
        kwargs = {"nbits": spec.bits, "q_group_size": spec.group, "residual_length": spec.residual}
    try:
        cache = QuantizedCache(spec.backend, config, **kwargs)
    except ValueError as err:
        raise ValueError(f"{spec.spec}: transformers' QuantizedCache cannot run this model: {err}") from err
    text = config.get_text_config(decoder=True)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    cache.hf_spec = spec  # type: ignore[attr-defined]
    cache.hf_row = text.num_key_value_heads * head_dim  # type: ignore[attr-defined]
    return cache


def hf_cache_nbytes(cache: Cache, float_bytes: int = 2, batch: int = 1) -> tuple[int, int, int]:
    """``(k_bytes, v_bytes, elements_per_side)`` held by a Hugging Face ``QuantizedCache``.

    Floating tensors (scales, zero points, the full-precision window) are counted at ``float_bytes``
    per element (2: as the same cache holds them for an fp16 model), integer codes as stored.
    ``batch`` is the batch size the cache was filled with (elements are counted from it).
    """
    kb = vb = n = 0
    for layer in cache.layers:
        if not layer.is_initialized:
            continue
        window_k = layer.keys if layer.keys.dim() == 4 else None
        window_v = layer.values if layer.values.dim() == 4 else None
        kb += _held_bytes(layer._quantized_keys, float_bytes) + _held_bytes(window_k, float_bytes)
        vb += _held_bytes(layer._quantized_values, float_bytes) + _held_bytes(window_v, float_bytes)
        n += batch * cache.hf_row * layer.get_seq_length()  # type: ignore[attr-defined]
    return kb, vb, n


def context_state(cache: Cache) -> tuple[int, int, bool]:
    """``(cached_tokens, full_precision_cached_tokens, current_token_exact)`` of layer 0 before a write.

    ``current_token_exact``: attention sees the token being written unquantized (transformers'
    ``QuantizedLayer`` returns it as is; walshkv only within a full-precision window: ``residual``
    tokens, or KIVI's fp16 window, which every token enters first).
    """
    from transformers.cache_utils import QuantizedLayer

    layer = cache.layers[0]
    if not layer.is_initialized:
        return 0, 0, True
    window = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    exact = isinstance(layer, (QuantizedLayer, KiviLayer)) or getattr(layer, "residual", 0) > 0
    return layer.get_seq_length(), window, exact


def make_cache(
    spec: str | CacheSpec | HFCacheSpec, config: Any, *, residual: int = 0, calibration: Any = None
) -> Cache:
    """A :class:`CompressedCache`, or Hugging Face's ``QuantizedCache`` for an ``hf-*`` spec."""
    parsed = parse_cache_spec(spec)
    if isinstance(parsed, HFCacheSpec):
        if residual:
            raise ValueError(f"{parsed.spec} has its own window (':r=TOKENS'); do not combine it with residual")
        return make_hf_cache(parsed, config)
    return CompressedCache(parsed, config=config, residual=residual, calibration=calibration)


# ---------------------------------------------------------------------------------------------------------
# Attention straight from the packed cache (CompressedCache(..., fused=True))
# ---------------------------------------------------------------------------------------------------------


def _all_visible(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def fused_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function that reads a fused :class:`CompressedLayer`'s packed codes.

    ``key``/``value`` are the markers the layer's ``update`` returned; anything else (sliding-window
    layers, other caches) goes to torch SDPA unchanged. One query token with nothing masked uses
    :func:`walshkv.ops.attention.decode_attention`; otherwise (prefill, padding)
    :func:`walshkv.ops.attention_chunked.chunked_attention` with the model's mask.

    Args:
        query: ``[batch, num_q_heads, T, head_dim]``.

    Returns:
        ``([batch, T, num_q_heads, head_dim], None)``, as transformers' attention functions return.
    """
    layer = getattr(key, "walshkv_layer", None)
    if layer is None:
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("softcap") is not None:
        raise ValueError("fused attention does not apply logit soft-capping; use CompressedCache(..., fused=False)")
    from walshkv.ops.attention import decode_attention
    from walshkv.ops.attention_chunked import chunked_attention

    t = query.shape[2]
    visible = _all_visible(attention_mask)
    head_k, head_v = layer.sink_tokens(layer.keys.dtype)
    if head_k and not (t == 1 and visible):
        # sink tokens come first in position order, which the chunked kernel's causal offsets do not know:
        # prefill (or a masked step) of a sink:N: cache decodes the layer and runs SDPA
        k_all, v_all = layer.decoded()
        return _sdpa(module, query, k_all, v_all, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    # one visible query token: order does not matter to softmax, so the sink joins the full-precision window
    window_k = torch.cat([*head_k, layer.keys], dim=-2) if head_k else layer.keys
    window_v = torch.cat([*head_v, layer.values], dim=-2) if head_v else layer.values
    window_k = window_k if window_k.shape[-2] else None
    window_v = window_v if window_v.shape[-2] else None
    if t == 1 and visible:
        out = decode_attention(
            query,
            layer.packed_k,
            layer.packed_v,
            layer.spec.k,
            layer.spec.v,
            scale=scaling,
            window_k=window_k,
            window_v=window_v,
        )
    else:
        out = chunked_attention(
            query,
            layer.packed_k,
            layer.packed_v,
            layer.spec.k,
            layer.spec.v,
            offset=layer._stored_length() - t,
            scale=scaling,
            window_k=window_k,
            window_v=window_v,
            mask=None if visible else attention_mask,
        )
    return out.transpose(1, 2).contiguous(), None


def _sdpa(
    module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any, **kwargs: Any
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, with the causal mask :func:`_fused_mask` may have skipped."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:
        # _fused_mask skipped the plain causal mask (fused layers apply it themselves); SDPA's is_causal
        # would align it top-left, so build the cache-aware (bottom-right) one for this layer
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _fused_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with :data:`FUSED_ATTENTION`: transformers' SDPA mask, except that the
    plain causal mask without padding is not built (``None``): fused layers apply the causal rule
    themselves, and a ``[chunk, context]`` mask per prefill chunk is memory that grows with the context."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    padding = kwargs.get("attention_mask")
    if (
        not args
        and kwargs.get("mask_function") is causal_mask_function
        and kwargs.get("allow_is_causal_skip", True)
        and (padding is None or bool(padding.all()))
    ):
        return None
    return sdpa_mask(*args, **kwargs)


def enable_fused_attention(model: Any) -> None:
    """Register :func:`fused_attention` with transformers and make ``model`` use it.

    Layers that are not fused compressed layers (sliding windows, other caches) still run torch SDPA,
    so the model stays usable with any cache. Undo with ``model.set_attn_implementation("sdpa")``.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if FUSED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(FUSED_ATTENTION, fused_attention)
        AttentionMaskInterface.register(FUSED_ATTENTION, _fused_mask)
    model.set_attn_implementation(FUSED_ATTENTION)
