"""The cache layer of KIVI codecs (``kivi2``, ``kivi4``): K quantized in groups of tokens.

Tokens enter an fp16 window; once it holds ``R + G`` tokens its oldest ``G`` leave as one K group (and
their V, per token) through the codec contract, ``codec.encode(x, start)`` with ``x`` whole groups. See
:mod:`walshkv.codecs.kivi`.

On a sliding-window layer (gemma3's local layers), :class:`KiviSlidingWindowLayer` holds the window the
model attends to and drops a quantized K group (and its V tokens) once every one of its tokens has left the
window: K's scale and zero point are shared by the group, so it leaves whole. It therefore holds up to
``G - 1`` tokens more than transformers' sliding layer (``sliding_window - 1`` tokens); the attention mask
hides them, and the cache's bytes count them.
"""

from __future__ import annotations

from typing import Any

import torch

from walshkv.cache.layers import CompressedLayer
from walshkv.cache.store import cat_packed, seq_len
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.spec import CacheSpec

__all__ = ["KiviLayer", "KiviSlidingWindowLayer"]

_FP16 = FloatCodec("fp16")  # the window: its encode refuses NaN/Inf and values fp16 cannot hold


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

    def _stored_length(self) -> int:
        return self._packed_tokens() + seq_len(self.keys)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_block(key_states, value_states)
        new_k16 = _FP16.encode(key_states).tensors["values"]  # checked before anything changes
        new_v16 = _FP16.encode(value_states).tensors["values"]
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        out_dtype = key_states.dtype
        window_k = torch.cat([self.keys, new_k16], dim=-2)
        window_v = torch.cat([self.values, new_v16], dim=-2)
        n_groups = max(0, window_k.shape[-2] - self.window) // self.group
        n = n_groups * self.group
        first = self._dropped()  # position of the first stored token (tokens a sliding window dropped before it)
        start = first + self._packed_tokens()  # position of the first token that leaves the window now
        # an fp16 model reads fp16: encoding the fp16 window as is makes the codec refuse what decodes past 65504
        enc = torch.float16 if out_dtype == torch.float16 else torch.float32
        new_k = self.kivi_k.encode(window_k[:, :, :n].to(enc), start) if n else None
        new_v = self.kivi_v.encode(window_v[:, :, :n].to(enc), start) if n else None
        stored_k = ((self.packed_k, first), (new_k, start))
        stored_v = ((self.packed_v, first), (new_v, start))
        parts_k = [self.kivi_k.decode(p, at) for p, at in stored_k if p is not None]
        parts_v = [self.kivi_v.decode(p, at) for p, at in stored_v if p is not None]
        out_k = torch.cat([p.to(out_dtype) for p in parts_k] + [window_k[:, :, n:].to(out_dtype)], dim=-2)
        out_v = torch.cat([p.to(out_dtype) for p in parts_v] + [window_v[:, :, n:].to(out_dtype)], dim=-2)
        self.packed_k = cat_packed(self.packed_k, new_k)
        self.packed_v = cat_packed(self.packed_v, new_v)
        self.keys = window_k[:, :, n:].contiguous()
        self.values = window_v[:, :, n:].contiguous()
        self.cumulative_length += key_states.shape[-2]
        self._after_update()
        return out_k, out_v

    def _dropped(self) -> int:
        """Tokens that left the layer (a sliding window's oldest groups; none on a full-attention layer)."""
        return 0

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


class KiviSlidingWindowLayer(KiviLayer):
    """A sliding-window layer for KIVI codecs: holds the last ``sliding_window - 1`` tokens, in whole K groups.

    A quantized group leaves once all its ``G`` tokens are older than the window (its K scale and zero point
    are per group), so the layer holds between ``sliding_window - 1`` and ``sliding_window + G - 2`` tokens
    once the context has passed the window (plus the fp16 window's schedule, as on a full layer). The attention
    mask (:meth:`get_mask_sizes` gives it the first held token's position) hides the older ones, so attention
    sees exactly the window; the extra tokens count in the cache's bytes.

    Args:
        spec: a KIVI cache spec (``kivi2``, ``kivi4:g=32:r=32``).
        sliding_window: the model's window (``config.sliding_window``): a query attends to itself and the
            ``sliding_window - 1`` tokens before it.
    """

    is_sliding = True

    def __init__(self, spec: CacheSpec | str, sliding_window: int) -> None:
        super().__init__(spec)
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1 token, got {sliding_window}")
        self.sliding_window = sliding_window

    def _dropped(self) -> int:
        return self.cumulative_length - self._stored_length()

    def _after_update(self) -> None:
        """Drop the quantized groups whose every token is older than the last ``sliding_window - 1``."""
        if self.packed_k is None or self.packed_v is None:
            return
        oldest_kept = self.cumulative_length - (self.sliding_window - 1)  # position of the first token to keep
        stale = min(max(0, oldest_kept - self._dropped()) // self.group, self.packed_k.seq_len)
        if stale == 0:
            return
        groups, tokens = self.packed_k.seq_len, self._packed_tokens()
        self.packed_k = self.packed_k.slice_seq(stale, groups) if stale < groups else None
        self.packed_v = self.packed_v.slice_seq(stale * self.group, tokens) if stale < groups else None

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._stored_length() + query_length, self._dropped()

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def get_max_length(self) -> int:
        return self.sliding_window
