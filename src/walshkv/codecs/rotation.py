"""Rotation wrappers ``rot+SPEC`` and ``rrot[:SEED]+SPEC``.

``rot+`` applies the orthonormal Walsh-Hadamard transform over head_dim before the
inner codec and its inverse (the same transform) after decoding. ``rrot+`` first flips
signs with a seeded random ±1 vector (a randomized Hadamard transform):
``y = H(s * x)``, ``x = s * H(y)``. Neither adds stored bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.ops.hadamard import _check_size, hadamard_transform, signed_hadamard, signs_for

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["Rotated"]


@dataclass(frozen=True, repr=False)
class Rotated(Wrapper):
    """Wrap ``inner`` in a (randomized) Walsh-Hadamard rotation over head_dim.

    Attributes:
        inner: the codec that stores the rotated vectors.
        seed: ``None`` for the plain rotation (``rot+``), or a seed for random sign
            flips (``rrot:SEED+``).
    """

    name = "rot"
    kinds = ("k", "v")

    seed: int | None = None

    @property
    def prefix(self) -> str:
        """``rot``, ``rrot`` (seed 0) or ``rrot:SEED``."""
        return "rot" if self.seed is None else ("rrot" if self.seed == 0 else f"rrot:{self.seed}")

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        inner = self.inner.bind(layer_idx, kind, calibration)
        return self if inner is self.inner else replace(self, inner=inner)

    def check_head_dim(self, head_dim: int) -> None:
        _check_size(head_dim, f"head_dim of '{self.spec}'")
        self.inner.check_head_dim(head_dim)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """Forward rotation ``H(s * x)`` over the last dimension (float32)."""
        x = x if x.dtype == torch.float32 else x.to(torch.float32)
        if self.seed is not None:
            signed = signed_hadamard(x, self.seed)
            if signed is not None:
                return x @ signed
            x = x * signs_for(x.shape[-1], self.seed, x.device)
        return hadamard_transform(x)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """Inverse rotation ``s * H(y)`` over the last dimension (float32)."""
        x = hadamard_transform(y if y.dtype == torch.float32 else y.to(torch.float32))
        if self.seed is not None:
            x = x * signs_for(x.shape[-1], self.seed, x.device)
        return x

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        return self.inner, self.rotate(x)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return self.unrotate(self.inner._decode(packed))
