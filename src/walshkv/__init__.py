"""walshkv: compress transformer KV caches and measure honestly what it costs.

Tensor layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``.
"""

from walshkv.codecs import CacheSpec, Codec, Packed, parse_cache_spec, parse_codec

__version__ = "0.1.0"

__all__ = [
    "CacheSpec",
    "Codec",
    "CompressedCache",
    "Packed",
    "__version__",
    "parse_cache_spec",
    "parse_codec",
]


def __getattr__(name: str):
    if name == "CompressedCache":
        from walshkv.cache import CompressedCache

        return CompressedCache
    raise AttributeError(f"module 'walshkv' has no attribute {name!r}")
