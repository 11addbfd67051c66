"""What a saved cache records to recognise its model and calibration, and the checksum over its bytes.

* :func:`model_identity` (from :mod:`walshkv.identity`, where calibration files use it too): the model's config
  class, layers, kv heads, head size, and a sha256 of its text config;
* :func:`calibration_digest`: a sha256 over what each layer's bound codecs took from calibration (K means,
  ``eq+`` transforms, RoPE tables, calibrated orders), ``None`` for a spec that needs none;
* :func:`checksum`: a sha256 over a header text and a dict of tensors (name, dtype, shape, bytes), in name order.

Used by :mod:`walshkv.cache.persist`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Any

import torch

from walshkv.cache.kivi import KiviLayer
from walshkv.codecs.base import Codec, unwrap, wrappers
from walshkv.identity import model_identity

if TYPE_CHECKING:
    from walshkv.cache.compressed import CompressedCache
    from walshkv.cache.layers import CompressedLayer

__all__ = ["calibration_digest", "checksum", "layer_codecs", "model_identity"]


def _feed(h: Any, value: Any) -> None:
    """Hash a codec attribute: tensors by bytes, dataclasses and sequences by parts; caches (dicts) skipped."""
    if isinstance(value, torch.Tensor):
        t = value.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            _feed(h, getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for v in value:
            _feed(h, v)
    elif value is None or isinstance(value, (bool, int, float, str)):
        h.update(repr(value).encode())


def layer_codecs(layer: CompressedLayer) -> tuple[Codec, Codec]:
    """The bound K and V codecs of a layer (KIVI's bound to their side)."""
    if isinstance(layer, KiviLayer):
        return layer.kivi_k, layer.kivi_v
    return layer.spec.k, layer.spec.v


def calibration_digest(cache: CompressedCache) -> str | None:
    """sha256 over what each layer's bound codecs took from calibration; ``None`` for an uncalibrated spec.

    Every wrapper and storing codec of each layer's K and V contributes its tensors (K means, ``eq+``
    transforms, RoPE tables, calibrated orders) and settings; lazily filled caches (dicts) are left out.
    """
    if not cache.cache_spec.needs_calibration:
        return None
    h = hashlib.sha256()
    for layer in cache.layers:
        for codec in layer_codecs(layer):  # type: ignore[arg-type]
            for part in (*wrappers(codec), unwrap(codec)):
                h.update(type(part).__name__.encode())
                for name, value in sorted(vars(part).items()):
                    if not isinstance(value, Codec):
                        h.update(name.encode())
                        _feed(h, value)
    return h.hexdigest()


def checksum(header_text: str, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over ``header_text`` then every tensor of ``tensors`` (name, dtype, shape, bytes) in name order."""
    h = hashlib.sha256(header_text.encode())
    for name in sorted(tensors):
        h.update(name.encode())
        _feed(h, tensors[name])
    return h.hexdigest()
