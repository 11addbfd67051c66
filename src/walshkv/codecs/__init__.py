"""K/V codecs: one file per method, composed by spec strings (see :mod:`.spec`)."""

from walshkv.codecs.base import Codec, Field, Packed, check_kv
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.ggml import GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import (
    CacheSpec,
    HFCacheSpec,
    available_codecs,
    parse_cache_spec,
    parse_codec,
    register_codec,
    register_wrapper,
)

__all__ = [
    "CacheSpec",
    "Codec",
    "Field",
    "FloatCodec",
    "GGMLCodec",
    "HFCacheSpec",
    "IntCodec",
    "Packed",
    "Rotated",
    "available_codecs",
    "check_kv",
    "parse_cache_spec",
    "parse_codec",
    "register_codec",
    "register_wrapper",
]
