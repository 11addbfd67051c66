"""How the fused CPU kernel reads each codec: its row formats and the per-(codecs, head_dim) plans.

A :class:`KernelFormat` says which of the kernel's decode paths reads a core codec's packed rows (by the
name the compiled module exports in ``FORMATS``; the numeric ids live only in ``cpu_kernel_formats.h``),
with the code width, bytes per row, the decoded length and the basis that maps the kernel's buffer order back
to the codec's own. A :class:`CpuPlan` adds the wrappers: the K rotations, the softmax scale and the
buffer order folded into one query matrix, the V order and unrotation into one output matrix. Both are
built once and cached; nothing here needs the compiled kernel (see :mod:`walshkv.attention.cpu`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch

from walshkv.attention.keys import PreRopeParts, split_prerope
from walshkv.attention.peeling import core_codec, peel
from walshkv.codecs.base import Codec
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.ggml import QK, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.trellis import TrellisQuant
from walshkv.codecs.turbo import TurboQuant
from walshkv.codecs.vht2 import VHT2Codec
from walshkv.ops import trellis
from walshkv.ops.lognorm import log_norm_table
from walshkv.ops.packing import packed_nbytes

__all__ = [
    "CPU_SUPPORTED",
    "FORMAT_NAMES",
    "MAX_BANDS",
    "CpuPlan",
    "FormatName",
    "KernelFormat",
    "cpu_format",
    "cpu_plan",
    "cpu_supports",
]

#: Human-readable list of the (inner) codecs the fused CPU kernel reads.
CPU_SUPPORTED = (
    "int2..int8, q4_0, q8_0, iq4_nl, vht2, tq, tcq (each also under rot+, rrot+, center+, eq+, eqr+ and prerope+, "
    "K also in the block frame, ropeblock:G+)"
)

#: The kernel's decode paths, by the names of its ``FORMATS`` (``int_generic``: int3, int5, int6, int7;
#: ``banded``: vht2; ``tq``: Lloyd-Max codes in one or two segments, own tensors, one fp16 norm; ``tcq``: tq's
#: fields, the codes one wrapped trellis stream read through a table).
FormatName = Literal["int4", "int8", "int_generic", "q4_0", "q8_0", "int2", "banded", "tq", "iq4_nl", "tcq"]
FORMAT_NAMES: tuple[FormatName, ...] = get_args(FormatName)
#: Most vht2 bands one row may have; the compiled module's ``MAX_BANDS`` (checked when it loads).
MAX_BANDS = 32


@dataclass(frozen=True)
class KernelFormat:
    """How the kernel reads one codec's rows: format, code width, bytes per row, decoded length L.

    ``basis`` (``[head_dim, L]``, ``None`` = identity) maps a vector in the codec's own basis to the
    kernel's buffer order: buffer row ``b`` stands for the decoded vector ``b @ basis.T``.
    """

    fmt: FormatName
    bits: int
    row_bytes: int
    length: int
    offset: int
    codes_field: str
    scale_field: str | None
    basis: torch.Tensor | None
    scales: int = 1  # fp16 scales per row
    bands: tuple[int, ...] = ()  # banded: (first byte, first buffer position, size, bits) per band
    # tq: (field, first buffer position, size, bits, levels) per segment; levels float32, >= 32 entries
    segments: tuple[tuple[str, int, int, int, torch.Tensor], ...] = ()
    # tcq: (table float32 [2**L], shifts int32 [taps, head_dim], taps, L, parts): value i decodes to
    # table[(sum_t code[(i - t) mod d] << shifts[t, i]) mod 2**L] (a shift of 32 adds nothing); parts: a split
    # set's P then Q (float32 [32], table[s] = P[s & 15] + Q[s >> 4]: AVX2 reads them by permutes), or None
    trellis: tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor | None] | None = None
    # tq, tcq at norm=8: the norm field is one log byte per row, worth norm_table[byte] (float32 [256])
    norm_table: torch.Tensor | None = None


_FORMATS: dict[tuple[str, str, int], KernelFormat | None] = {}


def _position_basis(pos: torch.Tensor, length: int) -> torch.Tensor:
    """``[d, length]`` with a 1 at ``(i, pos[i])``: value ``i`` sits at buffer position ``pos[i]``."""
    basis = torch.zeros(pos.numel(), length)
    basis[torch.arange(pos.numel()), pos] = 1.0
    return basis


def _vht2_format(core: VHT2Codec, head_dim: int) -> KernelFormat | None:
    """vht2: the kept coefficients band by band; the basis is the WHT followed by the codec's order."""
    try:
        core.check_head_dim(head_dim)
        bands = core.bands(head_dim)
        basis = core.coefficient_basis(head_dim)
    except ValueError:  # not bound yet (auto / variance without calibration), or a bad head_dim
        return None
    if not 1 <= len(bands) <= MAX_BANDS:
        return None
    table: list[int] = []
    byte = start = 0
    for band in bands:
        table += [byte, start, band.size, band.bits]
        byte += band.nbytes
        start += band.size
    return KernelFormat("banded", 0, byte, start, 0, "codes", "scale", basis, len(bands), tuple(table))


def _norm_table(core: TurboQuant) -> torch.Tensor | None:
    """The value of each norm byte (float32 [256]) where ``core`` stores its norms as log bytes, else ``None``."""
    return log_norm_table() if core.norm_bits == 8 else None


def _tq_format(core: TurboQuant, head_dim: int) -> KernelFormat | None:
    """tq: each segment's codes through its Lloyd-Max levels; the basis is the codec's inverse rotation."""
    try:
        core.check_head_dim(head_dim)
    except ValueError:
        return None
    segments = []
    for name, start, stop, bits in core.segments(head_dim):
        levels = core.quantizer(bits, head_dim).levels.to(torch.float32)
        padded = torch.zeros(max(32, levels.numel()))
        padded[: levels.numel()] = levels
        segments.append((name, start, stop - start, bits, padded))
    basis = core.unrotate(torch.eye(head_dim)).T.contiguous()  # column j: the vector buffer position j decodes to
    first = segments[0]
    row_bytes = packed_nbytes(first[2], first[3])
    return KernelFormat(
        "tq", 0, row_bytes, head_dim, 0, first[0], "norm", basis, segments=tuple(segments), norm_table=_norm_table(core)
    )


def _tcq_format(core: TrellisQuant, head_dim: int) -> KernelFormat | None:
    """tcq: tq's segments as raw codes, each value through the trellis table at its state."""
    try:
        core.check_head_dim(head_dim)
    except ValueError:
        return None
    table = core.table().contiguous()
    shifts = trellis.state_taps(core.widths(head_dim), core.state_bits)[1]  # tap t of value i: code i - t
    segments = tuple(
        (name, start, stop - start, bits, table) for name, start, stop, bits in core.rotation.segments(head_dim)
    )
    basis = core.rotation.unrotate(torch.eye(head_dim)).T.contiguous()
    first = segments[0]
    row_bytes = packed_nbytes(first[2], first[3])
    return KernelFormat(
        "tcq",
        0,
        row_bytes,
        head_dim,
        0,
        first[0],
        "norm",
        basis,
        segments=segments,
        trellis=(table, shifts.contiguous(), shifts.shape[0], core.state_bits, core.table_parts()),
        norm_table=_norm_table(core.rotation),
    )


def cpu_format(core: Codec, head_dim: int) -> KernelFormat | None:
    """How the kernel reads ``core``'s packed rows at ``head_dim``, or ``None`` if it cannot."""
    key = (type(core).__qualname__, core.spec, head_dim)
    if key in _FORMATS:
        return _FORMATS[key]
    fmt: KernelFormat | None = None
    if type(core) is IntCodec and head_dim >= 1:
        bits = core.bits
        nb = packed_nbytes(head_dim, bits)
        qmax = (1 << (bits - 1)) - 1
        if bits == 8:
            fmt = KernelFormat("int8", 8, nb, head_dim, qmax, "codes", "scale", None)
        elif bits in (2, 4):
            planes = 8 // bits
            i = torch.arange(head_dim)
            pos = (i % planes) * nb + i // planes
            kind: FormatName = "int4" if bits == 4 else "int2"
            fmt = KernelFormat(kind, bits, nb, planes * nb, qmax, "codes", "scale", _position_basis(pos, planes * nb))
        else:
            fmt = KernelFormat("int_generic", bits, nb, head_dim, qmax, "codes", "scale", None)
    elif type(core) is GGMLCodec and core.name in ("q4_0", "q8_0", "iq4_nl") and head_dim >= QK and head_dim % QK == 0:
        kind = {"q4_0": "q4_0", "q8_0": "q8_0", "iq4_nl": "iq4_nl"}[core.name]
        nbytes = head_dim // QK * core.block_bytes
        fmt = KernelFormat(kind, 8 if kind == "q8_0" else 4, nbytes, head_dim, 0, "blocks", None, None)
    elif type(core) is VHT2Codec:
        fmt = _vht2_format(core, head_dim)
        if core.calibrated_perm is not None:  # a calibrated (bound) codec: its spec names the layer, but do not cache
            return fmt
    elif type(core) is TurboQuant:
        fmt = _tq_format(core, head_dim)
    elif type(core) is TrellisQuant:
        fmt = _tcq_format(core, head_dim)
    _FORMATS[key] = fmt
    return fmt


def cpu_supports(codec: Codec, head_dim: int) -> bool:
    """True if the fused kernel reads ``codec``'s packed rows (after peeling rotations and centering; keys stored
    before RoPE, ``prerope+``, through their core codec)."""
    if isinstance(codec, RopeBlock):  # K in the block frame: its storing codec, with a query per block
        return codec.rope is not None and cpu_format(core_codec(codec.inner), head_dim) is not None
    parts = split_prerope(codec) if _bound_prerope(codec) else None
    return cpu_format(parts.core if parts is not None else core_codec(codec), head_dim) is not None


def _bound_prerope(codec: Codec) -> bool:
    """A ``prerope+`` codec bound to a layer (an unbound one has no table and no mean to read through)."""
    try:
        return split_prerope(codec) is not None
    except ValueError:
        return False


@dataclass(frozen=True)
class CpuPlan:
    """Everything about a (K codec, V codec, head_dim, scale) that does not change between decode steps."""

    k: KernelFormat
    v: KernelFormat
    scale: float
    q_map: torch.Tensor | None  # [d, L_k]: scale, K's rotations and buffer order in one matmul (None: q * scale)
    out_map: torch.Tensor | None  # [L_v, d]: V's buffer order back and its unrotation (None: identity)
    prerope: PreRopeParts | None = None  # K stored before RoPE: the kernel turns each row into the key (q_map None)
    #: ``q_map / scale`` is an orthogonal map of the head onto K's buffer (rotations, reordering): a vector in the
    #: head's basis reaches the buffer as ``x @ (q_map / scale)`` (fused_decode_cpu's key_table)
    k_buffer_orthogonal: bool = True


_PLANS: dict[tuple[Any, ...], tuple[CpuPlan | None, Codec, Codec]] = {}
_MAX_PLANS = 256


def _rotation_matrix(rots: list[Rotated], d: int, inverse: bool) -> torch.Tensor | None:
    """Row ``i`` = the chain applied to basis vector ``e_i`` (so ``x @ M`` applies it to ``x``)."""
    if not rots:
        return None
    m = torch.eye(d, dtype=torch.float32)
    for r in reversed(rots) if inverse else rots:
        m = r.unrotate(m) if inverse else r.rotate(m)
    return m


def _make_plan(k_codec: Codec, v_codec: Codec, d: int, scale: float) -> CpuPlan | None:
    parts = split_prerope(k_codec) if _bound_prerope(k_codec) else None
    k_rots, k_core = peel(k_codec) if parts is None else ([], parts.core)
    v_rots, v_core = peel(v_codec)
    fk, fv = cpu_format(k_core, d), cpu_format(v_core, d)
    if fk is None or fv is None:
        return None
    q_map = None
    rot_k = _rotation_matrix(k_rots, d, inverse=False)
    if rot_k is not None or fk.basis is not None:
        q_map = (rot_k if rot_k is not None else torch.eye(d)) @ (fk.basis if fk.basis is not None else torch.eye(d))
        q_map = q_map * scale
    out_map = None
    rot_v = _rotation_matrix(v_rots, d, inverse=True)
    if rot_v is not None or fv.basis is not None:
        basis_t = fv.basis.T if fv.basis is not None else torch.eye(d)
        out_map = basis_t @ (rot_v if rot_v is not None else torch.eye(d))
    if parts is not None:  # the query stays in the model's basis; the kernel maps each key row (KeyTransform)
        return CpuPlan(fk, fv, scale, None, out_map, parts)
    orthogonal = q_map is None or torch.allclose((q_map / scale) @ (q_map / scale).T, torch.eye(d), atol=1e-4)
    return CpuPlan(fk, fv, scale, q_map, out_map, k_buffer_orthogonal=orthogonal)


def cpu_plan(k_codec: Codec, v_codec: Codec, head_dim: int, scale: float) -> CpuPlan | None:
    """The kernel's cached per-(codecs, head_dim, scale) setup, or ``None`` if it cannot read a codec."""
    key: tuple[Any, ...] = (type(k_codec).__qualname__, k_codec.spec, type(v_codec).__qualname__, v_codec.spec)
    key += (head_dim, scale)
    if _calibrated(k_codec) or _calibrated(v_codec):
        # a calibrated codec's spec does not identify its statistics: key on the objects themselves (the
        # entry keeps them alive, so their ids cannot be reused while it exists)
        key += (id(k_codec), id(v_codec))
    if key in _PLANS:
        return _PLANS[key][0]
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _make_plan(k_codec, v_codec, head_dim, scale)
    _PLANS[key] = (plan, k_codec, v_codec)
    return plan


def _calibrated(codec: Codec) -> bool:
    if _bound_prerope(codec):  # its RoPE table, mean and eq+ transform are the layer's
        return True
    core = peel(codec)[1]
    return isinstance(core, VHT2Codec) and core.calibrated_perm is not None
