"""``eq+SPEC``: a calibrated linear transform of K or V before the codec.

Any invertible transform ``A`` is allowed before a codec, since decoding applies ``A⁻¹``. ``eq+``
chooses, per (layer, kv-head), the ``A`` that minimises the error a codec with isotropic noise (a
rotation then one width per coordinate, as ``tq``) leaves where the model reads it
(:func:`walshkv.ops.equalize.k_equalizer`): for K the attention scores, weighted by the queries'
second moment; for V the attention output after the output projection, weighted by ``Σ W_oᵀW_o``
over the heads that share the kv-head. Both use the covariance measured on calibration text.
Directions the model weighs heavily get more of the codec's precision, directions it ignores less.
Stored bytes are the inner codec's: ``A`` lives in the calibration file, not in the cache.

Write it after ``center+`` and before any rotation: ``center+eq+tq:3.5/eq+tq:3``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.codecs.calibration import KEqualizer, VEqualizer

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["Equalized"]


class Equalized(Wrapper):
    """Wrap a codec with a per-(layer, kv-head) transform ``y = A x`` (decode: ``x = A⁻¹ y``).

    Args:
        inner: the codec that stores ``A x``.
        matrix: ``[kv_heads, head_dim, head_dim]`` for a bound (per-layer) codec; ``None`` until
            :meth:`bind`.
    """

    name = "eq"
    kinds = ("k", "v")
    misplaced = "eq+ works in the plain basis: write {fixed}, not {given}"

    def __init__(self, inner: Codec, matrix: torch.Tensor | None = None, spec: str | None = None) -> None:
        super().__init__(inner)
        self.spec = spec or f"eq+{inner.spec}"
        self.matrix: torch.Tensor | None = None
        self.inverse: torch.Tensor | None = None
        if matrix is not None:
            m = matrix.to(torch.float64)
            if m.dim() != 3 or m.shape[-1] != m.shape[-2]:
                raise ValueError(
                    f"{self.spec}: the transform must be [kv_heads, head_dim, head_dim], got {tuple(m.shape)}"
                )
            if not bool(torch.isfinite(m).all()):
                raise ValueError(f"{self.spec}: the transform has NaN/Inf values; recalibrate")
            self.matrix = m.to(torch.float32)
            self.inverse = torch.linalg.inv(m).to(torch.float32)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.matrix is None or self.inner.needs_calibration

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        inner = self.inner.bind(layer_idx, kind, calibration)
        if kind == "k" and isinstance(calibration, KEqualizer):
            matrix = calibration.k_equalizer(layer_idx)
        elif kind == "v" and isinstance(calibration, VEqualizer):
            matrix = calibration.v_equalizer(layer_idx)
        else:
            raise ValueError(
                f"{self.spec} needs a calibrated {kind.upper()} transform: pass --calib-text TEXT, or a file written "
                "by `walshkv calibrate --eq` / `--preset NAME` / `walshkv recommend` for a spec with eq+"
            )
        return Equalized(inner, matrix, self.spec)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if self.matrix is not None and self.matrix.shape[-1] != head_dim:
            raise ValueError(
                f"{self.spec}: the transform has head_dim {self.matrix.shape[-1]}, the input has {head_dim}"
            )

    def _apply(self, m: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
        if m is None:
            raise ValueError(f"{self.spec} is not bound to a layer's transform; build it through CompressedCache")
        if m.shape[0] != x.shape[1]:
            raise ValueError(f"{self.spec}: the transform has {m.shape[0]} kv heads, the input has {x.shape[1]}")
        return torch.einsum("hed,bhnd->bhne", m.to(x.device), x.to(torch.float32))

    def _encode(self, x: torch.Tensor) -> Packed:
        return self.inner.encode(self._apply(self.matrix, x))

    def _decode(self, packed: Packed) -> torch.Tensor:
        return self._apply(self.inverse, self.inner._decode(packed))
