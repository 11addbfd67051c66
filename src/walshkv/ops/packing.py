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
_FLOAT_WEIGHTS: dict[tuple[int, torch.device], torch.Tensor] = {}
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
    if codes.is_floating_point() or codes.dtype == torch.bool:
        codes = codes.to(torch.uint8)
    weights, shifts = _pack_consts(bits, codes.device)
    c, lead, n, groups = _grouped(codes, weights.numel())
    # Each group's codes summed at their bit offsets (exact in int64: at most 56 bits), then cut into bytes.
    if c.device.type == "cpu":
        value = (c if c.dtype == torch.int64 else c.to(torch.int64)) @ weights
    else:  # integer matmul is CPU-only
        value = (c * weights).sum(dim=-1)
    return _cut_bytes(value, shifts, lead, n, bits, groups)


def pack_float_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack_bits` of float codes that hold whole numbers in ``[0, 2**bits)`` (a quantizer's rounded output).

    The same bytes as ``pack_bits(codes.to(torch.uint8), bits)``. On the CPU, for widths whose group of codes
    spans at most 24 bits (1, 2, 3, 4, 6), one float32 matmul sums the groups, exactly (every product and partial
    sum is a whole number below 2**24), without the uint8 and int64 copies.
    """
    _check_bits(bits)
    if bits == 8 or bits in (5, 7) or not codes.is_cpu or codes.dtype != torch.float32:
        return pack_bits(codes.to(torch.uint8), bits)
    key = (bits, codes.device)
    weights = _FLOAT_WEIGHTS.get(key)
    if weights is None:
        weights = _FLOAT_WEIGHTS[key] = _pack_consts(bits, codes.device)[0].to(torch.float32)
    c, lead, n, groups = _grouped(codes, weights.numel())
    value = c @ weights
    shifts = _pack_consts(bits, codes.device)[1]
    if shifts.numel() > 1:
        value = value.to(torch.int32)  # at most 24 bits
    return _cut_bytes(value, shifts, lead, n, bits, groups)


def pack_bits_span(codes: torch.Tensor, start: int, stop: int, bits: int) -> torch.Tensor:
    """``pack_bits(codes[..., start:stop], bits)``, for contiguous ``codes`` ``[..., n]``.

    Where the span starts and ends on whole groups of codes (:func:`_pack_consts`), every group of the row is
    summed at once and the span's groups are taken from the result, so the span is never copied out first.
    """
    _check_bits(bits)
    n = codes.shape[-1]
    weights, shifts = _pack_consts(bits, codes.device)
    group = weights.numel()
    if (
        bits == 8
        or start % group
        or stop % group
        or n % group
        or not 0 <= start < stop <= n
        or codes.dtype != torch.int64
        or not codes.is_contiguous()
    ):
        return pack_bits(codes[..., start:stop], bits)
    lead = codes.shape[:-1]
    c = codes.view(*lead, n // group, group)
    value = c @ weights if c.device.type == "cpu" else (c * weights).sum(dim=-1)
    first, last = start // group, stop // group
    per_group = shifts.numel()
    if per_group == 1:
        return (value if first == 0 and last == n // group else value[..., first:last]).to(torch.uint8)
    if not _LITTLE:
        return _cut_bytes(value[..., first:last], shifts, lead, stop - start, bits, last - first)
    index = _byte_index(last, per_group, 8, value.device)[first * per_group :]
    return value.view(torch.uint8).index_select(-1, index)


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
