"""Dense bit packing of unsigned integer codes.

Layout: codes of ``bits`` bits each are written LSB-first into a little-endian bit
stream along the last dimension; code ``i`` occupies stream bits
``[i*bits, (i+1)*bits)`` and stream bit ``j`` is bit ``j % 8`` of byte ``j // 8``.
Each row (one vector) is padded with zero bits to a whole byte, so a row of ``n``
codes takes ``ceil(n * bits / 8)`` bytes. Two int4 codes share a byte (low nibble
first), four int2 codes share a byte, and 64 int3 codes take 24 bytes.
"""

from __future__ import annotations

import torch

__all__ = ["pack_bits", "packed_nbytes", "unpack_bits"]


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed for a row of ``n`` codes of ``bits`` bits each (byte-aligned row)."""
    return (n * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes densely, LSB-first, along the last dimension.

    Args:
        codes: integer tensor ``[..., n]`` with values in ``[0, 2**bits)``.
        bits: code width, 1..8.

    Returns:
        ``uint8`` tensor ``[..., ceil(n * bits / 8)]``.
    """
    _check_bits(bits)
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.contiguous()
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
    if 8 % bits == 0:
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & mask
        return codes.reshape(*lead, expected * (8 // bits))[..., :n]
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = ((packed.unsqueeze(-1) >> shifts) & 1).reshape(*lead, expected * 8)[..., : n * bits]
    stream = stream.reshape(*lead, n, bits).to(torch.int32)
    weights = 1 << torch.arange(bits, dtype=torch.int32, device=packed.device)
    return (stream * weights).sum(dim=-1).to(torch.uint8)
