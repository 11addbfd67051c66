"""Hugging Face's ``QuantizedCache`` as a peer: built from an ``hf-*`` spec, its bytes counted as walshkv's.

transformers' own quantized cache (quanto or HQQ codes with a scale and zero point per group, or fp8)
runs through the same harness as :class:`~walshkv.cache.CompressedCache`; :func:`hf_cache_nbytes`
counts what it holds from its tensors, floating tensors at 16 bits as for an fp16 model.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import Cache, QuantizedCache

from walshkv.identity import head_dim_of

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from walshkv.codecs.spec import HFCacheSpec

__all__ = ["hf_cache_nbytes", "make_hf_cache"]


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


def make_hf_cache(spec: HFCacheSpec, config: PretrainedConfig) -> Cache:
    """Hugging Face's ``QuantizedCache`` for ``spec``, with walshkv's byte accounting attached.

    Raises:
        ImportError: the backend's package is missing (the message names the pip command).
        ValueError: the model has sliding-window layers (transformers' QuantizedCache refuses them).
    """
    package = spec.pip_package
    if package is not None:
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
    head_dim = head_dim_of(text)
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
