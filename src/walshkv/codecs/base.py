"""The codec core: :class:`Packed` (what a cache stores), :class:`Codec` and :class:`Wrapper`.

Tensor layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``. A codec
compresses each (batch, kv-head, token) vector of ``head_dim`` values into a fixed
set of fields (codes, scales, ...). Its :meth:`Codec.layout` lists those fields per
vector, and :meth:`Codec.bits_per_element` is computed from that layout, never typed.
``encode``/``decode`` take the block's first position (``start``); only positional codecs
(``prerope+``) read it. The order wrappers nest in is :data:`WRAPPER_ORDER`, checked by
:func:`check_wrapper_order` when a wrapper is built (docs/codecs.md has the whole contract).

The built-in codecs are frozen dataclasses: a codec's fields are its identity (``bits``, ``seed``, a
wrapper's ``inner``, ...), two codecs with equal fields are equal, and :attr:`Codec.spec` is derived from
the fields (:meth:`Codec._spec`) when the codec is built. What a bound codec took from calibration (a K
mean, an ``eq+`` transform, a RoPE table) is a field too, left out of equality and hashing
(``field(compare=False)``), as are caches filled on use (a ``dict`` field, ``init=False``).
"""

from __future__ import annotations

import functools
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import TYPE_CHECKING, ClassVar, Literal, TypeVar

import torch

from walshkv.constants import MAX_WRAPPERS
from walshkv.ops.quant import FP16_MAX, checks_on_device, device_checks, finite_absmax
from walshkv.ops.threads import SERIAL_BLAS_MAX, serial_blas

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = [
    "WRAPPER_ORDER",
    "Codec",
    "Field",
    "Packed",
    "Wrapper",
    "check_kv",
    "check_start",
    "check_wrapper_order",
    "checks_on_device",
    "find_wrapper",
    "rewrap",
    "unwrap",
    "wrappers",
]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

#: float16 blocks with a larger ``|x|`` are decoded once on encode to check that they stay within the fp16
#: range: a codec's scales round up, and ``rot+`` spreads a vector's norm, so decoded values can pass 65504
#: although the input did not. Below it no codec comes near (decoded ``|x|`` stays under 32 times the
#: input's, which tests/codecs/test_fp16_range.py checks on every matrix entry), so healthy K/V pay nothing.
FP16_TRIAL_ABOVE = FP16_MAX / 32


@dataclass(frozen=True)
class Field:
    """One stored field of a codec, per vector: its trailing shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        """Bytes this field takes per vector."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Packed:
    """Compressed K or V: named tensors, each ``[batch, num_kv_heads, seq_len, *field.shape]``.

    Attributes:
        tensors: the stored fields (packed ``uint8`` codes, fp16 scales, ...).
        head_dim: length of the vectors that were encoded.
        dtype: dtype that :meth:`Codec.decode` returns.
    """

    tensors: dict[str, torch.Tensor]
    head_dim: int
    dtype: torch.dtype

    def _first(self) -> torch.Tensor:
        return next(iter(self.tensors.values()))

    @property
    def batch_size(self) -> int:
        return self._first().shape[0]

    @property
    def num_heads(self) -> int:
        return self._first().shape[1]

    @property
    def seq_len(self) -> int:
        return self._first().shape[2]

    def nbytes(self) -> int:
        """Bytes actually held by the stored tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def _map(self, fn) -> Packed:
        return Packed({k: fn(t) for k, t in self.tensors.items()}, self.head_dim, self.dtype)

    def slice_seq(self, start: int | None = None, stop: int | None = None) -> Packed:
        """Tokens ``start:stop`` along the sequence dimension."""
        return self._map(lambda t: t[:, :, start:stop])

    def index_batch(self, index: torch.Tensor) -> Packed:
        """Select (or reorder) sequences along the batch dimension."""
        return self._map(lambda t: t.index_select(0, index.to(t.device)))

    def repeat_batch(self, repeats: int) -> Packed:
        """Repeat every sequence ``repeats`` times along the batch dimension (interleaved)."""
        return self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def to(self, device: torch.device | str) -> Packed:
        return self._map(lambda t: t.to(device, non_blocking=True))

    @staticmethod
    def cat(parts: list[Packed]) -> Packed:
        """Concatenate along the sequence dimension."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        return Packed(
            {k: torch.cat([p.tensors[k] for p in parts], dim=2) for k in first.tensors},
            first.head_dim,
            first.dtype,
        )


def check_kv(x: torch.Tensor, what: str = "K/V") -> None:
    """Validate a K/V block: 4-D ``[batch, num_kv_heads, seq_len, head_dim]``, float, finite."""
    _checked_absmax(x, what)


def _checked_absmax(x: torch.Tensor, what: str = "K/V", on_device: bool = False) -> float:
    """:func:`check_kv`, returning ``max |x|`` (0 for an empty block) from the same pass; ``on_device``: the
    NaN/Inf refusal as a device-side assert (:func:`checks_on_device`), and ``nan`` for the unread maximum."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{what} must have shape [batch, num_kv_heads, seq_len, head_dim], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be a float tensor (float16, bfloat16, float32, float64), got {x.dtype}")
    if on_device:
        torch._assert_async(
            torch.isfinite(x).all(),
            f"{what} contains NaN or Inf values; walshkv codecs refuse non-finite K/V instead of spreading them "
            "through a shared scale. Find where the model overflows (run it in float32 or bfloat16)",
        )
        return math.nan
    return finite_absmax(x, what)


def check_start(start: int) -> None:
    """Validate a block's first position: a whole number >= 0."""
    if isinstance(start, bool) or not isinstance(start, int) or start < 0:
        raise ValueError(f"start is the position of the block's first token, an int >= 0; got {start!r}")


class Codec(ABC):
    """A K/V vector codec. Subclasses override :meth:`layout`, :meth:`_encode`, :meth:`_decode`.

    ``encode`` validates its input (shape, dtype, finiteness, head size, start) before any
    work, so a failed call changes nothing. A codec whose result depends on the tokens'
    positions overrides :meth:`_encode_at` and :meth:`_decode_at` instead.

    A wrapper hands its transformed block to its inner codec's :meth:`_encode_inner`, which skips the checks
    that the wrapper's own ``encode`` already made on the same block (see :class:`Wrapper`).

    A subclass is a ``@dataclass(frozen=True, repr=False)`` whose fields are the codec's parameters; it
    implements :meth:`_spec` (the canonical spec, from those fields) and, if it checks or normalises its
    fields, ``__post_init__`` ending in ``super().__post_init__()`` (which stores :attr:`spec`). A plain
    (non-dataclass) subclass sets :attr:`spec` itself.
    """

    #: Canonical spec string, e.g. ``"rot+int4"``: derived from the fields when a dataclass codec is built
    #: (:meth:`_spec`), so that ``parse_codec(codec.spec)`` rebuilds an equal codec; a bound codec's spec may
    #: name its layer (``vht2:4,3:order=variance[k0]``). Read it freely: it is a stored string, not recomputed.
    spec: str = ""

    def __post_init__(self) -> None:
        """Store :attr:`spec`, derived from the fields (a dataclass codec's ``__init__`` calls this; an override
        checks the fields first, then calls ``super().__post_init__()``)."""
        self._set(spec=self._spec())

    def _spec(self) -> str:
        """The canonical spec of this codec, from its fields (``f"int{self.bits}"``); ``parse_codec`` reads it back."""
        raise NotImplementedError(f"{type(self).__name__} must implement _spec (or set spec itself)")

    def _set(self, **values: object) -> None:
        """Assign attributes of a frozen dataclass codec: the one place a codec writes to itself.

        Only ``__post_init__`` calls it: to store :attr:`spec`, to normalise a field (``bits=float(bits)``), or
        to fill a field derived from the others (``init=False``: ``eq+``'s inverse, ``tqprod``'s MSE stage).
        """
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Every ``layout`` (and so ``bytes_per_vector``, ``bits_per_element``) refuses, with the same error as
        ``encode``, the head sizes :meth:`check_head_dim` refuses: no method answers for a size encode refuses."""
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("layout")
        if own is not None and not getattr(own, "checks_head_dim", False):
            cls.layout = _checking_head_dim(own)  # type: ignore[method-assign]

    @abstractmethod
    def layout(self, head_dim: int) -> dict[str, Field]:
        """Stored fields per vector of ``head_dim`` values (``ValueError`` for a size the codec refuses)."""

    #: True if :meth:`bind` needs calibration statistics (e.g. ``vht2`` with ``order=variance``).
    needs_calibration: bool = False

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        """The codec to use for one layer's K (``kind="k"``) or V (``"v"``).

        Codecs with calibrated, per-layer parameters return a specialised copy; the default
        returns ``self``. ``calibration`` holds the parts the codec reads (see
        :mod:`walshkv.codecs.calibration`: a file, collected statistics) or is ``None``.
        """
        return self

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ``ValueError`` if this codec cannot encode vectors of ``head_dim`` values."""
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")

    def bytes_per_vector(self, head_dim: int) -> int:
        """Bytes stored per (batch, kv-head, token) vector, from :meth:`layout`."""
        return sum(f.nbytes for f in self.layout(head_dim).values())

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per K/V element, every scale and padding byte included."""
        return 8.0 * self.bytes_per_vector(head_dim) / head_dim

    def encode(self, x: torch.Tensor, start: int = 0) -> Packed:
        """Compress ``x`` of shape ``[batch, num_kv_heads, seq_len, head_dim]``.

        Args:
            x: the block, any float dtype; :meth:`decode` returns that dtype.
            start: position of the block's first token (token ``i`` is at ``start + i``).
        """
        on_device = device_checks()
        peak = _checked_absmax(x, on_device=on_device)
        self.check_head_dim(x.shape[-1])
        check_start(start)
        x = x.contiguous()  # the same bytes for a view and its copy (matmul and rounding follow the strides)
        with serial_blas(x.numel() <= SERIAL_BLAS_MAX):  # a decode step's token: no thread woken per product
            packed = self._encode_checked(x, start)
        packed.dtype = x.dtype
        if x.dtype == torch.float16 and on_device:
            decoded = self._decode_at(packed, start).to(torch.float32).abs()
            torch._assert_async(
                (decoded < FP16_MAX + 16).all(),
                f"{self.spec} would decode this float16 block to values past the float16 maximum 65504 (its "
                "scales round up near the top of the range). Run the model (and so the cache) in bfloat16 or "
                "float32, or use a codec that keeps the range (fp16, fp32)",
            )
        elif x.dtype == torch.float16 and peak > FP16_TRIAL_ABOVE:
            self._check_fp16_range(x, packed, start)
        return packed

    #: True if :meth:`_encode` itself raises on NaN/Inf input (which ``encode`` refuses first): a wrapper's output,
    #: which the wrapper's ``encode`` did not check, may then skip ``check_kv`` in :meth:`_encode_inner`.
    refuses_nonfinite: ClassVar[bool] = False

    def _encode_checked(self, x: torch.Tensor, start: int) -> Packed:
        """Encode a block that :meth:`encode` validated (a :class:`Wrapper` takes its fast path here)."""
        return self._encode_at(x, start)

    def _encode_inner(self, x: torch.Tensor) -> Packed:
        """Encode a wrapper's transformed block ``x`` (4-D float, this codec's head size, position 0).

        The same as ``encode(x)`` when ``x`` is finite, minus the checks that the wrapper's ``encode`` made: the
        head size (a wrapper keeps it) and, for a codec that :attr:`refuses_nonfinite`, the NaN/Inf scan. It may
        raise on a block that ``encode`` would refuse (with another message); the wrapper then reruns
        ``encode``, see :meth:`Wrapper._encode_checked`.
        """
        if not self.refuses_nonfinite or x.dtype == torch.float16:
            return self.encode(x)
        x = x.contiguous()
        packed = self._encode_at(x, 0)
        packed.dtype = x.dtype
        return packed

    def _check_fp16_range(self, x: torch.Tensor, packed: Packed, start: int) -> None:
        """Refuse a float16 block whose decoded values would round to ±Inf in float16 (nothing is stored yet)."""
        peak = float(self._decode_at(packed, start).to(torch.float32).abs().amax())
        if peak < FP16_MAX + 16:  # float16 rounds values below 65520 to 65504, from 65520 to Inf
            return
        raise ValueError(
            f"{self.spec} would decode this float16 block (|x| up to {float(x.abs().amax()):.6g}) to values up to "
            f"{peak:.6g}, past the float16 maximum 65504: its scales round up near the top of the range. Run the "
            "model (and so the cache) in bfloat16 or float32, or use a codec that keeps the range (fp16, fp32)"
        )

    def decode(self, packed: Packed, start: int = 0) -> torch.Tensor:
        """Decompress to ``[batch, num_kv_heads, seq_len, head_dim]`` in the encoded dtype.

        Args:
            packed: what :meth:`encode` returned (or a slice or concatenation of it).
            start: position of the block's first token, as passed to :meth:`encode`.
        """
        check_start(start)
        return self._decode_at(packed, start).to(packed.dtype)

    def _encode_at(self, x: torch.Tensor, start: int) -> Packed:
        """Encode a validated block at positions ``start, ...``; codecs blind to positions use :meth:`_encode`."""
        return self._encode(x)

    def _decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        """Decode a block at positions ``start, ...``; codecs blind to positions use :meth:`_decode`."""
        return self._decode(packed)

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> Packed:
        """Encode a validated block ``[batch, num_kv_heads, seq_len, head_dim]``."""

    @abstractmethod
    def _decode(self, packed: Packed) -> torch.Tensor:
        """Decode to ``[batch, num_kv_heads, seq_len, head_dim]`` (any float dtype; ``decode`` casts it)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


def _checking_head_dim(
    layout: Callable[[Codec, int], dict[str, Field]],
) -> Callable[[Codec, int], dict[str, Field]]:
    @functools.wraps(layout)
    def checked(self: Codec, head_dim: int) -> dict[str, Field]:
        self.check_head_dim(head_dim)
        return layout(self, head_dim)

    checked.checks_head_dim = True  # type: ignore[attr-defined]
    return checked


#: The order wrappers nest in, outermost first (``prerope+center+eq+rot+SPEC``); ``rrot`` takes ``rot``'s slot.
#: Each name is a :attr:`Wrapper.name`; a wrapper may only wrap codecs whose wrappers come later here.
WRAPPER_ORDER: tuple[str, ...] = ("prerope", "center", "eq", "rot")
#: Wrappers that may wrap themselves (``rot+rot+SPEC`` is a valid, if useless, double rotation).
REPEATABLE_WRAPPERS: frozenset[str] = frozenset({"rot"})


@dataclass(frozen=True, repr=False)
class Wrapper(Codec):
    """A codec that transforms each vector and stores the result with ``inner`` (``rot+``, ``center+``, ...).

    A wrapper adds no stored bytes: :meth:`layout` and the head-size check are the inner codec's, and it
    needs calibration if its inner codec does. Walk a chain with :func:`wrappers` and :func:`unwrap`, never
    by reading attributes by name. Building one checks its place in :data:`WRAPPER_ORDER`. A subclass is a
    frozen dataclass too: its own parameters are fields after ``inner`` (its spec is ``PREFIX+INNER``, from
    :attr:`prefix` and ``inner.spec``); what :meth:`bind` takes from calibration is a ``compare=False`` field.

    A subclass implements :meth:`_transform` (the codec that stores its output, and that output) and
    ``_decode``. Encoding then checks the input once, at the outermost ``encode``: each transform's output goes
    to the next codec's :meth:`Codec._encode_inner`, and the storing codec refuses a NaN or Inf that a
    transform made (an overflow) or passed on, or else its ``encode`` scans for them. If anything on that path
    raises, :meth:`_encode_checked` reruns the chain with every inner codec's ``encode``, which raises what each
    level's checks raise (the reference path, :meth:`_encode_at`): results and errors are those of a chain that
    validates at every level.

    Attributes:
        name: the slot in :data:`WRAPPER_ORDER` (``"rot"``, ``"center"``, ...); :attr:`prefix` is how a spec
            writes it (``rrot:3`` for a ``rot`` slot with random signs).
        kinds: the sides it transforms (``("k",)`` for K-only wrappers; see :attr:`other_kind`).
        other_kind: what :meth:`bind` does on a side not in ``kinds``: ``"skip"`` (return the bound inner codec,
            so one spec serves K and V) or ``"refuse"`` (raise: the spec must not name it on that side).
        misplaced: the error when this wrapper sits inside one that :data:`WRAPPER_ORDER` puts after it, a
            format string with ``{fixed}`` (the spec written in order) and ``{given}`` (the spec as written).
        inner: the wrapped codec.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[Kind, ...]] = ("k", "v")
    other_kind: ClassVar[Literal["skip", "refuse"]] = "skip"
    misplaced: ClassVar[str] = "write {fixed}, not {given}"

    inner: Codec

    def __post_init__(self) -> None:
        check_wrapper_order([self, *wrappers(self.inner)], unwrap(self.inner).spec)
        super().__post_init__()

    def _spec(self) -> str:
        return f"{self.prefix}+{self.inner.spec}"

    @property
    def prefix(self) -> str:
        """How a spec writes this wrapper (before its ``+``)."""
        return self.name

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.inner.needs_calibration

    def layout(self, head_dim: int) -> dict[str, Field]:
        return self.inner.layout(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        """``(codec, y)``: the codec that stores this wrapper's output ``y`` for a block ``x`` at ``start``.

        ``y`` keeps ``x``'s shape and is float; ``codec`` is ``inner`` (``center+rot+`` hands its output to the
        rotation's inner codec). Every NaN or Inf of ``x`` must leave one in ``y`` (true of invertible linear maps).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _transform")

    def _encode_at(self, x: torch.Tensor, start: int) -> Packed:
        """The reference path: the transformed block through the storing codec's own ``encode``.

        An error about the size of the values the inner codec was handed says where they came from when this
        transform made them: finite K/V that turn into Inf, or grow past a range, inside the wrapper.
        """
        codec, y = self._transform(x, start)
        try:
            return codec.encode(y)
        except ValueError as err:
            raise self._grown(x, y, err) from err

    def _grown(self, x: torch.Tensor, y: torch.Tensor, err: ValueError) -> ValueError:
        """``err``, or an error naming this transform where its output (not its finite input) broke a limit."""
        if getattr(err, "walshkv_explained", False) or not x.numel():
            return err
        peak_in = float(x.detach().abs().amax())  # finite: the outermost encode checked it
        peak_out = float(y.detach().abs().amax())
        if not math.isfinite(peak_in):
            return err
        if not math.isfinite(peak_out):
            out = ValueError(
                f"{self.spec}: the {self.prefix}+ transform overflowed {y.dtype}: finite K/V (|x| up to "
                f"{peak_in:.4g}) became Inf inside it (a rotation can grow one value by up to sqrt(head_dim)). Values "
                f"this large are not K/V of a healthy model: rescale them, or store them without {self.prefix}+"
            )
        elif peak_out > 1.001 * peak_in and peak_out > FP16_MAX * 0.5:
            out = ValueError(
                f"{err} (those values come from {self.prefix}+: the K/V handed to {self.spec} reach only |x| up to "
                f"{peak_in:.4g}, the transform grew them to {peak_out:.4g}; a codec without {self.prefix}+ keeps the "
                "input's range)"
            )
        else:
            return err
        out.walshkv_explained = True  # type: ignore[attr-defined]
        return out

    def _encode(self, x: torch.Tensor) -> Packed:
        return self._encode_at(x, 0)

    def _encode_checked(self, x: torch.Tensor, start: int) -> Packed:
        try:
            codec, y = self._transform(x, start)
            return codec._encode_inner(y)
        except Exception:  # rerun with every level's checks: the error (or result) of the reference path
            return self._encode_at(x, start)

    def _encode_inner(self, x: torch.Tensor) -> Packed:
        if x.dtype == torch.float16:
            return self.encode(x)
        x = x.contiguous()
        codec, y = self._transform(x, 0)
        packed = codec._encode_inner(y)
        packed.dtype = x.dtype
        return packed

    def unwrap(self) -> Codec:
        """The innermost codec, the one that stores the bits."""
        return unwrap(self.inner)


W = TypeVar("W", bound=Wrapper)


def check_wrapper_order(chain: Sequence[Wrapper], base: str) -> None:
    """Refuse a chain of wrappers (outermost first, around a codec written ``base``) out of :data:`WRAPPER_ORDER`.

    The one place the order is checked: every wrapper's constructor calls it with itself and its inner
    codec's wrappers, and :func:`walshkv.codecs.registry.parse_codec` with the whole chain before building it
    (so that the fix it names is the whole spec, written in order). Pairs are checked innermost first.

    Raises:
        ValueError: a wrapper repeated, or inside one that comes after it; the message is the misplaced
            wrapper's :attr:`Wrapper.misplaced` with the spec written in order.
    """
    if len(chain) > MAX_WRAPPERS:
        raise ValueError(
            f"{len(chain)} wrappers around {base}; a codec takes at most {MAX_WRAPPERS} (prerope+, center+ and eq+ "
            "once each, then a rotation: prerope+center+eq+rot+SPEC)"
        )
    for w in chain:
        if w.name not in WRAPPER_ORDER:
            raise ValueError(f"wrapper {w.name!r} has no slot in WRAPPER_ORDER {WRAPPER_ORDER}; add it there")
    given = "+".join([*(w.prefix for w in chain), base])
    ordered: list[Wrapper] = []
    for w in sorted(chain, key=lambda w: WRAPPER_ORDER.index(w.name)):  # stable: rot+rrot:3+ keeps its order
        if not (ordered and ordered[-1].name == w.name and w.name not in REPEATABLE_WRAPPERS):
            ordered.append(w)
    fixed = "+".join([*(w.prefix for w in ordered), base])
    for outer, inner in reversed(list(pairwise(chain))):
        if outer.name == inner.name and outer.name not in REPEATABLE_WRAPPERS:
            kinds = {w.prefix.split(":")[0] for w in (outer, inner)}
            if len(kinds) > 1:  # two wrappers of one slot (prerope+ and ropeblock:G+ both set K's frame)
                both = " and ".join(f"{k}+" for k in sorted(kinds))
                raise ValueError(f"{both} fill one slot; keep one, write {fixed}")
            raise ValueError(f"{outer.name}+ appears twice in one codec spec: write {fixed}")
        if WRAPPER_ORDER.index(outer.name) > WRAPPER_ORDER.index(inner.name):
            raise ValueError(inner.misplaced.format(fixed=fixed, given=given))


def wrappers(codec: Codec) -> list[Wrapper]:
    """The wrappers of ``codec``, outermost first (empty for a plain codec)."""
    out: list[Wrapper] = []
    while isinstance(codec, Wrapper):
        out.append(codec)
        codec = codec.inner
    return out


def unwrap(codec: Codec) -> Codec:
    """The innermost (storing) codec of ``codec``; ``codec`` itself if it is not a :class:`Wrapper`."""
    while isinstance(codec, Wrapper):
        codec = codec.inner
    return codec


def rewrap(codec: Codec, store: Codec) -> Codec:
    """``codec``'s wrapper chain around another storing codec ``store`` (``store`` itself if ``codec`` has none).

    Each wrapper is rebuilt with :func:`dataclasses.replace`: it keeps its own fields (a seed, what it took from
    calibration) and checks its place in :data:`WRAPPER_ORDER` again. ``rewrap(center+tq:4, TurboQuant(4.5))``
    is ``center+tq:4.5``.
    """
    out = store
    for w in reversed(wrappers(codec)):
        out = replace(w, inner=out)
    return out


def find_wrapper(codec: Codec, kind: type[W]) -> W | None:
    """The outermost wrapper of class ``kind`` in ``codec``'s chain, or ``None``."""
    for w in wrappers(codec):
        if isinstance(w, kind):
            return w
    return None
