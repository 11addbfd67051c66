"""The one spec parser used by the CLI and the Python API.

Grammar::

    SPEC       := ["sink:" N ":"] (CACHE_SPEC | "layers:" PARTS)  # N first tokens kept in fp16
    CACHE_SPEC := CODEC_SPEC | CODEC_SPEC "/" CODEC_SPEC        # K / V
    CODEC_SPEC := (WRAPPER "+")* BASE
    WRAPPER    := "center" | "eq" | "rot" | "rrot" [":" SEED]
    BASE       := NAME [":" ARGS]                               # e.g. int4, fp16

A single codec spec applies to both K and V. New codecs join through
:func:`register_codec`, new wrappers through :func:`register_wrapper`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from walshkv.codecs.base import Codec
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.floats import FLOAT_CODECS, FloatCodec
from walshkv.codecs.ggml import GGML_BLOCK_BYTES, GGML_TYPES, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.kivi import KiviCodec, parse_kivi_args
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.turbo import parse_tq_args, parse_tqprod_args
from walshkv.codecs.vht2 import SqfreeCodec, VZCCodec, parse_vht2_args

__all__ = [
    "HF_BACKENDS",
    "CacheSpec",
    "HFCacheSpec",
    "LayeredCacheSpec",
    "available_codecs",
    "parse_cache_spec",
    "parse_codec",
    "parse_hf_spec",
    "parse_layered_spec",
    "parse_sink_spec",
    "register_codec",
    "register_wrapper",
]

CodecFactory = Callable[[str | None], Codec]
WrapperFactory = Callable[[str | None, Codec], Codec]

_CODECS: dict[str, tuple[CodecFactory, str]] = {}
_EXAMPLES: dict[str, str] = {}
_WRAPPERS: dict[str, tuple[WrapperFactory, str]] = {}


def _check_name(name: str) -> str:
    name = name.strip().lower()
    if not name or any(ch in name for ch in "+/:"):
        raise ValueError(f"a codec or wrapper name must be non-empty and free of '+', '/', ':', got {name!r}")
    return name


def register_codec(name: str, factory: CodecFactory, help: str, example: str | None = None) -> None:
    """Make ``name[:ARGS]`` parseable; ``factory(args_or_None)`` builds the codec.

    ``example`` is a full spec shown by ``walshkv codecs`` (default: the bare name).
    """
    name = _check_name(name)
    _EXAMPLES[name] = example or name
    _CODECS[name] = (factory, help)


def register_wrapper(name: str, factory: WrapperFactory, help: str) -> None:
    """Make ``name[:ARGS]+INNER`` parseable; ``factory(args_or_None, inner)`` wraps it."""
    name = _check_name(name)
    _WRAPPERS[name] = (factory, help)


def codec_example(name: str) -> str:
    """A parseable example spec for a registered codec name."""
    return _EXAMPLES.get(name, name)


def available_codecs() -> dict[str, str]:
    """Spec names with a one-line description (wrappers end in ``+``)."""
    out = {name: help for name, (_, help) in _CODECS.items()}
    out.update({f"{name}+": help for name, (_, help) in _WRAPPERS.items()})
    return out


def _no_args(name: str, args: str | None) -> None:
    if args is not None:
        raise ValueError(f"codec {name!r} takes no arguments, got {name}:{args}")


def _float_factory(name: str) -> CodecFactory:
    def make(args: str | None) -> Codec:
        _no_args(name, args)
        return FloatCodec(name)

    return make


def _int_factory(bits: int) -> CodecFactory:
    def make(args: str | None) -> Codec:
        _no_args(f"int{bits}", args)
        return IntCodec(bits)

    return make


def _seed(args: str | None) -> int:
    if args is None:
        return 0
    try:
        seed = int(args)
    except ValueError:
        raise ValueError(f"rrot takes an integer seed (rrot:7+int4), got {args!r}") from None
    if not -(2**63) <= seed < 2**64:
        raise ValueError(f"rrot seeds must be in -2**63 .. 2**64-1, got {seed}")
    return seed


for _name in FLOAT_CODECS:
    register_codec(_name, _float_factory(_name), f"stored as {_name}")
for _bits in range(2, 9):
    register_codec(
        f"int{_bits}",
        _int_factory(_bits),
        f"symmetric RTN, {_bits}-bit codes packed, one fp16 scale per vector",
    )
register_codec(
    "vht2",
    parse_vht2_args,
    "banded Walsh-Hadamard: vht2:B1,..,Bn[:order=natural|sequency|squarefree|squarefree-dc|variance][:sk=N], "
    "or vht2:auto@BITS",
    example="vht2:5,5,4,3",
)


def _vzc(args: str | None) -> Codec:
    _no_args("vzc", args)
    return VZCCodec()


def _sqfree(args: str | None) -> Codec:
    try:
        return SqfreeCodec(int(args or ""))
    except ValueError:
        raise ValueError(f"sqfree takes a bit width 1..8 (sqfree:4), got {args!r}") from None


register_codec("vzc", _vzc, "sign bitmap of WHT coefficients + fp16 mean-|y| scale per index class mod 3")
register_codec("sqfree", _sqfree, "only squarefree-indexed WHT coefficients at B bits (sqfree:B)", example="sqfree:4")
register_wrapper(
    "rot",
    lambda args, inner: (_no_args("rot", args), Rotated(inner))[1],
    "orthonormal Walsh-Hadamard rotation over head_dim (power of two)",
)
register_wrapper(
    "center",
    lambda args, inner: (_no_args("center", args), Centered(inner))[1],
    "subtract a calibrated per-(layer, head, channel) K mean first (K only; --kv-mean-center FILE)",
)
register_wrapper(
    "eq",
    lambda args, inner: (_no_args("eq", args), Equalized(inner))[1],
    "calibrated query-weighted K transform before the codec (K only; write center+eq+SPEC)",
)
register_wrapper(
    "prerope",
    lambda args, inner: (_no_args("prerope", args), PreRope(inner))[1],
    "quantize K before RoPE, re-applying it when read (K only, outermost: prerope+center+eq+SPEC)",
)
register_wrapper(
    "rrot",
    lambda args, inner: Rotated(inner, seed=_seed(args)),
    "randomized Hadamard: seeded sign flips then rotation (rrot:SEED+...)",
)


def _split_name(token: str) -> tuple[str, str | None]:
    name, sep, args = token.partition(":")
    return name.strip().lower(), (args if sep else None)


def _valid_list() -> str:
    bases = ", ".join(_CODECS)
    wrappers = ", ".join(f"{w}+" for w in _WRAPPERS)
    return f"codecs: {bases}; wrappers: {wrappers}"


def parse_codec(spec: str) -> Codec:
    """Parse one codec spec such as ``"int4"``, ``"rot+int3"`` or ``"rrot:3+int2"``.

    Raises:
        ValueError: unknown names or bad arguments; the message lists valid names.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty codec spec; {_valid_list()}")
    tokens = spec.strip().split("+")
    base_name, base_args = _split_name(tokens[-1])
    if base_name not in _CODECS:
        hint = ""
        if base_name in _WRAPPERS:
            hint = f" ('{base_name}' is a wrapper: write '{base_name}+int4')"
        raise ValueError(f"unknown codec {tokens[-1]!r} in {spec!r}{hint}; {_valid_list()}")
    codec = _CODECS[base_name][0](base_args)
    for i, token in reversed(list(enumerate(tokens[:-1]))):
        name, args = _split_name(token)
        if name not in _WRAPPERS:
            raise ValueError(f"unknown wrapper {token!r}+ in {spec!r}; {_valid_list()}")
        if name == "prerope" and i > 0:
            fixed = "+".join(["prerope", *(t for t in tokens if _split_name(t)[0] != "prerope")])
            raise ValueError(f"prerope+ must be the first wrapper (it sees K as the cache does): write {fixed}")
        codec = _WRAPPERS[name][0](args, codec)
    return codec


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

    def bind(self, layer_idx: int, calibration: Any = None) -> CacheSpec:
        """K and V codecs specialised for one layer (see :meth:`Codec.bind`)."""
        if self.needs_calibration and calibration is None:
            raise ValueError(
                f"cache spec {self.spec!r} is calibrated (center+ / order=variance / auto@BITS): pass calibration "
                "(CLI: --kv-mean-center FILE for center+, or --calib-text TEXT; API: "
                "calibration=collect_kv_stats(...) or read_kv_mean_center(...))"
            )
        if getattr(calibration, "k_basis", "post-rope") == "pre-rope" and not isinstance(self.k, PreRope):
            raise ValueError(
                f"this calibration holds K statistics before RoPE (made for a prerope+ spec); {self.spec!r} "
                "quantizes K after RoPE: calibrate for this spec (walshkv calibrate --preset / --calib-text)"
            )
        k = self.k.bind(layer_idx, "k", calibration)
        v = self.v.bind(layer_idx, "v", calibration)
        return self if (k is self.k and v is self.v) else CacheSpec(k, v, self.sink)


def _parse_layers(text: str, spec: str) -> frozenset[int]:
    out: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        try:
            if "-" in item:
                a, b = (int(x) for x in item.split("-", 1))
                if b < a:
                    raise ValueError
                out.update(range(a, b + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise ValueError(
                f"bad layer list {text!r} in {spec!r}: write layer indices and ranges like 0,1,28-29"
            ) from None
    if min(out) < 0:
        raise ValueError(f"layer indices are >= 0, got {text!r} in {spec!r}")
    return frozenset(out)


@dataclass(frozen=True)
class LayeredCacheSpec(CacheSpec):
    """A cache spec per layer: ``layers:SPEC@LAYERS;SPEC@LAYERS;...;SPEC``.

    Each part is a plain cache spec (``KSPEC/VSPEC`` or one spec) for the listed layers (indices and
    ranges, ``0,1,28-29``); the last part has no ``@`` and covers every other layer. Example:
    ``layers:center+tq:5/tq:3@0,29;center+tq:4/tq:2.5`` gives layers 0 and 29 wider K and V. Per-layer
    widths are what ``walshkv recommend --per-layer`` chooses from measured layer sensitivities.

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

    def for_layer(self, layer_idx: int) -> CacheSpec:
        """The plain spec of layer ``layer_idx``."""
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
        return sum(self.for_layer(i).bits_per_element(head_dim) for i in range(num_layers)) / num_layers

    def _token_bits(self, head_dim: int, num_layers: int | None) -> float:
        return self.bits_per_element(head_dim, num_layers)

    def check_head_dim(self, head_dim: int) -> None:
        for part, _ in self.parts:
            part.check_head_dim(head_dim)

    def check_layers(self, num_layers: int) -> None:
        """Refuse layer indices the model does not have."""
        listed = set().union(*(layers for _, layers in self.parts if layers is not None))
        if listed and max(listed) >= num_layers:
            raise ValueError(
                f"{self.spec!r} names layer {max(listed)}, but the model has {num_layers} layers (0..{num_layers - 1})"
            )

    @property
    def needs_calibration(self) -> bool:
        return any(part.needs_calibration for part, _ in self.parts)

    def bind(self, layer_idx: int, calibration: Any = None) -> CacheSpec:
        part = self.for_layer(layer_idx).bind(layer_idx, calibration)
        return replace(part, sink=self.sink) if self.sink else part


def _format_layers(layers: frozenset[int]) -> str:
    items, run = [], []
    for i in sorted(layers):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [i]
    if run:
        items.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
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
    inner = parse_cache_spec(m["rest"])
    if not isinstance(inner, CacheSpec):
        raise ValueError(f"{spec!r}: sink:N: wraps a walshkv spec, not Hugging Face's {inner.spec!r}")
    if inner.sink:
        raise ValueError(f"{spec!r}: sink:N: appears twice")
    if isinstance(inner.k, KiviCodec):
        raise ValueError(f"{spec!r}: KIVI specs keep their own full-precision window; sink:N: does not apply")
    return replace(inner, sink=n)


def parse_cache_spec(spec: str | CacheSpec | HFCacheSpec) -> CacheSpec | HFCacheSpec:
    """Parse ``"KSPEC/VSPEC"`` (e.g. ``"rot+int4/int3"``) or one spec for both K and V.

    ``hf-quanto:B``, ``hf-hqq:B`` and ``hf-fp8`` give an :class:`HFCacheSpec` (Hugging Face's own
    ``QuantizedCache``, run as a peer). ``walshkv:3``, ``walshkv:3.5`` and ``walshkv:4.5`` give the
    built-in spec of that preset (:mod:`walshkv.presets`; a calibration file can choose another:
    see :meth:`walshkv.cache.CompressedCache.from_preset`).
    """
    if isinstance(spec, (CacheSpec, HFCacheSpec)):
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"a cache spec is a string like 'rot+int4/int3', got {type(spec).__name__}")
    if spec.strip().lower().startswith("sink:"):
        return parse_sink_spec(spec)
    if spec.strip().lower().startswith("layers:"):
        return parse_layered_spec(spec)
    if spec.strip().lower().startswith("hf-"):
        return parse_hf_spec(spec)
    if spec.strip().lower().startswith("walshkv:"):  # a built-in preset (walshkv.presets)
        from walshkv.presets import resolve_preset

        return parse_cache_spec(resolve_preset(spec).spec)
    parts = spec.split("/")
    if len(parts) == 1:
        codec = parse_codec(parts[0])
        return CacheSpec(codec, codec)
    if len(parts) == 2:
        return CacheSpec(parse_codec(parts[0]), parse_codec(parts[1]))
    raise ValueError(f"a cache spec has at most one '/' (KSPEC/VSPEC), got {spec!r}")


# ---- llama.cpp KV-cache block types (walshkv.codecs.ggml) -----------------------------------------


def _ggml_factory(name: str) -> CodecFactory:
    def make(args: str | None) -> Codec:
        _no_args(name, args)
        return GGMLCodec(name)

    return make


for _name in GGML_TYPES:
    register_codec(
        _name,
        _ggml_factory(_name),
        f"llama.cpp {_name.upper()} blocks of 32 along head_dim, {GGML_BLOCK_BYTES[_name]} bytes each, "
        "byte-exact with ggml (head_dim a multiple of 32)",
    )


# ---- TurboQuant-class codecs (walshkv.codecs.turbo) -----------------------------------------------

register_codec(
    "tq",
    parse_tq_args,
    "TurboQuant MSE: randomized Hadamard rotation, fp16 norm, Lloyd-Max codes per coordinate "
    "(tq:B, B in 1..8 or a half width like 2.5; [:codebook=gauss|beta][:seed=N])",
    example="tq:3",
)
register_codec(
    "tqprod",
    parse_tqprod_args,
    "TurboQuant-prod: tq:(B-1) plus a 1-bit QJL sketch of the residual and its fp16 norm; unbiased inner "
    "products (tqprod:B, B in 1..8 or 2.5..7.5)",
    example="tqprod:3",
)


def _kivi_factory(bits: int) -> CodecFactory:
    def make(args: str | None) -> Codec:
        return parse_kivi_args(bits, args)

    return make


for _kb in (2, 4):
    register_codec(
        f"kivi{_kb}",
        _kivi_factory(_kb),
        f"KIVI {_kb}-bit: asymmetric, K per channel over groups of G tokens, V per token, fp16 window of R "
        "recent tokens (kivi2:g=32:r=32)",
    )


# ---- Hugging Face QuantizedCache as a peer (built by walshkv.cache.make_cache) --------------------

# name -> (transformers backend, allowed bits, pip package that provides it)
HF_BACKENDS: dict[str, tuple[str, tuple[int, ...], str | None]] = {
    "hf-quanto": ("quanto", (2, 4), "optimum-quanto"),
    "hf-hqq": ("hqq", (1, 2, 3, 4, 8), "hqq"),
    "hf-fp8": ("fp8", (8,), None),
}
# HQQ packs 3-bit codes ten to an int32; the others pack into bytes.
_HF_CODES_PER_WORD = {1: (8, 8), 2: (4, 8), 3: (10, 32), 4: (2, 8), 8: (1, 8)}


@dataclass(frozen=True)
class HFCacheSpec:
    """Hugging Face's ``QuantizedCache`` as a peer: ``hf-quanto:B``, ``hf-hqq:B``, ``hf-fp8``.

    Grammar: ``hf-quanto:B[:g=G][:r=R]`` (B in 2, 4), ``hf-hqq:B[:g=G][:r=R]`` (B in 1, 2, 3, 4, 8),
    ``hf-fp8`` (per-tensor float8 e4m3, scale frozen at the first write). ``g`` is transformers'
    ``q_group_size`` (default 64) and ``r`` its ``residual_length`` (default 128): up to ``r`` recent
    tokens stay in full precision and are re-quantized together with the whole cache when the window
    fills. Like transformers, the first write (the prompt) is returned to attention unquantized, so
    ``walshkv eval`` feeds these caches one scored token at a time (``feed="decode"``).

    Attributes:
        backend: ``quanto``, ``hqq`` or ``fp8``.
        bits: code width.
        group: elements per scale/zero-point group.
        residual: full-precision window in tokens (0 for fp8).
    """

    backend: str
    bits: int
    group: int = 64
    residual: int = 128

    @property
    def spec(self) -> str:
        if self.backend == "fp8":
            return "hf-fp8"
        out = f"hf-{self.backend}:{self.bits}"
        if self.group != 64:
            out += f":g={self.group}"
        if self.residual != 128:
            out += f":r={self.residual}"
        return out

    @property
    def needs_calibration(self) -> bool:
        return False

    @property
    def pip_package(self) -> str | None:
        return HF_BACKENDS[f"hf-{self.backend}"][2]

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per element of the quantized part (residual window excluded), fp16 scale and zero."""
        if self.backend == "fp8":
            return 8.0
        per, word = _HF_CODES_PER_WORD[self.bits] if self.backend == "hqq" else (8 // self.bits, 8)
        code_bits = word * -(-self.group // per) / self.group
        return code_bits + 2 * 16 / self.group

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")

    def bind(self, layer_idx: int, calibration: Any = None) -> HFCacheSpec:
        return self


def parse_hf_spec(spec: str) -> HFCacheSpec:
    """Parse ``hf-quanto:B[:g=G][:r=R]``, ``hf-hqq:B[:g=G][:r=R]`` or ``hf-fp8``."""
    name, _, rest = spec.strip().lower().partition(":")
    if name not in HF_BACKENDS:
        raise ValueError(f"unknown Hugging Face cache {spec!r}; choose from {', '.join(HF_BACKENDS)}")
    backend, allowed, _ = HF_BACKENDS[name]
    parts = [p for p in rest.split(":") if p] if rest else []
    if backend == "fp8":
        if parts:
            raise ValueError(f"'hf-fp8' takes no arguments (per-tensor scale, no window), got {spec!r}")
        return HFCacheSpec("fp8", 8, group=0, residual=0)
    if not parts or not parts[0].isdigit() or int(parts[0]) not in allowed:
        raise ValueError(f"{name} needs a width from {allowed}, e.g. '{name}:{allowed[-2]}'; got {spec!r}")
    opts = {"g": 64, "r": 128}
    for p in parts[1:]:
        key, eq, val = p.partition("=")
        if key not in opts or not eq or not val.isdigit():
            raise ValueError(f"bad option {p!r} in {spec!r}: use g=GROUP (scale group size) and r=TOKENS (window)")
        opts[key] = int(val)
    if opts["g"] < 1 or opts["r"] < 1:
        raise ValueError(f"g and r must be at least 1 in {spec!r}")
    return HFCacheSpec(backend, int(parts[0]), group=opts["g"], residual=opts["r"])
