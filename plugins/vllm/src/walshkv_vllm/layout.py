"""The paged slot layout: how one token's packed K and V sit in a vLLM page.

vLLM hands an attention backend one cache tensor per layer. For walshkv's fixed-size codecs it is a ``uint8``
page tensor ``[num_blocks, block_size, num_kv_heads, slot_bytes]`` (vLLM's ``LBNHC`` layout, as its TurboQuant
backend uses): token ``offset`` of block ``block`` is slot ``block * block_size + offset``, and each
(slot, kv head) cell holds the K codec's fields then the V codec's fields, each field's bytes in the order of
:meth:`walshkv.codecs.Codec.layout`, with no padding. So ``slot_bytes`` is exactly
``(bits_per_element(K) + bits_per_element(V)) * head_dim / 8`` and a page is ``block_size * num_kv_heads *
slot_bytes`` bytes.

Fields wider than a byte (fp16 scales, norms) are stored as their raw little-endian bytes; reading copies each
field out of the slot before viewing it in its dtype, so no field needs aligning.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from walshkv.codecs import Codec, Field, Packed

__all__ = ["FieldSlice", "SideLayout", "SlotLayout"]


@dataclass(frozen=True)
class FieldSlice:
    """One stored field of a codec inside a slot: its name, shape, dtype and byte range."""

    name: str
    field: Field
    offset: int

    @property
    def nbytes(self) -> int:
        return self.field.nbytes

    @property
    def stop(self) -> int:
        return self.offset + self.field.nbytes


@dataclass(frozen=True)
class SideLayout:
    """The fields of one side (K or V) of a slot, from ``offset`` on."""

    fields: tuple[FieldSlice, ...]
    offset: int
    nbytes: int
    head_dim: int

    @classmethod
    def of(cls, codec: Codec, head_dim: int, offset: int) -> SideLayout:
        """The byte layout of ``codec``'s fields per vector of ``head_dim``, starting at ``offset``."""
        fields: list[FieldSlice] = []
        at = offset
        for name, field in codec.layout(head_dim).items():
            fields.append(FieldSlice(name, field, at))
            at += field.nbytes
        return cls(tuple(fields), offset, at - offset, head_dim)

    def to_bytes(self, packed: Packed) -> torch.Tensor:
        """``packed``'s fields as one ``uint8`` tensor ``[batch, kv_heads, seq_len, nbytes]``.

        Raises:
            ValueError: a field is missing or has another shape or dtype than this layout's.
        """
        parts = []
        for f in self.fields:
            t = packed.tensors.get(f.name)
            if t is None or tuple(t.shape[3:]) != f.field.shape or t.dtype != f.field.dtype:
                got = "missing" if t is None else f"{t.dtype} {tuple(t.shape[3:])}"
                raise ValueError(
                    f"packed field {f.name!r} should be {f.field.dtype} {f.field.shape} per vector, got {got}; "
                    "encode with the codec this layout was built from"
                )
            lead = t.shape[:3]
            parts.append(t.contiguous().view(torch.uint8).reshape(*lead, f.nbytes))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def from_bytes(self, raw: torch.Tensor, dtype: torch.dtype) -> Packed:
        """The :class:`Packed` that a slot tensor ``raw [batch, kv_heads, seq_len, slot_bytes]`` holds on this side.

        Args:
            raw: ``uint8`` slots (the whole slot: this side's bytes are read from :attr:`offset`).
            dtype: the dtype :meth:`walshkv.codecs.Codec.decode` returns (the model's).
        """
        lead = raw.shape[:3]
        tensors: dict[str, torch.Tensor] = {}
        for f in self.fields:
            chunk = raw[..., f.offset : f.stop].contiguous()
            tensors[f.name] = chunk.view(f.field.dtype).reshape(*lead, *f.field.shape)
        return Packed(tensors, self.head_dim, dtype)

    def page_view(self, pages: torch.Tensor, dtype: torch.dtype) -> Packed:
        """This side's fields as views of a page tensor, ``[num_blocks, kv_heads, block_size, ...]``: no copy.

        ``uint8`` fields keep their shape; wider ones (fp16 scales, norms) stay raw bytes ``[..., nbytes]``, since a
        slot does not align them (:func:`walshkv.attention.decode_attention_paged` reads both forms).

        Args:
            pages: ``uint8 [num_blocks, block_size, num_kv_heads, slot_bytes]``.
            dtype: the dtype :meth:`walshkv.codecs.Codec.decode` returns (the model's).
        """
        tensors: dict[str, torch.Tensor] = {}
        for f in self.fields:
            view = pages[..., f.offset : f.stop].transpose(1, 2)  # [blocks, kv_heads, block_size, nbytes]
            tensors[f.name] = view.unflatten(-1, f.field.shape) if f.field.dtype == torch.uint8 else view
        return Packed(tensors, self.head_dim, dtype)


@dataclass(frozen=True)
class SlotLayout:
    """Where one token's K and V fields sit in a slot of ``slot_bytes`` bytes (per kv head).

    Attributes:
        k, v: the two sides; K occupies bytes ``[0, k.nbytes)``, V ``[k.nbytes, slot_bytes)``.
        head_dim: K/V head size.
        num_kv_heads: kv heads per layer (cells per slot).
    """

    k: SideLayout
    v: SideLayout
    head_dim: int
    num_kv_heads: int

    @classmethod
    def of(cls, k_codec: Codec, v_codec: Codec, head_dim: int, num_kv_heads: int) -> SlotLayout:
        """The slot layout of a K codec and a V codec at ``head_dim`` (``ValueError`` for a size they refuse)."""
        if num_kv_heads < 1:
            raise ValueError(f"num_kv_heads must be positive, got {num_kv_heads}")
        k = SideLayout.of(k_codec, head_dim, 0)
        v = SideLayout.of(v_codec, head_dim, k.nbytes)
        return cls(k, v, head_dim, num_kv_heads)

    @property
    def slot_bytes(self) -> int:
        """Bytes of one (token, kv head) cell: K's fields then V's."""
        return self.k.nbytes + self.v.nbytes

    def page_bytes(self, block_size: int) -> int:
        """Bytes of one page (block) of ``block_size`` tokens over every kv head."""
        return block_size * self.num_kv_heads * self.slot_bytes

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """The page tensor's shape ``[num_blocks, block_size, num_kv_heads, slot_bytes]``."""
        return (num_blocks, block_size, self.num_kv_heads, self.slot_bytes)

    def empty_pages(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """A zeroed ``uint8`` page tensor (what vLLM allocates, for tests and tools)."""
        return torch.zeros(self.page_shape(num_blocks, block_size), dtype=torch.uint8, device=device)

    def to_bytes(self, packed_k: Packed, packed_v: Packed) -> torch.Tensor:
        """Packed K and V ``[batch, kv_heads, seq_len, ...]`` as slots ``[batch, kv_heads, seq_len, slot_bytes]``."""
        return torch.cat([self.k.to_bytes(packed_k), self.v.to_bytes(packed_v)], dim=-1)

    def page_views(self, pages: torch.Tensor, dtype: torch.dtype) -> tuple[Packed, Packed]:
        """K's and V's fields as views of ``pages`` (:meth:`SideLayout.page_view`)."""
        return self.k.page_view(pages, dtype), self.v.page_view(pages, dtype)

    def from_bytes(self, raw: torch.Tensor, dtype: torch.dtype) -> tuple[Packed, Packed]:
        """Slots ``[batch, kv_heads, seq_len, slot_bytes]`` back to packed K and V."""
        if raw.dtype != torch.uint8 or raw.shape[-1] != self.slot_bytes:
            raise ValueError(
                f"slots must be uint8 [..., {self.slot_bytes}] for this layout, got {raw.dtype} {tuple(raw.shape)}"
            )
        return self.k.from_bytes(raw, dtype), self.v.from_bytes(raw, dtype)
