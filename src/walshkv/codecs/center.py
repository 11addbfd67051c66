"""``center+SPEC``: subtract a calibrated per-(layer, kv-head, channel) K mean before the K codec.

Exact for attention: ``q·k = q·(k - k̄) + q·k̄`` and the last term is the same for every key a
query sees, which softmax ignores. So the decoded K is left centered (nothing is added back) and
V is untouched (``bind(..., "v")`` returns the inner codec).

Basis: in ``center+rot+SPEC`` the bias is subtracted after the rotation, in the rotated basis
(as llama.cpp forks do), so a bias *file* for it must be in the ``rot`` basis; ``center+SPEC``
without a rotation needs a ``plain`` file. Statistics collected in the same run
(:class:`walshkv.calibration.KVStats`) serve either basis.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.codecs.calibration import KMean, Means
from walshkv.codecs.rotation import Rotated

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Basis, Kind

__all__ = ["Centered"]


@dataclass(frozen=True, repr=False)
class Centered(Wrapper):
    """Wrap a K codec with calibrated mean subtraction.

    Attributes:
        inner: the codec that stores the centered K (``Rotated`` codecs center after rotating).
        bias: ``[kv_heads, head_dim]`` for a bound (per-layer) codec; ``None`` until :meth:`bind` (left out of
            equality: a bound codec equals its unbound one).
    """

    name = "center"
    kinds = ("k",)
    other_kind = "skip"
    misplaced = "write center+ first: {fixed}, not {given}"

    bias: torch.Tensor | None = field(default=None, compare=False)
    #: the bias as ``[1, kv_heads, 1, head_dim]`` per device, filled on use
    _views: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, compare=False)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.bias is None or self.inner.needs_calibration

    @property
    def basis(self) -> Basis:
        """``rot`` if the bias is subtracted after a Walsh-Hadamard rotation, else ``plain``."""
        return "rot" if isinstance(self.inner, Rotated) else "plain"

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        inner = self.inner.bind(layer_idx, kind, calibration)
        if kind not in self.kinds:
            return inner  # centering is for K only (other_kind = "skip")
        if not isinstance(calibration, KMean):
            raise ValueError(
                f"{self.spec} needs a K mean: pass --kv-mean-center FILE (from `walshkv calibrate`) "
                "or --calib-text TEXT"
            )
        if isinstance(self.inner, Rotated) and self.inner.seed is not None:
            if not isinstance(calibration, Means):
                raise ValueError(f"{self.spec}: a bias file cannot serve rrot+ (random signs); use --calib-text")
            bias = self.inner.rotate(calibration.mean("k", layer_idx, "plain"))
        else:
            bias = calibration.k_bias(layer_idx, self.basis)
        return Centered(inner, bias.to(torch.float32))

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if self.bias is not None and self.bias.shape[-1] != head_dim:
            raise ValueError(f"{self.spec}: bias has head_dim {self.bias.shape[-1]}, K has {head_dim}")

    def _bias_for(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias
        if bias is None:
            raise ValueError(f"{self.spec} is not bound to a layer's K mean; build it through CompressedCache")
        if bias.shape[0] != x.shape[1]:
            raise ValueError(f"{self.spec}: bias has {bias.shape[0]} kv heads, K has {x.shape[1]}")
        view = self._views.get(x.device)
        if view is None:
            view = self._views[x.device] = bias.to(x.device)[None, :, None, :]
        return view

    def plain_offset(self) -> torch.Tensor:
        """What decoding leaves subtracted from K, in the plain basis: ``[kv_heads, head_dim]``.

        Full-precision tokens stored beside this codec's (``sink:N:``) subtract it too, so that every key
        a query sees is shifted by the same vector.
        """
        if self.bias is None:
            raise ValueError(f"{self.spec} is not bound to a layer's K mean; build it through CompressedCache")
        if isinstance(self.inner, Rotated):
            return self.inner.unrotate(self.bias)
        return self.bias

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        if isinstance(self.inner, Rotated):
            y = self.inner.rotate(x) - self._bias_for(x)
            return self.inner.inner, y
        return self.inner, (x if x.dtype == torch.float32 else x.to(torch.float32)) - self._bias_for(x)

    def _decode(self, packed: Packed) -> torch.Tensor:
        if isinstance(self.inner, Rotated):
            return self.inner.unrotate(self.inner.inner._decode(packed))
        return self.inner._decode(packed)
