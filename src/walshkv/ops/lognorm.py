"""8-bit logarithmic norms: a vector's L2 norm in one byte instead of an fp16 (``tq:B:norm=8``, ``tcq:B:norm=8``).

Code ``c`` in 1..255 stands for ``2 ** ((c - 128) / 8)`` (eight steps per octave, ``1.7e-5`` to ``59,577``: about
fp16's range); code 0 stands for 0, the norm of a vector too small to matter (below the smallest step). A codec
that stores such a norm scales its vector by the *decoded* norm before coding it, so the codes absorb the rounding:
what the step costs is only that the coded values' spread is off unit variance by at most ``2 ** (1/16)`` (4.4%),
and what it saves is 8 bits per vector, ``8 / head_dim`` bits per element.
"""

from __future__ import annotations

import math

import torch

from walshkv.ops.quant import device_checks

__all__ = ["LOG_NORM_MAX", "LOG_NORM_STEPS", "decode_log_norms", "encode_log_norms", "log_norm_table"]

#: Codes per octave of the norm.
LOG_NORM_STEPS = 8
#: The largest norm code 255 stands for, ``2 ** (127 / 8)``.
LOG_NORM_MAX = 2.0 ** (127 / LOG_NORM_STEPS)

_TABLES: dict[torch.device, torch.Tensor] = {}


def log_norm_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The norm each code stands for: float32 ``[256]``, entry 0 is 0 (cached per device)."""
    device = torch.device(device)
    tab = _TABLES.get(device)
    if tab is None:
        exps = (torch.arange(256, dtype=torch.float64) - 128) / LOG_NORM_STEPS
        tab = torch.exp2(exps).to(torch.float32)
        tab[0] = 0.0
        tab = _TABLES[device] = tab.to(device)
    return tab


def encode_log_norms(norm: torch.Tensor, spec: str) -> torch.Tensor:
    """Norms (float64 or float32, ``>= 0``) to their nearest codes in the log domain (uint8, same shape).

    Raises:
        ValueError: a NaN or Inf norm, or one past :data:`LOG_NORM_MAX` (named with ``spec``, and the fix).
    """
    norm = norm.to(torch.float64)
    limit = LOG_NORM_MAX * 2.0 ** (1 / (2 * LOG_NORM_STEPS))  # where rounding would pass code 255
    message = (
        f"'{spec}' stores each vector's L2 norm in 8 bits, up to {limit:.6g} (the fp16 maximum is 65504), but a vector "
        "has norm {biggest:.6g}; values this large (or NaN/Inf) are not K/V of a healthy model. Rescale the input, or "
        "use a float codec (spec fp32 or bf16)"
    )
    within = (norm <= limit).all()  # False for a NaN too
    if device_checks():  # no value read back: a device-side assert, as tq's fp16 norm check
        torch._assert_async(within, message.format(biggest=math.inf))
    elif norm.numel() and not bool(within):
        biggest = math.nan if bool(torch.isnan(norm).any()) else float(norm.max())
        raise ValueError(message.format(biggest=biggest))
    code = torch.round(torch.log2(norm.clamp_min(1e-300)) * LOG_NORM_STEPS) + 128
    return code.clamp(0, 255).to(torch.uint8)


def decode_log_norms(codes: torch.Tensor) -> torch.Tensor:
    """Codes (uint8) to the norms they stand for (float32, same shape)."""
    return log_norm_table(codes.device)[codes.to(torch.int64)]
