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

``prerope+`` must be the outermost K wrapper (``prerope+center+eq+tq:3.5``) and needs calibration made
by :func:`walshkv.calibration.collect_kv_stats` (K before RoPE and the model's RoPE tables) or a file
written for a ``prerope+`` spec. The fused attention kernels do not re-rotate keys: a cache with
``prerope+`` reads through the reference path.
"""

from __future__ import annotations

from typing import Any

import torch

from walshkv.codecs.base import Codec, Packed, Wrapper, check_kv, find_wrapper
from walshkv.ops.rope import RopeTable, apply_rope, undo_rope

__all__ = ["PreRope"]


class PreRope(Wrapper):
    """Wrap a K codec so that it stores K before RoPE.

    Args:
        inner: the codec of K before RoPE (``center+`` / ``eq+`` inside it use statistics of K before RoPE).
        rope: the layer's :class:`walshkv.ops.rope.RopeTable` (``None`` until :meth:`bind`).
    """

    name = "prerope"

    def __init__(self, inner: Codec, rope: RopeTable | None = None, spec: str | None = None) -> None:
        if find_wrapper(inner, PreRope) is not None:
            raise ValueError("prerope+ appears twice in one codec spec")
        super().__init__(inner)
        self.rope = rope
        self.spec = spec or f"prerope+{inner.spec}"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rope is None or self.inner.needs_calibration

    def bind(self, layer_idx: int, kind: str, calibration: Any = None) -> Codec:
        if kind != "k":
            raise ValueError(f"{self.spec}: prerope+ is for K (V carries no RoPE); write it on the K side only")
        view = getattr(calibration, "pre_rope", None)
        if view is None:
            raise ValueError(
                f"{self.spec} needs K statistics before RoPE and the model's RoPE tables: pass --calib-text TEXT "
                "(calibration=collect_kv_stats(...)) or a file written by `walshkv calibrate --preset` / "
                "`walshkv recommend` for a prerope+ spec"
            )
        stats = view()
        return PreRope(self.inner.bind(layer_idx, kind, stats), stats.rope_table(layer_idx), self.spec)

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if self.rope is not None and self.rope.head_dim != head_dim:
            raise ValueError(f"{self.spec}: the RoPE table has head_dim {self.rope.head_dim}, K has {head_dim}")

    def _table(self) -> RopeTable:
        if self.rope is None:
            raise ValueError(f"{self.spec} is not bound to a layer's RoPE table; build it through CompressedCache")
        return self.rope

    def _encode(self, x: torch.Tensor) -> Packed:
        raise ValueError(f"{self.spec} needs the keys' positions: use encode_at(x, start) (CompressedCache does)")

    def _decode(self, packed: Packed) -> torch.Tensor:
        raise ValueError(f"{self.spec} needs the keys' positions: use decode_at(packed, start) (CompressedCache does)")

    def encode_at(self, x: torch.Tensor, start: int) -> Packed:
        """Compress keys ``x`` ``[batch, kv_heads, seq, head_dim]`` (after RoPE) at positions ``start, ...``."""
        check_kv(x, "K")
        self.check_head_dim(x.shape[-1])
        packed = self.inner.encode(undo_rope(x, self._table(), start))
        packed.dtype = x.dtype
        return packed

    def decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        """Keys after RoPE ``[batch, kv_heads, seq, head_dim]`` at positions ``start, ...``, in the encoded dtype."""
        y = self.inner._decode(packed).to(torch.float32)
        offset = getattr(self.inner, "plain_offset", None)
        if offset is not None:  # center+ left its mean subtracted; after RoPE it is no longer a constant
            y = y + offset().to(y.device)[None, :, None, :]
        return apply_rope(y, self._table(), start).to(packed.dtype)
