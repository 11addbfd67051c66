"""Quantizer math: symmetric round-to-nearest with one fp16 scale per vector.

``quantize_symmetric`` maps each vector (last dimension) to signed integers in
``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1`` and ``scale = absmax / qmax``,
stored as fp16. Codes are returned offset by ``qmax`` so they are unsigned and fit
in ``bits`` bits. The scale is rounded to fp16 *before* the codes are computed, so
encode and decode use the same number. All-zero vectors get scale 0 and decode to
zeros (never NaN).
"""

from __future__ import annotations

import torch

__all__ = [
    "FP16_MAX",
    "check_finite",
    "dequantize_symmetric",
    "divide_by_scale",
    "fp16_scale_up",
    "quantize_symmetric",
    "symmetric_qmax",
]

FP16_MAX = 65504.0


def symmetric_qmax(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit quantizer (``2**(bits-1) - 1``)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"symmetric integer quantization needs 2..8 bits, got {bits}")
    return (1 << (bits - 1)) - 1


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise ``ValueError`` naming the count of NaN/Inf values if ``x`` has any."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        n_nan = int(torch.isnan(x).sum())
        n_inf = int(torch.isinf(x).sum())
        raise ValueError(
            f"{what} contains {n_nan} NaN and {n_inf} Inf values; walshkv codecs refuse non-finite "
            "K/V instead of spreading them through a shared scale. Find where the model overflows "
            "(e.g. run it in float32) and pass finite values."
        )


def quantize_symmetric(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric RTN quantization of each vector along the last dimension.

    Args:
        x: float tensor ``[..., n]`` (e.g. ``[batch, num_kv_heads, seq_len, head_dim]``), finite.
        bits: code width, 2..8.

    Returns:
        ``(codes, scale)``: ``codes`` is ``uint8 [..., n]`` in ``[0, 2*qmax]`` (offset by
        ``qmax``), ``scale`` is ``float16 [..., 1]``.

    Raises:
        ValueError: if a vector's scale would overflow fp16.
    """
    qmax = symmetric_qmax(bits)
    xf = x.to(torch.float32)
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale32 = absmax / qmax
    biggest = float(scale32.max()) if scale32.numel() else 0.0
    if biggest > FP16_MAX:
        raise ValueError(
            f"a vector with |x| up to {float(absmax.max()):.4g} needs a scale of {biggest:.4g}, beyond the "
            f"fp16 scale range (max {FP16_MAX}) of int{bits}; values this large are not K/V of a healthy "
            "model. Rescale the input or use a float codec (fp32, bf16)."
        )
    scale16 = fp16_scale_up(scale32)
    q = divide_by_scale(xf, scale16).clamp_(-qmax, qmax) + qmax
    return q.to(torch.uint8), scale16


def fp16_scale_up(scale32: torch.Tensor) -> torch.Tensor:
    """``scale32`` as fp16, rounded up, never down, so a vector's largest value is never clamped
    (matters for tiny vectors whose scale is an fp16 subnormal). The caller checks the range."""
    scale16 = scale32.to(torch.float16)
    rounded_down = scale16.to(torch.float32) < scale32
    return torch.where(rounded_down, torch.nextafter(scale16, torch.full_like(scale16, float("inf"))), scale16)


def divide_by_scale(x: torch.Tensor, scale16: torch.Tensor) -> torch.Tensor:
    """``round(x / scale)`` with the stored fp16 scale; 0 where the scale is 0 (all-zero vectors)."""
    s = scale16.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return torch.where(s > 0, torch.round(x / safe), torch.zeros_like(x))


def dequantize_symmetric(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`quantize_symmetric` (in float32).

    Args:
        codes: ``uint8 [..., n]`` offset codes.
        scale: ``float16 [..., 1]``.
        bits: code width, 2..8.

    Returns:
        float32 tensor ``[..., n]``.
    """
    qmax = symmetric_qmax(bits)
    return (codes.to(torch.float32) - qmax) * scale.to(torch.float32)
