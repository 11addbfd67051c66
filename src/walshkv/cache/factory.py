"""What callers use for either kind of cache: :func:`make_cache` builds one, :func:`context_state` reads it.

A spec is a walshkv codec spec (a :class:`~walshkv.cache.CompressedCache`) or an ``hf-*`` spec
(Hugging Face's ``QuantizedCache``, :mod:`walshkv.cache.hf`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers.cache_utils import Cache, QuantizedLayer

from walshkv.cache.compressed import CompressedCache
from walshkv.cache.hf import make_hf_cache
from walshkv.cache.kivi import KiviLayer
from walshkv.cache.layers import CompressedLayer
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, parse_cache_spec

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from walshkv.codecs.calibration import Calibration
    from walshkv.constants import Prefill

__all__ = ["context_state", "make_cache"]


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


def context_state(cache: Cache) -> tuple[int, int, bool]:
    """``(cached_tokens, full_precision_cached_tokens, current_token_exact)`` of layer 0 before a write.

    ``current_token_exact``: attention sees the token being written unquantized (transformers'
    ``QuantizedLayer`` returns it as is; walshkv only within a full-precision window: ``residual``
    tokens, or KIVI's fp16 window, which every token enters first).
    """
    layer = cache.layers[0]
    if not layer.is_initialized:
        return 0, 0, True
    window = layer.keys.shape[-2] if layer.keys.dim() == 4 else 0
    windowed = isinstance(layer, CompressedLayer) and layer.residual > 0
    exact = isinstance(layer, (QuantizedLayer, KiviLayer)) or windowed
    return layer.get_seq_length(), window, exact
