"""What a cache holds, asked the same way of every kind: the one introspection API above ``cache/``.

The harness, the needle runs and the generation bench measure three kinds of cache side by side: walshkv's
:class:`~walshkv.cache.CompressedCache`, Hugging Face's ``QuantizedCache`` (a peer) and the uncompressed
``DynamicCache`` (the reference). Only this package reads their layers; the callers ask:

* :func:`footprint`: bytes held and reserved, bits per element (K and V apart where the layout says);
* :func:`fp_bytes`: bytes an uncompressed cache of a model holds for ``ctx`` tokens (sliding layers capped);
* :func:`croppable_to_prefix`: whether a filled cache can be cut back to a common prefix and hold what a fresh
  one would (needle runs reuse a haystack's prefix);
* :func:`prefill_is_exact`: whether a multi-token forward attends to its own K/V as computed (``prefill="exact"``).

Layout of every tensor: ``[batch, num_kv_heads, seq_len, head_dim]``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicLayer

from walshkv.cache.compressed import CompressedCache
from walshkv.cache.hf import hf_cache_nbytes
from walshkv.cache.kivi import KiviLayer
from walshkv.cache.layers import CompressedLayer, CompressedSlidingWindowLayer
from walshkv.identity import head_dim_of

if TYPE_CHECKING:
    from transformers import Cache, PretrainedConfig

__all__ = ["Footprint", "croppable_to_prefix", "footprint", "fp_bytes", "prefill_is_exact"]


@dataclass(frozen=True)
class Footprint:
    """What a filled cache holds.

    Attributes:
        kind: ``walshkv``, ``hf-quantized`` or ``uncompressed``.
        kv_bytes: bytes of K and V held (packed codes, scales, norms, full-precision windows and sinks).
        reserved_bytes: bytes allocated (``kv_bytes`` plus unused store capacity; equal where nothing is reserved).
        bits_per_element: stored bits per K/V element (``nan`` for an empty cache).
        bits_k, bits_v: the same for K and V apart.
    """

    kind: str
    kv_bytes: int
    reserved_bytes: int
    bits_per_element: float
    bits_k: float
    bits_v: float


def _float_layers(cache: Cache) -> list[Any]:
    return [layer for layer in cache.layers if getattr(layer, "keys", None) is not None and layer.keys.dim() == 4]


def footprint(cache: Cache, *, dtype: torch.dtype | None = None, hf_float_bytes: int = 2) -> Footprint:
    """The bytes and bits ``cache`` holds, whatever its kind.

    Args:
        cache: a :class:`CompressedCache`, a Hugging Face ``QuantizedCache`` (:func:`walshkv.cache.make_hf_cache`)
            or any cache whose layers hold float ``keys``/``values`` (``DynamicCache``).
        dtype: for an uncompressed cache, the dtype its bits are counted in (default: the tensors' own).
        hf_float_bytes: bytes per floating element of a ``QuantizedCache`` (scales, its window: 2, as it holds them
            for an fp16 model; see :func:`walshkv.cache.hf_cache_nbytes`).
    """
    if isinstance(cache, CompressedCache):
        bk, bv = cache.bits_per_element_kv()
        return Footprint(
            "walshkv", cache.nbytes(), cache.reserved_nbytes(), cache.bits_per_element(), float(bk), float(bv)
        )
    if hasattr(cache, "hf_row"):  # Hugging Face's QuantizedCache, as make_hf_cache builds it
        kb, vb, n = hf_cache_nbytes(cache, hf_float_bytes)
        nan = float("nan")
        bits = (8.0 * (kb + vb) / (2 * n), 8.0 * kb / n, 8.0 * vb / n) if n else (nan, nan, nan)
        return Footprint("hf-quantized", kb + vb, kb + vb, *bits)
    layers = _float_layers(cache)
    held = sum(layer.keys.numel() + layer.values.numel() for layer in layers)
    size = torch.tensor([], dtype=dtype).element_size() if dtype is not None else None
    if size is None:
        nbytes = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
    else:
        nbytes = held * size
    bits = 8.0 * nbytes / held if held else float("nan")
    return Footprint("uncompressed", nbytes, nbytes, bits, bits, bits)


def fp_bytes(config: PretrainedConfig, ctx: int, element_bytes: int = 2) -> int:
    """Bytes an uncompressed cache of ``element_bytes`` per element holds for ``ctx`` tokens of one sequence.

    Sliding-window layers hold at most their window (minus the token being written), as the model's own cache.
    """
    cache = CompressedCache("fp16", config=config)
    text = config.get_text_config(decoder=True)
    head_dim = head_dim_of(text)
    total = 0
    for layer in cache.layers:
        tokens = min(ctx, layer.sliding_window - 1) if getattr(layer, "is_sliding", False) else ctx
        total += 2 * element_bytes * tokens * text.num_key_value_heads * head_dim
    return total


def croppable_to_prefix(cache: Cache, residual: int = 0) -> bool:
    """Whether ``cache`` can be cropped back to a common prefix and then hold what a fresh cache would.

    True for full-attention ``DynamicLayer`` and walshkv layers without a full-precision window; False for
    KIVI's token groups, Hugging Face's quantized layers, sliding windows, and any ``residual`` window.
    """
    if residual:
        return False
    for layer in cache.layers:
        walshkv = isinstance(layer, CompressedLayer) and not isinstance(layer, KiviLayer | CompressedSlidingWindowLayer)
        if not (walshkv or type(layer) is DynamicLayer):
            return False
    return True


def prefill_is_exact(cache: Cache) -> bool:
    """Whether a multi-token forward attends to its own K/V as computed (a cache built with ``prefill="exact"``)."""
    return bool(cache.layers) and bool(getattr(cache.layers[0], "exact_prefill", False))
