"""KIVI: asymmetric 2/4-bit KV quantization, K per channel, V per token (Liu et al., 2024).

``kivi2``, ``kivi4`` (options ``:g=G`` group size, default 32; ``:r=R`` full-precision window,
default 32), e.g. ``kivi2:g=32:r=128``:

* K is quantized **per channel**, in groups of ``G`` consecutive tokens: for each (kv-head,
  channel) of a group, ``zero = min`` and ``scale = (max - min) / (2^B - 1)``, both fp16.
  Stored per group: codes ``uint8[ceil(G * head_dim * B / 8)]`` (token-major, packed LSB-first),
  ``scale`` and ``zero`` ``float16[head_dim]`` each.
* V is quantized **per token**, in groups of ``G`` channels: per (token, channel group) an fp16
  scale and zero. Stored per token: codes ``uint8[ceil(head_dim * B / 8)]``, ``scale``/``zero``
  ``float16[head_dim / G]``.
* The most recent tokens stay in a full-precision (fp16) window; once the window holds
  ``R + G`` tokens its oldest ``G`` are quantized as one K group (and their V), so K tokens wait
  in the window until their group is full, and the window holds between ``R`` and ``R + G - 1``
  tokens. Its bytes count in the cache's bits per element.

Deviations from the paper, on purpose: V leaves the window on the same schedule as K (the paper
can quantize V token by token as it leaves a window of ``R``); the window is stored in fp16 as in
the paper's code whatever the model's dtype. The window and the grouping schedule are the cache's
(:class:`walshkv.cache.KiviLayer`); the codec itself follows the contract once bound to a side:
``bind(layer, "k").encode(x)`` takes whole groups (``seq_len`` a multiple of ``G``; the stored sequence
dimension counts groups), ``bind(layer, "v").encode(x)`` any number of tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Field, Packed
from walshkv.ops.packing import pack_bits, packed_nbytes, unpack_bits
from walshkv.ops.quant import FP16_MAX, divide_by_scale, fp16_scale_up

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["KiviCodec", "dequantize_asymmetric", "parse_kivi_args", "quantize_asymmetric"]


def quantize_asymmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Min/max asymmetric RTN along ``dim``: ``(codes uint8, scale fp16, zero fp16)``.

    ``scale`` and ``zero`` keep ``dim`` as size 1. The fp16 scale is rounded up and codes are
    computed from the stored fp16 numbers, so decode uses exactly what encode used.
    """
    if not 1 <= bits <= 8:
        raise ValueError(f"asymmetric quantization takes 1..8 bits, got {bits}")
    xf = x.to(torch.float32)
    mn = xf.amin(dim=dim, keepdim=True)
    mx = xf.amax(dim=dim, keepdim=True)
    levels = (1 << bits) - 1
    scale32 = (mx - mn) / levels
    peak = max(float(scale32.max()), float(mn.abs().max())) if xf.numel() else 0.0
    if peak > FP16_MAX:
        raise ValueError(
            f"KIVI: a scale or zero point of {peak:.4g} is beyond the fp16 range (max {FP16_MAX}); "
            "values this large are not K/V of a healthy model"
        )
    scale = fp16_scale_up(scale32)
    zero = mn.to(torch.float16)
    q = divide_by_scale(xf - zero.to(torch.float32), scale)
    return q.clamp_(0, levels).to(torch.uint8), scale, zero


def dequantize_asymmetric(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """``codes * scale + zero`` in float32."""
    return codes.to(torch.float32) * scale.to(torch.float32) + zero.to(torch.float32)


@dataclass(frozen=True, repr=False)
class KiviCodec(Codec):
    """One side (K or V) of KIVI; built as a pair by the ``kivi2``/``kivi4`` spec.

    Attributes:
        bits: code width (2 or 4 in the paper; 1..8 accepted).
        group: G, tokens per K group and channels per V group.
        residual: R, the full-precision window (tokens).
        kind: ``"k"`` (per-channel over token groups) or ``"v"`` (per-token); ``None`` until bound (the spec,
            ``kivi{bits}[:g=G][:r=R]``, names both sides and does not show it).
    """

    bits: int
    group: int = 32
    residual: int = 32
    kind: Kind | None = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 1 <= self.bits <= 8:
            raise ValueError(f"kivi takes 1..8 bits (kivi2, kivi4), got {self.bits!r}")
        if self.group < 1 or self.residual < 0:
            raise ValueError(f"kivi needs g >= 1 and r >= 0, got g={self.group}, r={self.residual}")
        if self.kind not in (None, "k", "v"):
            raise ValueError(f"kivi binds to a side, 'k' or 'v', got {self.kind!r}")
        super().__post_init__()

    def _spec(self) -> str:
        opts = (f":g={self.group}" if self.group != 32 else "") + (f":r={self.residual}" if self.residual != 32 else "")
        return f"kivi{self.bits}{opts}"

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        return self if self.kind == kind else replace(self, kind=kind)

    def v_group(self, head_dim: int) -> int:
        """Channels per V group (G, or head_dim if head_dim is not a multiple of G)."""
        return self.group if head_dim % self.group == 0 else head_dim

    def layout(self, head_dim: int) -> dict[str, Field]:
        """Per K *group of G tokens* (kind ``k``) or per V token (kind ``v``)."""
        if self.kind == "k":
            return {
                "codes": Field((packed_nbytes(self.group * head_dim, self.bits),), torch.uint8),
                "scale": Field((head_dim,), torch.float16),
                "zero": Field((head_dim,), torch.float16),
            }
        n = head_dim // self.v_group(head_dim)
        return {
            "codes": Field((packed_nbytes(head_dim, self.bits),), torch.uint8),
            "scale": Field((n,), torch.float16),
            "zero": Field((n,), torch.float16),
        }

    def bytes_per_vector(self, head_dim: int) -> int:
        per = super().bytes_per_vector(head_dim)
        return per / self.group if self.kind == "k" else per  # type: ignore[return-value]

    def _encode(self, x: torch.Tensor) -> Packed:
        """``[batch, heads, n*G, head_dim]`` -> K: n groups (quantized per channel); V: n*G tokens."""
        if self.kind is None:
            raise ValueError(
                f"{self.spec} stores K and V differently: bind it to a side first (codec.bind(layer, 'k') or "
                "'v'; CompressedCache does)"
            )
        b, h, t, d = x.shape
        if self.kind == "k":
            if t % self.group:
                raise ValueError(
                    f"{self.spec} quantizes K in groups of {self.group} tokens: encode a multiple of {self.group} "
                    f"tokens, got {t} (CompressedCache keeps the rest in its fp16 window)"
                )
            g = x.reshape(b, h, t // self.group, self.group, d)
            q, s, z = quantize_asymmetric(g, self.bits, dim=3)  # per channel over the group's tokens
            codes = pack_bits(q.reshape(b, h, t // self.group, self.group * d), self.bits)
            return Packed({"codes": codes, "scale": s.squeeze(3), "zero": z.squeeze(3)}, d, x.dtype)
        gv = self.v_group(d)
        v = x.reshape(b, h, t, d // gv, gv)
        q, s, z = quantize_asymmetric(v, self.bits, dim=4)
        codes = pack_bits(q.reshape(b, h, t, d), self.bits)
        return Packed({"codes": codes, "scale": s.squeeze(4), "zero": z.squeeze(4)}, d, x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        """Inverse of :meth:`_encode`: ``[batch, heads, tokens, head_dim]`` float32."""
        d = packed.head_dim
        codes, s, z = packed.tensors["codes"], packed.tensors["scale"], packed.tensors["zero"]
        b, h, n = codes.shape[:3]
        if self.kind == "k":
            q = unpack_bits(codes, self.bits, self.group * d).reshape(b, h, n, self.group, d)
            x = dequantize_asymmetric(q, s.unsqueeze(3), z.unsqueeze(3))
            return x.reshape(b, h, n * self.group, d)
        gv = self.v_group(d)
        q = unpack_bits(codes, self.bits, d).reshape(b, h, n, d // gv, gv)
        return dequantize_asymmetric(q, s.unsqueeze(4), z.unsqueeze(4)).reshape(b, h, n, d)


def parse_kivi_args(bits: int, args: str | None) -> KiviCodec:
    """``kivi{bits}[:g=G][:r=R]``."""
    kw = {"g": 32, "r": 32}
    for opt in (args or "").split(":") if args else []:
        key, sep, value = opt.partition("=")
        if not sep or key not in kw:
            raise ValueError(f"unknown kivi option {opt!r}; options are g=GROUP and r=RESIDUAL (kivi2:g=32:r=128)")
        try:
            kw[key] = int(value)
        except ValueError:
            raise ValueError(f"kivi option {key} takes an integer, got {value!r}") from None
    return KiviCodec(bits, group=kw["g"], residual=kw["r"])
