"""Dense bit packing of unsigned integer codes.

Layout: codes of ``bits`` bits each are written LSB-first into a little-endian bit
stream along the last dimension; code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)`` and stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``.
Each row (one vector) is padded with zero bits to a whole byte, so a row of ``n``
codes takes ``ceil(n * bits / 8)`` bytes. Two int4 codes share a byte (low nibble
first), four int2 codes share a byte, and 64 int3 codes take 24 bytes.
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import torch

__all__ = ["pack_bits", "pack_bits_span", "pack_float_codes", "packed_nbytes", "unpack_bits"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed for a row of ``n`` codes of ``bits`` bits each (byte-aligned row)."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def _pack_consts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, shifts)`` of :func:`pack_bits` for ``bits`` on ``device`` (cached; read-only).

    A group of ``8 / gcd(bits, 8)`` codes fills whole bytes (24 bits for 3-bit codes): ``weights[i] = 2**(i*bits)``
    places code ``i`` of a group in its stream bits, ``shifts`` (``0, 8, 16, ...``) cut the group's value into bytes.
    """
    key = (bits, device)
    consts = _PACK_CACHE.get(key)
    if consts is None:
        group = 8 // math.gcd(bits, 8)
        weights = torch.tensor([1 << (i * bits) for i in range(group)], dtype=torch.int64, device=device)
        shifts = torch.arange(0, group * bits, 8, dtype=torch.int64, device=device)
        consts = _PACK_CACHE[key] = (weights, shifts)
    return consts


def _byte_index(groups: int, nbytes: int, itemsize: int, device: torch.device) -> torch.Tensor:
    """Where each group's ``nbytes`` low bytes lie among the bytes of ``groups`` little-endian integers."""
    key = (groups, nbytes, itemsize, device)
    index = _BYTE_INDEX.get(key)
    if index is None:
        index = [g * itemsize + k for g in range(groups) for k in range(nbytes)]
        index = torch.tensor(index, dtype=torch.int64, device=device)
        _BYTE_INDEX[key] = index
    return index


_PACK_CACHE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
_BYTE_INDEX: dict[tuple[int, int, int, torch.device], torch.Tensor] = {}
_UNPACK_CACHE: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = {}
_LITTLE = sys.byteorder == "little"


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes densely, LSB-first, along the last dimension.

    Args:
        codes: integer tensor ``[..., n]`` with values in ``[0, 2**bits)``.
        bits: code width, 1..8.

    Returns:
        ``uint8`` tensor ``[..., ceil(n * bits / 8)]``.
    """
    _check_bits(bits)
    if bits == 8:
        return codes.to(torch.uint8).contiguous()
    if not codes.is_contiguous() or codes.device.type != "cpu":  # (a non-contiguous input's layout is kept)
        return _pack_bits_by_shifts(codes, bits)
    if codes.is_floating_point() or codes.dtype == torch.bool:
        codes = codes.to(torch.uint8)
    weights, shifts = _pack_consts(bits, codes.device)
    c, lead, n, groups = _grouped(codes, weights.numel())
    # Each group's codes summed at their bit offsets (exact in int64: at most 56 bits), then cut into bytes.
    value = (c if c.dtype == torch.int64 else c.to(torch.int64)) @ weights
    return _cut_bytes(value, shifts, lead, n, bits, groups)


def _pack_bits_by_shifts(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` by shifts and ORs in uint8: for non-contiguous ``codes`` (whose layout the output keeps),
    and off the CPU (where integer matmul is not available)."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    c = codes.to(torch.uint8)
    per_byte = 8 // bits
    if 8 % bits == 0:
        pad = (-n) % per_byte
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*lead, (n + pad) // per_byte, per_byte)
        out = c[..., 0].clone()
        for i in range(1, per_byte):
            out |= c[..., i] << (i * bits)
        return out
    # General widths (3, 5, 6, 7): expand to a bit stream, then regroup by bytes.
    shifts = torch.arange(bits, dtype=torch.uint8, device=c.device)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n * bits)
    pad = (-(n * bits)) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*lead, (n * bits + pad) // 8, 8)
    weights = (1 << torch.arange(8, dtype=torch.int32, device=c.device)).to(torch.uint8)
    return (stream * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


def pack_float_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` of float codes that hold whole numbers in ``[0, 2**bits)`` (a quantizer's rounded output).

    The same bytes as ``pack_bits(codes.to(torch.uint8), bits)``. On the CPU, for widths whose group of codes
    spans at most 24 bits (1, 2, 3, 4, 6), a float32 matmul sums the groups exactly (every product and partial
    sum is a whole number below 2**24), without the uint8 and int64 copies.
    """
    n = codes.shape[-1]
    plan = _span_plan(codes, 0, n, bits)
    if plan is None:
        return pack_bits(codes.to(torch.uint8), bits)
    return _pack_planned(codes, plan)


def pack_bits_span(codes: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    """``pack_bits(codes[..., start:stop], bits)`` for int64 ``codes`` ``[..., n]``.

    On the CPU, where the span starts and ends on whole groups of codes (:func:`_pack_consts`), every group of
    the row is summed at once and the span's groups are read from the result: the span is never copied out.
    """
    plan = _span_plan(codes, start, stop, bits)
    if plan is None:
        return pack_bits(codes[..., start:stop], bits)
    return _pack_planned(codes, plan)


class _SpanPlan(NamedTuple):
    """How :func:`_pack_planned` packs codes ``[start, stop)`` of contiguous rows of ``n`` codes."""

    weights: torch.Tensor  # [group]: 2**(i*bits), in the codes' dtype
    groups: int  # groups of codes per row
    first: int  # the span's groups: first ... last - 1
    last: int
    index: torch.Tensor | None  # multi-byte groups: the span's bytes among the group values' bytes (little-endian)
    to_int: bool  # float group values are made int32 before their bytes are read


_PLANS: dict[tuple[int, int, int, int, torch.dtype, torch.device], _SpanPlan | None] = {}


def _span_plan(codes: torch.Tensor, start: int, stop: int, bits: int) -> _SpanPlan | None:
    """The cached plan for packing ``codes[..., start:stop]``, or ``None`` where only :func:`pack_bits` applies."""
    if not codes.is_contiguous():
        return None
    n = codes.shape[-1]
    key = (n, start, stop, bits, codes.dtype, codes.device)
    try:
        return _PLANS[key]
    except KeyError:
        pass
    _check_bits(bits)
    plan = None
    exact = codes.dtype == torch.int64 or (codes.dtype == torch.float32 and bits in (1, 2, 3, 4, 6))
    if bits != 8 and exact and codes.device.type == "cpu" and 0 <= start < stop <= n:  # integer matmul: CPU only
        weights, shifts = _pack_consts(bits, codes.device)
        group, per_group = weights.numel(), shifts.numel()
        if not (start % group or stop % group or n % group) and (per_group == 1 or _LITTLE):
            first, last = start // group, stop // group
            index = None
            if per_group > 1:  # int64 values (8 bytes each), or float ones made int32 (4 bytes)
                itemsize = 8 if codes.dtype == torch.int64 else 4
                index = _byte_index(last, per_group, itemsize, codes.device)[first * per_group :]
            plan = _SpanPlan(weights.to(codes.dtype), n // group, first, last, index, codes.is_floating_point())
    _PLANS[key] = plan
    return plan


def _pack_planned(codes: torch.Tensor, plan: _SpanPlan) -> torch.Tensor:
    value = codes.view(*codes.shape[:-1], plan.groups, plan.weights.numel()) @ plan.weights
    if plan.index is None:  # a group is one byte: every value is below 256
        if plan.first or plan.last != plan.groups:
            value = value[..., plan.first : plan.last]
        return value.to(torch.uint8)
    if plan.to_int:
        value = value.to(torch.int32)  # a whole number below 2**24
    return value.view(torch.uint8).index_select(-1, plan.index)


def _grouped(codes: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Size, int, int]:
    """``codes`` ``[..., n]`` zero-padded to whole groups, as ``[..., groups, group]``."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    pad = (-n) % group
    groups = (n + pad) // group
    return (torch.nn.functional.pad(codes, (0, pad)) if pad else codes).reshape(*lead, groups, group), lead, n, groups


def _cut_bytes(
    value: torch.Tensor, shifts: torch.Tensor, lead: torch.Size, n: int, bits: int, groups: int
) -> torch.Tensor:
    """The packed row from each group's value ``[..., groups]`` (whole bytes: ``shifts`` has one per byte)."""
    per_group = shifts.numel()
    if per_group == 1:
        out = value.to(torch.uint8)  # a group is one byte: every value is below 256
    elif _LITTLE and value.is_contiguous():  # the low bytes of each value, as they lie in memory
        raw = value.view(torch.uint8)
        out = raw.index_select(-1, _byte_index(groups, per_group, value.element_size(), value.device))
    else:  # to(uint8) keeps each shifted value's low byte
        out = (value.unsqueeze(-1) >> shifts).to(torch.uint8).reshape(*lead, groups * per_group)
    nbytes = packed_nbytes(n, bits)
    return out if out.shape[-1] == nbytes else out[..., :nbytes].contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`.

    Args:
        packed: ``uint8`` tensor ``[..., ceil(n * bits / 8)]``.
        bits: code width, 1..8.
        n: number of codes per row.

    Returns:
        ``uint8`` tensor ``[..., n]`` of codes in ``[0, 2**bits)``.
    """
    _check_bits(bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    expected = packed_nbytes(n, bits)
    if packed.shape[-1] != expected:
        raise ValueError(f"packed rows hold {packed.shape[-1]} bytes, but {n} codes of {bits} bits need {expected}")
    lead = packed.shape[:-1]
    if bits == 8:
        return packed.clone()
    mask = (1 << bits) - 1
    shifts, weights = _unpack_consts(bits, packed.device)
    if weights is None:
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*lead, expected * (8 // bits))[..., :n]
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*lead, expected * 8)[..., : n * bits]
    stream = stream.reshape(*lead, n, bits).to(torch.int32)
    return (stream * weights).sum(dim=-1).to(torch.uint8)


def _unpack_consts(bits: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(shifts, weights)`` of :func:`unpack_bits` (cached; ``weights`` is ``None`` where ``bits`` divides 8)."""
    key = (bits, device)
    consts = _UNPACK_CACHE.get(key)
    if consts is None:
        if 8 % bits == 0:
            consts = (torch.arange(0, 8, bits, dtype=torch.uint8, device=device), None)
        else:
            weights = 1 << torch.arange(bits, dtype=torch.int32, device=device)
            consts = (torch.arange(8, dtype=torch.uint8, device=device), weights)
        _UNPACK_CACHE[key] = consts
    return consts
