"""Hugging Face's ``QuantizedCache`` as a peer: ``hf-quanto:B``, ``hf-hqq:B``, ``hf-fp8`` (built by
:func:`walshkv.cache.make_cache`; :func:`walshkv.codecs.spec.parse_cache_spec` parses them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = ["HF_BACKENDS", "HFCacheSpec", "parse_hf_spec"]

# name -> (transformers backend, allowed bits, pip package that provides it)
HF_BACKENDS: dict[str, tuple[str, tuple[int, ...], str | None]] = {
    "hf-quanto": ("quanto", (2, 4), "optimum-quanto"),
    "hf-hqq": ("hqq", (1, 2, 3, 4, 8), "hqq"),
    "hf-fp8": ("fp8", (8,), None),
}
# HQQ packs 3-bit codes ten to an int32; the others pack into bytes.
_HF_CODES_PER_WORD = {1: (8, 8), 2: (4, 8), 3: (10, 32), 4: (2, 8), 8: (1, 8)}


@dataclass(frozen=True)
class HFCacheSpec:
    """Hugging Face's ``QuantizedCache`` as a peer: ``hf-quanto:B``, ``hf-hqq:B``, ``hf-fp8``.

    Grammar: ``hf-quanto:B[:g=G][:r=R]`` (B in 2, 4), ``hf-hqq:B[:g=G][:r=R]`` (B in 1, 2, 3, 4, 8),
    ``hf-fp8`` (per-tensor float8 e4m3, scale frozen at the first write). ``g`` is transformers'
    ``q_group_size`` (default 64) and ``r`` its ``residual_length`` (default 128): up to ``r`` recent
    tokens stay in full precision and are re-quantized together with the whole cache when the window
    fills. Like transformers, the first write (the prompt) is returned to attention unquantized, so
    ``walshkv eval`` feeds these caches one scored token at a time (``feed="decode"``).

    Attributes:
        backend: ``quanto``, ``hqq`` or ``fp8``.
        bits: code width.
        group: elements per scale/zero-point group.
        residual: full-precision window in tokens (0 for fp8).
    """

    backend: str
    bits: int
    group: int = 64
    residual: int = 128

    @property
    def spec(self) -> str:
        if self.backend == "fp8":
            return "hf-fp8"
        out = f"hf-{self.backend}:{self.bits}"
        if self.group != 64:
            out += f":g={self.group}"
        if self.residual != 128:
            out += f":r={self.residual}"
        return out

    @property
    def needs_calibration(self) -> bool:
        return False

    @property
    def pip_package(self) -> str | None:
        return HF_BACKENDS[f"hf-{self.backend}"][2]

    def bits_per_element(self, head_dim: int) -> float:
        """Stored bits per element of the quantized part (residual window excluded), fp16 scale and zero."""
        if self.backend == "fp8":
            return 8.0
        per, word = _HF_CODES_PER_WORD[self.bits] if self.backend == "hqq" else (8 // self.bits, 8)
        code_bits = word * -(-self.group // per) / self.group
        return code_bits + 2 * 16 / self.group

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")

    def bind(self, layer_idx: int, calibration: CalibrationLike | None = None) -> HFCacheSpec:
        return self


def parse_hf_spec(spec: str) -> HFCacheSpec:
    """Parse ``hf-quanto:B[:g=G][:r=R]``, ``hf-hqq:B[:g=G][:r=R]`` or ``hf-fp8``."""
    name, _, rest = spec.strip().lower().partition(":")
    if name not in HF_BACKENDS:
        raise ValueError(f"unknown Hugging Face cache {spec!r}; choose from {', '.join(HF_BACKENDS)}")
    backend, allowed, _ = HF_BACKENDS[name]
    parts = [p for p in rest.split(":") if p] if rest else []
    if backend == "fp8":
        if parts:
            raise ValueError(f"'hf-fp8' takes no arguments (per-tensor scale, no window), got {spec!r}")
        return HFCacheSpec("fp8", 8, group=0, residual=0)
    if not parts or not parts[0].isdigit() or int(parts[0]) not in allowed:
        raise ValueError(f"{name} needs a width from {allowed}, e.g. '{name}:{allowed[-2]}'; got {spec!r}")
    opts = {"g": 64, "r": 128}
    for p in parts[1:]:
        key, eq, val = p.partition("=")
        if key not in opts or not eq or not val.isdigit():
            raise ValueError(f"bad option {p!r} in {spec!r}: use g=GROUP (scale group size) and r=TOKENS (window)")
        opts[key] = int(val)
    if opts["g"] < 1 or opts["r"] < 1:
        raise ValueError(f"g and r must be at least 1 in {spec!r}")
    return HFCacheSpec(backend, int(parts[0]), group=opts["g"], residual=opts["r"])
