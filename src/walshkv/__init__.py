"""walshkv: compress transformer KV caches and measure honestly what it costs.

Tensor layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``. The package's map (which module
may import which) is docs/architecture.md.
"""

from walshkv._version import __version__
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
