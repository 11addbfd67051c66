"""VHT2: banded Walsh-Hadamard compression, and its companion formats ``vzc`` and ``sqfree:B``.

``vht2:B1,...,Bn[:order=ORDER][:sk=N]`` — per (batch, kv-head, token) vector of ``head_dim`` values:

1. ``y = WHT(x)``: orthonormal Walsh-Hadamard transform, natural (Sylvester) order;
2. ``y = y[perm]``: coefficients reordered (``natural``, ``sequency``, ``squarefree``,
   ``squarefree-dc``, ``variance``; see :mod:`walshkv.ops.orders`);
3. skeleton: only the first ``N = sk`` coefficients are kept (default all); the rest decode as 0;
4. the kept coefficients are split into ``n`` contiguous bands of ``N // n`` coefficients, the last
   band taking any remainder;
5. each band is quantized symmetric round-to-nearest at its width ``b`` with one fp16 scale
   ``absmax / (2^(b-1) - 1)``; a 1-bit band stores signs with scale = mean |y| (the symmetric
   formula has no 1-bit form).

Byte layout per vector: field ``codes`` = the bands' packed codes one after another, each band
LSB-first and starting on a byte (``ceil(size_i * b_i / 8)`` bytes each); field ``scale`` =
``float16[n]``. So ``vht2:5,5,4,3`` at head_dim 64 holds 10 + 10 + 8 + 6 = 34 code bytes and 8
scale bytes: 42 bytes = 336 bits = 5.25 bits per element. Flat V is the one-band case ``vht2:3``.

``vht2:auto@BITS`` chooses band edges and widths per layer from calibrated coefficient variances
(reverse water-filling, see :func:`allocate_bits`) for a budget of BITS bits per element, all
scales included.

``vzc``: WHT, then the sign bit of every coefficient (bitmap) plus one fp16 mean-|y| scale per
residue class of the coefficient index mod 3; decode = sign x class scale. 22 bytes at head_dim 128.

``sqfree:B``: only the squarefree-indexed WHT coefficients (μ(i) != 0; 39 of 64, 78 of 128),
quantized at B bits with one fp16 scale; the others decode as zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Field, Packed
from walshkv.codecs.calibration import Variances
from walshkv.ops.hadamard import _check_size, hadamard_transform
from walshkv.ops.numtheory import squarefree_indices
from walshkv.ops.orders import ORDERS, coefficient_order, variance_order
from walshkv.ops.packing import pack_bits, packed_nbytes, unpack_bits
from walshkv.ops.quant import FP16_MAX, dequantize_symmetric, quantize_symmetric

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["SqfreeCodec", "VHT2Codec", "VZCCodec", "allocate_bits", "parse_vht2_args"]

_SCALE = torch.float16


def _fp16_scale(scale: torch.Tensor, what: str) -> torch.Tensor:
    """``scale`` (float32) as fp16, refusing values beyond the fp16 range (as quantize_symmetric does)."""
    biggest = float(scale.max()) if scale.numel() else 0.0
    if biggest > FP16_MAX:
        raise ValueError(
            f"{what}: a mean |y| scale of {biggest:.4g} is beyond the fp16 scale range (max {FP16_MAX}); "
            "values this large are not K/V of a healthy model. Rescale the input or use a float codec."
        )
    return scale.to(_SCALE)


def _quantize_band(y: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Band codes (``uint8 [..., size]``) and fp16 scale (``[..., 1]``); 1 bit = sign x mean|y|."""
    if bits == 1:
        scale = _fp16_scale(y.to(torch.float32).abs().mean(dim=-1, keepdim=True), "1-bit band")
        return (y >= 0).to(torch.uint8), scale
    return quantize_symmetric(y, bits)


def _dequantize_band(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 1:
        return (codes.to(torch.float32) * 2 - 1) * scale.to(torch.float32)
    return dequantize_symmetric(codes, scale, bits)


@dataclass(frozen=True)
class Band:
    """``size`` coefficients at ``bits`` bits (one fp16 scale)."""

    size: int
    bits: int

    @property
    def nbytes(self) -> int:
        return packed_nbytes(self.size, self.bits)


def equal_bands(widths: tuple[int, ...], kept: int) -> tuple[Band, ...]:
    """``len(widths)`` contiguous bands over ``kept`` coefficients; the last takes the remainder."""
    n = len(widths)
    if n > kept:
        raise ValueError(f"{n} bands need at least {n} kept coefficients, but only {kept} are kept")
    size = kept // n
    return tuple(Band(size if i < n - 1 else kept - size * (n - 1), b) for i, b in enumerate(widths))


@dataclass(frozen=True, repr=False)
class VHT2Codec(Codec):
    """Banded Walsh-Hadamard codec (see the module docstring for the exact layout).

    Attributes:
        widths: band widths in bits (1..8), e.g. ``(5, 5, 4, 3)``.
        order: coefficient order, one of :data:`walshkv.ops.orders.ORDERS` (``variance`` for ``auto@BITS``).
        sk: skeleton, the number of coefficients kept after ordering (``None``: all).
        auto_bits: for ``vht2:auto@BITS``: the bits-per-element budget (bands come from calibration).
        kind, layer: the side and layer a calibrated codec was bound to (``None`` before :meth:`bind`); its
            spec then names them, ``vht2:4,3:order=variance[k0]``.
        calibrated_bands: the bands :meth:`bind` allocated for ``auto@BITS`` (left out of equality).
        calibrated_perm: the coefficient order :meth:`bind` measured for ``variance`` (left out of equality).
    """

    widths: tuple[int, ...] = ()
    order: str = "natural"
    sk: int | None = None
    auto_bits: float | None = field(default=None, kw_only=True)
    kind: Kind | None = field(default=None, kw_only=True)
    layer: int | None = field(default=None, kw_only=True)
    calibrated_bands: tuple[Band, ...] | None = field(default=None, kw_only=True, compare=False)
    calibrated_perm: torch.Tensor | None = field(default=None, kw_only=True, compare=False)
    _perm_cache: dict[int, torch.Tensor] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"unknown vht2 order {self.order!r}; choose one of {', '.join(ORDERS)}")
        for b in self.widths:
            if isinstance(b, bool) or not isinstance(b, int) or not 1 <= b <= 8:
                raise ValueError(f"vht2 band widths must be integers in 1..8 bits, got {b!r} in {self.widths}")
        if self.sk is not None and self.sk < 1:
            raise ValueError(f"vht2 sk (kept coefficients) must be >= 1, got {self.sk}")
        if self.auto_bits is not None:
            if not 0.5 <= self.auto_bits <= 16:
                raise ValueError(
                    f"vht2:auto@BITS takes a budget between 0.5 and 16 bits per element, got {self.auto_bits}"
                )
            self._set(auto_bits=float(self.auto_bits), order="variance")
        if (self.kind is None) != (self.layer is None):
            raise ValueError(f"a bound vht2 codec names its side and layer together, got {self.kind!r}, {self.layer!r}")
        self._set(widths=tuple(self.widths))
        super().__post_init__()

    def _spec(self) -> str:
        if self.auto_bits is not None:
            s = f"vht2:auto@{repr(self.auto_bits).removesuffix('.0')}"
        else:
            s = "vht2:" + ",".join(str(b) for b in self.widths)
            if self.order != "natural":
                s += f":order={self.order}"
            if self.sk is not None:
                s += f":sk={self.sk}"
        return s if self.layer is None else f"{s}[{self.kind}{self.layer}]"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return (self.order == "variance" or self.auto_bits is not None) and self.calibrated_perm is None

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        if not self.needs_calibration:
            return self
        if not isinstance(calibration, Variances):
            raise ValueError(f"{self.spec} needs calibration statistics (CLI: --calib-text TEXT)")
        variance = calibration.variance(kind, layer_idx, "wht").mean(dim=0)  # over kv heads
        perm = variance_order(variance)
        bands = None
        if self.auto_bits is not None:
            bands = allocate_bits(variance[perm], self.auto_bits)
        return replace(self, kind=kind, layer=layer_idx, calibrated_bands=bands, calibrated_perm=perm)

    def bands(self, head_dim: int) -> tuple[Band, ...]:
        """The bands for ``head_dim`` (kept coefficients only)."""
        if self.calibrated_bands is not None:
            return self.calibrated_bands
        if self.auto_bits is not None:
            raise ValueError(f"{self.spec}: band widths come from calibration; bind() the codec first")
        kept = self.sk if self.sk is not None else head_dim
        return equal_bands(self.widths, kept)

    def check_head_dim(self, head_dim: int) -> None:
        _check_size(head_dim, f"head_dim of '{self.spec}'")
        if self.sk is not None and self.sk > head_dim:
            raise ValueError(f"{self.spec}: sk={self.sk} exceeds head_dim {head_dim}; use sk <= {head_dim}")
        if self.calibrated_bands is None and self.auto_bits is None:
            self.bands(head_dim)  # raises if there are more bands than kept coefficients
        perm = self.calibrated_perm
        if perm is not None and perm.numel() != head_dim:
            raise ValueError(f"{self.spec} was calibrated for head_dim {perm.numel()}, not {head_dim}")

    def perm(self, head_dim: int) -> torch.Tensor:
        """The coefficient order at ``head_dim`` (the calibrated one once bound)."""
        if self.calibrated_perm is not None:
            return self.calibrated_perm
        if head_dim not in self._perm_cache:
            self._perm_cache[head_dim] = coefficient_order(self.order, head_dim)
        return self._perm_cache[head_dim]

    def coefficient_basis(self, head_dim: int) -> torch.Tensor:
        """``[head_dim, kept]`` float32: column ``j`` is the WHT basis vector of kept coefficient ``j``.

        ``x @ basis`` gives the coefficients this codec stores, in its order; ``c @ basis.T`` maps them
        back (what fused attention uses instead of decoding every vector).
        """
        kept = sum(b.size for b in self.bands(head_dim))
        wht = hadamard_transform(torch.eye(head_dim, dtype=torch.float32))  # symmetric: row i = WHT(e_i)
        return wht[:, self.perm(head_dim)[:kept].cpu()].contiguous()

    def layout(self, head_dim: int) -> dict[str, Field]:
        bands = self.bands(head_dim)
        return {
            "codes": Field((sum(b.nbytes for b in bands),), torch.uint8),
            "scale": Field((len(bands),), _SCALE),
        }

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        y = hadamard_transform(x)[..., self.perm(d).to(x.device)]
        codes, scales, start = [], [], 0
        for band in self.bands(d):
            q, s = _quantize_band(y[..., start : start + band.size], band.bits)
            codes.append(pack_bits(q, band.bits))
            scales.append(s)
            start += band.size
        return Packed({"codes": torch.cat(codes, dim=-1), "scale": torch.cat(scales, dim=-1)}, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        codes, scales = packed.tensors["codes"], packed.tensors["scale"]
        parts, offset = [], 0
        for i, band in enumerate(self.bands(d)):
            q = unpack_bits(codes[..., offset : offset + band.nbytes], band.bits, band.size)
            parts.append(_dequantize_band(q, scales[..., i : i + 1], band.bits))
            offset += band.nbytes
        kept = torch.cat(parts, dim=-1)
        y = kept.new_zeros((*kept.shape[:-1], d))
        y[..., self.perm(d)[: kept.shape[-1]].to(y.device)] = kept
        return hadamard_transform(y)


def allocate_bits(variance: torch.Tensor, budget: float, max_bits: int = 8) -> tuple[Band, ...]:
    """Reverse water-filling with integer widths and the fp16 scale per band counted.

    Args:
        variance: per-coefficient variance, already sorted in descending order (``[head_dim]``).
        budget: bits per element for the whole vector, scales included.
        max_bits: widest band.

    Returns:
        Bands in the same (descending-variance) order; coefficients given 0 bits are dropped
        (the skeleton), so the bands may cover fewer than ``head_dim`` coefficients.

    The Gaussian rate-distortion rule gives coefficient ``i`` the rate ``max(0, ½ log2(σ²_i / θ))``.
    Rates are rounded to integers, consecutive coefficients with the same width form a band, and
    the water level ``θ`` is bisected to the largest total that fits ``budget * head_dim`` bits.
    """
    d = variance.numel()
    # A tiny decreasing factor breaks ties by index, so equal variances can still get unequal widths.
    var = variance.to(torch.float64).clamp_min(1e-30) * (1 - 1e-9 * torch.arange(d, dtype=torch.float64))
    target = budget * d

    def bands_for(theta: float) -> tuple[Band, ...]:
        rates = (0.5 * torch.log2(var / theta)).clamp(0, max_bits)
        widths = torch.round(rates).to(torch.long)
        # Non-increasing widths along the (descending-variance) order, so bands stay contiguous.
        widths = torch.cummin(widths, dim=0).values
        out: list[Band] = []
        for w in widths.tolist():
            if w == 0:
                break
            if out and out[-1].bits == w:
                out[-1] = Band(out[-1].size + 1, w)
            else:
                out.append(Band(1, w))
        return tuple(out)

    def cost(bands: tuple[Band, ...]) -> int:
        return sum(8 * b.nbytes + 16 for b in bands)

    lo, hi = math.log2(float(var.min())) - 2 * max_bits - 2, math.log2(float(var.max())) + 1
    best: tuple[Band, ...] = ()
    for _ in range(60):
        mid = (lo + hi) / 2
        bands = bands_for(2.0**mid)
        if cost(bands) <= target:
            best, hi = bands, mid
        else:
            lo = mid
    if not best:
        raise ValueError(f"a budget of {budget} bits per element cannot hold even one band at head_dim {d}")
    return best


@dataclass(frozen=True, repr=False)
class VZCCodec(Codec):
    """``vzc``: sign bitmap of the WHT coefficients + one fp16 mean-|y| scale per index class mod 3 (no fields)."""

    def _spec(self) -> str:
        return "vzc"

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {"signs": Field((packed_nbytes(head_dim, 1),), torch.uint8), "scale": Field((3,), _SCALE)}

    def check_head_dim(self, head_dim: int) -> None:
        _check_size(head_dim, "head_dim of 'vzc'")
        if head_dim < 3:
            raise ValueError(f"vzc needs head_dim >= 3 (three residue classes), got {head_dim}")

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        y = hadamard_transform(x)
        cls = torch.arange(d, device=y.device) % 3
        scales = _fp16_scale(torch.stack([y[..., cls == r].abs().mean(dim=-1) for r in range(3)], dim=-1), "vzc")
        return Packed({"signs": pack_bits((y >= 0).to(torch.uint8), 1), "scale": scales}, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        signs = unpack_bits(packed.tensors["signs"], 1, d).to(torch.float32) * 2 - 1
        cls = torch.arange(d, device=signs.device) % 3
        return hadamard_transform(signs * packed.tensors["scale"].to(torch.float32)[..., cls])


@dataclass(frozen=True, repr=False)
class SqfreeCodec(Codec):
    """``sqfree:B``: keep only squarefree-indexed WHT coefficients at B bits, one fp16 scale.

    Attributes:
        bits: code width, 1..8.
    """

    bits: int

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"sqfree:B takes B in 1..8 bits, got {self.bits!r}")
        super().__post_init__()

    def _spec(self) -> str:
        return f"sqfree:{self.bits}"

    def check_head_dim(self, head_dim: int) -> None:
        _check_size(head_dim, f"head_dim of '{self.spec}'")
        if head_dim < 4:
            raise ValueError(f"{self.spec} needs head_dim >= 4 (squarefree indices 1, 2, 3), got {head_dim}")

    def _index(self, d: int, device: torch.device) -> torch.Tensor:
        return torch.tensor(squarefree_indices(d), device=device)

    def layout(self, head_dim: int) -> dict[str, Field]:
        n = len(squarefree_indices(head_dim))
        return {"codes": Field((packed_nbytes(n, self.bits),), torch.uint8), "scale": Field((1,), _SCALE)}

    def _encode(self, x: torch.Tensor) -> Packed:
        d = x.shape[-1]
        y = hadamard_transform(x)[..., self._index(d, x.device)]
        q, s = _quantize_band(y, self.bits)
        return Packed({"codes": pack_bits(q, self.bits), "scale": s}, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        idx = self._index(d, packed.tensors["codes"].device)
        q = unpack_bits(packed.tensors["codes"], self.bits, idx.numel())
        kept = _dequantize_band(q, packed.tensors["scale"], self.bits)
        y = kept.new_zeros((*kept.shape[:-1], d))
        y[..., idx] = kept
        return hadamard_transform(y)


def parse_vht2_args(args: str | None) -> VHT2Codec:
    """Parse the part after ``vht2:`` — ``5,5,4,3[:order=X][:sk=N]`` or ``auto@BITS``."""
    usage = "vht2:B1,...,Bn[:order=ORDER][:sk=N] or vht2:auto@BITS (e.g. vht2:5,5,4,3:order=squarefree)"
    if not args:
        raise ValueError(f"vht2 needs band widths: {usage}")
    head, *opts = args.split(":")
    kw: dict[str, str] = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or key not in ("order", "sk"):
            raise ValueError(f"unknown vht2 option {opt!r}; options are order=ORDER and sk=N ({usage})")
        kw[key] = value
    sk = None
    if "sk" in kw:
        try:
            sk = int(kw["sk"])
        except ValueError:
            raise ValueError(f"vht2 sk takes an integer, got {kw['sk']!r}") from None
    if head.startswith("auto@"):
        if opts:
            raise ValueError("vht2:auto@BITS takes no options (it chooses order and bands itself)")
        try:
            budget = float(head[5:])
        except ValueError:
            raise ValueError(f"vht2:auto@BITS takes a number, got {head[5:]!r}") from None
        return VHT2Codec(auto_bits=budget)
    try:
        widths = tuple(int(b) for b in head.split(","))
    except ValueError:
        raise ValueError(f"vht2 band widths must be integers, got {head!r}; {usage}") from None
    return VHT2Codec(widths, kw.get("order", "natural"), sk)
