"""Pure-torch reference primitives: transforms, bit packing, quantizer math."""

from walshkv.ops.hadamard import fwht, hadamard_matrix, hadamard_transform, is_power_of_two, random_signs
from walshkv.ops.packing import pack_bits, packed_nbytes, unpack_bits
from walshkv.ops.quant import (
    check_finite,
    dequantize_symmetric,
    quantize_symmetric,
    symmetric_qmax,
)

__all__ = [
    "check_finite",
    "dequantize_symmetric",
    "fwht",
    "hadamard_matrix",
    "hadamard_transform",
    "is_power_of_two",
    "pack_bits",
    "packed_nbytes",
    "quantize_symmetric",
    "random_signs",
    "symmetric_qmax",
    "unpack_bits",
]
