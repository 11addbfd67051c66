"""``CompressedCache``: a transformers ``Cache`` that stores packed codes.

This package is the only code that touches transformers' cache API. Layout of every
tensor: ``[batch, num_kv_heads, seq_len, head_dim]``.

Each layer holds :class:`~walshkv.codecs.Packed` K and V (packed ``uint8`` codes and
their scales) and, only if ``residual > 0`` was asked for, a full-precision window of
the most recent ``residual`` tokens; with a ``sink:N:`` spec, full-attention layers also keep
their first ``N`` tokens in fp16. ``update()`` quantizes on write: the incoming
block is encoded and appended first, and attention receives the *decoded* K/V, so the
current block is seen compressed too (tokens in the residual window excepted). The
window's bytes count in :meth:`CompressedCache.nbytes` and
:meth:`CompressedCache.bits_per_element`.

Modules, bottom up:

* :mod:`~walshkv.cache.store`: a layer's packed store (in-place appends, growth);
* :mod:`~walshkv.cache.fused`: attention straight from the packed codes (:func:`enable_fused_attention`);
* :mod:`~walshkv.cache.layers`: :class:`CompressedLayer`, :class:`CompressedSlidingWindowLayer`;
* :mod:`~walshkv.cache.kivi`: :class:`KiviLayer`, :class:`KiviSlidingWindowLayer` (KIVI's token groups);
* :mod:`~walshkv.cache.persist`: saved caches (:meth:`CompressedCache.save`, :meth:`CompressedCache.load`);
* :mod:`~walshkv.cache.compressed`: :class:`CompressedCache` (``from_preset``, ``from_model``, ``save``, ``load``);
* :mod:`~walshkv.cache.hf`: Hugging Face's ``QuantizedCache`` as a peer (:func:`make_hf_cache`,
  :func:`hf_cache_nbytes`);
* :mod:`~walshkv.cache.factory`: :func:`make_cache` (either kind), :func:`check_spec_fits` (a spec against a
  model's config, before anything runs) and :func:`context_state`;
* :mod:`~walshkv.cache.recording`: :class:`RecordingCache`, how calibration and capture record K/V;
* :mod:`~walshkv.cache.introspect`: what any cache holds (:func:`footprint`, :func:`fp_bytes`,
  :func:`croppable_to_prefix`, :func:`prefill_is_exact`), the one way code above this package asks.
"""

from __future__ import annotations

from walshkv.cache.compressed import CompressedCache
from walshkv.cache.factory import check_spec_fits, context_state, make_cache
from walshkv.cache.fused import FUSED_ATTENTION, enable_fused_attention, fused_attention
from walshkv.cache.hf import hf_cache_nbytes, make_hf_cache
from walshkv.cache.introspect import Footprint, croppable_to_prefix, footprint, fp_bytes, prefill_is_exact
from walshkv.cache.kivi import KiviLayer, KiviSlidingWindowLayer
from walshkv.cache.layers import CompressedLayer, CompressedSlidingWindowLayer
from walshkv.cache.persist import CacheFileError, load_cache, save_cache
from walshkv.cache.recording import RecordingCache

__all__ = [
    "FUSED_ATTENTION",
    "CacheFileError",
    "CompressedCache",
    "CompressedLayer",
    "CompressedSlidingWindowLayer",
    "Footprint",
    "KiviLayer",
    "KiviSlidingWindowLayer",
    "RecordingCache",
    "check_spec_fits",
    "context_state",
    "croppable_to_prefix",
    "enable_fused_attention",
    "footprint",
    "fp_bytes",
    "fused_attention",
    "hf_cache_nbytes",
    "load_cache",
    "make_cache",
    "make_hf_cache",
    "prefill_is_exact",
    "save_cache",
]
