"""What callers use for either kind of cache: :func:`make_cache` builds one, :func:`check_spec_fits` checks a spec
against a model before one is built, :func:`context_state` reads it.

A spec is a walshkv codec spec (a :class:`~walshkv.cache.CompressedCache`) or an ``hf-*`` spec
(Hugging Face's ``QuantizedCache``, :mod:`walshkv.cache.hf`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import Cache, QuantizedLayer, get_layer_types_and_kwargs

from walshkv.cache.compressed import CompressedCache, check_fits
from walshkv.cache.hf import make_hf_cache
from walshkv.cache.kivi import KiviLayer
from walshkv.cache.layers import CompressedLayer
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, parse_cache_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from walshkv.codecs.calibration import Calibration
    from walshkv.constants import Prefill

__all__ = ["check_spec_fits", "context_state", "make_cache"]


def make_cache(
    spec: str | CacheSpec | HFCacheSpec,
    config: PretrainedConfig,
    *,
    residual: int = 0,
    calibration: Calibration | None = None,
    prefill: Prefill = "quantized",
) -> Cache:
    """A :class:`CompressedCache`, or Hugging Face's ``QuantizedCache`` for an ``hf-*`` spec.

    ``prefill``: as for :class:`CompressedCache`; Hugging Face's caches show a prompt its exact K/V whatever it is.
    """
    parsed = parse_cache_spec(spec)
    if isinstance(parsed, HFCacheSpec):
        if residual:
            raise ValueError(f"{parsed.spec} has its own window (':r=TOKENS'); do not combine it with residual")
        return make_hf_cache(parsed, config)
    return CompressedCache(parsed, config=config, residual=residual, calibration=calibration, prefill=prefill)


def check_spec_fits(spec: str | CacheSpec | HFCacheSpec, config: PretrainedConfig) -> None:
    """Refuse a spec this model's cache cannot hold, from its config alone (no calibration, no tensors).

    A walshkv spec: :func:`~walshkv.cache.compressed.check_fits` (head size, ``layers:`` indices, layer types).
    An ``hf-*`` spec: Hugging Face's ``QuantizedCache`` holds full-attention layers only, and needs its backend's
    package (built here as :func:`make_cache` would, which holds no tensors yet).

    Raises:
        ValueError: what the model has that the spec cannot hold (the spec, the layer kind and the fix).
        ImportError: an ``hf-*`` spec's backend package is missing (the message names the pip command).
    """
    parsed = parse_cache_spec(spec)
    if not isinstance(parsed, HFCacheSpec):
        check_fits(parsed, config)
        return
    layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    other = [t for t in dict.fromkeys(layer_types) if t != "full_attention"]
    if other:
        count = sum(t in other for t in layer_types)
        raise ValueError(
            f"{parsed.spec} cannot hold this model's {' and '.join(map(repr, other))} layers ({count} of "
            f"{len(layer_types)}): Hugging Face's QuantizedCache holds full_attention layers only; compare with "
            "a walshkv spec on this model instead (kivi4, rot+q4_0, tq:4, a walshkv: preset)"
        )
    make_hf_cache(parsed, config)


def context_state(cache: Cache) -> tuple[int, int, bool]:
    """``(cached_tokens, full_precision_cached_tokens, current_token_exact)`` of the first full-attention layer
    (layer 0 if every layer slides) before a write.

    ``current_token_exact``: attention sees the token being written unquantized (transformers'
    ``QuantizedLayer`` returns it as is; walshkv only within a full-precision window: ``residual``
    tokens, or KIVI's fp16 window, which every token enters first). A full-attention layer is read because it
    attends to every cached token (a sliding layer's count includes the tokens it dropped).
    """
    layer = next((layer for layer in cache.layers if not getattr(layer, "is_sliding", False)), cache.layers[0])
    if not layer.is_initialized:
        return 0, 0, True
    window = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    windowed = isinstance(layer, CompressedLayer) and layer.residual > 0
    exact = isinstance(layer, (QuantizedLayer, KiviLayer)) or windowed
    return layer.get_seq_length(), window, exact
