"""Attention straight from packed K/V codes: decode (reference, fused CPU, Triton) and chunked prefill.

Modules: :mod:`~walshkv.attention.decode` (the :func:`decode_attention` dispatcher and its backends),
:mod:`~walshkv.attention.reference` (input checks, online softmax, the pure-torch path),
:mod:`~walshkv.attention.chunked` (a block of queries, for prefill), :mod:`~walshkv.attention.paged` (many
requests over a paged cache through a block table, one kernel call), :mod:`~walshkv.attention.cpu` with
:mod:`~walshkv.attention.cpu_formats` (the C++ kernel in ``cpu_kernel.cpp``),
:mod:`~walshkv.attention.triton_decode` with :mod:`~walshkv.attention.triton_kernels` (the GPU kernel) and
:mod:`~walshkv.attention.peeling` (the wrappers each backend moves onto the query and the V sum).
Layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``.
"""

from walshkv.attention.chunked import chunked_attention
from walshkv.attention.cpu import CPU_SUPPORTED, cpu_supports, fused_decode_cpu, kernel_available, load_kernel
from walshkv.attention.decode import BACKENDS, decode_attention, decode_attention_reference
from walshkv.attention.paged import decode_attention_paged, gather_pages
from walshkv.attention.peeling import core_codec, peel, peel_equalizer
from walshkv.attention.triton_decode import (
    TRITON_SUPPORTED,
    fused_decode_triton,
    triton_available,
    triton_interpret,
    triton_supports,
)

__all__ = [
    "BACKENDS",
    "CPU_SUPPORTED",
    "TRITON_SUPPORTED",
    "chunked_attention",
    "core_codec",
    "cpu_supports",
    "decode_attention",
    "decode_attention_paged",
    "decode_attention_reference",
    "fused_decode_cpu",
    "fused_decode_triton",
    "gather_pages",
    "kernel_available",
    "load_kernel",
    "peel",
    "peel_equalizer",
    "triton_available",
    "triton_interpret",
    "triton_supports",
]
