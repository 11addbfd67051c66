"""``ropeblock:G+SPEC``: K in the block frame, and ``eqr[:L]+SPEC``, the equalizer that holds there.

``prerope+`` stores K before RoPE, so a decode step maps every cached key by a dense matrix (``eq+``) and turns
it to its position: work per key that holds decode attention near plain SDPA. The block frame keeps ``eq+``'s
gain without a per-key map. A key ``k`` at position ``p`` is turned back by the first position of its block of
``G`` positions, ``p0 = G floor(p / G)``, and centred by the calibrated mean ``mu`` (of K before RoPE) turned to
its offset ``j = p - p0`` in the block::

    ropeblock:G+X stores  X(R(p0)ᵀ k / s - R(j) mu) = X(R(j) (k_pre - mu))      (s: the table's scaling)

Inside a block a key keeps RoPE's turn by its offset only, so ``eqr:G+`` (``eq+``'s transform ``A`` fitted to
K and query moments turned by RoPE and averaged over ``G`` offsets, :func:`walshkv.ops.rope.rope_averaged`)
holds there. Attention reads the codes as a key stored after RoPE would be read::

    q · k = s (A⁻ᵀ R(p0)ᵀ q) · (codes + A R(j) mu)

the query is turned and mapped once per block (``d²/G`` multiply-adds per key and query head), the mean is a
``[kv_heads, G, head_dim]`` table added to each decoded key by its offset (one add per element and kv head,
shared by the GQA group). :func:`walshkv.attention.decode.decode_attention` does exactly that on the CPU
(``fused_decode_cpu``'s ``query_block`` and ``key_table``); elsewhere the keys are decoded and turned.

Blocks are counted from position 0 (``p0`` is a multiple of ``G`` whatever ``start`` a chunk has), so a cache's
first packed block is shorter when sink tokens come before it.

``ropeblock:G+`` must be the outermost K wrapper and needs statistics before RoPE
(:func:`walshkv.calibration.collect_kv_stats`); inside it, write ``eqr:G+`` (not ``eq+``/``eqd+``, fitted to K
before RoPE, nor ``center+``: the block frame centres K itself), then any rotation and codec.

``eqr:L[:Q]+`` (K only) averages the K moments over ``L`` positions and the query moment over ``Q`` (default
``L``; ``inf``: the limit of a long context). Without arguments (``eqr+``) both take the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper, wrappers
from walshkv.codecs.calibration import KEqualizerFitted, KMean, KMoments, PreRopeSource, RopeTables
from walshkv.codecs.equalize import Equalized
from walshkv.ops.equalize import k_equalizer
from walshkv.ops.rope import RopeTable, rope_averaged, turn

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["RopeAveragedEqualized", "RopeBlock", "eqr_transform"]


def _pre_rope(calibration: CalibrationLike | None, spec: str) -> object:
    """The calibration's view before RoPE, or an error that names what the spec needs."""
    if not isinstance(calibration, PreRopeSource):
        raise ValueError(
            f"{spec} needs K and query statistics before RoPE and the model's RoPE tables: pass --calib-text TEXT "
            "(calibration=collect_kv_stats(...))"
        )
    return calibration.pre_rope()


def eqr_transform(pre: object, layer: int, length: int | None, q_length: int | None) -> torch.Tensor:
    """``eqr+``'s K transform ``A`` ``[kv_heads, head_dim, head_dim]`` (float32) of ``layer`` from statistics before
    RoPE: ``eq+``'s fit to the K covariance averaged over ``length`` positions and the query moment over ``q_length``
    (``None``: the limit).

    Raises:
        ValueError: ``pre`` holds no K/query moments or RoPE tables.
    """
    if not isinstance(pre, KMoments) or not isinstance(pre, RopeTables):
        raise ValueError(
            "eqr+ needs statistics (K covariance and query moments before RoPE, and the RoPE tables): pass "
            "--calib-text TEXT (calibration=collect_kv_stats(...))"
        )
    inv_freq = pre.rope_table(layer).inv_freq
    cov = rope_averaged(pre.k_covariance(layer), inv_freq, length)
    qmom = rope_averaged(pre.query_moment(layer), inv_freq, q_length)
    return k_equalizer(cov, qmom).to(torch.float32)


@dataclass(frozen=True, repr=False)
class RopeAveragedEqualized(Equalized):
    """``eqr[:L[:Q]]+SPEC``: ``eq+``'s K transform fitted after RoPE to moments averaged over ``L`` positions.

    Attributes:
        length: positions the K covariance is averaged over (``None``: the limit).
        q_length: positions for the query moment when not ``length`` (``0``: the limit, ``inf`` in a spec).
    """

    kinds = ("k",)
    other_kind = "refuse"
    misplaced = "eqr+ works in the plain basis: write {fixed}, not {given}"

    length: int | None = None
    q_length: int | None = None

    @property
    def prefix(self) -> str:
        if self.q_length is not None:
            return f"eqr:{self.length}:{self.q_length or 'inf'}"
        return "eqr" if self.length is None else f"eqr:{self.length}"

    @property
    def fit(self) -> str:
        """How a file records this fit: ``eqr:L:Q`` (``0`` for the limit)."""
        q_len = self.length if self.q_length is None else (self.q_length or None)
        return f"eqr:{self.length or 0}:{q_len or 0}"

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        if kind != "k":
            raise ValueError(f"{self.spec}: eqr+ is for K (write it on the K side only)")
        pre = _pre_rope(calibration, self.spec)
        if isinstance(pre, KMoments):  # statistics: fit here
            q_len = self.length if self.q_length is None else (self.q_length or None)
            matrix = eqr_transform(pre, layer_idx, self.length, q_len)
        elif isinstance(pre, KEqualizerFitted):  # files: the transform fitted this way (refused if not held)
            try:
                matrix = pre.k_equalizer_fitted(self.fit, layer_idx)
            except ValueError as err:
                raise ValueError(f"{self.spec}: {err}") from None
        else:
            raise ValueError(
                f"{self.spec} needs K and query statistics before RoPE, or a file written for it ({self.fit}): pass "
                "--calib-text TEXT, or write the file with `walshkv calibrate --preset` for this spec"
            )
        inner = self.inner.bind(layer_idx, kind, calibration)
        return replace(self, inner=inner, matrix=matrix)


@dataclass(frozen=True, repr=False)
class RopeBlock(Wrapper):
    """``ropeblock:G+SPEC``: K turned back by its block's first position and centred by the mean at its offset.

    Attributes:
        inner: the codec of the block-frame keys (``eqr:G+`` and a rotation or codec inside).
        block: ``G``, positions per block (``>= 1``).
        rope: the layer's RoPE table (``None`` until :meth:`bind`).
        mu: the layer's K mean before RoPE ``[kv_heads, head_dim]`` (``None`` until :meth:`bind`).
    """

    name = "prerope"  # the K-frame slot: outermost, one per spec
    kinds = ("k",)
    other_kind = "refuse"
    misplaced = "ropeblock+ must be the first wrapper (it sees K as the cache does): write {fixed}, not {given}"

    block: int = 64
    rope: RopeTable | None = field(default=None, compare=False)
    mu: torch.Tensor | None = field(default=None, compare=False)
    #: the mean turned to each offset, ``[kv_heads, G, head_dim]``, per device (``"cpu"``, ...)
    _table: dict[str, torch.Tensor] = field(default_factory=dict, init=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block, int) or self.block < 1:
            raise ValueError(
                f"ropeblock takes a block of positions >= 1 (ropeblock:64+eqr:64+tq:3.5), got {self.block}"
            )
        for w in wrappers(self.inner):
            if w.name == "center" or (isinstance(w, Equalized) and not isinstance(w, RopeAveragedEqualized)):
                raise ValueError(
                    f"ropeblock:{self.block}+ centres K itself and reads it after RoPE: write "
                    f"ropeblock:{self.block}+eqr:{self.block}+..., not {w.prefix}+ inside it"
                )
        super().__post_init__()

    @property
    def prefix(self) -> str:
        return f"ropeblock:{self.block}"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rope is None or self.mu is None or self.inner.needs_calibration

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        if kind != "k":
            raise ValueError(f"{self.spec}: ropeblock+ is for K (V carries no RoPE); write it on the K side only")
        pre = _pre_rope(calibration, self.spec)
        if not isinstance(pre, RopeTables) or not isinstance(pre, KMean):
            raise ValueError(f"{self.spec}: the calibration before RoPE holds no RoPE tables or K mean; recalibrate")
        table = pre.rope_table(layer_idx)
        mu = pre.k_bias(layer_idx, "plain").to(torch.float32).contiguous()
        if not bool(torch.isfinite(mu).all()):
            raise ValueError(f"{self.spec}: layer {layer_idx}'s calibrated K mean has NaN or Inf entries; recalibrate")
        return replace(self, inner=self.inner.bind(layer_idx, kind, calibration), rope=table, mu=mu)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if head_dim % 2:
            raise ValueError(f"{self.spec}: RoPE pairs channels, so head_dim must be even, got {head_dim}")
        for what, size in (
            ("RoPE table", None if self.rope is None else self.rope.head_dim),
            ("K mean", None if self.mu is None else self.mu.shape[-1]),
        ):
            if size is not None and size != head_dim:
                raise ValueError(f"{self.spec}: the {what} has head_dim {size}, K has {head_dim}")

    def bound(self) -> tuple[RopeTable, torch.Tensor]:
        """``(rope, mu)``, or an error if the codec is not bound to a layer."""
        if self.rope is None or self.mu is None:
            raise ValueError(
                f"{self.spec} is not bound to a layer's RoPE table and K mean; bind it (CompressedCache does)"
            )
        return self.rope, self.mu

    def offset_means(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The mean turned to each offset in a block, ``R(j) mu``: ``[kv_heads, G, head_dim]`` float32."""
        key = str(device)
        hit = self._table.get(key)
        if hit is None:
            rope, mu = self.bound()
            offsets = torch.arange(self.block, device=device)
            hit = turn(mu.to(device)[:, None, :].expand(-1, self.block, -1), rope, offsets).contiguous()
            self._table[key] = hit
        return hit

    def block_starts(self, start: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``p0`` of the keys at positions ``start .. start + n - 1``: ``[n]`` int64."""
        pos = torch.arange(start, start + n, device=device)
        return torch.div(pos, self.block, rounding_mode="floor") * self.block

    def _centre(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        """``R(j) mu`` for the keys at positions ``start ..``: ``[kv_heads, n, head_dim]``."""
        table = self.offset_means(device)
        rows = torch.arange(start, start + n, device=device) % self.block
        return table[:, rows]

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        """Keys after RoPE ``[batch, kv_heads, seq, head_dim]`` at positions ``start, ...``, in the block frame."""
        rope, mu = self.bound()
        if x.shape[-1] != rope.head_dim or x.shape[1] != mu.shape[0]:
            raise ValueError(
                f"{self.spec} is bound to {mu.shape[0]} kv heads of head_dim {rope.head_dim}; K is "
                f"{tuple(x.shape)} (the calibration of another model or layer?)"
            )
        n = x.shape[-2]
        u = turn(x, rope, self.block_starts(start, n, x.device), inverse=True)
        if rope.scaling != 1.0:
            u = u / rope.scaling
        return self.inner, u - self._centre(start, n, x.device)[None]

    def _decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        """Keys after RoPE ``[batch, kv_heads, seq, head_dim]`` (float32) at positions ``start, ...``."""
        rope, _ = self.bound()
        y = self.inner._decode(packed).to(torch.float32)
        n = y.shape[-2]
        k = turn(y + self._centre(start, n, y.device)[None], rope, self.block_starts(start, n, y.device))
        return k if rope.scaling == 1.0 else k * rope.scaling

    def _decode(self, packed: Packed) -> torch.Tensor:
        return self._decode_at(packed, 0)
