"""Symmetric integer codecs ``int2`` .. ``int8``.

Per (batch, kv-head, token) vector of ``head_dim`` values:

* ``codes``: ``uint8[ceil(head_dim * B / 8)]``, the offset codes ``q + qmax`` packed
  LSB-first (see :mod:`walshkv.ops.packing`);
* ``scale``: ``float16[1]`` = absmax / (2**(B-1) - 1).

So ``int4`` at head_dim 64 stores 32 + 2 = 34 bytes: 4.25 bits per element.
Note that ``int2`` has levels {-1, 0, +1} (qmax = 1), as the symmetric rule implies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from walshkv.codecs.base import Codec, Field, Packed
from walshkv.ops.packing import pack_float_codes, packed_nbytes, unpack_bits
from walshkv.ops.quant import check_finite, dequantize_symmetric, quantize_symmetric_codes

__all__ = ["IntCodec"]


@dataclass(frozen=True, repr=False)
class IntCodec(Codec):
    """Symmetric round-to-nearest ``bits``-bit quantization, one fp16 scale per vector.

    Attributes:
        bits: code width, 2..8 (spec ``int{bits}``).
    """

    bits: int

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"intB codecs take B in 2..8 (int2 ... int8), got {self.bits!r}")
        super().__post_init__()

    def _spec(self) -> str:
        return f"int{self.bits}"

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {
            "codes": Field((packed_nbytes(head_dim, self.bits),), torch.uint8),
            "scale": Field((1,), torch.float16),
        }

    refuses_nonfinite = True  # a NaN makes the largest scale NaN, an Inf makes it too large

    def _encode(self, x: torch.Tensor) -> Packed:
        codes, scale, biggest = quantize_symmetric_codes(x, self.bits)
        if math.isnan(biggest):
            check_finite(x, "K/V")
        return Packed({"codes": pack_float_codes(codes, self.bits), "scale": scale}, x.shape[-1], x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed.tensors["codes"], self.bits, packed.head_dim)
        return dequantize_symmetric(codes, packed.tensors["scale"], self.bits)
