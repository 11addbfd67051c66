"""The Triton decode-attention kernel bodies, jitted on first use (see :mod:`walshkv.attention.triton_decode`).

The bodies are plain functions, so this module imports without triton; :func:`build_kernel` applies
``triton.jit`` for the current ``TRITON_INTERPRET`` mode. The format ids below are the values of the
kernels' ``K_FMT``/``V_FMT`` constexprs (the bodies compare them as literals: Triton reads only constexpr
globals); the decode glue picks them per codec.

Two kernels share the row decoder :func:`_rows`: :func:`_decode_kernel` (one program per query head, the
query already in the K codec's basis) and :func:`_prerope_kernel` (one program per kv head, for ``prerope+``
K: each decoded K tile is mapped to the pre-RoPE keys, shifted by the mean and rotated to its tokens'
positions once, then scored against all the group's query heads).
"""

# ruff: noqa: N803  (Triton convention: upper-case kernel arguments for sizes and constexprs)

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = [
    "FMT_BANDED",
    "FMT_INT",
    "FMT_Q4_0",
    "FMT_Q8_0",
    "FMT_TCQ",
    "FMT_TQ",
    "build_kernel",
    "build_prerope_kernel",
    "triton_available",
    "triton_interpret",
]

FMT_INT = 0  # intB, B in 2..8
FMT_Q4_0 = 1
FMT_Q8_0 = 2
FMT_BANDED = 3  # vht2
FMT_TQ = 4  # tq: Lloyd-Max codes in one or two code tensors, one fp16 norm
FMT_TCQ = 5  # tcq: tq's fields, each value the trellis table at the state the codes ending at it form

_lock = threading.Lock()
_available: bool | None = None
_kernels: dict[bool, tuple[Any, Any, Any]] = {}  # interpret mode -> jitted (_rows, _decode_kernel, _prerope_kernel)


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


# The kernel bodies are plain functions here (so this module imports without triton); build_kernel() applies
# ``triton.jit`` to them for the current mode and binds the module globals ``tl`` and ``_rows`` that the
# bodies use (Triton resolves a kernel's names, including the jitted helpers it calls, in the module's
# globals; its interpreter even re-executes the source there, so closures would not do).
tl: Any = None  # triton.language, bound by build_kernel()


def _rows(
    codes_ptr,
    scale_ptr,
    tab_ptr,
    codes2_ptr,
    lev_ptr,
    offc,
    offs,
    offc2,
    mask_n,
    offs_d,
    mask_d,
    FMT: tl.constexpr,
    BITS: tl.constexpr,
    ROW_BYTES: tl.constexpr,
    QMAX: tl.constexpr,
    ROW_D: tl.constexpr,
    S_RAW: tl.constexpr,
):
    """Unpacked rows ``[BLOCK_N, BLOCK_D]`` (block scales applied) and per-token scales ``[BLOCK_N]``.

    ``offc``, ``offs``, ``offc2`` ``[BLOCK_N]``: where each token's codes, scales and second codes start (elements
    from the pointers: the caller resolves batch, head, token or a block table into them). ``S_RAW``: 0, typed fp16
    scales; 1, the fp16 scales as their bytes (``scale_ptr`` uint8, ``offs`` in bytes; a page slot does not align
    them); 2 (tq/tcq at ``norm=8``), one log byte per token, ``2 ** ((byte - 128) / 8)`` and 0 for byte 0
    (:mod:`walshkv.ops.lognorm`).
    """
    row = codes_ptr + offc[:, None]
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
        if S_RAW:
            srow = scale_ptr + offs[:, None] + 2 * band[None, :]
            blo = tl.load(srow, mask=mk, other=0).to(tl.uint16)
            bhi = tl.load(srow + 1, mask=mk, other=0).to(tl.uint16)
            bsc = (blo | (bhi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            bsc = tl.load(scale_ptr + offs[:, None] + band[None, :], mask=mk, other=0.0).to(tl.float32)
        vals = tl.where(mk, (code * mul[None, :] - off[None, :]).to(tl.float32) * bsc, 0.0)
        tok = tl.where(mask_n, 1.0, 0.0)
    elif FMT == 4:  # tq: per position bit offset, width, segment, first level, segment row bytes
        bitpos = tl.load(tab_ptr + offs_d, mask=mask_d, other=0)
        width = tl.load(tab_ptr + ROW_D + offs_d, mask=mask_d, other=0)
        seg = tl.load(tab_ptr + 2 * ROW_D + offs_d, mask=mask_d, other=0)
        first = tl.load(tab_ptr + 3 * ROW_D + offs_d, mask=mask_d, other=0)
        nbytes = tl.load(tab_ptr + 4 * ROW_D + offs_d, mask=mask_d, other=0)
        row2 = codes2_ptr + offc2[:, None]
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
    elif FMT == 5:  # tcq: BITS taps, each (source bit offset, width, segment, segment row bytes, state shift)
        row2 = codes2_ptr + offc2[:, None]
        state = tl.zeros(m2.shape, dtype=tl.int32)
        for t in tl.static_range(BITS):
            base = t * 5 * ROW_D
            bitpos = tl.load(tab_ptr + base + offs_d, mask=mask_d, other=0)
            width = tl.load(tab_ptr + base + ROW_D + offs_d, mask=mask_d, other=0)
            seg = tl.load(tab_ptr + base + 2 * ROW_D + offs_d, mask=mask_d, other=0)
            nbytes = tl.load(tab_ptr + base + 3 * ROW_D + offs_d, mask=mask_d, other=0)
            sh = tl.load(tab_ptr + base + 4 * ROW_D + offs_d, mask=mask_d, other=32)
            use = m2 & (sh < 32)[None, :]
            byte = (bitpos // 8)[None, :]
            shift = (bitpos % 8)[None, :]
            in0 = use & (seg == 0)[None, :]
            in1 = use & (seg == 1)[None, :]
            more = (byte + 1) < nbytes[None, :]
            lo = tl.load(row + byte, mask=in0, other=0).to(tl.int32)
            lo += tl.load(row2 + byte, mask=in1, other=0).to(tl.int32)
            hi = tl.load(row + byte + 1, mask=in0 & more, other=0).to(tl.int32)
            hi += tl.load(row2 + byte + 1, mask=in1 & more, other=0).to(tl.int32)
            code = ((lo | (hi << 8)) >> shift) & ((1 << width) - 1)[None, :]
            state = state | tl.where(use, code << tl.where(sh < 32, sh, 0)[None, :], 0)
        vals = tl.load(lev_ptr + (state & QMAX), mask=m2, other=0.0)
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
    if FMT == 0 or FMT == 4 or FMT == 5:  # one fp16 factor per token: intB's scale, tq's and tcq's norm
        if S_RAW == 2:  # tq/tcq at norm=8: a log byte
            nb = tl.load(scale_ptr + offs, mask=mask_n, other=0).to(tl.float32)
            tok = tl.where(nb > 0.0, tl.exp2((nb - 128.0) * 0.125), 0.0)
        elif S_RAW:
            slo = tl.load(scale_ptr + offs, mask=mask_n, other=0).to(tl.uint16)
            shi = tl.load(scale_ptr + offs + 1, mask=mask_n, other=0).to(tl.uint16)
            tok = (slo | (shi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        else:
            tok = tl.load(scale_ptr + offs, mask=mask_n, other=0.0).to(tl.float32)
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
    bt_ptr,
    lens_ptr,
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
    BT_STRIDE,
    NUM_BLOCKS,
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
    K_RAW: tl.constexpr = False,
    V_RAW: tl.constexpr = False,
    PAGED: tl.constexpr = False,
    BS: tl.constexpr = 1,
):
    """One program per (batch or request, query head). ``PAGED``: the fields are pages whose "batch" is the block
    and "token" the row in it (``BS`` rows a block); request ``b`` has ``lens[b]`` tokens and its token ``t`` is row
    ``t % BS`` of block ``bt[b * BT_STRIDE + t // BS]`` (ids clamped to ``0 .. NUM_BLOCKS - 1``: the caller checks
    them on the device). Else token ``t`` of batch ``b`` is at the strides, ``T`` tokens each."""
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
    if PAGED:  # noqa: SIM108  (a constexpr branch: Triton compiles one side)
        t_end = tl.load(lens_ptr + b).to(tl.int32)
    else:
        t_end = T
    for start in range(0, t_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < t_end
        offs_n64 = offs_n.to(tl.int64)
        if PAGED:
            blk = tl.load(bt_ptr + b * BT_STRIDE + offs_n64 // BS, mask=mask_n, other=0).to(tl.int64)
            blk = tl.minimum(tl.maximum(blk, 0), NUM_BLOCKS - 1)
            rown = offs_n64 % BS
        else:
            blk = b
            rown = offs_n64
        kofc = blk * kcs0 + h * kcs1 + rown * kcs2
        kofs = blk * kss0 + h * kss1 + rown * kss2
        kofc2 = blk * kc2s0 + h * kc2s1 + rown * kc2s2
        kv_rows, ktok = _rows(
            kc_ptr, ks_ptr, kt_ptr, kc2_ptr, kl_ptr, kofc, kofs, kofc2, mask_n, offs_d, mask_d,
            K_FMT, K_BITS, K_ROW, K_QMAX, D, K_RAW,
        )  # fmt: skip
        s = tl.sum(kv_rows * q[None, :], axis=1) * ktok
        s = tl.where(mask_n, s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp(m_i - m_new)  # 0 on the first block (m_i = -inf)
        p = tl.exp(s - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vofc = blk * vcs0 + h * vcs1 + rown * vcs2
        vofs = blk * vss0 + h * vss1 + rown * vss2
        vofc2 = blk * vc2s0 + h * vc2s1 + rown * vc2s2
        v_rows, vtok = _rows(
            vc_ptr, vs_ptr, vt_ptr, vc2_ptr, vl_ptr, vofc, vofs, vofc2, mask_n, offs_d, mask_d,
            V_FMT, V_BITS, V_ROW, V_QMAX, D, V_RAW,
        )  # fmt: skip
        acc = acc * alpha + tl.sum((p * vtok)[:, None] * v_rows, axis=0)
        m_i = m_new
    tl.store(m_ptr + pid, m_i)
    tl.store(l_ptr + pid, l_i)
    tl.store(acc_ptr + pid.to(tl.int64) * D + offs_d, acc, mask=mask_d)


def _prerope_kernel(
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
    mt_ptr,
    mu_ptr,
    cos_ptr,
    sin_ptr,
    m_ptr,
    l_ptr,
    acc_ptr,
    T,
    KV,
    G,
    START,
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
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_FMT: tl.constexpr,
    K_BITS: tl.constexpr,
    K_ROW: tl.constexpr,
    K_QMAX: tl.constexpr,
    V_FMT: tl.constexpr,
    V_BITS: tl.constexpr,
    V_ROW: tl.constexpr,
    V_QMAX: tl.constexpr,
    K_RAW: tl.constexpr = 0,
    V_RAW: tl.constexpr = 0,
):
    """``prerope+`` K: one program per (batch, kv head) and all ``G`` query heads of its group.

    Per block of ``BLOCK_N`` tokens: K rows ``[BLOCK_N, BLOCK_D]`` (row factor applied), pre-RoPE keys
    ``z = rows @ mt[h] + mu[h]`` as two halves ``[BLOCK_N, BLOCK_H]``, RoPE at positions ``START + n`` from
    the half tables ``cos/sin [N, HALF]``, scores ``[BLOCK_G, BLOCK_N]`` with the (scaled, model-basis)
    queries, online softmax per query head, V rows as in :func:`_decode_kernel`. ``mt``: ``[KV, D, D]``
    float32 contiguous; ``mu``: ``[KV, D]``; ``q``: ``[B * KV * G, D]``; outputs ``m, l [B * KV * G]``,
    ``acc [B * KV * G, D]``.
    """
    pid = tl.program_id(0)  # batch * kv + kv head
    b = (pid // KV).to(tl.int64)
    h = (pid % KV).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < HALF
    offs_g = tl.arange(0, BLOCK_G)
    mask_g = offs_g < G
    heads = pid.to(tl.int64) * G + offs_g  # rows of q, m, l, acc
    q_row = q_ptr + heads[:, None] * D + offs_h[None, :]
    mask_q = mask_g[:, None] & mask_h[None, :]
    q1 = tl.load(q_row, mask=mask_q, other=0.0)  # [BLOCK_G, BLOCK_H]: first half of head_dim
    q2 = tl.load(q_row + HALF, mask=mask_q, other=0.0)
    mt_row = mt_ptr + h * D * D + offs_d[:, None] * D + offs_h[None, :]  # [BLOCK_D, BLOCK_H]
    mask_mt = mask_d[:, None] & mask_h[None, :]
    mu1 = tl.load(mu_ptr + h * D + offs_h, mask=mask_h, other=0.0)
    mu2 = tl.load(mu_ptr + h * D + HALF + offs_h, mask=mask_h, other=0.0)
    m_i = tl.full([BLOCK_G], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for n0 in range(0, T, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < T
        offs_n64 = offs_n.to(tl.int64)
        k_rows, ktok = _rows(
            kc_ptr, ks_ptr, kt_ptr, kc2_ptr, kl_ptr, b * kcs0 + h * kcs1 + offs_n64 * kcs2,
            b * kss0 + h * kss1 + offs_n64 * kss2, b * kc2s0 + h * kc2s1 + offs_n64 * kc2s2, mask_n, offs_d, mask_d,
            K_FMT, K_BITS, K_ROW, K_QMAX, D, K_RAW,
        )  # fmt: skip
        k_rows = k_rows * ktok[:, None]
        mt1 = tl.load(mt_row, mask=mask_mt, other=0.0)  # (re-read per block from cache: fewer live registers)
        mt2 = tl.load(mt_row + HALF, mask=mask_mt, other=0.0)
        z1 = tl.dot(k_rows, mt1, input_precision="ieee") + mu1[None, :]  # [BLOCK_N, BLOCK_H]
        z2 = tl.dot(k_rows, mt2, input_precision="ieee") + mu2[None, :]
        pos = (START + offs_n64)[:, None] * HALF + offs_h[None, :]
        mask_r = mask_n[:, None] & mask_h[None, :]
        cos = tl.load(cos_ptr + pos, mask=mask_r, other=0.0)
        sin = tl.load(sin_ptr + pos, mask=mask_r, other=0.0)
        k1 = z1 * cos - z2 * sin
        k2 = z2 * cos + z1 * sin
        s = tl.dot(q1, tl.trans(k1), input_precision="ieee")
        s += tl.dot(q2, tl.trans(k2), input_precision="ieee")  # [BLOCK_G, BLOCK_N]
        s = tl.where(mask_n[None, :], s, -float("inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)  # 0 on the first block (m_i = -inf)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v_rows, vtok = _rows(
            vc_ptr, vs_ptr, vt_ptr, vc2_ptr, vl_ptr, b * vcs0 + h * vcs1 + offs_n64 * vcs2,
            b * vss0 + h * vss1 + offs_n64 * vss2, b * vc2s0 + h * vc2s1 + offs_n64 * vc2s2, mask_n, offs_d, mask_d,
            V_FMT, V_BITS, V_ROW, V_QMAX, D, V_RAW,
        )  # fmt: skip
        acc = acc * alpha[:, None] + tl.dot(p, v_rows * vtok[:, None], input_precision="ieee")
        m_i = m_new
    tl.store(m_ptr + heads, m_i, mask=mask_g)
    tl.store(l_ptr + heads, l_i, mask=mask_g)
    tl.store(acc_ptr + heads[:, None] * D + offs_d[None, :], acc, mask=mask_g[:, None] & mask_d[None, :])


_ROWS_PY = _rows
_KERNEL_PY = _decode_kernel
_PREROPE_PY = _prerope_kernel


def _build() -> tuple[Any, Any, Any]:
    """The jitted ``(_rows, _decode_kernel, _prerope_kernel)`` for the current ``TRITON_INTERPRET`` mode.

    Built once per mode; also rebinds the module global ``_rows`` to the helper jitted for that mode (the
    kernels call it through the module's globals), so switching modes within one process works, though not
    from two threads at once.
    """
    global tl
    mode = triton_interpret()
    with _lock:
        if mode not in _kernels:
            import triton
            import triton.language

            tl = triton.language
            _kernels[mode] = (triton.jit(_ROWS_PY), triton.jit(_KERNEL_PY), triton.jit(_PREROPE_PY))
        built = _kernels[mode]
        globals()["_rows"] = built[0]
        return built


def build_kernel() -> Any:
    """The jitted :func:`_decode_kernel` for the current ``TRITON_INTERPRET`` mode (see :func:`_build`)."""
    return _build()[1]


def build_prerope_kernel() -> Any:
    """The jitted :func:`_prerope_kernel` for the current ``TRITON_INTERPRET`` mode (see :func:`_build`)."""
    return _build()[2]
