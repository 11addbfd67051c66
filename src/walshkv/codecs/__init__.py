"""K/V codecs: one file per method, registered in :mod:`.registry`, composed by spec strings (:mod:`.spec`).

The contract (docs/architecture.md, "The codec contract"): :class:`Codec` (a frozen dataclass whose ``spec``
derives from its fields; ``layout``, ``encode(x, start)``, ``decode(packed, start)``, ``bind(layer, kind,
calibration)``), :class:`Wrapper` (``inner``, ``unwrap()``, its slot in :data:`WRAPPER_ORDER`), :class:`Packed` and
:class:`Field`; what ``bind`` reads is typed by the protocols of :mod:`.calibration`.
"""

from walshkv.codecs.base import (
    WRAPPER_ORDER,
    Codec,
    Field,
    Packed,
    Wrapper,
    check_kv,
    checks_on_device,
    find_wrapper,
    rewrap,
    unwrap,
    wrappers,
)
from walshkv.codecs.calibration import Calibration, CalibrationLike, Statistics
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.ggml import GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import (
    CacheSpec,
    HFCacheSpec,
    NamedSpec,
    SpecLike,
    available_codecs,
    check_spec_list,
    name_spec,
    parse_cache_spec,
    parse_codec,
    register_codec,
    register_wrapper,
)

__all__ = [
    "WRAPPER_ORDER",
    "CacheSpec",
    "Calibration",
    "CalibrationLike",
    "Codec",
    "Field",
    "FloatCodec",
    "GGMLCodec",
    "HFCacheSpec",
    "IntCodec",
    "NamedSpec",
    "Packed",
    "Rotated",
    "SpecLike",
    "Statistics",
    "Wrapper",
    "available_codecs",
    "check_kv",
    "check_spec_list",
    "checks_on_device",
    "find_wrapper",
    "name_spec",
    "parse_cache_spec",
    "parse_codec",
    "register_codec",
    "register_wrapper",
    "rewrap",
    "unwrap",
    "wrappers",
]
