"""The codec core: :class:`Packed` (what a cache stores) and :class:`Codec`.

Tensor layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``. A codec
compresses each (batch, kv-head, token) vector of ``head_dim`` values into a fixed
set of fields (codes, scales, ...). Its :meth:`Codec.layout` lists those fields per
vector, and :meth:`Codec.bits_per_element` is computed from that layout, never typed.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import torch

from walshkv.ops.quant import check_finite

__all__ = ["Codec", "Field", "Packed", "Wrapper", "check_kv", "find_wrapper", "unwrap", "wrappers"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


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
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{what} must have shape [batch, num_kv_heads, seq_len, head_dim], got {tuple(x.shape)}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{what} must be a float tensor (float16, bfloat16, float32, float64), got {x.dtype}")
    check_finite(x, what)


class Codec(ABC):
    """A K/V vector codec. Subclasses override :meth:`layout`, :meth:`_encode`, :meth:`_decode`.

    ``encode`` validates its input (shape, dtype, finiteness, head size) before any
    work, so a failed call changes nothing.
    """

    #: Canonical spec string, e.g. ``"rot+int4"``.
    spec: str = ""

    @abstractmethod
    def layout(self, head_dim: int) -> dict[str, Field]:
        """Stored fields per vector of ``head_dim`` values."""

    #: True if :meth:`bind` needs calibration statistics (e.g. ``vht2`` with ``order=variance``).
    needs_calibration: bool = False

    def bind(self, layer_idx: int, kind: str, calibration: Any = None) -> Codec:
        """The codec to use for one layer's K (``kind="k"``) or V (``"v"``).

        Codecs with calibrated, per-layer parameters return a specialised copy; the default
        returns ``self``. ``calibration`` is a :class:`walshkv.calibration.KVStats` or ``None``.
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

    def encode(self, x: torch.Tensor) -> Packed:
        """Compress ``x`` of shape ``[batch, num_kv_heads, seq_len, head_dim]``."""
        check_kv(x)
        self.check_head_dim(x.shape[-1])
        packed = self._encode(x)
        packed.dtype = x.dtype
        return packed

    def decode(self, packed: Packed) -> torch.Tensor:
        """Decompress to ``[batch, num_kv_heads, seq_len, head_dim]`` in the encoded dtype."""
        return self._decode(packed).to(packed.dtype)

    @abstractmethod
    def _encode(self, x: torch.Tensor) -> Packed: ...

    @abstractmethod
    def _decode(self, packed: Packed) -> torch.Tensor: ...

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec!r})"


class Wrapper(Codec):
    """A codec that transforms each vector and stores the result with ``inner`` (``rot+``, ``center+``, ...).

    A wrapper adds no stored bytes: :meth:`layout` and the head-size check are the inner codec's, and it
    needs calibration if its inner codec does. Walk a chain with :func:`wrappers` and :func:`unwrap`, never
    by reading attributes by name.

    Attributes:
        name: the spec prefix (``"rot"``, ``"center"``, ...), written ``name+INNER``.
        inner: the wrapped codec.
    """

    name: ClassVar[str] = ""

    def __init__(self, inner: Codec) -> None:
        self.inner = inner

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.inner.needs_calibration

    def layout(self, head_dim: int) -> dict[str, Field]:
        return self.inner.layout(head_dim)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)

    def unwrap(self) -> Codec:
        """The innermost codec, the one that stores the bits."""
        return unwrap(self.inner)


W = TypeVar("W", bound=Wrapper)


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


def find_wrapper(codec: Codec, kind: type[W]) -> W | None:
    """The outermost wrapper of class ``kind`` in ``codec``'s chain, or ``None``."""
    for w in wrappers(codec):
        if isinstance(w, kind):
            return w
    return None
