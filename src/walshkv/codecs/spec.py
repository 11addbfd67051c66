"""The one spec parser used by the CLI and the Python API: cache specs over registered codecs.

Grammar::

    SPEC       := ["sink:" N ":"] (CACHE_SPEC | "layers:" PARTS)  # N first tokens kept in fp16
    CACHE_SPEC := CODEC_SPEC | CODEC_SPEC "/" CODEC_SPEC        # K / V
                | "walshkv:" B                                  # a built-in preset (builtin_presets)
                | ("vllm:" | "lmcache:") NAME                   # an engine's own cache NAME (.vllm)
                | "hf-" ...                                     # Hugging Face's caches (.hf)
    PARTS      := (CACHE_SPEC "@" LAYERS ";")* CACHE_SPEC        # LAYERS like 0,1,28-29 or 0,1,-2,-1
    CODEC_SPEC := (WRAPPER "+")* BASE                           # wrappers in WRAPPER_ORDER
    WRAPPER    := "prerope" | "center" | "eq" | "rot" | "rrot" [":" SEED]
    BASE       := NAME [":" ARGS]                               # e.g. int4, fp16, tq:3

A single codec spec applies to both K and V. Codec and wrapper names come from the registry
(:mod:`.registry`: :func:`register_codec`, :func:`register_wrapper`, :func:`parse_codec`); the wrapper
order is :data:`walshkv.codecs.base.WRAPPER_ORDER`. This module re-exports the registry's and
:mod:`.hf`'s names, as it did before they moved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from walshkv.codecs.base import Codec
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.builtin_presets import builtin_preset_spec, check_preset_name
from walshkv.codecs.calibration import k_basis_of
from walshkv.codecs.hf import HF_BACKENDS, HFCacheSpec, parse_hf_spec
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.registry import (
    CodecFactory,
    WrapperFactory,
    available_codecs,
    codec_example,
    parse_codec,
    register_codec,
    register_wrapper,
)
from walshkv.codecs.vllm import engine_peer_spec, is_engine_peer
from walshkv.constants import MAX_LAYERS

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = [
    "HF_BACKENDS",
    "CacheSpec",
    "CodecFactory",
    "HFCacheSpec",
    "LayeredCacheSpec",
    "NamedSpec",
    "SpecLike",
    "WrapperFactory",
    "available_codecs",
    "check_spec_list",
    "codec_example",
    "name_spec",
    "parse_cache_spec",
    "parse_codec",
    "parse_hf_spec",
    "parse_layered_spec",
    "parse_sink_spec",
    "register_codec",
    "register_wrapper",
]


@dataclass(frozen=True)
class CacheSpec:
    """A K codec and a V codec, parsed from ``"KSPEC/VSPEC"`` or one shared ``"SPEC"``.

    ``sink:N:SPEC`` (``sink`` > 0) keeps the first ``N`` tokens of every full-attention layer in fp16
    (attention-sink tokens: the first token of a window draws much of every query's attention and is
    unlike the other tokens, so a low-bit codec tuned to the typical token hurts it most). Their bits
    count: see :meth:`bits_at`.
    """

    k: Codec
    v: Codec
    sink: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.sink, int) or self.sink < 0:
            raise ValueError(f"sink must be a whole number of tokens >= 0, got {self.sink!r}")

    @property
    def spec(self) -> str:
        body = self.k.spec if self.k.spec == self.v.spec else f"{self.k.spec}/{self.v.spec}"
        return f"sink:{self.sink}:{body}" if self.sink else body

    def bits_per_element(self, head_dim: int) -> float:
        """Mean stored bits per element over K and V together, per compressed token (sink tokens excluded:
        they are a fixed count, see :meth:`bits_at`)."""
        return (self.k.bits_per_element(head_dim) + self.v.bits_per_element(head_dim)) / 2

    def bits_at(self, head_dim: int, tokens: int, num_layers: int | None = None) -> float:
        """Mean stored bits per element of a context of ``tokens`` tokens, the fp16 sink tokens included.

        Args:
            head_dim: K/V head size.
            tokens: context length (e.g. the 512-token evaluation window).
            num_layers: the model's layer count (needed for ``layers:`` specs).
        """
        if tokens < 1:
            raise ValueError(f"tokens must be >= 1, got {tokens}")
        per_token = self._token_bits(head_dim, num_layers)
        held = min(self.sink, tokens)
        return (held * 16.0 + (tokens - held) * per_token) / tokens

    def _token_bits(self, head_dim: int, num_layers: int | None) -> float:
        return self.bits_per_element(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        self.k.check_head_dim(head_dim)
        self.v.check_head_dim(head_dim)

    @property
    def needs_calibration(self) -> bool:
        return self.k.needs_calibration or self.v.needs_calibration

    def bind(self, layer_idx: int, calibration: CalibrationLike | None = None) -> CacheSpec:
        """K and V codecs specialised for one layer (see :meth:`Codec.bind`)."""
        if self.needs_calibration and calibration is None:
            raise ValueError(
                f"cache spec {self.spec!r} is calibrated (center+ / order=variance / auto@BITS): pass calibration "
                "(CLI: --kv-mean-center FILE for center+, or --calib-text TEXT; API: "
                "calibration=collect_kv_stats(...) or read_kv_mean_center(...))"
            )
        if k_basis_of(calibration) == "pre-rope" and not isinstance(self.k, (PreRope, RopeBlock)):
            raise ValueError(
                f"this calibration holds K statistics before RoPE (made for a prerope+ spec); {self.spec!r} "
                "quantizes K after RoPE: calibrate for this spec (walshkv calibrate --preset / --calib-text)"
            )
        k = self.k.bind(layer_idx, "k", calibration)
        v = self.v.bind(layer_idx, "v", calibration)
        return self if (k is self.k and v is self.v) else CacheSpec(k, v, self.sink)


def _parse_layers(text: str, spec: str) -> frozenset[int]:
    """The layer indices of ``0,1,28-29`` (or ``0,1,-2,-1``: a negative index counts from the model's last layer, as
    in Python); every index and range end checked against :data:`MAX_LAYERS` first."""
    bounds: list[tuple[int, int]] = []
    for item in text.split(","):
        item = item.strip()
        try:
            if item.startswith("-"):  # one index from the end: -1 is the last layer
                a = b = int(item)
                if a >= 0:
                    raise ValueError
            elif "-" in item:
                a, b = (int(x) for x in item.split("-", 1))
                if b < a or a < 0:
                    raise ValueError
            else:
                a = b = int(item)
        except ValueError:
            raise ValueError(
                f"bad layer list {text!r} in {spec!r}: write layer indices and ranges like 0,1,28-29, and layers "
                "counted from the end one at a time, like -2,-1 (the last two)"
            ) from None
        if b >= MAX_LAYERS or a < -MAX_LAYERS:
            raise ValueError(
                f"layer {b if b >= MAX_LAYERS else a} in {spec!r} is past any model (walshkv reads layer indices "
                f"0..{MAX_LAYERS - 1}, or -1..-{MAX_LAYERS} from the end); name the model's own layers, e.g. "
                "0,1,28-29 for a 30-layer model"
            )
        bounds.append((a, b))
    return frozenset(i for a, b in bounds for i in range(a, b + 1))


@dataclass(frozen=True)
class LayeredCacheSpec(CacheSpec):
    """A cache spec per layer: ``layers:SPEC@LAYERS;SPEC@LAYERS;...;SPEC``.

    Each part is a plain cache spec (``KSPEC/VSPEC`` or one spec) for the listed layers (indices and
    ranges, ``0,1,28-29``); the last part has no ``@`` and covers every other layer. Example:
    ``layers:center+tq:5/tq:3@0,29;center+tq:4/tq:2.5`` gives layers 0 and 29 wider K and V. Per-layer
    widths are what ``walshkv recommend --per-layer`` chooses from measured layer sensitivities. A negative index
    counts from the model's end (``bf16@0,1,-2,-1``: the first two and the last two layers, whatever the depth, as
    vLLM's TurboQuant keeps them); such a spec is made concrete for one model by :meth:`resolve`, which the cache
    calls with the model's layer count.

    Attributes:
        k, v: the default (last) part's codecs, for code that inspects a spec's kind.
        parts: ``(CacheSpec, layers)`` pairs; ``layers`` is ``None`` for the default (last) part.
    """

    parts: tuple[tuple[CacheSpec, frozenset[int] | None], ...] = ()

    @property
    def spec(self) -> str:
        items = []
        for part, layers in self.parts:
            if layers is None:
                items.append(part.spec)
            else:
                items.append(f"{part.spec}@{_format_layers(layers)}")
        return (f"sink:{self.sink}:" if self.sink else "") + "layers:" + ";".join(items)

    @property
    def default(self) -> CacheSpec:
        return self.parts[-1][0]

    @property
    def counts_from_end(self) -> bool:
        """True if a part names a layer by a negative index (its layers depend on the model's depth)."""
        return any(layers is not None and min(layers) < 0 for _, layers in self.parts)

    def resolve(self, num_layers: int) -> LayeredCacheSpec:
        """This spec for a model of ``num_layers`` layers: negative indices turned into the model's own.

        Raises:
            ValueError: an index the model does not have, or a layer two parts claim once counted (``0`` and ``-2``
                on a two-layer model in different parts).
        """
        self.check_layers(num_layers)
        if not self.counts_from_end:
            return self
        parts: list[tuple[CacheSpec, frozenset[int] | None]] = []
        seen: set[int] = set()
        for part, layers in self.parts:
            if layers is not None:
                layers = frozenset(i % num_layers for i in layers)
                if seen & layers:
                    raise ValueError(
                        f"{self.spec!r} gives layer {min(seen & layers)} of this {num_layers}-layer model two specs "
                        "(an index and one counted from the end name the same layer): list it once"
                    )
                seen |= layers
            parts.append((part, layers))
        return replace(self, parts=tuple(parts))

    def for_layer(self, layer_idx: int) -> CacheSpec:
        """The plain spec of layer ``layer_idx``.

        Raises:
            ValueError: the spec counts layers from the end and is not resolved for a model yet (:meth:`resolve`).
        """
        if self.counts_from_end:
            raise ValueError(
                f"{self.spec!r} names layers counted from the model's end: resolve it for the model first "
                "(spec.resolve(num_layers); CompressedCache does this when given config=model.config)"
            )
        for part, layers in self.parts:
            if layers is None or layer_idx in layers:
                return part
        return self.default

    def bits_per_element(self, head_dim: int, num_layers: int | None = None) -> float:  # type: ignore[override]
        """Mean stored bits per element over K and V and over ``num_layers`` layers (all equal in size).

        Raises:
            ValueError: ``num_layers`` is needed (the default part's share depends on it) but missing.
        """
        if num_layers is None:
            raise ValueError(
                f"the bits per element of {self.spec!r} depend on the model's layer count; pass num_layers"
            )
        spec = self.resolve(num_layers)
        return sum(spec.for_layer(i).bits_per_element(head_dim) for i in range(num_layers)) / num_layers

    def _token_bits(self, head_dim: int, num_layers: int | None) -> float:
        return self.bits_per_element(head_dim, num_layers)

    def check_head_dim(self, head_dim: int) -> None:
        for part, _ in self.parts:
            part.check_head_dim(head_dim)

    def check_layers(self, num_layers: int) -> None:
        """Refuse layer indices the model does not have (``28`` or ``-31`` on a 30-layer model)."""
        listed = set().union(*(layers for _, layers in self.parts if layers is not None))
        if listed and (max(listed) >= num_layers or min(listed) < -num_layers):
            bad = max(listed) if max(listed) >= num_layers else min(listed)
            raise ValueError(
                f"{self.spec!r} names layer {bad}, but the model has {num_layers} layers (0..{num_layers - 1}, "
                f"or -1..-{num_layers} from the end)"
            )

    @property
    def needs_calibration(self) -> bool:
        return any(part.needs_calibration for part, _ in self.parts)

    def bind(self, layer_idx: int, calibration: CalibrationLike | None = None) -> CacheSpec:
        part = self.for_layer(layer_idx).bind(layer_idx, calibration)
        return replace(part, sink=self.sink) if self.sink else part


def _format_layers(layers: frozenset[int]) -> str:
    items, run = [], []
    for i in sorted(i for i in layers if i >= 0):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    items.extend(str(i) for i in sorted(i for i in layers if i < 0))  # counted from the end: one at a time
    return ",".join(items)


def parse_layered_spec(spec: str) -> LayeredCacheSpec:
    """Parse ``layers:SPEC@LAYERS;...;SPEC`` (see :class:`LayeredCacheSpec`)."""
    body = spec.strip()[len("layers:") :]
    items = [x.strip() for x in body.split(";") if x.strip()]
    if not items:
        raise ValueError(f"{spec!r}: write layers:SPEC@LAYERS;...;SPEC (the last part, without @, covers the rest)")
    parts: list[tuple[CacheSpec, frozenset[int] | None]] = []
    seen: set[int] = set()
    for n, item in enumerate(items):
        last = n == len(items) - 1
        if "@" in item:
            if last:
                raise ValueError(
                    f"{spec!r}: the last part covers every other layer and takes no @LAYERS; "
                    "end with a plain spec, e.g. ...;center+tq:4/tq:2.5"
                )
            text, at = item.rsplit("@", 1)
            layers: frozenset[int] | None = _parse_layers(at, spec)
            twice = seen & layers
            if twice:
                raise ValueError(f"{spec!r} lists layer {min(twice)} twice")
            seen |= layers
        else:
            if not last:
                raise ValueError(f"{spec!r}: every part but the last needs @LAYERS (e.g. tq:5@0,29)")
            text, layers = item, None
        if text.strip().lower().startswith("layers:"):  # checked before parsing: no nesting, no recursion
            raise ValueError(f"{spec[:80]!r}: layers: appears twice; write one list, layers:SPEC@LAYERS;...;SPEC")
        if text.strip().lower().startswith("sink:"):
            raise ValueError(f"{spec[:80]!r}: sink:N: applies to the whole cache; write it before layers:")
        part = parse_cache_spec(text)
        if not isinstance(part, CacheSpec):
            raise ValueError(f"{spec!r}: a layer's spec must be a walshkv spec, not {text!r}")
        if part.sink:
            raise ValueError(f"{spec!r}: sink:N: applies to the whole cache; write it before layers:")
        parts.append((part, layers))
    return LayeredCacheSpec(parts[-1][0].k, parts[-1][0].v, parts=tuple(parts))


_SINK = re.compile(r"^sink:(?P<n>[^:]*):(?P<rest>.*)$", re.IGNORECASE | re.DOTALL)


def parse_sink_spec(spec: str) -> CacheSpec:
    """Parse ``sink:N:SPEC``: ``SPEC`` with the first ``N`` tokens of each layer kept in fp16."""
    m = _SINK.match(spec.strip())
    if m is None:
        raise ValueError(f"{spec!r}: write sink:N:SPEC, e.g. sink:1:center+tq:4/tq:2.5")
    try:
        n = int(m["n"])
    except ValueError:
        n = -1
    if n < 1:
        raise ValueError(f"{spec!r}: N in sink:N:SPEC is a number of tokens >= 1 (sink:1:SPEC keeps the first token)")
    if m["rest"].strip().lower().startswith("sink:"):  # before parsing: no nesting, no recursion
        raise ValueError(f"{spec[:80]!r}: sink:N: appears twice; write it once, e.g. sink:1:center+tq:4/tq:2.5")
    inner = parse_cache_spec(m["rest"])
    if not isinstance(inner, CacheSpec):
        raise ValueError(f"{spec!r}: sink:N: wraps a walshkv spec, not Hugging Face's {inner.spec!r}")
    if inner.sink:
        raise ValueError(f"{spec!r}: sink:N: appears twice")
    if isinstance(inner.k, KiviCodec):
        raise ValueError(f"{spec!r}: KIVI specs keep their own full-precision window; sink:N: does not apply")
    return replace(inner, sink=n)


def check_spec_list(codecs: object, what: str = "cache specs") -> None:
    """Refuse a bare string where a list of specs is wanted (a string is iterable: ``"int4"`` would read as four).

    Args:
        codecs: what a config's ``codecs`` field was given.
        what: how the message names the items (``"cache specs"``, ``"cache specs or presets"``).

    Raises:
        ValueError: ``codecs`` is a string; the message shows the list to write instead.
    """
    if isinstance(codecs, str):
        raise ValueError(f"codecs is a list of {what}: give [{codecs!r}], not {codecs!r}")


@dataclass(frozen=True)
class NamedSpec:
    """One codec of a run as it was asked for, with the parsed spec it runs as.

    What a command keeps from its argument parser to its report: the spec object (parsed once, never parsed
    again from text) and the name a user knows it by, so a row can show both. ``spec.spec`` (:attr:`text`) is the
    one canonical string form, for files and JSON. :func:`name_spec` makes one without a model (a preset name
    gives its built-in spec); :func:`walshkv.presets.name_specs` resolves presets for a model and a calibration.

    Attributes:
        asked: the codec as given, stripped: ``"walshkv:3.5"``, ``"vllm:fp8"``, ``"rot+int4"``; a spec object
            given as such is named by its canonical text.
        spec: what runs.
        label: the name rows carry next to the spec: the preset's (``walshkv:3.5``) or the engine cache's
            (``vllm:fp8``), lower case; ``None`` for a plain spec.
        source: where a preset's spec came from (``built-in``, ``shipped:MODEL``, the calibration file that chose
            it); ``None`` for anything else.
        note: what a user should know about that choice (a model walshkv has not measured); ``""`` when nothing.
    """

    asked: str
    spec: CacheSpec | HFCacheSpec
    label: str | None = None
    source: str | None = None
    note: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, (CacheSpec, HFCacheSpec)):
            raise TypeError(f"NamedSpec.spec is a parsed spec (parse_cache_spec), got {type(self.spec).__name__}")

    @property
    def text(self) -> str:
        """The spec's canonical text (``spec.spec``): the form files, JSON and rows' ``codec`` carry."""
        return self.spec.spec


#: Anything that names a cache spec: its text, a parsed spec, or a :class:`NamedSpec`.
SpecLike = str | CacheSpec | HFCacheSpec | NamedSpec


def name_spec(codec: SpecLike) -> NamedSpec:
    """``codec`` as a :class:`NamedSpec`, without a model: a preset name stands for its built-in spec (as in
    :func:`parse_cache_spec`; :func:`walshkv.presets.name_specs` gives a model's own), an engine cache's name for
    the spec that stores what that cache stores; a spec object is named by its canonical text.

    Raises:
        ValueError: what :func:`parse_cache_spec` refuses.
        TypeError: ``codec`` is not text, a spec or a :class:`NamedSpec`.
    """
    if isinstance(codec, NamedSpec):
        return codec
    spec = parse_cache_spec(codec)
    if not isinstance(codec, str):
        return NamedSpec(spec.spec, spec)
    asked = codec.strip()
    if asked.lower().startswith("walshkv:"):
        return NamedSpec(asked, spec, label=check_preset_name(asked), source="built-in")
    if is_engine_peer(asked):
        return NamedSpec(asked, spec, label=asked.lower())
    return NamedSpec(asked, spec)


def parse_cache_spec(spec: SpecLike) -> CacheSpec | HFCacheSpec:
    """Parse ``"KSPEC/VSPEC"`` (e.g. ``"rot+int4/int3"``) or one spec for both K and V.

    ``hf-quanto:B``, ``hf-hqq:B`` and ``hf-fp8`` give an :class:`HFCacheSpec` (Hugging Face's own
    ``QuantizedCache``, run as a peer). ``walshkv:3``, ``walshkv:3.5`` and ``walshkv:4.5`` give the
    built-in spec of that preset (:mod:`walshkv.presets`; a calibration file can choose another:
    see :meth:`walshkv.cache.CompressedCache.from_preset`). ``vllm:turboquant_k3v4_nc`` and the other names of
    :data:`walshkv.codecs.vllm.VLLM_PEERS` give the spec that stores what that vLLM cache dtype stores, and
    ``lmcache:NAME`` (:data:`walshkv.codecs.vllm.LMCACHE_PEERS`) what that LMCache serde stores.

    A :class:`NamedSpec` gives the spec it holds; a parsed spec is returned as it is.
    """
    if isinstance(spec, (CacheSpec, HFCacheSpec)):
        return spec
    if isinstance(spec, NamedSpec):
        return spec.spec
    if not isinstance(spec, str):
        raise TypeError(f"a cache spec is a string like 'rot+int4/int3', got {type(spec).__name__}")
    if spec.strip().lower().startswith("sink:"):
        return parse_sink_spec(spec)
    if spec.strip().lower().startswith("layers:"):
        return parse_layered_spec(spec)
    if spec.strip().lower().startswith("hf-"):
        return parse_hf_spec(spec)
    if spec.strip().lower().startswith("walshkv:"):  # a built-in preset (builtin_presets)
        return parse_cache_spec(builtin_preset_spec(spec))
    if is_engine_peer(spec):  # vLLM's or LMCache's own quantized cache, emulated (.vllm)
        return parse_cache_spec(engine_peer_spec(spec))
    parts = spec.split("/")
    if len(parts) == 1:
        codec = parse_codec(parts[0])
        return CacheSpec(codec, codec)
    if len(parts) == 2:
        return CacheSpec(parse_codec(parts[0]), parse_codec(parts[1]))
    raise ValueError(f"a cache spec has at most one '/' (KSPEC/VSPEC), got {spec!r}")
