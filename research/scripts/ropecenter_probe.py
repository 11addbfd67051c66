"""Probe: store K *after* RoPE, centred by the pre-RoPE K mean turned to each key's position (``ropecenter+``).

``center+`` after RoPE subtracts one calibrated vector for every position, but a channel pair's offset before
RoPE spins with the position after it, so a mean taken over positions 0..511 is the wrong offset for keys at
4k-8k (docs/long-context.md). ``prerope+center+`` removes the offset where it does not turn, at the price of a
per-key map in the decode kernel (undo the core's rotation, re-apply RoPE). This probe tests the third frame:

    ropecenter+X stores  X(k - R(p) mu)  =  X(R(p) (k_pre - mu))     (mu: K mean before RoPE, R(p): RoPE at p)

The residual is the pre-RoPE residual of ``prerope+center+`` turned by R(p), so it is centred at every position,
while the codes stay in the model's frame: a kernel reads them as ``X``'s codes and only adds the bias
``q·R(p) mu`` per key (no per-key transform). This probe measures the quality side; it is not a codec of the
package, and the fused kernels do not know it, so run it through ``walshkv eval`` (which decodes the cache).

    python research/scripts/ropecenter_probe.py eval --model smollm2-135m --text ../shared/data/austen_emma.txt \\
        --ctx 512 --windows 16 --calib-text python-docs --codec "sink:1:ropecenter+rot+iq4_nl/tq:4"

``ropecenter:M+X`` keeps only the M channel pairs with the largest mean (by norm over kv heads): a bias
kernel then costs M complex multiply-adds per key and query head.

``eqr[:L]+X`` (K only) is ``eq+``'s transform fitted in the frame after RoPE to moments that hold at every position:
the pre-RoPE K covariance and query moment turned by RoPE and averaged over positions ``0 .. L-1``
(:func:`rope_averaged`; no ``L``: the limit of a long context, where every pair of channel pairs with different
frequencies decorrelates). One fixed transform after RoPE folds into the query once per decode step (no per-key
map); ``eq+`` fitted to the post-RoPE statistics of short calibration windows does not hold at 4k (the table in
docs/long-context.md), since slow pairs have not turned there yet.

``eqr:L:Q+X`` averages the query moment over ``Q`` positions instead (``inf``: the limit): in the block frame the
query a key's codes meet is ``R(p0)ᵀ q = R(pq - p0) q_pre``, turned by the distance from the query to the key's
block, not by an offset inside a block.

``blockrope:G+X`` (K only) is the frame between the two: K turned back by the first position of its block of ``G``
positions, ``u = R(p0)ᵀ k = R(p - p0) k_pre`` with ``p0 = G floor(p / G)``, minus the pre-RoPE mean turned and
averaged over a block's offsets (``mean_j R(j) mu``). Inside a block the keys keep RoPE's turn by their offset
only, so a transform fitted to moments averaged over ``G`` offsets (``eqr:G+``) keeps ``eq+``'s structure in the
pairs that turn slowly over ``G`` positions; a kernel folds ``R(p0)`` (and every transform) into the query once per
block of ``G`` keys, not per key: ``d x d`` multiply-adds per query head per block, ``d²/G`` per key.

    python research/scripts/ropecenter_probe.py eval ... --codec "sink:1:blockrope:256+eqr:256+tq:3.5/tq:3"

``blockropec:G+X`` subtracts the mean turned to each key's offset in its block, ``R(p - p0) mu``, instead of its
average over the block: exact centring, at the price of a bias per key (``(R(p0)ᵀ q) · R(j) mu`` for the ``G``
offsets ``j``: one ``[query heads, d] x [d, G]`` product per block, a float dot product per key and query head).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace

import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.blockrope import RopeAveragedEqualized
from walshkv.codecs.calibration import PreRopeSource, RopeTables
from walshkv.codecs.prerope import PreRope
from walshkv.ops.rope import RopeTable, apply_rope
from walshkv_research.probes import count_argument, run_probe_eval


@dataclass(frozen=True, repr=False)
class RopeCentered(PreRope):
    """``ropecenter[:M]+X``: X stores ``k - R(p) mu`` (K after RoPE), decoded as ``X⁻¹(codes) + R(p) mu``."""

    mu: torch.Tensor | None = field(default=None, compare=False)
    pairs: int | None = None

    @property
    def prefix(self) -> str:
        return "ropecenter" if self.pairs is None else f"ropecenter:{self.pairs}"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rope is None or self.mu is None or self.inner.needs_calibration

    def bind(self, layer_idx, kind, calibration=None):  # type: ignore[no-untyped-def]
        if kind != "k":
            raise ValueError(f"{self.spec}: ropecenter+ is for K only")
        if not isinstance(calibration, PreRopeSource):
            raise ValueError(f"{self.spec} needs --calib-text (K statistics before RoPE)")
        stats = calibration.pre_rope()
        if not isinstance(stats, RopeTables):
            raise ValueError(f"{self.spec}: no RoPE tables in the calibration")
        mu = stats.k_bias(layer_idx, "plain").to(torch.float32)  # [kv_heads, head_dim], before RoPE
        if self.pairs is not None:
            half = mu.shape[-1] // 2
            norm = (mu[:, :half] ** 2 + mu[:, half:] ** 2).sum(0)  # rotate_half pairs (i, i + d/2)
            keep = torch.zeros(half, dtype=torch.bool)
            keep[norm.topk(min(self.pairs, half)).indices] = True
            mu = mu * torch.cat([keep, keep]).to(mu.dtype)
        inner = self.inner.bind(layer_idx, kind, calibration)  # the inner codec sees K after RoPE
        return replace(self, inner=inner, rope=stats.rope_table(layer_idx), mu=mu)

    def _offset(self, x: torch.Tensor, start: int) -> torch.Tensor:
        if self.mu is None:
            raise ValueError(f"{self.spec} is not bound")
        b, h, t, d = x.shape
        mu = self.mu.to(x.device)[None, :, None, :].expand(b, h, t, d)
        return apply_rope(mu, self._table(), start)

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        return self.inner, xf - self._offset(xf, start)

    def _decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        y = self.inner._decode(packed).to(torch.float32)
        return y + self._offset(y, start)


def _turn(x: torch.Tensor, table: RopeTable, pos: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """``x`` ``[..., seq, d]`` turned by RoPE to the positions ``pos`` ``[seq]`` (or back, ``inverse``), unscaled."""
    freqs = pos.to(torch.float64)[:, None] * table.inv_freq.to(torch.float64)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(torch.float32), emb.sin().to(torch.float32)
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos - rot * sin if inverse else x * cos + rot * sin


@dataclass(frozen=True, repr=False)
class BlockRoped(PreRope):
    """``blockrope:G+X``: X stores ``R(p0)ᵀ k - mean_j R(j) mu`` (``p0``: the first position of ``k``'s block)."""

    block: int = 1
    mu: torch.Tensor | None = field(default=None, compare=False)
    #: subtract the mean turned to each key's offset in its block (``R(j) mu``, a bias per key) instead of its
    #: average over the block (``blockropec:G+``)
    exact: bool = False

    @property
    def prefix(self) -> str:
        return f"blockropec:{self.block}" if self.exact else f"blockrope:{self.block}"

    @property
    def needs_calibration(self) -> bool:  # type: ignore[override]
        return self.rope is None or self.mu is None or self.inner.needs_calibration

    def bind(self, layer_idx, kind, calibration=None):  # type: ignore[no-untyped-def]
        if kind != "k":
            raise ValueError(f"{self.spec}: blockrope+ is for K only")
        if not isinstance(calibration, PreRopeSource):
            raise ValueError(f"{self.spec} needs --calib-text (K statistics before RoPE)")
        stats = calibration.pre_rope()
        if not isinstance(stats, RopeTables):
            raise ValueError(f"{self.spec}: no RoPE tables in the calibration")
        table = stats.rope_table(layer_idx)
        mu = stats.k_bias(layer_idx, "plain").to(torch.float32)  # [kv_heads, head_dim], before RoPE
        offsets = torch.arange(self.block)
        mu_g = mu if self.exact else _turn(mu[:, None, :].expand(-1, self.block, -1), table, offsets).mean(1)
        inner = self.inner.bind(layer_idx, kind, calibration)  # eqr:G+ fits its moments itself
        return replace(self, inner=inner, rope=table, mu=mu_g)

    def _mean(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        """The mean subtracted from keys at positions ``start ..``: ``[kv_heads, n, d]`` (or ``[kv_heads, 1, d]``)."""
        assert self.mu is not None
        mu = self.mu.to(device)[:, None, :]
        if not self.exact:
            return mu
        pos = torch.arange(start, start + n, device=device)
        return _turn(mu.expand(-1, n, -1), self._table(), pos - self._starts(start, n, device))

    def _starts(self, start: int, n: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(start, start + n, device=device)
        return torch.div(pos, self.block, rounding_mode="floor") * self.block

    def _transform(self, x: torch.Tensor, start: int) -> tuple[Codec, torch.Tensor]:
        if self.mu is None:
            raise ValueError(f"{self.spec} is not bound")
        xf = x if x.dtype == torch.float32 else x.to(torch.float32)
        table = self._table()
        u = _turn(xf, table, self._starts(start, x.shape[-2], x.device), inverse=True) / (table.scaling**2)
        return self.inner, u - self._mean(start, x.shape[-2], x.device)[None]

    def _decode_at(self, packed: Packed, start: int) -> torch.Tensor:
        if self.mu is None:
            raise ValueError(f"{self.spec} is not bound")
        y = self.inner._decode(packed).to(torch.float32)
        y = y + self._mean(start, y.shape[-2], y.device)[None]
        table = self._table()
        return _turn(y, table, self._starts(start, y.shape[-2], y.device)) * table.scaling


def _eqr_factory(args: str | None, inner: Codec) -> Codec:
    if args is None:
        return RopeAveragedEqualized(inner)
    what = "eqr takes a number of positions >= 1, then optionally the query's (a number or inf) (eqr:64:inf+tq:3.5)"
    head, _, q_arg = args.partition(":")
    length = count_argument(head, what)
    if not q_arg:
        return RopeAveragedEqualized(inner, length=length)
    return RopeAveragedEqualized(inner, length=length, q_length=0 if q_arg == "inf" else count_argument(q_arg, what))


def _blockrope_factory(args: str | None, inner: Codec) -> Codec:
    block = count_argument(args, "blockrope takes a block of positions >= 1 (blockrope:256+eqr:256+tq:3.5)")
    return BlockRoped(inner, block=block)


def _blockropec_factory(args: str | None, inner: Codec) -> Codec:
    block = count_argument(args, "blockropec takes a block of positions >= 1 (blockropec:64+eqr:64+tq:3.5)")
    return BlockRoped(inner, block=block, exact=True)


def _factory(args: str | None, inner: Codec) -> Codec:
    if args is None:
        return RopeCentered(inner)
    pairs = count_argument(args, "ropecenter takes a number of channel pairs >= 1 (ropecenter:16+rot+iq4_nl)")
    return RopeCentered(inner, pairs=pairs)


def main(argv: list[str]) -> int:
    # the fused kernels read a PreRope subclass as prerope+ codes (they would rotate post-RoPE codes again):
    # only `walshkv eval`, which decodes the cache through the codec, measures this wrapper correctly
    return run_probe_eval(
        argv,
        "research/scripts/ropecenter_probe.py",
        [
            ("ropecenter", _factory, "probe: K after RoPE minus the pre-RoPE mean turned to each position"),
            ("eqr", _eqr_factory, "probe: eq+ after RoPE fitted to moments averaged over positions 0..L-1"),
            ("blockrope", _blockrope_factory, "probe: K turned back by its block's first position (G positions)"),
            ("blockropec", _blockropec_factory, "probe: blockrope+ minus the mean turned to each key's offset"),
        ],
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
