"""The codec registry: spec names, their factories, and :func:`parse_codec` for one ``CODEC_SPEC``.

Every built-in codec and wrapper is registered here, one ``register_codec`` / ``register_wrapper`` line
each (the list at the bottom); the order of the lines is the order ``walshkv codecs`` prints. A new codec
adds its file and one line here (docs/architecture.md, "Adding a codec"); code outside walshkv registers its own
with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from walshkv.codecs.base import Codec, Wrapper, check_wrapper_order
from walshkv.codecs.blockrope import RopeAveragedEqualized, RopeBlock
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import DiagonalEqualized, Equalized
from walshkv.codecs.floats import FLOAT_CODECS, FloatCodec
from walshkv.codecs.ggml import GGML_BLOCK_BYTES, GGML_TYPES, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.kivi import parse_kivi_args
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.trellis import parse_tcq_args
from walshkv.codecs.turbo import parse_tq_args, parse_tqprod_args
from walshkv.codecs.vht2 import SqfreeCodec, VZCCodec, parse_vht2_args
from walshkv.codecs.vllm import VllmFp8, VllmInt4, parse_lmcache_tq_args, parse_vllm_tq_args, parse_vllm_uq_args
from walshkv.constants import MAX_WRAPPERS

__all__ = [
    "CodecFactory",
    "WrapperFactory",
    "available_codecs",
    "codec_example",
    "no_args",
    "parse_codec",
    "register_codec",
    "register_wrapper",
    "registered_codecs",
    "registered_wrappers",
]

#: ``factory(args)`` builds a codec from the text after ``NAME:`` (``None`` if there is no ``:``).
CodecFactory = Callable[[str | None], Codec]
#: ``factory(args, inner)`` wraps ``inner``.
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
    """Make ``name[:ARGS]+INNER`` parseable; ``factory(args_or_None, inner)`` wraps it.

    The wrapper's class needs a slot in :data:`walshkv.codecs.base.WRAPPER_ORDER` (its constructor checks it).
    """
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


def registered_codecs() -> tuple[str, ...]:
    """The registered codec names (no wrappers), in registration order."""
    return tuple(_CODECS)


def registered_wrappers() -> tuple[str, ...]:
    """The registered wrapper names (``rot``, ``rrot``, ``center``, ...), in registration order."""
    return tuple(_WRAPPERS)


def no_args(name: str, args: str | None) -> None:
    """Refuse arguments for a codec or wrapper that takes none (``int4:3``)."""
    if args is not None:
        raise ValueError(f"codec {name!r} takes no arguments, got {name}:{args}")


def _split_name(token: str) -> tuple[str, str | None]:
    name, sep, args = token.partition(":")
    return name.strip().lower(), (args if sep else None)


def _valid_list() -> str:
    bases = ", ".join(_CODECS)
    wrappers = ", ".join(f"{w}+" for w in _WRAPPERS)
    return f"codecs: {bases}; wrappers: {wrappers}"


def parse_codec(spec: str) -> Codec:
    """Parse one codec spec such as ``"int4"``, ``"rot+int3"`` or ``"rrot:3+int2"``.

    Wrappers are built inside out; each checks its place in :data:`walshkv.codecs.base.WRAPPER_ORDER`.

    Raises:
        ValueError: unknown names, bad arguments or wrappers out of order; the message lists valid names
            or the spec written in order.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"empty codec spec; {_valid_list()}")
    tokens = spec.strip().split("+")
    if len(tokens) - 1 > MAX_WRAPPERS:
        raise ValueError(
            f"{spec[:60]!r}{'...' if len(spec) > 60 else ''} chains {len(tokens) - 1} wrappers; a codec takes at "
            f"most {MAX_WRAPPERS} (prerope+, center+ and eq+ once each, then a rotation: prerope+center+eq+rot+int4)"
        )
    base_name, base_args = _split_name(tokens[-1])
    if base_name not in _CODECS:
        hint = ""
        if base_name in _WRAPPERS:
            hint = f" ('{base_name}' is a wrapper: write '{base_name}+int4')"
        raise ValueError(f"unknown codec {tokens[-1]!r} in {spec!r}{hint}; {_valid_list()}")
    base = _CODECS[base_name][0](base_args)
    factories: list[tuple[WrapperFactory, str | None]] = []
    for token in reversed(tokens[:-1]):
        name, args = _split_name(token)
        if name not in _WRAPPERS:
            raise ValueError(f"unknown wrapper {token!r}+ in {spec!r}; {_valid_list()}")
        factories.append((_WRAPPERS[name][0], args))
    # each wrapper alone around the base codec (arguments checked, inside out), then the whole order at once
    alone = [make(args, base) for make, args in factories]
    check_wrapper_order([w for w in reversed(alone) if isinstance(w, Wrapper)], base.spec)
    codec = base
    for make, args in factories:
        codec = make(args, codec)
    return codec


# ---- factories of the built-in codecs -------------------------------------------------------------------


def _plain(name: str, make: Callable[[], Codec]) -> CodecFactory:
    """A factory for a codec that takes no arguments."""

    def factory(args: str | None) -> Codec:
        no_args(name, args)
        return make()

    return factory


def _sqfree(args: str | None) -> Codec:
    try:
        return SqfreeCodec(int(args or ""))
    except ValueError:
        raise ValueError(f"sqfree takes a bit width 1..8 (sqfree:4), got {args!r}") from None


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


def _count(name: str, args: str | None, what: str, example: str) -> int:
    """A wrapper's positive integer argument, or an error that shows how to write it."""
    try:
        value = int(args) if args is not None else 0
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} takes {what} >= 1 ({example}), got {args!r}")
    return value


def _eqr(args: str | None, inner: Codec) -> Codec:
    """``eqr``, ``eqr:L`` or ``eqr:L:Q`` (``Q`` a number of positions or ``inf``)."""
    if args is None:
        return RopeAveragedEqualized(inner)
    head, _, q_arg = args.partition(":")
    what, example = "a number of positions (then optionally the query's: a number or inf)", "eqr:64+tq:3"
    length = _count("eqr", head, what, example)
    if not q_arg:
        return RopeAveragedEqualized(inner, length=length)
    return RopeAveragedEqualized(
        inner, length=length, q_length=0 if q_arg == "inf" else _count("eqr", q_arg, what, example)
    )


def _wrapper(name: str, cls: Callable[[Codec], Codec]) -> WrapperFactory:
    """A factory for a wrapper that takes no arguments."""

    def factory(args: str | None, inner: Codec) -> Codec:
        no_args(name, args)
        return cls(inner)

    return factory


# ---- the built-in codecs and wrappers, one line each (this order is the order `walshkv codecs` prints) ----

for _name in FLOAT_CODECS:
    register_codec(_name, _plain(_name, partial(FloatCodec, _name)), f"stored as {_name}")
for _bits in range(2, 9):
    register_codec(
        f"int{_bits}",
        _plain(f"int{_bits}", partial(IntCodec, _bits)),
        f"symmetric RTN, {_bits}-bit codes packed, one fp16 scale per vector",
    )
register_codec(
    "vht2",
    parse_vht2_args,
    "banded Walsh-Hadamard: vht2:B1,..,Bn[:order=natural|sequency|squarefree|squarefree-dc|variance][:sk=N], "
    "or vht2:auto@BITS",
    example="vht2:5,5,4,3",
)
register_codec(
    "vzc", _plain("vzc", VZCCodec), "sign bitmap of WHT coefficients + fp16 mean-|y| scale per index class mod 3"
)
register_codec("sqfree", _sqfree, "only squarefree-indexed WHT coefficients at B bits (sqfree:B)", example="sqfree:4")
register_wrapper("rot", _wrapper("rot", Rotated), "orthonormal Walsh-Hadamard rotation over head_dim (power of two)")
register_wrapper(
    "center",
    _wrapper("center", Centered),
    "subtract a calibrated per-(layer, head, channel) K mean first (K only; --kv-mean-center FILE)",
)
register_wrapper(
    "eq",
    _wrapper("eq", Equalized),
    "calibrated query-weighted K transform before the codec (K only; write center+eq+SPEC)",
)
register_wrapper(
    "eqd",
    _wrapper("eqd", DiagonalEqualized),
    "eq+ with a diagonal transform, one factor per channel (keeps prerope+ keys on the kernel's fast "
    "Walsh-Hadamard map; write center+eqd+SPEC)",
)
register_wrapper(
    "prerope",
    _wrapper("prerope", PreRope),
    "quantize K before RoPE, re-applying it when read (K only, outermost: prerope+center+eq+SPEC)",
)
register_wrapper(
    "ropeblock",
    lambda args, inner: RopeBlock(
        inner, block=_count("ropeblock", args, "a block of positions", "ropeblock:64+eqr:64+tq:3")
    ),
    "K in the block frame: turned back by its block's first position, centred by the mean turned to its offset "
    "(K only, outermost: ropeblock:G+eqr:G+SPEC; no per-key map at decode)",
)
register_wrapper(
    "eqr",
    lambda args, inner: _eqr(args, inner),
    "eq+ fitted after RoPE to K/query moments averaged over L positions (K only: eqr:L[:Q]+SPEC, Q a number or "
    "inf; inside ropeblock:G+ write eqr:G+)",
)
register_wrapper(
    "rrot",
    lambda args, inner: Rotated(inner, seed=_seed(args)),
    "randomized Hadamard: seeded sign flips then rotation (rrot:SEED+...)",
)
for _name in GGML_TYPES:
    register_codec(
        _name,
        _plain(_name, partial(GGMLCodec, _name)),
        f"llama.cpp {_name.upper()} blocks of 32 along head_dim, {GGML_BLOCK_BYTES[_name]} bytes each, "
        "byte-exact with ggml (head_dim a multiple of 32)",
    )
register_codec(
    "tq",
    parse_tq_args,
    "TurboQuant MSE: randomized Hadamard rotation, fp16 norm, Lloyd-Max codes per coordinate "
    "(tq:B, B in 1..8 or a half width like 2.5; [:codebook=gauss|beta][:seed=N][:norm=8: the norm as a log byte])",
    example="tq:3",
)
register_codec(
    "tqprod",
    parse_tqprod_args,
    "TurboQuant-prod: tq:(B-1) plus a 1-bit QJL sketch of the residual and its fp16 norm; unbiased inner "
    "products (tqprod:B, B in 1..8 or 2.5..7.5)",
    example="tqprod:3",
)
register_codec(
    "tcq",
    parse_tcq_args,
    "tq's rotation and fp16 norm with a tail-biting bitshift trellis code of 2**L states in place of the scalar "
    "quantizer (tcq:B, B in 1..5 or a half width like 2.5; [:L=8][:seed=N][:norm=8][:tables=2])",
    example="tcq:3",
)
for _bits in (2, 4):
    register_codec(
        f"kivi{_bits}",
        partial(parse_kivi_args, _bits),
        f"KIVI {_bits}-bit: asymmetric, K per channel over groups of G tokens, V per token, fp16 window of R "
        "recent tokens (kivi2:g=32:r=32)",
    )
register_codec(
    "vllm-tq",
    parse_vllm_tq_args,
    "vLLM 0.32 TurboQuant keys: fp16 norm, Sylvester Hadamard, Lloyd-Max codes for N(0, 1/d); :nc rescales the "
    "decoded centroids to unit norm (vllm-tq:B[:nc], B in 3, 4)",
    example="vllm-tq:3:nc",
)
register_codec(
    "vllm-uq",
    parse_vllm_uq_args,
    "vLLM 0.32 TurboQuant values: asymmetric min-max codes, fp16 scale and minimum (vllm-uq:B, B in 3, 4)",
    example="vllm-uq:4",
)
register_codec(
    "vllm-fp8", _plain("vllm-fp8", VllmFp8), "vLLM 0.32 turboquant_k8v4 keys: float8 e4m3 cast, saturating, no scale"
)
register_codec(
    "vllm-int4",
    _plain("vllm-int4", VllmInt4),
    "vLLM 0.32 int4_per_token_head: fixed-sign Hadamard, asymmetric int4, fp32 scale holding the zero point",
)
register_codec(
    "lmcache-tq",
    parse_lmcache_tq_args,
    "LMCache 0.5.6 TurboQuant keys: vllm-tq with each layer's rotation H diag(s), signs seeded 42 + 1337 * layer "
    "(lmcache-tq:B[:nc], B in 3, 4)",
    example="lmcache-tq:3:nc",
)
