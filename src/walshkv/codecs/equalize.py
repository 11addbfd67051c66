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

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.codecs.calibration import KEqualizer, VEqualizer

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["MAX_TRANSFORM_COND", "TRANSFORM_SCALE_RANGE", "DiagonalEqualized", "Equalized", "checked_inverse"]

#: Largest condition number of a transform read or bound (calibration caps it at 100,
#: :data:`walshkv.ops.equalize.MAX_COND`; past 1e6 ``A⁻¹`` amplifies the codec's error a millionfold in some
#: direction, and in float32 loses the digits that the inverse check needs).
MAX_TRANSFORM_COND = 1e6
#: A transform's scale, the geometric mean of its singular values (``|det A|^(1/head_dim)``), must lie within
#: this factor of 1: calibration writes determinant 1, and a near-zero ``A`` makes the codec store (fp16)
#: values that underflow, so that every decoded vector is 0.
TRANSFORM_SCALE_RANGE = 100.0
_FIX = "recalibrate (walshkv calibrate --eq ... -o FILE, or the --preset / recommend command that wrote it)"


def checked_inverse(m: torch.Tensor, what: str, fix: str = _FIX) -> torch.Tensor:
    """Validate ``eq+`` transforms and return their inverses.

    Args:
        m: ``[kv_heads, head_dim, head_dim]``.
        what: the transforms' name in messages (a file's tensor, ``walshkv.k_eq.blk.N``, or a codec spec).
        fix: what to do about a bad one.

    Returns:
        ``A⁻¹``, ``[kv_heads, head_dim, head_dim]`` float64, with ``A A⁻¹ = I`` checked.

    Raises:
        ValueError: a wrong shape, NaN/Inf, a singular or ill-conditioned head (condition number over
            :data:`MAX_TRANSFORM_COND`), a near-zero or huge head (scale outside :data:`TRANSFORM_SCALE_RANGE`),
            or an inverse that does not check; the message names the tensor, the head and ``fix``.
    """
    if m.dim() != 3 or m.shape[-1] != m.shape[-2]:
        raise ValueError(f"{what}: the transform must be [kv_heads, head_dim, head_dim], got {tuple(m.shape)}")
    m = m.to(torch.float64)
    if not bool(torch.isfinite(m).all()):
        raise ValueError(f"{what}: the transform has NaN/Inf values; {fix}")
    sv = torch.linalg.svdvals(m)  # [kv_heads, head_dim], descending
    cond = sv[:, 0] / sv[:, -1]  # inf for a singular head
    scale = sv.log().mean(-1).exp()  # |det|^(1/head_dim); 0 for a singular head
    bad_cond = ~(cond <= MAX_TRANSFORM_COND)
    bad_scale = ~((scale >= 1 / TRANSFORM_SCALE_RANGE) & (scale <= TRANSFORM_SCALE_RANGE))
    if bool(bad_cond.any()):
        h = int(bad_cond.nonzero()[0])
        raise ValueError(
            f"{what}: head {h} is singular or ill-conditioned (condition number {float(cond[h]):.3g}, at most "
            f"{MAX_TRANSFORM_COND:.0e} allowed): decoding divides by it; {fix}"
        )
    if bool(bad_scale.any()):
        h = int(bad_scale.nonzero()[0])
        raise ValueError(
            f"{what}: head {h} is near zero or huge (scale |det|^(1/head_dim) = {float(scale[h]):.3g}, allowed "
            f"{1 / TRANSFORM_SCALE_RANGE:g}..{TRANSFORM_SCALE_RANGE:g}; calibration writes 1): the codec would store "
            f"values that vanish or overflow; {fix}"
        )
    inverse, info = torch.linalg.inv_ex(m)
    eye = torch.eye(m.shape[-1], dtype=torch.float64)
    residual = (m @ inverse - eye).abs().amax(dim=(-1, -2))
    if bool(info.any()) or not bool((residual <= 1e-6).all()):
        h = int((info != 0).logical_or(~(residual <= 1e-6)).nonzero()[0])
        raise ValueError(f"{what}: head {h} has no accurate inverse (|A A^-1 - I| = {float(residual[h]):.3g}); {fix}")
    return inverse


_PER_HEAD_MM = 16  # tokens up to which one sequence's transform is a 2-D product per head


def _apply_per_head(m: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.einsum("hed,bhnd->bhne", m, x)`` for ``m`` ``[h, e, d]`` (contiguous) and ``x`` ``[b, h, n, d]``.

    The same ``bmm`` on the same views as einsum makes of them (so the same result, bit for bit, and a
    ``[b, h, n, e]`` view of the same strides) without einsum's planning, which costs more than the product itself
    on a decoding step's single token. Other shapes or dtypes go to einsum.
    """
    if m.dim() != 3 or x.dim() != 4 or m.dtype != x.dtype or x.device != m.device or not m.is_contiguous():
        return torch.einsum("hed,bhnd->bhne", m, x)
    b, h, n, d = x.shape
    e = m.shape[1]
    if m.shape[0] != h or m.shape[2] != d:
        return torch.einsum("hed,bhnd->bhne", m, x)
    # einsum's [h, d, e] view of m; for h > 1 its strides are m.transpose(1, 2)'s
    right = m.transpose(1, 2) if h > 1 else m[..., None, None].permute(0, 2, 1, 3, 4).view(h, d, e)
    if b == 1 and x.is_contiguous():  # einsum's views of one sequence are the plain ones
        if n <= _PER_HEAD_MM and x.device.type == "cpu":
            # a decoding step's few tokens: one 2-D product per head (the same sgemm as bmm's per batch entry, so
            # the same bits) runs on the calling thread, where bmm wakes the thread pool for microseconds of work
            # (about 100 us a call with OMP_WAIT_POLICY=passive, against 14 us for three 2-D products)
            rows = x.view(h, n, d)
            return torch.stack([rows[i] @ right[i] for i in range(h)]).view(1, h, n, e)
        return torch.bmm(x.view(h, n, d), right).view(1, h, n, e)
    left = x.unsqueeze(4).permute(1, 0, 2, 3, 4).reshape(h, b * n, d)  # einsum's [h, (b n), d]
    out = torch.bmm(left, right)  # [h, (b n), e]
    return out.view(h, b, n, 1, e).permute(1, 0, 2, 4, 3).view(b, h, n, e)


@dataclass(frozen=True, repr=False)
class Equalized(Wrapper):
    """Wrap a codec with a per-(layer, kv-head) transform ``y = A x`` (decode: ``x = A⁻¹ y``).

    Attributes:
        inner: the codec that stores ``A x``.
        matrix: ``[kv_heads, head_dim, head_dim]`` for a bound (per-layer) codec, ``None`` until :meth:`bind`
            (checked, and stored as contiguous float32; left out of equality).
        inverse: ``A⁻¹``, derived from ``matrix``.
    """

    name = "eq"
    kinds = ("k", "v")
    misplaced = "eq+ works in the plain basis: write {fixed}, not {given}"

    matrix: torch.Tensor | None = field(default=None, compare=False)
    inverse: torch.Tensor | None = field(default=None, init=False, compare=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.matrix is not None:
            # contiguous: a calibration file's transposed view would send every product to einsum's planning
            self._set(
                inverse=checked_inverse(self.matrix, self.spec).to(torch.float32).contiguous(),
                matrix=self.matrix.to(torch.float32).contiguous(),
            )

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.matrix is None or self.inner.needs_calibration

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        inner = self.inner.bind(layer_idx, kind, calibration)
        return replace(self, inner=inner, matrix=self._calibrated(layer_idx, kind, calibration))

    def _calibrated(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None) -> torch.Tensor:
        """The layer's transform from ``calibration`` (statistics or a file)."""
        if kind == "k" and isinstance(calibration, KEqualizer):
            fit = getattr(calibration, "k_equalizer_fit", None)
            if fit is not None:
                raise ValueError(
                    f"{self.spec}: the file holds K transforms fitted as {fit}+ (after RoPE), not {self.prefix}+'s: "
                    "use the spec it was written for, or pass --calib-text TEXT"
                )
            return calibration.k_equalizer(layer_idx)
        if kind == "v" and isinstance(calibration, VEqualizer):
            return calibration.v_equalizer(layer_idx)
        raise ValueError(
            f"{self.spec} needs a calibrated {kind.upper()} transform: pass --calib-text TEXT, or a file written "
            f"by `walshkv calibrate --eq` / `--preset NAME` / `walshkv recommend` for a spec with {self.prefix}+"
        )

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
        device = x.device
        return _apply_per_head(
            m if m.device == device else m.to(device), x if x.dtype == torch.float32 else x.to(torch.float32)
        )

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        return self.inner, self._apply(self.matrix, x)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return self._apply(self.inverse, self.inner._decode(packed))


@dataclass(frozen=True, repr=False)
class DiagonalEqualized(Equalized):
    """``eqd+SPEC``: ``eq+`` restricted to a diagonal ``A`` (one factor per channel), in ``eq+``'s slot.

    The best diagonal transform for the same objective (:func:`walshkv.ops.equalize.k_equalizer_diagonal`). It
    gives up part of ``eq+``'s gain (smollm2-135m, Emma 16x512, ``sink:1:prerope+center+...+rot+iq4_nl/tq:4``:
    research/scripts/diag_eq_probe.py measured mean KLD 0.0116 against 0.0091 with ``eq+`` and 0.0161 without
    either) and keeps a ``prerope+`` K on the CPU kernel's fast Walsh-Hadamard key map, where ``eq+``'s dense
    ``A⁻¹`` costs ``head_dim x head_dim`` multiply-adds per cached key at every decode step.

    Calibrated from statistics (``--calib-text``) or from a file written for an ``eqd+`` spec (``walshkv calibrate
    --preset`` / ``recommend``), whose transforms must be diagonal.
    """

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.matrix is not None:
            off = self.matrix - torch.diag_embed(torch.diagonal(self.matrix, dim1=-2, dim2=-1))
            if bool((off != 0).any()):
                raise ValueError(
                    f"{self.spec}: the calibration's transform is not diagonal (a file written for eq+, whose dense "
                    "transforms eqd+ cannot use): pass --calib-text TEXT, or write the file for this spec "
                    "(walshkv calibrate --preset NAME / walshkv recommend)"
                )

    @property
    def prefix(self) -> str:
        return "eqd"

    def _calibrated(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None) -> torch.Tensor:
        diagonal = getattr(calibration, f"{kind}_equalizer_diagonal", None)
        if callable(diagonal):  # statistics (or a file next to them): the best diagonal transform
            return diagonal(layer_idx)
        return super()._calibrated(layer_idx, kind, calibration)  # a file: it must hold diagonal transforms
