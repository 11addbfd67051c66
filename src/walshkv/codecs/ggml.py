"""llama.cpp's KV-cache block types as codecs: ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``, ``iq4_nl``.

Each (batch, kv-head, token) vector of ``head_dim`` values is cut into ``head_dim / 32``
blocks of 32 consecutive values, and every block is stored as the exact bytes of ggml's
``block_<type>`` struct (little-endian, no padding). The one stored field per vector is
``blocks: uint8[head_dim / 32 * block_bytes]``, so the cache holds real ggml blocks:

=========  ===========  ==================================================  =======
type       block bytes  layout (byte offsets)                               bits/el
=========  ===========  ==================================================  =======
q8_0       34           0 d:f16, 2 qs:int8[32]                              8.5
q5_1       24           0 d:f16, 2 m:f16, 4 qh:u32, 8 qs:u8[16]             6.0
q5_0       22           0 d:f16, 2 qh:u32, 6 qs:u8[16]                      5.5
q4_1       20           0 d:f16, 2 m:f16, 4 qs:u8[16]                       5.0
q4_0       18           0 d:f16, 2 qs:u8[16]                                4.5
iq4_nl     18           0 d:f16, 2 qs:u8[16] (indices into KVALUES_IQ4NL)   4.5
=========  ===========  ==================================================  =======

Byte ``qs[j]`` holds the 4-bit code of value ``j`` in its low nibble and of value ``j + 16``
in its high nibble; bit ``j`` of the little-endian ``qh`` is bit 4 of the 5-bit code of value
``j``. Decoding: ``q4_0``: ``(c - 8) * d``; ``q5_0``: ``(c - 16) * d``; ``q8_0``: ``c * d``;
``q4_1``/``q5_1``: ``c * d + m``; ``iq4_nl``: ``KVALUES_IQ4NL[c] * d``.

The encoders follow ggml's reference quantizers (``quantize_row_<type>_ref`` in
``ggml/src/ggml-quants.c``) operation by operation in float32, every operation rounded on its
own (no fused multiply-add), vectorised over all blocks in torch. ``q4_0``, ``q4_1``, ``q5_0``,
``q5_1`` and ``q8_0`` are byte-identical to the numpy ports in the ``gguf`` package
(``gguf.quants.quantize``); ``gguf`` has no ``IQ4_NL`` quantizer, so ``iq4_nl`` follows
``quantize_row_iq4_nl_ref`` of current llama.cpp (the function ggml's CPU backend uses to write
an ``iq4_nl`` KV cache): one pass, no scale search (``ntry = -1``)::

    max  = the first element of largest |x|;  if |max| < 1e-15: d = 0, all indices 0
    id   = 1 / (max / -127)
    l_j  = index of the nearest KVALUES_IQ4NL entry to id * x_j (ties go up)
    w_j  = x_j * x_j
    d    = sum_j(w_j * q_j * x_j) / sum_j(w_j * q_j * q_j)      (sums in float32, j = 0..31 in order)

Details that matter for bit-exactness: the scale ``d`` is computed in float32, its reciprocal
``id`` (used for the codes) comes from that float32 ``d`` and not from its fp16 rounding, and
only then is ``d`` rounded to fp16 for storage. ``q4_0``/``q5_0`` truncate ``x * id + 8.5``
(``+ 16.5``), ``q4_1``/``q5_1`` truncate ``(x - min) * id + 0.5``, ``q8_0`` uses ``roundf``
(halves away from zero). The signed maximum is the first element of largest magnitude.

Edge cases: an all-zero vector decodes to zeros (never NaN). A block whose stored ``d`` or
``m`` would exceed the fp16 range (±65504) raises ``ValueError`` instead of storing Inf. NaN/Inf
input is refused by :meth:`Codec.encode` before anything is stored.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from walshkv.codecs.base import Codec, Field, Packed
from walshkv.ops.quant import FP16_MAX, device_checks

__all__ = [
    "GGML_BLOCK_BYTES",
    "GGML_TYPES",
    "KVALUES_IQ4NL",
    "QK",
    "GGMLCodec",
    "ggml_dequantize",
    "ggml_quantize",
]

#: Values per ggml block (``QK4_0 = QK4_1 = QK5_0 = QK5_1 = QK8_0 = QK4_NL = 32``).
QK = 32

#: The non-linear 4-bit grid of ``iq4_nl`` (``kvalues_iq4nl`` in ggml-common.h).
KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Sums of neighbouring grid values: value x takes index i >= 1 once 2x reaches val[i-1] + val[i]
# (ggml's best_index_int8; exact integers, so the comparison has no rounding).
_IQ4NL_MIDPOINTS_X2 = tuple(a + b for a, b in itertools.pairwise(KVALUES_IQ4NL))

_GROUP_MAX_EPS = 1e-15  # ggml's GROUP_MAX_EPS (compared in float32, as 1e-15f)


# ---- byte helpers (endian-independent: explicit shifts, ggml blocks are little-endian) -------------


def _f16_bytes(v: torch.Tensor) -> torch.Tensor:
    """float32 ``[n]`` -> the little-endian bytes of its fp16 rounding, ``uint8 [n, 2]``."""
    bits = v.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.stack([bits & 0xFF, bits >> 8], dim=-1).to(torch.uint8)


def _f16_from_bytes(b: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, 2]`` little-endian fp16 -> float32 ``[n, 1]``."""
    u = b[:, 0].to(torch.int32) | (b[:, 1].to(torch.int32) << 8)
    s = u - ((u & 0x8000) << 1)  # two's complement int16 value
    return s.to(torch.int16).view(torch.float16).to(torch.float32).unsqueeze(-1)


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``uint8 [n, 32]`` -> ``uint8 [n, 16]``: ``q[j] | q[j + 16] << 4``."""
    return (q[:, :16] & 0x0F) | ((q[:, 16:] & 0x0F) << 4)


def _unpack_nibbles(b: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, 16]`` -> 4-bit codes ``uint8 [n, 32]``."""
    return torch.cat([b & 0x0F, b >> 4], dim=-1)


def _pack_qh(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each 5-bit code ``uint8 [n, 32]`` -> little-endian uint32 bitfield ``uint8 [n, 4]``."""
    bits = ((q >> 4) & 1).to(torch.int32).reshape(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=q.device)
    return (bits * weights).sum(dim=-1).to(torch.uint8)


def _unpack_qh(b: torch.Tensor) -> torch.Tensor:
    """``uint8 [n, 4]`` -> bit ``j`` of the little-endian uint32 as ``uint8 [n, 32]`` (0 or 1)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(-1, 32)


# ---- float32 steps of the reference quantizers ---------------------------------------------------


def _div(num: torch.Tensor, den: float) -> torch.Tensor:
    """``num / den`` in float32, correctly rounded (a tensor divisor: no reciprocal shortcut)."""
    return num / torch.full_like(num, den)


def _recip_or_zero(d: torch.Tensor) -> torch.Tensor:
    """ggml's ``id = d ? 1.0f/d : 0.0f`` in float32."""
    one = torch.ones_like(d)
    return torch.where(d != 0, one / torch.where(d != 0, d, one), torch.zeros_like(d))


def _signed_absmax(xb: torch.Tensor) -> torch.Tensor:
    """The first element of largest magnitude per block, ``+0.0`` for an all-zero block (ggml's loop)."""
    ax = xb.abs()
    idx = ax.argmax(dim=-1, keepdim=True)  # first occurrence
    mx = xb.gather(-1, idx)
    return torch.where(ax.gather(-1, idx) > 0, mx, torch.zeros_like(mx))


def _first_extreme(xb: torch.Tensor, largest: bool) -> torch.Tensor:
    """Block min (or max) as ggml's strict-comparison loop finds it: the first such element."""
    ext = xb.amax(dim=-1, keepdim=True) if largest else xb.amin(dim=-1, keepdim=True)
    idx = (xb == ext).to(torch.uint8).argmax(dim=-1, keepdim=True)
    return xb.gather(-1, idx)  # keeps the sign of a zero extreme, as C does


def _trunc_codes(v: torch.Tensor, qmax: int) -> torch.Tensor:
    """``MIN(qmax, (int8_t)v)`` for ``v >= 0``; non-finite ``v`` (blocks below float32's normal range,
    where ``1/d`` overflows) become code 0 as in ggml/gguf on x86."""
    v = torch.trunc(v)
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    return v.clamp(0, qmax).to(torch.uint8)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf`` (halves away from zero), exact in float32 (gguf's ``np_roundf``)."""
    a = v.abs()
    f = torch.floor(a)
    return torch.sign(v) * (f + torch.floor(2 * (a - f)))


def _check_fp16(name: str, what: str, value: torch.Tensor, xb: torch.Tensor) -> None:
    """Refuse (``ValueError``) a stored fp16 field that would overflow to Inf."""
    if not value.numel():
        return
    bad = ~(value.abs() <= FP16_MAX)  # NaN too (only from float32 overflow of huge inputs)
    if device_checks():  # nothing read back (checks_on_device): the same refusal as a device-side assert
        torch._assert_async(
            ~bad.any(),
            f"{name}: a block of 32 values needs {what} beyond the fp16 range (max {FP16_MAX}) of ggml's block "
            "format; values this large are not K/V of a healthy model. Rescale the input or use a float codec",
        )
        return
    if bool(bad.any()):
        rows = bad.reshape(-1)
        peak = float(xb[rows].abs().max())
        worst = value[bad].abs().max()
        raise ValueError(
            f"{name}: a block of 32 values with |x| up to {peak:.4g} needs {what} = {float(worst):.4g}, beyond "
            f"the fp16 range (max {FP16_MAX}) of ggml's block format; values this large are not K/V of a healthy "
            "model. Rescale the input or use a float codec (fp32, bf16)."
        )


# ---- the six block types: quantize float32 [n, 32] -> uint8 [n, bytes], and back ----------------


def _quant_sym(name: str, xb: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q4_0 / q5_0: ``d = max / -2^(bits-1)``, code ``MIN(2^bits - 1, (int8_t)(x*id + 2^(bits-1) + 0.5))``."""
    half = 1 << (bits - 1)
    d = _div(_signed_absmax(xb), -float(half))
    _check_fp16(name, "a scale d", d, xb)
    q = _trunc_codes(xb * _recip_or_zero(d) + (half + 0.5), (1 << bits) - 1)
    return _f16_bytes(d.squeeze(-1)), q


def _quant_asym(name: str, xb: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_1 / q5_1: ``d = (max - min) / (2^bits - 1)``, code ``(int8_t)((x - min)*id + 0.5)``."""
    qmax = (1 << bits) - 1
    mn = _first_extreme(xb, largest=False)
    mx = _first_extreme(xb, largest=True)
    d = _div(mx - mn, float(qmax))
    _check_fp16(name, "a scale d", d, xb)
    _check_fp16(name, "a block minimum m", mn, xb)
    q = _trunc_codes((xb - mn) * _recip_or_zero(d) + 0.5, qmax)
    return _f16_bytes(d.squeeze(-1)), _f16_bytes(mn.squeeze(-1)), q


def _q4_0(xb: torch.Tensor) -> torch.Tensor:
    d, q = _quant_sym("q4_0", xb, 4)
    return torch.cat([d, _pack_nibbles(q)], dim=-1)


def _q5_0(xb: torch.Tensor) -> torch.Tensor:
    d, q = _quant_sym("q5_0", xb, 5)
    return torch.cat([d, _pack_qh(q), _pack_nibbles(q)], dim=-1)


def _q4_1(xb: torch.Tensor) -> torch.Tensor:
    d, m, q = _quant_asym("q4_1", xb, 4)
    return torch.cat([d, m, _pack_nibbles(q)], dim=-1)


def _q5_1(xb: torch.Tensor) -> torch.Tensor:
    d, m, q = _quant_asym("q5_1", xb, 5)
    return torch.cat([d, m, _pack_qh(q), _pack_nibbles(q)], dim=-1)


def _q8_0(xb: torch.Tensor) -> torch.Tensor:
    d = _div(xb.abs().amax(dim=-1, keepdim=True), 127.0)
    _check_fp16("q8_0", "a scale d", d, xb)
    v = _roundf(xb * _recip_or_zero(d))
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))  # blocks below float32's normal range
    q = v.clamp(-128, 127).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d.squeeze(-1)), q], dim=-1)


def _iq4_nl(xb: torch.Tensor) -> torch.Tensor:
    """``quantize_row_iq4_nl_ref`` (current llama.cpp: no quant weights, ``ntry = -1``)."""
    ax = xb.abs()
    amax = ax.amax(dim=-1, keepdim=True)
    small = amax < torch.tensor(_GROUP_MAX_EPS, dtype=torch.float32, device=xb.device)
    mx = torch.where(small, torch.ones_like(amax), _signed_absmax(xb))  # small blocks are overwritten below
    d0 = _div(mx, float(KVALUES_IQ4NL[0]))  # d = max / values[0]
    al = xb * (torch.ones_like(d0) / d0)  # id = 1/d (d != 0 here)
    mids = torch.tensor(_IQ4NL_MIDPOINTS_X2, dtype=torch.float32, device=xb.device)
    idx = ((al + al).unsqueeze(-1) >= mids).sum(dim=-1)  # best_index_int8: count of midpoints reached
    kv = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=xb.device)
    q = kv[idx]
    wq = (xb * xb) * q  # weight[j] = x*x;  w*q*x and w*q*q evaluate left to right
    tqx = wq * xb
    tq2 = wq * q
    sumqx = torch.zeros_like(amax.squeeze(-1))
    sumq2 = torch.zeros_like(sumqx)
    for j in range(QK):  # float32 sums in ggml's order j = 0..31 (vectorised over all blocks)
        sumqx = sumqx + tqx[:, j]
        sumq2 = sumq2 + tq2[:, j]
    pos = sumq2 > 0
    d = torch.where(pos, sumqx / torch.where(pos, sumq2, torch.ones_like(sumq2)), torch.zeros_like(sumqx))
    small = small.squeeze(-1)
    d = torch.where(small, torch.zeros_like(d), d)
    _check_fp16("iq4_nl", "a scale d", d.unsqueeze(-1), xb)
    idx = torch.where(small.unsqueeze(-1), torch.zeros_like(idx), idx).to(torch.uint8)
    return torch.cat([_f16_bytes(d), _pack_nibbles(idx)], dim=-1)


def _dq4_0(b: torch.Tensor) -> torch.Tensor:
    q = _unpack_nibbles(b[:, 2:18]).to(torch.float32) - 8
    return q * _f16_from_bytes(b[:, 0:2])


def _dq5_0(b: torch.Tensor) -> torch.Tensor:
    q = (_unpack_nibbles(b[:, 6:22]) | (_unpack_qh(b[:, 2:6]) << 4)).to(torch.float32) - 16
    return q * _f16_from_bytes(b[:, 0:2])


def _dq4_1(b: torch.Tensor) -> torch.Tensor:
    q = _unpack_nibbles(b[:, 4:20]).to(torch.float32)
    return q * _f16_from_bytes(b[:, 0:2]) + _f16_from_bytes(b[:, 2:4])


def _dq5_1(b: torch.Tensor) -> torch.Tensor:
    q = (_unpack_nibbles(b[:, 8:24]) | (_unpack_qh(b[:, 4:8]) << 4)).to(torch.float32)
    return q * _f16_from_bytes(b[:, 0:2]) + _f16_from_bytes(b[:, 2:4])


def _dq8_0(b: torch.Tensor) -> torch.Tensor:
    q = b[:, 2:34].contiguous().view(torch.int8).to(torch.float32)
    return q * _f16_from_bytes(b[:, 0:2])


def _diq4_nl(b: torch.Tensor) -> torch.Tensor:
    kv = torch.tensor(KVALUES_IQ4NL, dtype=torch.float32, device=b.device)
    return kv[_unpack_nibbles(b[:, 2:18]).long()] * _f16_from_bytes(b[:, 0:2])


@dataclass(frozen=True)
class _BlockType:
    block_bytes: int
    quantize: Callable[[torch.Tensor], torch.Tensor]
    dequantize: Callable[[torch.Tensor], torch.Tensor]
    help: str


_TYPES: dict[str, _BlockType] = {
    "q8_0": _BlockType(34, _q8_0, _dq8_0, "fp16 d + 32 int8 codes, x = q*d"),
    "q5_1": _BlockType(24, _q5_1, _dq5_1, "fp16 d, fp16 min m + 32 5-bit codes, x = q*d + m"),
    "q5_0": _BlockType(22, _q5_0, _dq5_0, "fp16 d + 32 5-bit codes, x = (q-16)*d"),
    "q4_1": _BlockType(20, _q4_1, _dq4_1, "fp16 d, fp16 min m + 32 4-bit codes, x = q*d + m"),
    "q4_0": _BlockType(18, _q4_0, _dq4_0, "fp16 d + 32 4-bit codes, x = (q-8)*d"),
    "iq4_nl": _BlockType(18, _iq4_nl, _diq4_nl, "fp16 d + 32 4-bit indices into a non-linear grid, x = grid[q]*d"),
}

#: The block types, in decreasing size.
GGML_TYPES: tuple[str, ...] = tuple(_TYPES)
#: Bytes per block of 32 values (``sizeof(block_<type>)`` in ggml).
GGML_BLOCK_BYTES: dict[str, int] = {name: t.block_bytes for name, t in _TYPES.items()}


def _block_type(name: str) -> _BlockType:
    if name not in _TYPES:
        raise ValueError(f"unknown ggml block type {name!r}; choose one of {', '.join(GGML_TYPES)}")
    return _TYPES[name]


def _check_multiple(name: str, n: int) -> None:
    if n < 1 or n % QK:
        lo, hi = max(QK, n // QK * QK), (n // QK + 1) * QK
        near = f"{lo} or {hi}" if lo != hi and lo < n else f"{hi}"
        raise ValueError(
            f"head_dim must be a multiple of {QK} for {name}, which stores ggml blocks of {QK} values along "
            f"head_dim (32, 64, 96, 128, 256, ...); got {n}, nearest allowed: {near}"
        )


def ggml_quantize(x: torch.Tensor, name: str) -> torch.Tensor:
    """ggml's reference quantizer for block type ``name`` over the last dimension.

    Args:
        x: finite float tensor ``[..., n]`` with ``n`` a multiple of 32 (converted to float32 first,
            as ggml quantizes float32 rows).
        name: one of :data:`GGML_TYPES`.

    Returns:
        ``uint8 [..., n / 32 * GGML_BLOCK_BYTES[name]]``: the ggml blocks, byte for byte.

    Raises:
        ValueError: unknown type, ``n`` not a multiple of 32, or a block whose fp16 ``d``/``m``
            would overflow.
    """
    bt = _block_type(name)
    n = x.shape[-1]
    _check_multiple(name, n)
    lead = x.shape[:-1]
    xb = x.to(torch.float32).reshape(-1, QK)
    out = bt.quantize(xb) if xb.shape[0] else torch.empty(0, bt.block_bytes, dtype=torch.uint8, device=x.device)
    return out.reshape(*lead, n // QK * bt.block_bytes)


def ggml_dequantize(blocks: torch.Tensor, name: str) -> torch.Tensor:
    """ggml's dequantizer (``dequantize_row_<type>``) for block type ``name``.

    Args:
        blocks: ``uint8 [..., nb * GGML_BLOCK_BYTES[name]]`` as written by :func:`ggml_quantize`.
        name: one of :data:`GGML_TYPES`.

    Returns:
        float32 ``[..., nb * 32]``.
    """
    bt = _block_type(name)
    nbytes = blocks.shape[-1]
    if nbytes % bt.block_bytes:
        raise ValueError(f"{name}: {nbytes} bytes per row is not a whole number of {bt.block_bytes}-byte blocks")
    lead = blocks.shape[:-1]
    b = blocks.reshape(-1, bt.block_bytes)
    out = bt.dequantize(b) if b.shape[0] else torch.empty(0, QK, dtype=torch.float32, device=blocks.device)
    return out.reshape(*lead, nbytes // bt.block_bytes * QK)


@dataclass(frozen=True, repr=False)
class GGMLCodec(Codec):
    """One of llama.cpp's KV-cache block types, storing ggml's block bytes verbatim.

    Per vector of ``head_dim`` values (a multiple of 32): one field ``blocks`` of
    ``uint8[head_dim / 32 * block_bytes]``; bits per element are ``8 * block_bytes / 32``
    (``q8_0`` 8.5, ``q5_1`` 6.0, ``q5_0`` 5.5, ``q4_1`` 5.0, ``q4_0`` and ``iq4_nl`` 4.5) at any
    allowed head_dim.

    Attributes:
        name: one of :data:`GGML_TYPES` (also its spec).
    """

    name: str

    def __post_init__(self) -> None:
        _block_type(self.name)
        super().__post_init__()

    def _spec(self) -> str:
        return self.name

    @property
    def block_bytes(self) -> int:
        """Bytes of one ggml block (32 values)."""
        return _TYPES[self.name].block_bytes

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        _check_multiple(self.spec, head_dim)

    def layout(self, head_dim: int) -> dict[str, Field]:
        self.check_head_dim(head_dim)
        return {"blocks": Field((head_dim // QK * self.block_bytes,), torch.uint8)}

    def _encode(self, x: torch.Tensor) -> Packed:
        return Packed({"blocks": ggml_quantize(x, self.name)}, x.shape[-1], x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return ggml_dequantize(packed.tensors["blocks"], self.name)
