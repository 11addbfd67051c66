"""TurboQuant-class codecs: ``tq:B`` (MSE stage) and ``tqprod:B`` (MSE stage + 1-bit QJL residual).

After Zandieh, Daliri, Hadian, Mirrokni, *TurboQuant: Online Vector Quantization with Near-optimal
Distortion Rate* (arXiv:2504.19874), with the QJL residual of Zandieh, Daliri, Han, *QJL: 1-Bit
Quantized JL Transform for KV Cache Quantization with Zero Overhead* (arXiv:2406.03482).

``tq:B`` per (batch, kv-head, token) vector ``x`` of ``d = head_dim`` values (d a power of two):

1. rotate: ``y = H(s * x)``, the orthonormal Walsh-Hadamard transform after seeded sign flips
   ``s = random_signs(d, seed)`` (exactly ``rrot:SEED+``'s rotation);
2. ``norm = ||x||_2`` stored as fp16; every coordinate is scaled to unit variance,
   ``t = y / (norm / sqrt(d))`` (for a random rotation, ``t_i`` follows the beta-type density of
   ``sqrt(d) u_1``, close to N(0, 1));
3. each ``t_i`` is replaced by the index of its nearest Lloyd-Max level at B bits
   (:func:`walshkv.ops.lloyd_max.lloyd_max`, unit-variance Gaussian codebook by default), codes packed
   with :func:`walshkv.ops.pack_bits`;
4. decode: ``x_hat = s * H(levels[codes] * norm / sqrt(d))``.

Fractional ``tq:B.5`` stores the first ``d/2`` rotated coordinates at ``ceil(B)`` bits and the other
``d/2`` at ``floor(B)`` bits (a fixed split; the paper instead gives a set of outlier channels the
higher width).

``tqprod:B`` is TurboQuant-prod: ``tq:(B-1)`` plus a 1-bit QJL sketch of the residual
``r = x - x_hat_mse``: ``z = sign(S r)`` with ``S`` a seeded ``d x d`` matrix of i.i.d. N(0, 1) entries,
and ``gamma = ||r||`` as fp16. Decode adds ``sqrt(pi/2) / d * gamma * S^T z``, which makes
``<q, x_hat>`` an unbiased estimate of ``<q, x>`` (over the draw of ``S``) for every query ``q``.
``tqprod:1`` is the QJL sketch of ``x`` alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from walshkv.codecs import accelerated
from walshkv.codecs.accelerated import Step
from walshkv.codecs.base import Codec, Field, Packed
from walshkv.ops.hadamard import _check_size, hadamard_transform, signed_hadamard, signs_for
from walshkv.ops.lloyd_max import LloydMax, lloyd_max, threshold_codes
from walshkv.ops.lognorm import decode_log_norms, encode_log_norms
from walshkv.ops.packing import pack_bits, pack_bits_span, packed_nbytes, unpack_bits
from walshkv.ops.quant import FP16_MAX, check_finite, cpu_scalar, device_checks, min_max

__all__ = [
    "CODEBOOKS",
    "PACK_ROWS",
    "TQPROD_BITS",
    "TQ_BITS",
    "TurboQuant",
    "TurboQuantProd",
    "parse_tq_args",
    "parse_tqprod_args",
]

#: Bit widths of ``tq``: whole widths 1..8 and the half widths 1.5 .. 7.5.
TQ_BITS: tuple[float, ...] = tuple(sorted({float(b) for b in range(1, 9)} | {b + 0.5 for b in range(1, 8)}))
#: Bit widths of ``tqprod``: 1 (QJL alone) and every ``tq`` width plus one, up to 8.
TQPROD_BITS: tuple[float, ...] = (1.0, *(b + 1 for b in TQ_BITS if b + 1 <= 8))
#: Codebooks: the unit Gaussian, or the exact beta-type density of a rotated coordinate at this head_dim.
CODEBOOKS = ("gauss", "beta")
_MAX_SEED = 2**62

#: ``(rotated, norm16, tables) -> (fields, largest norm) | None``: the signature of :data:`PACK_ROWS`' implementations.
RowPacker = Callable[[torch.Tensor, torch.Tensor, list], "tuple[dict[str, torch.Tensor], float] | None"]

#: tq's packing of its rotated rows, a step an accelerated implementation may take over
#: (:mod:`walshkv.codecs.accelerated`; :mod:`walshkv.attention.cpu` registers the C++ kernel's). The torch path of
#: :meth:`TurboQuant._encode` is its reference; an implementation must give the same bits.
PACK_ROWS: Step[RowPacker] = Step(
    "tq.pack_rows",
    "takes the rotated rows [..., d] (float32, contiguous), their fp16 norms [..., 1] and _segment_tables' "
    "(name, start, stop, bits, thresholds) list; returns the packed fields (without norm) and the largest norm (NaN "
    "if any is NaN), or None to leave the block to the torch path",
)


def _fmt_bits(bits: float) -> str:
    return str(int(bits)) if float(bits).is_integer() else f"{bits:g}"


def _valid_text(valid: tuple[float, ...]) -> str:
    return ", ".join(_fmt_bits(b) for b in valid)


def _check_bits(bits: Any, valid: tuple[float, ...], name: str) -> float:
    try:
        value = float(bits)
    except (TypeError, ValueError):
        raise ValueError(f"{name} takes a bit width, one of {_valid_text(valid)}; got {bits!r}") from None
    if isinstance(bits, bool) or value not in valid:
        raise ValueError(f"{name} takes a bit width, one of {_valid_text(valid)}; got {bits!r}")
    return value


def _check_seed(seed: Any, name: str) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _MAX_SEED:
        raise ValueError(f"{name} seeds are integers in 0 .. 2**62-1, got {seed!r}")
    return seed


#: Bits of the stored norm: fp16, or a logarithmic byte (:mod:`walshkv.ops.lognorm`).
NORM_BITS: tuple[int, ...] = (16, 8)


def _check_norm_bits(norm_bits: Any, name: str) -> None:
    if isinstance(norm_bits, bool) or norm_bits not in NORM_BITS:
        raise ValueError(
            f"{name} stores its norm in one of {', '.join(map(str, NORM_BITS))} bits (norm=8: a log byte); "
            f"got {norm_bits!r}"
        )


def _check_codebook(codebook: Any, name: str) -> None:
    if codebook not in CODEBOOKS:
        raise ValueError(f"{name} codebook must be one of {', '.join(CODEBOOKS)}, got {codebook!r}")


def _check_fp16(norm: torch.Tensor, what: str, spec: str) -> torch.Tensor:
    """``norm`` (float64) rounded to fp16, or ``ValueError`` if that overflows."""
    norm16 = norm.to(torch.float16)
    if bool(torch.isinf(norm16).any()):
        biggest = float(norm.max())
        raise ValueError(
            f"'{spec}' stores the {what} as fp16 whatever the input's dtype, but a vector has {what} {biggest:.6g} "
            f"> {FP16_MAX:g} (the fp16 maximum); values this large are not K/V of a healthy model. Rescale the input "
            "or use a float codec (spec fp32 or bf16): a float32 or bf16 input does not help here"
        )
    return norm16


@dataclass(frozen=True, repr=False)
class TurboQuant(Codec):
    """``tq:B``: randomized Hadamard rotation, fp16 norm, Lloyd-Max codes per rotated coordinate.

    Attributes:
        bits: 1..8, or a half width 1.5..7.5 (half the coordinates at ``ceil(bits)``, half at ``floor``);
            stored as a float (``TurboQuant(3) == TurboQuant(3.0)``).
        seed: seed of the random sign flips (default 0).
        codebook: ``"gauss"`` (unit Gaussian Lloyd-Max levels, default) or ``"beta"`` (levels for the
            exact density of a rotated coordinate at this head_dim).
        norm_bits: 16 (the norm as fp16, default) or 8 (``:norm=8``: a logarithmic byte,
            :mod:`walshkv.ops.lognorm`; the vector is scaled by the decoded norm, so the codes absorb its rounding).

    Stored per vector (integer B): ``codes uint8[ceil(d*B/8)]`` and ``norm float16[1]`` (``uint8[1]`` at
    ``norm=8``); for a half width, ``codes_hi uint8[ceil((d/2)*ceil(B)/8)]``, ``codes_lo
    uint8[ceil((d/2)*floor(B)/8)]`` and ``norm``.
    """

    bits: float
    seed: int = 0
    codebook: str = "gauss"
    norm_bits: int = 16

    def __post_init__(self) -> None:
        self._set(bits=_check_bits(self.bits, TQ_BITS, "tq"))
        _check_seed(self.seed, "tq")
        _check_codebook(self.codebook, "tq")
        _check_norm_bits(self.norm_bits, "tq")
        super().__post_init__()

    def _spec(self) -> str:
        return _canonical("tq", self.bits, self.seed, self.codebook, self.norm_bits)

    # --- the norm -------------------------------------------------------------------------------------

    def store_norm(self, norm: torch.Tensor, spec: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stored, scale_norm)``: the norm field as stored (fp16, or uint8 log codes at ``norm=8``) and the norm
        the vector is scaled by and decoded with (fp16, or float32 at ``norm=8``); ``norm`` is ``||x||_2`` in
        float64, ``[..., 1]``.

        Raises:
            ValueError: at ``norm=8``, a norm past :data:`walshkv.ops.lognorm.LOG_NORM_MAX` or NaN (named with
                ``spec``); fp16 norms are checked by :meth:`scaled_rotation`.
        """
        if self.norm_bits == 16:
            norm16 = norm.to(torch.float16)
            return norm16, norm16
        codes = encode_log_norms(norm, spec)
        return codes, decode_log_norms(codes)

    def stored_norm(self, field: torch.Tensor) -> torch.Tensor:
        """The norms a stored ``norm`` field stands for (float32, same shape)."""
        return field.to(torch.float32) if self.norm_bits == 16 else decode_log_norms(field)

    # --- the parts ------------------------------------------------------------------------------------

    def segments(self, head_dim: int) -> list[tuple[str, int, int, int]]:
        """``(field, start, stop, bits)`` for each run of rotated coordinates stored at one width."""
        if float(self.bits).is_integer():
            return [("codes", 0, head_dim, int(self.bits))]
        half = head_dim // 2
        return [("codes_hi", 0, half, math.ceil(self.bits)), ("codes_lo", half, head_dim, math.floor(self.bits))]

    def quantizer(self, bits: int, head_dim: int) -> LloydMax:
        """The (cached) Lloyd-Max quantizer for ``bits`` at this head_dim."""
        if self.codebook == "beta":
            return lloyd_max(bits, "beta", head_dim)
        return lloyd_max(bits, "gaussian")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``H(s * x)`` over the last dimension (float32)."""
        x = x if x.dtype == torch.float32 else x.to(torch.float32)
        signed = signed_hadamard(x, self.seed)
        if signed is not None:
            return x @ signed
        return hadamard_transform(x * signs_for(x.shape[-1], self.seed, x.device))

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """``s * H(y)`` over the last dimension (float32)."""
        y = y if y.dtype == torch.float32 else y.to(torch.float32)
        return hadamard_transform(y) * signs_for(y.shape[-1], self.seed, y.device)

    def scaled_rotation(self, x: torch.Tensor, norm: torch.Tensor, norm16: torch.Tensor, spec: str) -> torch.Tensor:
        """``t = H(s * x) / (norm16 / sqrt(d))`` (float32, ``[..., d]``, close to N(0, 1) per coordinate), the values
        tq (and tcq, which shares this rotation) code; a zero vector gives zeros.

        Args:
            x: ``[..., d]``.
            norm: ``||x||_2`` in float64, ``[..., 1]``.
            norm16: ``norm`` as the codec stores it: rounded to fp16, or (``norm=8``) its decoded log code in
                float32 (:meth:`store_norm`).
            spec: the storing codec's spec, for messages.

        Raises:
            ValueError: a NaN or Inf in ``x``, or a norm past the fp16 maximum (named with ``spec``).
        """
        d = x.shape[-1]
        smallest = 0.0
        if device_checks():  # no read back: the where() below always, the range as a device assert
            torch._assert_async(
                (norm16 <= FP16_MAX).all(),
                f"{spec}: a K/V vector holds NaN/Inf or has an L2 norm past the fp16 maximum {FP16_MAX}; values like "
                "these are not K/V of a healthy model",
            )
        elif norm16.numel():
            smallest, biggest = min_max(norm16)
            if not biggest <= FP16_MAX:  # an Inf norm, or NaN from a NaN/Inf input (a wrapper's output)
                check_finite(x, "K/V")
                _check_fp16(norm, "L2 norm", spec)
        scale = norm16.to(torch.float32)
        scale = scale / cpu_scalar(math.sqrt(d), scale)
        # every norm positive (norm16 >= 2**-24, so is the scale): the where() is a no-op, skipped
        return self.rotate(x) / (scale if smallest > 0 else torch.where(scale > 0, scale, 1.0))

    def _segment_tables(self, head_dim: int, device: torch.device) -> list[tuple[str, int, int, int, torch.Tensor]]:
        """:meth:`segments` with each one's quantizer thresholds (float32 on ``device``), cached."""
        key = (self.bits, self.codebook, head_dim, device)
        tables = _SEGMENT_TABLES.get(key)
        if tables is None:
            tables = _SEGMENT_TABLES[key] = [
                (name, start, stop, bits, self.quantizer(bits, head_dim).table("thresholds", device, torch.float32))
                for name, start, stop, bits in self.segments(head_dim)
            ]
        return tables

    # --- the codec ------------------------------------------------------------------------------------

    def layout(self, head_dim: int) -> dict[str, Field]:
        fields = {
            name: Field((packed_nbytes(stop - start, bits),), torch.uint8)
            for name, start, stop, bits in self.segments(head_dim)
        }
        fields["norm"] = Field((1,), torch.float16 if self.norm_bits == 16 else torch.uint8)
        return fields

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        _check_size(head_dim, f"head_dim of '{self.spec}'")
        if not float(self.bits).is_integer() and head_dim < 2:
            raise ValueError(f"'{self.spec}' splits head_dim into two halves; head_dim {head_dim} is too small")
        if self.codebook == "beta" and head_dim < 4:
            raise ValueError(f"'{self.spec}' (beta codebook) needs head_dim >= 4, got {head_dim}")

    refuses_nonfinite = True  # a NaN or Inf input makes its norm NaN or Inf

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        norm = torch.linalg.vector_norm(x if x.dtype == torch.float64 else x.to(torch.float64), dim=-1, keepdim=True)
        stored, norm16 = self.store_norm(norm, self.spec)
        packer = accelerated.implementation(PACK_ROWS) if self.norm_bits == 16 else None  # it reads fp16 norms
        if packer is not None and x.device.type == "cpu" and norm16.numel():
            # the accelerated packer (the C++ kernel's: a decode step's one token in a few microseconds instead of
            # ~25 torch ops); anything it declines or refuses (an Inf or NaN norm) takes the torch path below, which
            # raises what it must
            done = packer(self.rotate(x), norm16, self._segment_tables(d, x.device))
            if done is not None and done[1] <= FP16_MAX:
                tensors = done[0]
                tensors["norm"] = norm16
                return Packed(tensors, d, x.dtype)
        t = self.scaled_rotation(x, norm, norm16, self.spec)
        # quantize() makes uint8 codes, which pack_bits would widen again: the codes are counted in int32 here. One
        # width codes the whole row, pack_bits_span packs its span without copying it out; half widths code each
        # span alone (the same codes as the whole row would get there, half the work).
        tables = self._segment_tables(d, x.device)
        tensors = {
            name: pack_bits_span(threshold_codes(t, bounds, torch.int32), start, stop, bits)
            if len(tables) == 1
            else pack_bits(threshold_codes(t[..., start:stop], bounds, torch.int32), bits)
            for name, start, stop, bits, bounds in tables
        }
        tensors["norm"] = stored
        return Packed(tensors, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        parts = [
            self.quantizer(bits, d).dequantize(unpack_bits(packed.tensors[name], bits, stop - start))
            for name, start, stop, bits in self.segments(d)
        ]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        scale = self.stored_norm(packed.tensors["norm"]) / math.sqrt(d)
        return self.unrotate(t * scale)


@dataclass(frozen=True, repr=False)
class TurboQuantProd(Codec):
    """``tqprod:B``: ``tq:(B-1)`` plus a 1-bit QJL sketch of its residual (TurboQuant-prod).

    Attributes:
        bits: total bit width, one of :data:`TQPROD_BITS` (1 = QJL sketch alone, no MSE stage); a float.
        seed: seed of the MSE stage's sign flips; ``S`` is drawn from ``seed + 1``.
        codebook: codebook of the MSE stage (see :class:`TurboQuant`).
        stage: the MSE stage ``tq:(B-1)`` (``None`` for B = 1), derived from the fields above.

    Stored per vector: the MSE stage's fields prefixed ``mse_`` (none for B = 1),
    ``qjl_signs uint8[ceil(d/8)]`` (bit i = 1 where ``(S r)_i >= 0``) and ``qjl_norm float16[1]`` (``||r||``).
    """

    bits: float
    seed: int = 0
    codebook: str = "gauss"
    stage: TurboQuant | None = field(init=False, compare=False)
    _proj: dict[int, torch.Tensor] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        self._set(bits=_check_bits(self.bits, TQPROD_BITS, "tqprod"))
        _check_seed(self.seed, "tqprod")
        _check_codebook(self.codebook, "tqprod")
        self._set(stage=TurboQuant(self.bits - 1, self.seed, self.codebook) if self.bits > 1 else None)
        super().__post_init__()

    def _spec(self) -> str:
        return _canonical("tqprod", self.bits, self.seed, self.codebook)

    def projection(self, head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The seeded QJL matrix ``S`` (``[d, d]``, i.i.d. N(0, 1), float32)."""
        if head_dim not in self._proj:
            gen = torch.Generator().manual_seed(self.seed + 1)
            self._proj[head_dim] = torch.randn(head_dim, head_dim, generator=gen, dtype=torch.float32)
        return self._proj[head_dim].to(device)

    def layout(self, head_dim: int) -> dict[str, Field]:
        fields = {} if self.stage is None else {f"mse_{k}": f for k, f in self.stage.layout(head_dim).items()}
        fields["qjl_signs"] = Field((packed_nbytes(head_dim, 1),), torch.uint8)
        fields["qjl_norm"] = Field((1,), torch.float16)
        return fields

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        if self.stage is not None:
            self.stage.check_head_dim(head_dim)

    def _mse_packed(self, packed: Packed) -> Packed:
        inner = {k[4:]: t for k, t in packed.tensors.items() if k.startswith("mse_")}
        return Packed(inner, packed.head_dim, packed.dtype)

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        x32 = x.to(torch.float32)
        tensors: dict[str, torch.Tensor] = {}
        if self.stage is None:
            residual = x32
        else:
            mse = self.stage._encode(x)
            tensors.update({f"mse_{k}": t for k, t in mse.tensors.items()})
            residual = x32 - self.stage._decode(mse)  # against what decode will really rebuild
        gamma = _check_fp16(
            torch.linalg.vector_norm(residual.to(torch.float64), dim=-1, keepdim=True), "residual norm", self.spec
        )
        signs = (residual @ self.projection(d, x.device).T) >= 0
        tensors["qjl_signs"] = pack_bits(signs.to(torch.uint8), 1)
        tensors["qjl_norm"] = gamma
        return Packed(tensors, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        z = unpack_bits(packed.tensors["qjl_signs"], 1, d).to(torch.float32) * 2 - 1
        gamma = packed.tensors["qjl_norm"].to(torch.float32)
        out = (math.sqrt(math.pi / 2) / d) * gamma * (z @ self.projection(d, z.device))
        if self.stage is not None:
            out = out + self.stage._decode(self._mse_packed(packed))
        return out


#: :meth:`TurboQuant._segment_tables` per (bits, codebook, head_dim, device).
_SEGMENT_TABLES: dict[tuple[float, str, int, torch.device], list[tuple[str, int, int, int, torch.Tensor]]] = {}


def _canonical(name: str, bits: float, seed: int, codebook: str, norm_bits: int = 16) -> str:
    spec = f"{name}:{_fmt_bits(bits)}"
    if codebook != "gauss":
        spec += f":codebook={codebook}"
    if seed:
        spec += f":seed={seed}"
    if norm_bits != 16:
        spec += f":norm={norm_bits}"
    return spec


def _parse(name: str, args: str | None, valid: tuple[float, ...], norm: bool = False) -> tuple[float, int, str, int]:
    """``(bits, seed, codebook, norm_bits)`` of ``args``; ``norm``: whether ``:norm=8|16`` is an option."""
    extra = "[:norm=16|8]" if norm else ""
    usage = (
        f"{name} takes {name}:BITS[:codebook=gauss|beta][:seed=N]{extra} with BITS one of {_valid_text(valid)} "
        f"(e.g. {name}:3)"
    )
    if not args:
        raise ValueError(f"{usage}; got {name!r} without a bit width")
    head, *opts = args.split(":")
    bits = _check_bits(head.strip(), valid, name)
    seed, codebook, norm_bits = 0, "gauss", 16
    for opt in opts:
        key, sep, value = opt.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or key not in ("seed", "codebook", *(("norm",) if norm else ())):
            raise ValueError(f"{usage}; unknown option {opt!r}")
        if key in ("seed", "norm"):
            try:
                number = int(value)
            except ValueError:
                raise ValueError(f"{usage}; {key} must be an integer, got {value!r}") from None
            if key == "seed":
                seed = number
            else:
                norm_bits = number
        else:
            codebook = value.lower()
    return bits, seed, codebook, norm_bits


def parse_tq_args(args: str | None) -> TurboQuant:
    """Factory for ``tq:BITS[:codebook=gauss|beta][:seed=N][:norm=16|8]``."""
    return TurboQuant(*_parse("tq", args, TQ_BITS, norm=True))


def parse_tqprod_args(args: str | None) -> TurboQuantProd:
    """Factory for ``tqprod:BITS[:codebook=gauss|beta][:seed=N]``."""
    return TurboQuantProd(*_parse("tqprod", args, TQPROD_BITS)[:3])
