"""``prerope+SPEC``: quantize K before RoPE (as KVQuant does), re-applying RoPE when K is read.

The cache hands a codec K after RoPE. ``prerope+`` rotates every key back by its own position's angle
(:func:`walshkv.ops.rope.undo_rope`), so the inner codec sees K as the K projection made it: a channel's
offset (Qwen2's K bias, the large K channels of llama models) is then the same for every token, and
``center+`` removes all of it rather than only its low-frequency part (after RoPE, a high-frequency
pair's mean spins with the position and averages out). Decoding adds the calibrated mean back (a
position-dependent vector after RoPE, so softmax would not ignore it) and rotates each key to its position.

Positions are the cache's own token indices (sink, packed, window in order; a sliding layer counts the
tokens it dropped). With left-padded batches a row's positions are offset by its padding: the round
trip is still exact, only the calibrated mean fits such a row less well.

Positions come through the codec contract: ``encode(x, start)`` and ``decode(packed, start)`` with
``start`` the position of the block's first key.

``prerope+`` must be the outermost K wrapper (``prerope+center+eq+tq:3.5``) and needs calibration made
by :func:`walshkv.calibration.collect_kv_stats` (K before RoPE and the model's RoPE tables) or a file
written for a ``prerope+`` spec. The fused attention kernels (CPU and Triton) turn each decoded key row into
the key after RoPE themselves (:mod:`walshkv.attention.keys`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.codecs.calibration import PreRopeSource, RopeTables
from walshkv.codecs.center import Centered
from walshkv.ops.rope import RopeRows, RopeTable, apply_rope, undo_rope

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Kind

__all__ = ["PreRope"]


@dataclass(frozen=True, repr=False)
class PreRope(Wrapper):
    """Wrap a K codec so that it stores K before RoPE.

    Attributes:
        inner: the codec of K before RoPE (``center+`` / ``eq+`` inside it use statistics of K before RoPE).
        rope: the layer's :class:`walshkv.ops.rope.RopeTable` (``None`` until :meth:`bind`; left out of equality).
    """

    name = "prerope"
    kinds = ("k",)
    other_kind = "refuse"
    misplaced = "prerope+ must be the first wrapper (it sees K as the cache does): write {fixed}, not {given}"

    rope: RopeTable | None = field(default=None, compare=False)
    #: the cos/sin rows of ``rope``, filled on use (``"rows"``)
    _rows: dict[str, RopeRows] = field(default_factory=dict, init=False, compare=False)

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rope is None or self.inner.needs_calibration

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        if kind not in self.kinds:  # other_kind = "refuse"
            raise ValueError(f"{self.spec}: prerope+ is for K (V carries no RoPE); write it on the K side only")
        if not isinstance(calibration, PreRopeSource):
            raise ValueError(
                f"{self.spec} needs K statistics before RoPE and the model's RoPE tables: pass --calib-text TEXT "
                "(calibration=collect_kv_stats(...)) or a file written by `walshkv calibrate --preset` / "
                "`walshkv recommend` for a prerope+ spec"
            )
        stats = calibration.pre_rope()
        if not isinstance(stats, RopeTables):
            raise ValueError(f"{self.spec}: the calibration before RoPE holds no RoPE tables; recalibrate")
        return replace(self, inner=self.inner.bind(layer_idx, kind, stats), rope=stats.rope_table(layer_idx))

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if self.rope is not None and self.rope.head_dim != head_dim:
            raise ValueError(f"{self.spec}: the RoPE table has head_dim {self.rope.head_dim}, K has {head_dim}")

    def _table(self) -> RopeTable:
        if self.rope is None:
            raise ValueError(
                f"{self.spec} is not bound to a layer's RoPE table, which turns the keys' positions into angles; "
                "bind it (CompressedCache does)"
            )
        return self.rope

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        """Keys ``x`` ``[batch, kv_heads, seq, head_dim]`` (after RoPE) at positions ``start, ...``, before RoPE."""
        table = self._table()
        rows = self._rows.get("rows")
        if rows is None:
            rows = self._rows["rows"] = RopeRows(table)
        return self.inner, undo_rope(x, table, start, rows)

    def _decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        """Keys after RoPE ``[batch, kv_heads, seq, head_dim]`` (float32) at positions ``start, ...``."""
        table = self._table()
        y = self.inner._decode(packed).to(torch.float32)
        if isinstance(self.inner, Centered):  # center+ left its mean subtracted; after RoPE it is not a constant
            y = y + self.inner.plain_offset().to(y.device)[None, :, None, :]
        return apply_rope(y, table, start)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return self._decode_at(packed, 0)
