"""walshkv: compress transformer KV caches and measure honestly what it costs.

Tensor layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``. The package's map (which module
may import which) is docs/architecture.md.

The facade is lazy (PEP 562): ``import walshkv.codecs`` (or ``walshkv.ops``, ``walshkv.attention``) loads
only those layers and so does not need transformers; ``from walshkv import CompressedCache`` imports
:mod:`walshkv.cache` (and transformers) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from walshkv._version import __version__

if TYPE_CHECKING:
    from walshkv.cache import CompressedCache
    from walshkv.codecs import CacheSpec, Codec, Packed, parse_cache_spec, parse_codec

__all__ = [
    "CacheSpec",
    "Codec",
    "CompressedCache",
    "Packed",
    "__version__",
    "parse_cache_spec",
    "parse_codec",
]

#: Where each lazily exported name lives (the module is imported on first access).
_LAZY: dict[str, str] = {
    "CacheSpec": "walshkv.codecs",
    "Codec": "walshkv.codecs",
    "CompressedCache": "walshkv.cache",
    "Packed": "walshkv.codecs",
    "parse_cache_spec": "walshkv.codecs",
    "parse_codec": "walshkv.codecs",
}


def __getattr__(name: str) -> object:
    """Import the module that defines ``name`` on first access and cache the name here (PEP 562)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'walshkv' has no attribute {name!r}; the public names are {__all__}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
