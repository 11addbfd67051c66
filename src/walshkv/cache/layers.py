"""The layers of a :class:`~walshkv.cache.CompressedCache`: full attention and sliding window.

Layout of every tensor: ``[batch, num_kv_heads, seq_len, head_dim]``. A layer holds
:class:`~walshkv.codecs.Packed` K and V and, only if ``residual > 0`` was asked for, a full-precision
window of the most recent ``residual`` tokens; with a ``sink:N:`` spec, full-attention layers also keep
their first ``N`` tokens in fp16. ``update()`` quantizes on write: the incoming block is encoded and
appended first, and attention receives the *decoded* K/V, so the current block is seen compressed too
(tokens in the residual window excepted). Positions reach the codecs through ``encode(x, start)`` /
``decode(packed, start)`` (they matter to ``prerope+`` only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from walshkv.cache.fused import marker
from walshkv.cache.store import GROWTH, append_packed, is_prefix, seq_len
from walshkv.codecs.base import Packed, check_kv
from walshkv.codecs.center import Centered
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.spec import CacheSpec, parse_cache_spec

__all__ = ["Checkpoint", "CompressedLayer", "CompressedSlidingWindowLayer"]

#: A layer's state before a write (:meth:`CompressedLayer.checkpoint`): its attributes, and for layers that
#: only append, the packed tokens (K, V) held, instead of views that would keep a grown store's old allocation.
Checkpoint = tuple[dict[str, Any], tuple[int, int] | None]

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
        self.exact_prefill = False  # set by CompressedCache(..., prefill="exact")
        # fused + exact prefill: (packed tokens before the block, old window K, V, the block's exact K, V)
        self._exact: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
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
        check_kv(key_states, "K")  # every token, the window's and the sink's too, before anything changes
        check_kv(value_states, "V")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n_tokens = key_states.shape[-2]
        n_sink = min(self.sink - seq_len(self.sink_k), n_tokens) if self.sink else 0
        sink_k, sink_v = self.sink_k, self.sink_v
        if n_sink > 0:  # checked (NaN, fp16 overflow) before anything changes, like the encoded part
            sink_k = _cat_sink(sink_k, _FP16.encode(key_states[:, :, :n_sink]).tensors["values"])
            sink_v = _cat_sink(sink_v, _FP16.encode(value_states[:, :, :n_sink]).tensors["values"])
            key_states, value_states = key_states[:, :, n_sink:], value_states[:, :, n_sink:]
        window_k = torch.cat([self.keys, key_states.to(self.keys.dtype)], dim=-2)
        window_v = torch.cat([self.values, value_states.to(self.values.dtype)], dim=-2)
        n_encode = max(0, window_k.shape[-2] - self.residual)
        # positions (for prerope+): tokens dropped by a sliding window, then sink, packed, window in order
        packed_pos = self.cumulative_length - self._stored_length() + seq_len(sink_k)
        new_pos = packed_pos + (0 if self.packed_k is None else self.packed_k.seq_len)
        # Encode first: a refused block (NaN, overflow) raises here and leaves the layer as it was.
        new_k = self.spec.k.encode(window_k[:, :, :n_encode], new_pos) if n_encode else None
        new_v = self.spec.v.encode(window_v[:, :, :n_encode], new_pos) if n_encode else None

        self.sink_k, self.sink_v = sink_k, sink_v
        # prefill="exact": a multi-token block attends to its own K/V as computed (stored compressed all the same)
        exact = self.exact_prefill and n_tokens > 1
        new_exact = (key_states.to(self.keys.dtype), value_states.to(self.values.dtype)) if exact else None
        self._exact = None
        if self.fused:  # attention reads the packed codes itself (fused_attention): hand it markers
            if new_exact is not None:
                n_old = 0 if self.packed_k is None else self.packed_k.seq_len
                self._exact = (n_old, self.keys, self.values, *new_exact)
            out_k, out_v = marker(self, key_states), marker(self, value_states)
        else:
            stored_k = ((self.packed_k, packed_pos), (None if exact else new_k, new_pos))
            stored_v = ((self.packed_v, packed_pos), (None if exact else new_v, new_pos))
            parts_k = [self.spec.k.decode(p, at) for p, at in stored_k if p is not None]
            parts_v = [self.spec.v.decode(p, at) for p, at in stored_v if p is not None]
            head_k, head_v = self.sink_tokens(window_k.dtype)
            if new_exact is not None:  # the old window, then the whole new block as computed
                tail_k, tail_v = torch.cat([self.keys, new_exact[0]], -2), torch.cat([self.values, new_exact[1]], -2)
            else:
                tail_k, tail_v = window_k[:, :, n_encode:], window_v[:, :, n_encode:]
            out_k = torch.cat([*head_k, *parts_k, tail_k], dim=-2)
            out_v = torch.cat([*head_v, *parts_v, tail_v], dim=-2)

        growth = 1.0 if self.is_sliding else GROWTH  # (a sliding window drops its oldest tokens anyway)
        self._store_k, self.packed_k = append_packed(self._store_k, self.packed_k, new_k, self.reserve, growth)
        self._store_v, self.packed_v = append_packed(self._store_v, self.packed_v, new_v, self.reserve, growth)
        self.keys = window_k[:, :, n_encode:].contiguous()
        self.values = window_v[:, :, n_encode:].contiguous()
        self.cumulative_length += n_tokens
        self._after_update()
        return out_k, out_v

    def sink_tokens(self, dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The fp16 sink tokens as attention reads them: ``([K], [V])``, or ``([], [])`` if there are none.

        K is shifted like the codec's decoded K (``center+`` leaves its calibrated mean subtracted).
        """
        if self.sink_k is None or self.sink_k.shape[-2] == 0:
            return [], []
        k = self.sink_k.to(torch.float32)
        if isinstance(self.spec.k, Centered):
            k = k - self.spec.k.plain_offset().to(k.device)[None, :, None, :]
        return [k.to(dtype)], [self.sink_v.to(dtype)]  # type: ignore[union-attr]

    def packed_start(self) -> int:
        """Position of the first packed token (what its ``encode`` was given): dropped tokens, then the sink."""
        return self.cumulative_length - self._stored_length() + seq_len(self.sink_k)

    def decoded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token as attention reads it (sink, decoded packed codes, window), ``[b, h, seq, d]``."""
        dtype = self.keys.dtype
        head_k, head_v = self.sink_tokens(dtype)
        start = self.packed_start()
        parts_k = [self.spec.k.decode(self.packed_k, start).to(dtype)] if self.packed_k is not None else []
        parts_v = [self.spec.v.decode(self.packed_v, start).to(dtype)] if self.packed_v is not None else []
        return torch.cat([*head_k, *parts_k, self.keys], dim=-2), torch.cat([*head_v, *parts_v, self.values], dim=-2)

    def checkpoint(self) -> Checkpoint:
        """The state :meth:`rollback` returns to: taken by :class:`CompressedCache` before each layer's write.

        References only (the window, sink and packed views are replaced, never written, by a write); a layer
        that only appends keeps the packed token counts instead of its views.
        """
        state = dict(vars(self))
        if self.is_sliding:  # drops its oldest tokens: the views themselves (one window's worth)
            return state, None
        for name in ("packed_k", "packed_v", "_store_k", "_store_v"):
            del state[name]
        return state, (0 if self.packed_k is None else self.packed_k.seq_len, self._packed_tokens())

    def rollback(self, checkpoint: Checkpoint) -> None:
        """Undo every write since ``checkpoint`` was taken (tokens, window, sink, positions)."""
        state, held = checkpoint
        now_k, now_v = self.packed_k, self.packed_v
        self.__dict__.update(state)
        if held is not None:  # the held tokens are a prefix of what is held now (appends only)
            self.packed_k = now_k.slice_seq(0, held[0]) if held[0] and now_k is not None else None
            self.packed_v = now_v.slice_seq(0, held[1]) if held[1] and now_v is not None else None

    def _packed_tokens(self) -> int:
        return 0 if self.packed_v is None else self.packed_v.seq_len

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
        n_sink = seq_len(self.sink_k)
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
    def _map_batch(
        self, on_packed: Callable[[Packed], Packed], on_tensor: Callable[[torch.Tensor], torch.Tensor]
    ) -> None:
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
        return seq_len(self.sink_k) + n + seq_len(self.keys)

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
            if store is not None and view is not None and is_prefix(view, store):
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
        window = seq_len(self.keys) * (dk + dv) * self.keys.element_size()
        sink = seq_len(self.sink_k) * (dk + dv) * 2  # fp16
        return batch * heads * (n_packed * per_token + window + sink)

    def bit_counts(self) -> tuple[float, int, float, int]:
        """``(k_bits, k_elements, v_bits, v_elements)`` held, from the layouts."""
        if not self.is_initialized:
            return 0.0, 0, 0.0, 0
        tokens = self.packed_k.seq_len if self.packed_k is not None else 0
        rows = self.keys.shape[0] * self.keys.shape[1]
        n_sink = seq_len(self.sink_k)
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
