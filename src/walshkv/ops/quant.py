"""Quantizer math: symmetric round-to-nearest with one fp16 scale per vector.

``quantize_symmetric`` maps each vector (last dimension) to signed integers in
``[-qmax, qmax]`` with ``qmax = 2**(bits-1) - 1`` and ``scale = absmax / qmax``,
stored as fp16. Codes are returned offset by ``qmax`` so they are unsigned and fit
in ``bits`` bits. The scale is rounded to fp16 *before* the codes are computed, so
encode and decode use the same number. All-zero vectors get scale 0 and decode to
zeros (never NaN).
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = [
    "FP16_MAX",
    "check_finite",
    "checks_on_device",
    "cpu_scalar",
    "dequantize_symmetric",
    "device_checks",
    "divide_by_scale",
    "finite_absmax",
    "fp16_scale_up",
    "min_max",
    "quantize_symmetric",
    "quantize_symmetric_codes",
    "symmetric_qmax",
]

FP16_MAX = 65504.0

_ON_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("walshkv_checks_on_device", default=False)


@contextmanager
def checks_on_device() -> Iterator[None]:
    """Within the block, encoding checks values on the tensors' device instead of reading them back to the host.

    By default a codec's ``encode`` reads ``max |x|`` and its scales' range back to the host, to refuse NaN/Inf and
    fp16 overflow (and to pick a faster path when no scale is 0): on a GPU each read waits for the device, and a
    CUDA graph cannot capture it. Here the same refusals are device-side asserts (``torch._assert_async``, with the
    same message: raised at once on the CPU, at the next synchronisation on CUDA, where a failed device assert ends
    the process's CUDA context as in any CUDA code) and the general path is taken; every float16 block gets its
    range trial. Shape, dtype and head size are still checked first (they are metadata). A serving engine's write
    path uses it (the vLLM plugin on CUDA); ``tests`` check that nothing in it reads a value back.
    """
    token = _ON_DEVICE.set(True)
    try:
        yield
    finally:
        _ON_DEVICE.reset(token)


def device_checks() -> bool:
    """Whether :func:`checks_on_device` is in effect (checks as device-side asserts, no value read back)."""
    return _ON_DEVICE.get()


def symmetric_qmax(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit quantizer (``2**(bits-1) - 1``)."""
    if not 2 <= bits <= 8:
        raise ValueError(f"symmetric integer quantization needs 2..8 bits, got {bits}")
    return (1 << (bits - 1)) - 1


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise ``ValueError`` naming the count of NaN/Inf values if ``x`` has any."""
    if x.is_floating_point():
        finite_absmax(x, what)
    elif not bool(torch.isfinite(x).all()):
        _refuse_nonfinite(x, what)


def finite_absmax(x: torch.Tensor, what: str = "input") -> float:
    """``max |x|`` of a float tensor (0 if it is empty), after :func:`check_finite`'s check, in one pass.

    One ``aminmax`` both checks and measures: a NaN propagates to both ends, an Inf reaches one of them.
    """
    if not x.numel():
        return 0.0
    lo, hi = min_max(x)
    if not (math.isfinite(lo) and math.isfinite(hi)):
        _refuse_nonfinite(x, what)
    return max(-lo, hi)


def min_max(x: torch.Tensor) -> tuple[float, float]:
    """``(min, max)`` of a non-empty tensor as Python floats, from one ``aminmax`` (NaN if ``x`` has a NaN).

    One transfer to the host: two ``item()`` calls on the CPU, where each is cheap, one list elsewhere.
    """
    lo, hi = torch.aminmax(x)
    if x.is_cpu:
        return lo.item(), hi.item()
    pair = torch.stack((lo, hi)).tolist()
    return pair[0], pair[1]


def _refuse_nonfinite(x: torch.Tensor, what: str) -> None:
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
    codes, scale16, _ = quantize_symmetric_codes(x, bits)
    return codes.to(torch.uint8), scale16


def quantize_symmetric_codes(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """:func:`quantize_symmetric` with the codes still float32 (whole numbers), and the largest float32 scale.

    The largest scale is NaN where ``x`` has a NaN (which the caller may refuse). Returns ``(codes, scale, biggest)``.
    """
    qmax = symmetric_qmax(bits)
    xf = x if x.dtype == torch.float32 else x.to(torch.float32)
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale32 = absmax / cpu_scalar(qmax, absmax)
    smallest, biggest = 0.0, 0.0
    if device_checks():  # no read back: the general path (a zero scale allowed), the range as a device assert
        torch._assert_async(
            (scale32 <= FP16_MAX).all(),
            f"a vector needs a scale beyond the fp16 scale range (max {FP16_MAX}) of int{bits}, or holds NaN/Inf; "
            "values like these are not K/V of a healthy model. Rescale the input or use a float codec (fp32, bf16).",
        )
    elif scale32.numel():
        smallest, biggest = min_max(scale32)
    if biggest > FP16_MAX:
        raise ValueError(
            f"a vector with |x| up to {float(absmax.max()):.4g} needs a scale of {biggest:.4g}, beyond the "
            f"fp16 scale range (max {FP16_MAX}) of int{bits}; values this large are not K/V of a healthy "
            "model. Rescale the input or use a float codec (fp32, bf16)."
        )
    # fp16_scale_up for scales in [+0, FP16_MAX] (or NaN): there nextafter(s, +Inf) is the next bit pattern. (Mixed
    # float16/float32 operands are compared and divided in float32, which holds every float16 value exactly.)
    scale16 = scale32.to(torch.float16)
    scale16 = (scale16.view(torch.int16) + (scale16 < scale32)).view(torch.float16)
    if math.isnan(biggest):  # NaN input: divide_by_scale's zeros where the scale is NaN
        q = divide_by_scale(xf, scale16)
    elif smallest > 0:  # every scale positive: divide_by_scale's where()s change nothing
        q = torch.round(xf / scale16)
    else:  # a zero scale means |x| underflowed to 0 at that vector's scale: round(x / 1) is ±0, the same code
        s = scale16.to(torch.float32)
        q = torch.round(xf / torch.where(s > cpu_scalar(0.0, s), s, cpu_scalar(1.0, s)))
    return q.clamp_(-qmax, qmax).add_(cpu_scalar(qmax, q)), scale16, biggest


_SCALARS: dict[tuple[float, float], torch.Tensor] = {}


def cpu_scalar(value: float, like: torch.Tensor) -> torch.Tensor | float:
    """``value`` as the other operand of an op on ``like``: a cached 0-d float32 tensor where ``like`` is a float32
    CPU tensor, else ``value`` itself.

    The op then gives the same result (a Python number is converted to the same 0-d float32 CPU tensor) without
    building that tensor at every call, which costs more than the op on a decoding step's few values. Treat the
    tensor as read-only.
    """
    if like.dtype != torch.float32 or not like.is_cpu:
        return value
    key = (value, math.copysign(1.0, value))
    scalar = _SCALARS.get(key)
    if scalar is None:
        scalar = _SCALARS[key] = torch.tensor(value, dtype=torch.float32)
    return scalar


def fp16_scale_up(scale32: torch.Tensor) -> torch.Tensor:
    """``scale32`` as fp16, rounded up, never down, so a vector's largest value is never clamped
    (matters for tiny vectors whose scale is an fp16 subnormal). The caller checks the range."""
    scale16 = scale32.to(torch.float16)
    rounded_down = scale16 < scale32  # compared in float32, which holds every float16 exactly
    return torch.where(rounded_down, torch.nextafter(scale16, _fp16_inf(scale16.device)), scale16)


_FP16_INF: dict[torch.device, torch.Tensor] = {}


def _fp16_inf(device: torch.device) -> torch.Tensor:
    """A cached float16 ``+Inf`` scalar tensor on ``device`` (read-only)."""
    inf = _FP16_INF.get(device)
    if inf is None:
        inf = _FP16_INF[device] = torch.tensor(float("inf"), dtype=torch.float16, device=device)
    return inf


def divide_by_scale(x: torch.Tensor, scale16: torch.Tensor) -> torch.Tensor:
    """``round(x / scale)`` with the stored fp16 scale; 0 where the scale is 0 (all-zero vectors)."""
    s = scale16.to(torch.float32)
    positive = s > 0
    return torch.where(positive, torch.round(x / torch.where(positive, s, 1.0)), 0.0)


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
