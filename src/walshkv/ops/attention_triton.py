"""Fused GPU decode attention straight from packed K/V codes, in Triton.

One Triton program per (batch, query head) walks the cached tokens of its kv head (grouped-query
attention: query head ``h`` reads kv head ``h // group``) in blocks of ``BLOCK_N`` tokens. For each
block it loads the packed K rows and their scales, unpacks them in registers, computes the scores
``(c - qmax) . q * scale_t`` (the softmax scale is already in ``q``), updates an online softmax
(running max ``m`` and denominator ``l``), then unpacks the block's V rows the same way and adds
``p_t * scale_t * (c_t - qmax)`` to a float32 accumulator. It writes the partial state ``(m, l, acc)``;
:func:`walshkv.ops.attention.decode_attention` merges it with the full-precision window and undoes
the V rotation exactly as for the other backends.

Packed layouts read (see :mod:`walshkv.ops.attention_cpu` for the byte-level description; the last
dimension of every field must be contiguous, the leading three may have any strides):

* ``intB``, B in 2..8: ``codes uint8[ceil(d*B/8)]`` LSB-first and ``scale float16[1]``. Code ``i`` is
  bits ``(i*B) & 7 ..`` of byte ``(i*B) >> 3`` (and, for B = 3, 5, 6, 7, of the next byte); B = 8 is a
  plain byte load, B = 2 and 4 one shift and mask per code.
* ``q4_0``: 18-byte blocks of 32 values, ``d: float16`` then 16 bytes of nibbles (value ``j`` low nibble
  of byte ``j``, value ``j + 16`` high nibble); value ``(nibble - 8) * d``.
* ``q8_0``: 34-byte blocks, ``d: float16`` then ``int8[32]``; value ``qs[j] * d``.

* ``vht2``: bands of LSB-first codes, each starting on a byte, one fp16 scale per band. A small int32
  table per head_dim position (bit offset in the row, width, band, and ``mul``/``offset`` so that the
  value is ``(code * mul - offset) * scale[band]``; width 0 for coefficients the skeleton drops) drives
  a gather load of one or two bytes per code. The query is multiplied by the WHT and the codec's order
  before the kernel and the V sum by the transpose after it, here rather than in the caller.

* ``tq``: ``codes`` (or ``codes_hi`` and ``codes_lo``, two tensors with their own strides) of
  LSB-first Lloyd-Max indices and ``norm float16[1]``. A per-position int32 table (bit offset in its
  segment's row, width, segment, first level, the segment's row bytes) drives the loads; each code
  picks its level from a small float table (levels over ``sqrt(d)``) and the token's factor is its
  norm. The query is rotated by the codec's rotation before the kernel and the V sum back after it.

Rotation wrappers (``rot+``/``rrot+``), ``center+`` and ``eq+`` are peeled by the caller: it passes the
query rotated into the K codec's basis and unrotates the V sum once. Anything else raises a ValueError.

The kernels are built on first use, separately for compiled and interpreted mode: ``TRITON_INTERPRET``
is read at each call (Triton itself reads it when a function is decorated), so setting
``TRITON_INTERPRET=1`` before the first call, even after this module was imported, runs the kernel on
CPU tensors through Triton's interpreter (slow; that is how the tests run it without a GPU).

Each program reads its kv head's codes on its own, so with a group of ``g`` query heads the codes are
read ``g`` times (mostly from L2); there is no split of long caches over several programs
(flash-decoding) yet.
"""

# ruff: noqa: N803  (Triton convention: upper-case kernel arguments for sizes and constexprs)

from __future__ import annotations

import math
import os
import threading
from typing import Any

import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.ggml import QK, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.turbo import TurboQuant
from walshkv.codecs.vht2 import VHT2Codec
from walshkv.ops.attention_cpu import core_codec
from walshkv.ops.packing import packed_nbytes

__all__ = [
    "TRITON_SUPPORTED",
    "fused_decode_triton",
    "triton_available",
    "triton_interpret",
    "triton_supports",
]

#: Human-readable list of the (inner) codecs the Triton kernel reads.
TRITON_SUPPORTED = "int2..int8, q4_0, q8_0, vht2, tq (each also under rot+, rrot+, center+ and eq+)"

_FMT_INT = 0
_FMT_Q4_0 = 1
_FMT_Q8_0 = 2
_FMT_BANDED = 3  # vht2
_FMT_TQ = 4  # tq: Lloyd-Max codes in one or two code tensors, one fp16 norm

_lock = threading.Lock()
_available: bool | None = None
_kernels: dict[bool, tuple[Any, Any]] = {}  # interpret mode -> jitted (_rows, _decode_kernel)


def triton_available() -> bool:
    """True if ``triton`` can be imported (checked once)."""
    global _available
    if _available is None:
        try:
            import triton
            import triton.language  # noqa: F401

            _available = True
        except Exception:  # not installed, or a broken install
            _available = False
    return _available


def triton_interpret() -> bool:
    """True if ``TRITON_INTERPRET=1`` is set now (the kernel then runs on CPU tensors, interpreted)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _format(core: Codec, head_dim: int) -> tuple[int, int, int, int, str] | None:
    """``(fmt, bits, row_bytes, qmax, codes field)`` for the kernel, or ``None`` if it cannot read ``core``."""
    if type(core) is IntCodec and 2 <= core.bits <= 8 and head_dim >= 1:
        return _FMT_INT, core.bits, packed_nbytes(head_dim, core.bits), (1 << (core.bits - 1)) - 1, "codes"
    if type(core) is GGMLCodec and core.name in ("q4_0", "q8_0") and head_dim >= QK and head_dim % QK == 0:
        fmt = _FMT_Q4_0 if core.name == "q4_0" else _FMT_Q8_0
        return fmt, 4 if fmt == _FMT_Q4_0 else 8, head_dim // QK * core.block_bytes, 0, "blocks"
    if type(core) is VHT2Codec:
        try:
            core.check_head_dim(head_dim)
            row_bytes = sum(band.nbytes for band in core.bands(head_dim))
            core.perm(head_dim)
        except ValueError:  # not bound yet (auto / variance without calibration), or a bad head_dim
            return None
        return _FMT_BANDED, 0, row_bytes, 0, "codes"
    if type(core) is TurboQuant:
        try:
            core.check_head_dim(head_dim)
        except ValueError:
            return None
        name, start, stop, bits = core.segments(head_dim)[0]
        return _FMT_TQ, 0, packed_nbytes(stop - start, bits), 0, name
    return None


_TQ_TABLES: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tq_table(core: TurboQuant, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per position ``j < head_dim``: int32 rows (bit offset in its segment's row, width, segment, first
    level, the segment's row bytes); the levels of every segment divided by ``sqrt(head_dim)`` (float32,
    one after another: times the token's norm they are the rotated coordinates); and the
    basis ``[head_dim, head_dim]`` whose column ``j`` is the vector rotated coordinate ``j`` decodes to.
    Built once per (spec, head_dim, device): a tq codec is fixed by its spec, and this runs every step."""
    key = (core.spec, head_dim, str(device))
    if key in _TQ_TABLES:
        return _TQ_TABLES[key]
    table = torch.zeros(5, head_dim, dtype=torch.int32)
    levels: list[torch.Tensor] = []
    first = 0
    for i, (_, start, stop, bits) in enumerate(core.segments(head_dim)):
        sl = slice(start, stop)
        table[0, sl] = torch.arange(stop - start, dtype=torch.int32) * bits
        table[1, sl] = bits
        table[2, sl] = i
        table[3, sl] = first
        table[4, sl] = packed_nbytes(stop - start, bits)
        lv = (core.quantizer(bits, head_dim).levels / math.sqrt(head_dim)).to(torch.float32)
        levels.append(lv)
        first += lv.numel()
    basis = core.unrotate(torch.eye(head_dim)).T.contiguous()
    _TQ_TABLES[key] = (table.to(device), torch.cat(levels).to(device), basis.to(device))
    return _TQ_TABLES[key]


def _band_table(core: VHT2Codec, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per buffer position ``j < head_dim``: int32 rows (bit offset in the row, width, band, mul, offset)
    with value ``(code * mul - offset) * scale[band]`` (width 0: not kept, decodes as 0), and the basis
    ``[head_dim, head_dim]`` whose column ``j`` is the WHT coefficient stored at position ``j``."""
    table = torch.zeros(5, head_dim, dtype=torch.int32)
    bit = start = 0
    for i, band in enumerate(core.bands(head_dim)):
        sl = slice(start, start + band.size)
        table[0, sl] = bit + torch.arange(band.size, dtype=torch.int32) * band.bits
        table[1, sl] = band.bits
        table[2, sl] = i
        table[3, sl] = 2 if band.bits == 1 else 1  # 1 bit: 2c - 1 (sign); else c - qmax
        table[4, sl] = 1 if band.bits == 1 else (1 << (band.bits - 1)) - 1
        bit += band.nbytes * 8
        start += band.size
    basis = torch.zeros(head_dim, head_dim)
    basis[:, :start] = core.coefficient_basis(head_dim)
    return table.to(device), basis.to(device)


def triton_supports(codec: Codec, head_dim: int) -> bool:
    """True if the Triton kernel reads ``codec``'s packed rows (after peeling rotations and centering)."""
    return _format(core_codec(codec), head_dim) is not None


# The kernel bodies are plain functions here (so this module imports without triton); _build() applies
# ``triton.jit`` to them for the current mode and binds the module globals ``tl`` and ``_rows`` that the
# bodies use (Triton resolves a kernel's names, including the jitted helpers it calls, in the module's
# globals; its interpreter even re-executes the source there, so closures would not do).
tl: Any = None  # triton.language, bound by _build()


def _rows(
    codes_ptr,
    scale_ptr,
    tab_ptr,
    codes2_ptr,
    lev_ptr,
    b,
    h,
    offs_n,
    mask_n,
    offs_d,
    mask_d,
    cs0,
    cs1,
    cs2,
    ss0,
    ss1,
    ss2,
    c2s0,
    c2s1,
    c2s2,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    QMAX: tl.constexpr,
    ROW_D: tl.constexpr,
):
    """Unpacked rows ``[BLOCK_N, BLOCK_D]`` (block scales applied) and per-token scales ``[BLOCK_N]``."""
    row = codes_ptr + b * cs0 + h * cs1 + offs_n[:, None] * cs2
    m2 = mask_n[:, None] & mask_d[None, :]
    if FMT == 0:  # intB, LSB-first bit stream, one fp16 scale per token
        bit = offs_d * BITS
        byte = (bit // 8)[None, :]
        shift = (bit % 8)[None, :]
        lo = tl.load(row + byte, mask=m2, other=0).to(tl.int32)
        if BITS == 8:
            code = lo
        elif (8 % BITS) == 0:  # B = 2, 4: a code never straddles two bytes
            code = (lo >> shift) & ((1 << BITS) - 1)
        else:
            hi = tl.load(row + byte + 1, mask=m2 & (byte + 1 < ROW_BYTES), other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> shift) & ((1 << BITS) - 1)
        vals = tl.where(m2, (code - QMAX).to(tl.float32), 0.0)
        tok = tl.load(scale_ptr + b * ss0 + h * ss1 + offs_n * ss2, mask=mask_n, other=0.0).to(tl.float32)
    elif FMT == 3:  # vht2 bands: per position bit offset, width, band, mul, offset (tab_ptr [5, D])
        bitpos = tl.load(tab_ptr + offs_d, mask=mask_d, other=0)
        width = tl.load(tab_ptr + ROW_D + offs_d, mask=mask_d, other=0)
        band = tl.load(tab_ptr + 2 * ROW_D + offs_d, mask=mask_d, other=0)
        mul = tl.load(tab_ptr + 3 * ROW_D + offs_d, mask=mask_d, other=0)
        off = tl.load(tab_ptr + 4 * ROW_D + offs_d, mask=mask_d, other=0)
        mk = m2 & (width > 0)[None, :]
        byte = (bitpos // 8)[None, :]
        shift = (bitpos % 8)[None, :]
        lo = tl.load(row + byte, mask=mk, other=0).to(tl.int32)
        hi = tl.load(row + byte + 1, mask=mk & (byte + 1 < ROW_BYTES), other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> shift) & ((1 << width) - 1)[None, :]
        srow = scale_ptr + b * ss0 + h * ss1 + offs_n[:, None] * ss2 + band[None, :]
        bsc = tl.load(srow, mask=mk, other=0.0).to(tl.float32)
        vals = tl.where(mk, (code * mul[None, :] - off[None, :]).to(tl.float32) * bsc, 0.0)
        tok = tl.where(mask_n, 1.0, 0.0)
    elif FMT == 4:  # tq: per position bit offset, width, segment, first level, segment row bytes
        bitpos = tl.load(tab_ptr + offs_d, mask=mask_d, other=0)
        width = tl.load(tab_ptr + ROW_D + offs_d, mask=mask_d, other=0)
        seg = tl.load(tab_ptr + 2 * ROW_D + offs_d, mask=mask_d, other=0)
        first = tl.load(tab_ptr + 3 * ROW_D + offs_d, mask=mask_d, other=0)
        nbytes = tl.load(tab_ptr + 4 * ROW_D + offs_d, mask=mask_d, other=0)
        row2 = codes2_ptr + b * c2s0 + h * c2s1 + offs_n[:, None] * c2s2
        byte = (bitpos // 8)[None, :]
        shift = (bitpos % 8)[None, :]
        in0 = m2 & (seg == 0)[None, :]
        in1 = m2 & (seg == 1)[None, :]
        more = (byte + 1) < nbytes[None, :]
        lo = tl.load(row + byte, mask=in0, other=0).to(tl.int32) + tl.load(row2 + byte, mask=in1, other=0).to(tl.int32)
        hi = tl.load(row + byte + 1, mask=in0 & more, other=0).to(tl.int32)
        hi += tl.load(row2 + byte + 1, mask=in1 & more, other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> shift) & ((1 << width) - 1)[None, :]
        vals = tl.load(lev_ptr + first[None, :] + code, mask=m2, other=0.0)
        tok = tl.load(scale_ptr + b * ss0 + h * ss1 + offs_n * ss2, mask=mask_n, other=0.0).to(tl.float32)
    else:  # ggml q4_0 / q8_0: 32-value blocks, fp16 d first
        j = offs_d % 32
        base = (offs_d // 32) * (18 if FMT == 1 else 34)  # block bytes
        dlo = tl.load(row + base[None, :], mask=m2, other=0).to(tl.uint16)
        dhi = tl.load(row + base[None, :] + 1, mask=m2, other=0).to(tl.uint16)
        dsc = (dlo | (dhi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        if FMT == 1:
            byte = tl.load(row + (base + 2 + j % 16)[None, :], mask=m2, other=0).to(tl.int32)
            code = (byte >> ((j // 16) * 4)[None, :]) & 15
            vals = (code - 8).to(tl.float32) * dsc
        else:
            qs = tl.load(row + (base + 2 + j)[None, :], mask=m2, other=0)
            vals = qs.to(tl.int8, bitcast=True).to(tl.float32) * dsc
        vals = tl.where(m2, vals, 0.0)
        tok = tl.where(mask_n, 1.0, 0.0)
    return vals, tok


def _decode_kernel(
    q_ptr,
    kc_ptr,
    ks_ptr,
    kt_ptr,
    vc_ptr,
    vs_ptr,
    vt_ptr,
    kc2_ptr,
    kl_ptr,
    vc2_ptr,
    vl_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    T,
    KV,
    G,
    kcs0,
    kcs1,
    kcs2,
    kss0,
    kss1,
    kss2,
    vcs0,
    vcs1,
    vcs2,
    vss0,
    vss1,
    vss2,
    kc2s0,
    kc2s1,
    kc2s2,
    vc2s0,
    vc2s1,
    vc2s2,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr,
    K_BITS: tl.constexpr,
    K_ROW: tl.constexpr,
    K_QMAX: tl.constexpr,
    V_FMT: tl.constexpr,
    V_BITS: tl.constexpr,
    V_ROW: tl.constexpr,
    V_QMAX: tl.constexpr,
):
    pid = tl.program_id(0)  # (batch * kv + kv head) * group + query head in the group
    n = pid // G
    b = (n // KV).to(tl.int64)
    h = (n % KV).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    q = tl.load(q_ptr + pid.to(tl.int64) * D + offs_d, mask=mask_d, other=0.0)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for start in range(0, T, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < T
        offs_n64 = offs_n.to(tl.int64)
        kv_rows, ktok = _rows(
            kc_ptr, ks_ptr, kt_ptr, kc2_ptr, kl_ptr, b, h, offs_n64, mask_n, offs_d, mask_d,
            kcs0, kcs1, kcs2, kss0, kss1, kss2, kc2s0, kc2s1, kc2s2, K_FMT, K_BITS, K_ROW, K_QMAX, D,
        )  # fmt: skip
        s = tl.sum(kv_rows * q[None, :], axis=1) * ktok
        s = tl.where(mask_n, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)  # 0 on the first block (m_i = -inf)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v_rows, vtok = _rows(
            vc_ptr, vs_ptr, vt_ptr, vc2_ptr, vl_ptr, b, h, offs_n64, mask_n, offs_d, mask_d,
            vcs0, vcs1, vcs2, vss0, vss1, vss2, vc2s0, vc2s1, vc2s2, V_FMT, V_BITS, V_ROW, V_QMAX, D,
        )  # fmt: skip
        acc = acc * alpha + tl.sum((p * vtok)[:, None] * v_rows, axis=0)
        m_i = m_new
    tl.store(m_ptr + pid, m_i)
    tl.store(l_ptr + pid, l_i)
    tl.store(acc_ptr + pid.to(tl.int64) * D + offs_d, acc, mask=mask_d)


_ROWS_PY = _rows
_KERNEL_PY = _decode_kernel


def _build() -> Any:
    """The jitted kernel for the current ``TRITON_INTERPRET`` mode (built once per mode).

    Also rebinds the module global ``_rows`` to the helper jitted for that mode (the kernel calls it
    through the module's globals), so switching modes within one process works, though not from two
    threads at once.
    """
    global tl
    mode = triton_interpret()
    with _lock:
        if mode not in _kernels:
            import triton
            import triton.language

            tl = triton.language
            _kernels[mode] = (triton.jit(_ROWS_PY), triton.jit(_KERNEL_PY))
        rows, kernel = _kernels[mode]
        globals()["_rows"] = rows
        return kernel


def _fields(
    packed: Packed, fmt: tuple[int, int, int, int, str], what: str, scales: int = 1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The codes (uint8, last dim contiguous) and, for intB, vht2 and tq, the fp16 scales (tq: norms)."""
    kind, _, row_bytes, _, name = fmt
    codes = packed.tensors.get(name)
    if codes is None or codes.dtype != torch.uint8 or codes.dim() != 4 or codes.shape[3] != row_bytes:
        got = "missing" if codes is None else f"{codes.dtype} {tuple(codes.shape)}"
        raise ValueError(
            f"packed {what} field {name!r} should be uint8 [..., {row_bytes}], got {got}: "
            "pass the codec that encoded this cache"
        )
    if codes.stride(3) != 1:
        codes = codes.contiguous()
    if kind not in (_FMT_INT, _FMT_BANDED, _FMT_TQ):
        return codes, None
    field = "norm" if kind == _FMT_TQ else "scale"
    scale = packed.tensors.get(field)
    if scale is None or scale.dtype != torch.float16 or tuple(scale.shape) != (*codes.shape[:3], scales):
        raise ValueError(f"packed {what} field {field!r} must be float16 [batch, heads, seq, {scales}]")
    if scale.stride(3) != 1:
        scale = scale.contiguous()
    return codes, scale


def _side(
    packed: Packed, core: Codec, fmt: tuple[int, int, int, int, str], d: int, device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One side's kernel inputs: codes, scales, position table, second codes tensor, levels, basis.

    Inputs a format does not read are stand-ins (the codes again, with their strides): any pointer will do.
    """
    table = basis = None
    codes2 = levels = None
    scales = 1
    if isinstance(core, VHT2Codec):
        table, basis = _band_table(core, d, device)
        scales = len(core.bands(d))
    codes, scale = _fields(packed, fmt, what, scales)
    if isinstance(core, TurboQuant):
        table, levels, basis = _tq_table(core, d, device)
        segments = core.segments(d)
        if len(segments) == 2:
            name, start, stop, bits = segments[1]
            codes2, _ = _fields(packed, (fmt[0], 0, packed_nbytes(stop - start, bits), 0, name), what)
            if tuple(codes2.shape[:3]) != tuple(codes.shape[:3]):
                raise ValueError(f"packed {what} fields {fmt[4]!r} and {name!r} hold different token counts")
    stand_in = codes
    return (
        codes,
        scale,
        table if table is not None else stand_in,
        codes2 if codes2 is not None else stand_in,
        levels if levels is not None else stand_in,
        basis,
    )


def fused_decode_triton(
    q: torch.Tensor,
    packed_k: Packed,
    packed_v: Packed,
    k_core: Codec,
    v_core: Codec,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of one query step over packed K/V, with the Triton kernel.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, already multiplied by the softmax scale and
            rotated into ``k_core``'s basis (rotation wrappers peeled by the caller).
        packed_k, packed_v: fields ``[batch, kv_heads, seq_len, ...]`` written by ``k_core`` / ``v_core``,
            on ``q``'s device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        k_core, v_core: the codecs that store the codes (no rotation or centering wrapper).
        block_n: tokens per block (power of two; default 64 for head_dim <= 64, else 32).

    Returns:
        ``(m, l, acc)``: running max ``[batch, kv_heads, group]`` of the scores, softmax denominator
        (same shape) and unnormalised weighted V sum ``[batch, kv_heads, group, head_dim]`` in
        ``v_core``'s basis, all float32.

    Raises:
        ValueError: a codec the kernel does not read, malformed packed fields, triton missing, or CPU
            tensors without ``TRITON_INTERPRET=1``.
    """
    b, kv, g, d = q.shape
    fk, fv = _format(k_core, d), _format(v_core, d)
    if fk is None or fv is None:
        bad = [c.spec for c, f in ((k_core, fk), (v_core, fv)) if f is None]
        raise ValueError(
            f"the Triton decode kernel does not read {', '.join(repr(s) for s in bad)} (at head_dim {d}); "
            f"it reads {TRITON_SUPPORTED}"
        )
    if not triton_available():
        raise ValueError("the Triton decode kernel needs the triton package (pip install triton)")
    if q.device.type != "cuda" and not triton_interpret():
        raise ValueError(
            f"the Triton decode kernel needs CUDA tensors, q is on {q.device}; CPU tensors only run under the "
            "Triton interpreter (set TRITON_INTERPRET=1)"
        )
    kc, ks, kt_t, kc2, kl, k_basis = _side(packed_k, k_core, fk, d, q.device, "K")
    vc, vs, vt_t, vc2, vl, v_basis = _side(packed_v, v_core, fv, d, q.device, "V")
    ks_t = ks if ks is not None else kc  # (unused by the ggml branch: any pointer will do)
    vs_t = vs if vs is not None else vc
    if k_basis is not None:  # the query in the order the kernel unpacks K's coefficients
        q = q.to(torch.float32) @ k_basis
    kss = ks.stride()[:3] if ks is not None else (0, 0, 0)
    vss = vs.stride()[:3] if vs is not None else (0, 0, 0)
    t = packed_k.seq_len
    qc = q.to(torch.float32).contiguous()
    m = torch.empty(b, kv, g, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b, kv, g, d, dtype=torch.float32, device=q.device)
    block_d = max(16, 1 << (d - 1).bit_length())
    bn = block_n if block_n is not None else (64 if block_d <= 64 else 32)
    kernel = _build()
    kernel[(b * kv * g,)](
        qc, kc, ks_t, kt_t, vc, vs_t, vt_t, kc2, kl, vc2, vl, m, l_sum, acc, t, kv, g,
        *kc.stride()[:3], *kss, *vc.stride()[:3], *vss, *kc2.stride()[:3], *vc2.stride()[:3],
        D=d, BLOCK_D=block_d, BLOCK_N=bn,
        K_FMT=fk[0], K_BITS=fk[1], K_ROW=fk[2], K_QMAX=fk[3],
        V_FMT=fv[0], V_BITS=fv[1], V_ROW=fv[2], V_QMAX=fv[3],
    )  # fmt: skip
    if v_basis is not None:  # the V sum from coefficient order back to v_core's (model) basis
        acc = acc @ v_basis.T
    return m, l_sum, acc
