"""Fused GPU decode attention straight from packed K/V codes, in Triton.

One Triton program per (batch, query head) walks the cached tokens of its kv head (grouped-query
attention: query head ``h`` reads kv head ``h // group``) in blocks of ``BLOCK_N`` tokens. For each
block it loads the packed K rows and their scales, unpacks them in registers, computes the scores
``(c - qmax) . q * scale_t`` (the softmax scale is already in ``q``), updates an online softmax
(running max ``m`` and denominator ``l``), then unpacks the block's V rows the same way and adds
``p_t * scale_t * (c_t - qmax)`` to a float32 accumulator. It writes the partial state ``(m, l, acc)``;
:func:`walshkv.attention.decode_attention` merges it with the full-precision window and undoes
the V rotation exactly as for the other backends.

Packed layouts read (see :mod:`walshkv.attention.cpu` for the byte-level description; the last
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

``prerope+`` K (keys stored before RoPE, :mod:`walshkv.codecs.prerope`) has its own kernel,
:func:`fused_decode_triton_prerope`: RoPE depends on each key's position, so the query cannot be moved
into the codec's basis once. One program per (batch, kv head) decodes a tile of ``BLOCK_N`` K rows as
above, maps it to the pre-RoPE keys with one ``[head_dim, head_dim]`` matrix per kv head (the core's
basis, the rotations and ``eq+``'s inverse folded together, :func:`walshkv.attention.keys.key_transform`),
adds the mean (``center+``), rotates each row by its position's angles (cos/sin tables indexed by
position) and scores it against all the group's query heads, which are in the model's basis. V is read as
in the other kernel. The matrix and mean are built once per codec and device and cached.

The kernels are built on first use, separately for compiled and interpreted mode: ``TRITON_INTERPRET``
is read at each call (Triton itself reads it when a function is decorated), so setting
``TRITON_INTERPRET=1`` before the first call, even after this module was imported, runs the kernel on
CPU tensors through Triton's interpreter (slow; that is how the tests run it without a GPU). The kernel
bodies are in :mod:`walshkv.attention.triton_kernels`; this module describes the codecs to them.

Each program reads its kv head's codes on its own, so with a group of ``g`` query heads the codes are
read ``g`` times (mostly from L2); there is no split of long caches over several programs
(flash-decoding) yet.
"""

from __future__ import annotations

import math

import torch

from walshkv.attention.keys import PreRopeParts, key_transform, rope_half_tables, split_prerope
from walshkv.attention.peeling import core_codec
from walshkv.attention.triton_kernels import (
    FMT_BANDED,
    FMT_INT,
    FMT_Q4_0,
    FMT_Q8_0,
    FMT_TCQ,
    FMT_TQ,
    build_kernel,
    build_prerope_kernel,
    triton_available,
    triton_interpret,
)
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.ggml import QK, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.trellis import TrellisQuant
from walshkv.codecs.turbo import TurboQuant
from walshkv.codecs.vht2 import VHT2Codec
from walshkv.ops import trellis
from walshkv.ops.packing import packed_nbytes

__all__ = [
    "TRITON_SUPPORTED",
    "fused_decode_triton",
    "fused_decode_triton_prerope",
    "triton_available",
    "triton_interpret",
    "triton_supports",
    "triton_supports_prerope",
]

#: Human-readable list of the (inner) codecs the Triton kernel reads.
TRITON_SUPPORTED = "int2..int8, q4_0, q8_0, vht2, tq, tcq (each also under rot+, rrot+, center+, eq+ and prerope+)"


def _format(core: Codec, head_dim: int) -> tuple[int, int, int, int, str] | None:
    """``(fmt, bits, row_bytes, qmax, codes field)`` for the kernel, or ``None`` if it cannot read ``core``."""
    if type(core) is IntCodec and 2 <= core.bits <= 8 and head_dim >= 1:
        return FMT_INT, core.bits, packed_nbytes(head_dim, core.bits), (1 << (core.bits - 1)) - 1, "codes"
    if type(core) is GGMLCodec and core.name in ("q4_0", "q8_0") and head_dim >= QK and head_dim % QK == 0:
        fmt = FMT_Q4_0 if core.name == "q4_0" else FMT_Q8_0
        return fmt, 4 if fmt == FMT_Q4_0 else 8, head_dim // QK * core.block_bytes, 0, "blocks"
    if type(core) is VHT2Codec:
        try:
            core.check_head_dim(head_dim)
            row_bytes = sum(band.nbytes for band in core.bands(head_dim))
            core.perm(head_dim)
        except ValueError:  # not bound yet (auto / variance without calibration), or a bad head_dim
            return None
        return FMT_BANDED, 0, row_bytes, 0, "codes"
    if type(core) is TurboQuant:
        try:
            core.check_head_dim(head_dim)
        except ValueError:
            return None
        name, start, stop, bits = core.segments(head_dim)[0]
        return FMT_TQ, 0, packed_nbytes(stop - start, bits), 0, name
    if type(core) is TrellisQuant:  # BITS: the taps per state, QMAX: the state mask
        try:
            core.check_head_dim(head_dim)
        except ValueError:
            return None
        name, start, stop, bits = core.rotation.segments(head_dim)[0]
        taps = _tcq_table(core, head_dim, torch.device("cpu"))[0].shape[0] // 5
        return FMT_TCQ, taps, packed_nbytes(stop - start, bits), (1 << core.state_bits) - 1, name
    return None


_TCQ_TABLES: dict[tuple[str, int, str], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _tcq_table(
    core: TrellisQuant, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per tap ``t`` and position ``j``: int32 rows (bit offset of code ``(j - t) mod head_dim`` in its segment's row,
    its width, its segment, the segment's row bytes, its shift in value ``j``'s state, 32 where the state needs no
    such code), ``[taps * 5, head_dim]``; the trellis table divided by ``sqrt(head_dim)``; the basis (as tq's)."""
    key = (core.spec, head_dim, str(device))
    if key in _TCQ_TABLES:
        return _TCQ_TABLES[key]
    segments = core.rotation.segments(head_dim)
    where = []  # per position: (bit offset in its segment, width, segment, segment row bytes)
    for i, (_, start, stop, bits) in enumerate(segments):
        where += [((j - start) * bits, bits, i, packed_nbytes(stop - start, bits)) for j in range(start, stop)]
    src, shift = trellis.state_taps(core.widths(head_dim), core.state_bits)
    at = torch.tensor(where, dtype=torch.int32)[src]  # [taps, head_dim, 4]: where each tap's code sits
    table = torch.cat([at, shift[..., None]], dim=-1).permute(0, 2, 1).contiguous()  # [taps, 5, head_dim]
    depth = src.shape[0]
    levels = (core.table() / math.sqrt(head_dim)).to(torch.float32)
    basis = core.rotation.unrotate(torch.eye(head_dim)).T.contiguous()
    _TCQ_TABLES[key] = (table.reshape(depth * 5, head_dim).to(device), levels.to(device), basis.to(device))
    return _TCQ_TABLES[key]


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
    """True if the Triton kernels read ``codec``'s packed rows (after peeling rotations and centering; a bound
    ``prerope+`` K codec through :func:`fused_decode_triton_prerope`)."""
    if isinstance(codec, PreRope):
        return triton_supports_prerope(codec, head_dim)
    return _format(core_codec(codec), head_dim) is not None


def _fields(
    packed: Packed, fmt: tuple[int, int, int, int, str], what: str, scales: int = 1, norm8: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """The codes (uint8, last dim contiguous), for intB, vht2 and tq the fp16 scales (tq: norms), and how the kernel
    reads those (``S_RAW``): 0 typed fp16, 1 their raw bytes (``uint8 [..., 2 * scales]``, a page slot's view: the
    kernel reads them bytewise), 2 one log byte per token (``norm8``: tq/tcq at ``norm=8``, ``uint8 [..., 1]``)."""
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
    if kind not in (FMT_INT, FMT_BANDED, FMT_TQ, FMT_TCQ):
        return codes, None, False
    field = "norm" if kind in (FMT_TQ, FMT_TCQ) else "scale"
    scale = packed.tensors.get(field)
    lead = (*codes.shape[:3],)
    if norm8:
        if scale is None or scale.dtype != torch.uint8 or tuple(scale.shape) != (*lead, 1):
            raise ValueError(f"packed {what} field {field!r} must be uint8 [batch, heads, seq, 1] (a log-coded norm)")
        return codes, scale, 2
    raw = scale is not None and scale.dtype == torch.uint8 and tuple(scale.shape) == (*lead, 2 * scales)
    if scale is None or not (raw or (scale.dtype == torch.float16 and tuple(scale.shape) == (*lead, scales))):
        raise ValueError(
            f"packed {what} field {field!r} must be float16 [batch, heads, seq, {scales}] (or its bytes, uint8 "
            f"[..., {2 * scales}])"
        )
    if scale.stride(3) != 1:
        scale = scale.contiguous()
    return codes, scale, int(raw)


def _side(
    packed: Packed, core: Codec, fmt: tuple[int, int, int, int, str], d: int, device: torch.device, what: str
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """One side's kernel inputs: codes, scales, position table, second codes tensor, levels, basis, and how the
    scales are read (``S_RAW`` of :func:`_fields`).

    Inputs a format does not read are stand-ins (the codes again, with their strides): any pointer will do.
    """
    table = basis = None
    codes2 = levels = None
    scales = 1
    if isinstance(core, VHT2Codec):
        table, basis = _band_table(core, d, device)
        scales = len(core.bands(d))
    rotation = core.rotation if isinstance(core, TrellisQuant) else core
    norm8 = isinstance(rotation, TurboQuant) and rotation.norm_bits == 8
    codes, scale, raw = _fields(packed, fmt, what, scales, norm8)
    if isinstance(core, (TurboQuant, TrellisQuant)):
        table, levels, basis = (
            _tq_table(core, d, device) if isinstance(core, TurboQuant) else _tcq_table(core, d, device)
        )
        segments = core.segments(d) if isinstance(core, TurboQuant) else core.rotation.segments(d)
        if len(segments) == 2:
            name, start, stop, bits = segments[1]
            codes2, _, _ = _fields(packed, (fmt[0], 0, packed_nbytes(stop - start, bits), 0, name), what, 1, norm8)
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
        raw,
    )


def _check_launch(fk: object, fv: object, k_spec: str, v_spec: str, d: int, device: torch.device) -> None:
    """Refuse unreadable codecs, a missing triton package and CPU tensors outside the interpreter."""
    if fk is None or fv is None:
        bad = [spec for spec, f in ((k_spec, fk), (v_spec, fv)) if f is None]
        raise ValueError(
            f"the Triton decode kernel does not read {', '.join(repr(s) for s in bad)} (at head_dim {d}); "
            f"it reads {TRITON_SUPPORTED}"
        )
    if not triton_available():
        raise ValueError("the Triton decode kernel needs the triton package (pip install triton)")
    if device.type != "cuda" and not triton_interpret():
        raise ValueError(
            f"the Triton decode kernel needs CUDA tensors, q is on {device}; CPU tensors only run under the "
            "Triton interpreter (set TRITON_INTERPRET=1)"
        )


def fused_decode_triton(
    q: torch.Tensor,
    packed_k: Packed,
    packed_v: Packed,
    k_core: Codec,
    v_core: Codec,
    block_n: int | None = None,
    paged: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of one query step over packed K/V, with the Triton kernel.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, already multiplied by the softmax scale and
            rotated into ``k_core``'s basis (rotation wrappers peeled by the caller).
        packed_k, packed_v: fields ``[batch, kv_heads, seq_len, ...]`` written by ``k_core`` / ``v_core``,
            on ``q``'s device (CUDA, or CPU under ``TRITON_INTERPRET=1``). fp16 scales may be given as their bytes
            (``uint8 [..., 2 * scales]``).
        k_core, v_core: the codecs that store the codes (no rotation or centering wrapper).
        block_n: tokens per block (power of two; default 64 for head_dim <= 64, else 32).
        paged: ``(block_table, seq_lens)``, integer ``[batch, max_blocks]`` and ``[batch]`` on ``q``'s device: the
            fields are pages ``[num_blocks, kv_heads, block_size, ...]`` and request ``b``'s token ``t`` is row
            ``t % block_size`` of block ``block_table[b, t // block_size]``, ``seq_lens[b]`` tokens (read on the
            device: nothing here waits for the GPU, so the launch can be captured in a CUDA graph). The caller
            checks the block ids (:func:`walshkv.attention.decode_attention_paged`); the kernel clamps them into
            the pages. ``None``: fields ``[batch, kv_heads, seq_len, ...]``.

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
    _check_launch(fk, fv, k_core.spec, v_core.spec, d, q.device)
    assert fk is not None and fv is not None
    kc, ks, kt_t, kc2, kl, k_basis, k_raw = _side(packed_k, k_core, fk, d, q.device, "K")
    vc, vs, vt_t, vc2, vl, v_basis, v_raw = _side(packed_v, v_core, fv, d, q.device, "V")
    ks_t = ks if ks is not None else kc  # (unused by the ggml branch: any pointer will do)
    vs_t = vs if vs is not None else vc
    if k_basis is not None:  # the query in the order the kernel unpacks K's coefficients
        q = q.to(torch.float32) @ k_basis
    kss = ks.stride()[:3] if ks is not None else (0, 0, 0)
    vss = vs.stride()[:3] if vs is not None else (0, 0, 0)
    t = packed_k.seq_len
    table, lens = kc, kc  # stand-ins when not paged (any pointer will do)
    if paged is not None:
        table, lens = (x.to(device=q.device, dtype=torch.int32).contiguous() for x in paged)
        if table.dim() != 2 or table.shape[0] < b or lens.shape != (b,):
            raise ValueError(
                f"paged decode needs block_table [{b}, max_blocks] and seq_lens [{b}], got {tuple(table.shape)} "
                f"and {tuple(lens.shape)}"
            )
    qc = q.to(torch.float32).contiguous()
    m = torch.empty(b, kv, g, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b, kv, g, d, dtype=torch.float32, device=q.device)
    block_d = max(16, 1 << (d - 1).bit_length())
    bn = block_n if block_n is not None else (64 if block_d <= 64 else 32)
    kernel = build_kernel()
    kernel[(b * kv * g,)](
        qc, kc, ks_t, kt_t, vc, vs_t, vt_t, kc2, kl, vc2, vl, m, l_sum, acc, table, lens, t, kv, g,
        *kc.stride()[:3], *kss, *vc.stride()[:3], *vss, *kc2.stride()[:3], *vc2.stride()[:3],
        table.stride(0) if paged is not None else 0, packed_k.batch_size,
        D=d, BLOCK_D=block_d, BLOCK_N=bn,
        K_FMT=fk[0], K_BITS=fk[1], K_ROW=fk[2], K_QMAX=fk[3],
        V_FMT=fv[0], V_BITS=fv[1], V_ROW=fv[2], V_QMAX=fv[3],
        K_RAW=k_raw, V_RAW=v_raw, PAGED=paged is not None, BS=t if paged is not None else 1,
    )  # fmt: skip
    if v_basis is not None:  # the V sum from coefficient order back to v_core's (model) basis
        acc = acc @ v_basis.T
    return m, l_sum, acc


def triton_supports_prerope(k_codec: Codec, head_dim: int) -> bool:
    """True if ``k_codec`` is a bound ``prerope+`` K codec whose core the Triton kernel reads at ``head_dim``.

    Args:
        k_codec: the K codec (not ``prerope+``, or not bound to a layer: ``False``).
        head_dim: the keys' length (even, and the RoPE table's).
    """
    try:
        parts = split_prerope(k_codec)
    except ValueError:  # prerope+ not bound to a layer's RoPE table
        return False
    if parts is None or head_dim % 2 or parts.table.head_dim != head_dim:
        return False
    return _format(parts.core, head_dim) is not None


def _buffer_basis(core: Codec, d: int) -> torch.Tensor | None:
    """``[d, d]`` on the CPU: buffer row ``b`` of the kernel's K decode stands for ``b @ basis.T`` (``None``:
    identity, the intB and ggml formats)."""
    cpu = torch.device("cpu")
    if isinstance(core, TurboQuant):
        return _tq_table(core, d, cpu)[2]
    if isinstance(core, TrellisQuant):
        return _tcq_table(core, d, cpu)[2]
    if isinstance(core, VHT2Codec):
        return _band_table(core, d, cpu)[1]
    return None


_TRANSFORMS: dict[tuple[int, int, int, str], tuple[Codec, torch.Tensor, torch.Tensor]] = {}
_MAX_TRANSFORMS = 256


def _transform(
    k_codec: Codec, parts: PreRopeParts, kv: int, d: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``mt [kv, d, d]`` and ``mu [kv, d]`` (float32, contiguous, on ``device``) for the kernel's K buffer.

    Cached per codec object, kv heads, head_dim and device (the entry keeps the codec alive, so its id is
    not reused while the entry exists): a calibrated codec's spec does not identify its statistics.
    """
    key = (id(k_codec), kv, d, str(device))
    hit = _TRANSFORMS.get(key)
    if hit is not None and hit[0] is k_codec:
        return hit[1], hit[2]
    transform = key_transform(parts, _buffer_basis(parts.core, d), kv, 0)
    mt = transform.mt.to(device=device, dtype=torch.float32).contiguous()
    mu = transform.mu.to(device=device, dtype=torch.float32).contiguous()
    if len(_TRANSFORMS) >= _MAX_TRANSFORMS:
        _TRANSFORMS.clear()
    _TRANSFORMS[key] = (k_codec, mt, mu)
    return mt, mu


def fused_decode_triton_prerope(
    q: torch.Tensor,
    packed_k: Packed,
    packed_v: Packed,
    k_codec: Codec,
    v_core: Codec,
    start: int,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unnormalised attention of one query step over a packed cache whose K is stored before RoPE.

    The kernel decodes each block of K rows once per kv head, maps them to the pre-RoPE keys
    (:func:`walshkv.attention.keys.key_transform`), adds the mean back, applies RoPE at the tokens'
    positions ``start, start + 1, ...`` and scores them against the group's query heads; no float copy of
    the cache is made.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, already multiplied by the softmax scale, in the
            model's basis (after RoPE; no rotation applied).
        packed_k, packed_v: fields ``[batch, kv_heads, seq_len, ...]`` written by ``k_codec`` / ``v_core``,
            on ``q``'s device (CUDA, or CPU under ``TRITON_INTERPRET=1``).
        k_codec: the bound ``prerope+`` K codec (whole: its mean, ``eq+`` and rotations are applied here).
        v_core: the V codec that stores the codes (rotations, ``center+`` and ``eq+`` peeled by the caller).
        start: position of packed token 0 (``k_codec.encode(k, start)``).
        block_n: tokens per block (power of two, at least 16; default 64 for head_dim <= 64, else 32).

    Returns:
        ``(m, l, acc)``: running max ``[batch, kv_heads, group]`` of the scores, softmax denominator
        (same shape) and unnormalised weighted V sum ``[batch, kv_heads, group, head_dim]`` in
        ``v_core``'s basis, all float32 (as :func:`fused_decode_triton`).

    Raises:
        ValueError: ``k_codec`` not a bound ``prerope+`` codec, a core or V codec the kernel does not read,
            a RoPE table, mean or ``eq+`` transform of another head_dim or number of kv heads, a negative
            ``start``, malformed packed fields, triton missing, or CPU tensors without ``TRITON_INTERPRET=1``.
    """
    b, kv, g, d = q.shape
    parts = split_prerope(k_codec)
    if parts is None:
        raise ValueError(f"{k_codec.spec} is not a prerope+ K codec: use fused_decode_triton")
    if d % 2 or parts.table.head_dim != d:
        raise ValueError(f"{k_codec.spec}: the RoPE table has head_dim {parts.table.head_dim}, q has {d}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a non-negative position, got {start!r}")
    fk, fv = _format(parts.core, d), _format(v_core, d)
    _check_launch(fk, fv, parts.core.spec, v_core.spec, d, q.device)
    assert fk is not None and fv is not None
    if block_n is not None and (block_n < 16 or block_n & (block_n - 1)):
        raise ValueError(f"block_n must be a power of two >= 16 (tl.dot), got {block_n}")
    kc, ks, kt_t, kc2, kl, _, k_raw = _side(packed_k, parts.core, fk, d, q.device, "K")
    vc, vs, vt_t, vc2, vl, v_basis, v_raw = _side(packed_v, v_core, fv, d, q.device, "V")
    if k_raw == 1 or v_raw == 1:
        raise ValueError("the prerope+ Triton kernel reads typed float16 scales, not their bytes (a page view)")
    ks_t = ks if ks is not None else kc  # (unused by the ggml branch: any pointer will do)
    vs_t = vs if vs is not None else vc
    kss = ks.stride()[:3] if ks is not None else (0, 0, 0)
    vss = vs.stride()[:3] if vs is not None else (0, 0, 0)
    t = packed_k.seq_len
    if packed_v.seq_len != t:
        raise ValueError(f"packed K holds {t} tokens, packed V {packed_v.seq_len}")
    mt, mu = _transform(k_codec, parts, kv, d, q.device)
    cos, sin = rope_half_tables(parts.table, start + t, q.device)
    qc = q.to(torch.float32).contiguous()
    m = torch.empty(b, kv, g, dtype=torch.float32, device=q.device)
    l_sum = torch.empty_like(m)
    acc = torch.empty(b, kv, g, d, dtype=torch.float32, device=q.device)
    half = d // 2
    block_d = max(16, 1 << (d - 1).bit_length())
    block_h = max(16, 1 << (half - 1).bit_length())
    block_g = max(16, 1 << (g - 1).bit_length())  # tl.dot needs 16 rows
    bn = block_n if block_n is not None else (64 if block_d <= 64 else 32)
    kernel = build_prerope_kernel()
    kernel[(b * kv,)](
        qc, kc, ks_t, kt_t, vc, vs_t, vt_t, kc2, kl, vc2, vl, mt, mu, cos, sin, m, l_sum, acc, t, kv, g, start,
        *kc.stride()[:3], *kss, *vc.stride()[:3], *vss, *kc2.stride()[:3], *vc2.stride()[:3],
        D=d, HALF=half, BLOCK_D=block_d, BLOCK_H=block_h, BLOCK_G=block_g, BLOCK_N=bn,
        K_FMT=fk[0], K_BITS=fk[1], K_ROW=fk[2], K_QMAX=fk[3],
        V_FMT=fv[0], V_BITS=fv[1], V_ROW=fv[2], V_QMAX=fv[3], K_RAW=k_raw, V_RAW=v_raw,
        num_warps=4 if block_d <= 64 else 8,
    )  # fmt: skip
    if v_basis is not None:  # the V sum from coefficient order back to v_core's (model) basis
        acc = acc @ v_basis.T
    return m, l_sum, acc
