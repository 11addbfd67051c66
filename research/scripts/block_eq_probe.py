"""Probe: ``eq+`` restricted to block-diagonal K transforms, the structured maps a decode kernel could afford.

``prerope+center+eq+`` (the shipped presets' K) maps every cached key by a dense ``head_dim x head_dim`` matrix at
decode time: ``head_dim`` multiply-adds per element, the cost that caps the presets' speed (issue 35). A
block-diagonal transform costs ``b`` per element (``b x b`` blocks), within ``O(head_dim log head_dim)`` for
``b <= log2 head_dim``. This probe measures what such transforms keep of the dense one's quality, which
research/scripts/frame_gain.py only predicts (``block:b``, ``pairblock:b``).

* ``eqb:B+X`` (K only, inside ``prerope+``): the block-diagonal ``A`` whose blocks are ``B`` consecutive channels;
* ``eqpb:B+X``: blocks of ``B/2`` whole rotary pairs (channels ``j`` and ``j + head_dim/2`` in one block).

Each block is ``eq+``'s closed form on that block's moments (before RoPE: K covariance ``C_b``, query moment
``M_b``): ``P_b = M_b^½ (M_b^½ C_b M_b^½)^-½ M_b^½``, all blocks at one common scale (the optimum of the
block-diagonal family, see frame_gain.py), then as ``eq+``: determinant 1, condition number capped, ``A = P^½``.
``B = head_dim`` is ``eq+`` itself (a check of this code).

    python research/scripts/block_eq_probe.py eval --model smollm2-135m --text ../shared/data/austen_emma.txt \\
        --ctx 512 --windows 16 --calib-text python-docs \\
        --codec sink:1:prerope+center+eqb:8+tq:3.5/tq:3 ... --json OUT.json --markdown OUT.md

Only ``eval`` runs (it decodes the cache through the codecs: the result is the codec's, whatever kernel reads it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from walshkv.codecs.base import Codec
from walshkv.codecs.equalize import Equalized
from walshkv.ops.equalize import MAX_COND
from walshkv_research.probes import count_argument, run_probe_eval


def block_groups(head_dim: int, size: int, pairs: bool) -> list[torch.Tensor]:
    """Channel index groups: ``size`` consecutive channels, or ``size/2`` rotary pairs (``j``, ``j + head_dim/2``)."""
    if head_dim % size or (pairs and size % 2):
        raise ValueError(f"block size {size} must divide head_dim {head_dim} (and be even for pair blocks)")
    if not pairs:
        return [torch.arange(i, i + size) for i in range(0, head_dim, size)]
    h, k = head_dim // 2, size // 2
    return [torch.cat([torch.arange(j, j + k), torch.arange(j, j + k) + h]) for j in range(0, h, k)]


def _sym_pow(m: torch.Tensor, p: float) -> torch.Tensor:
    e, u = torch.linalg.eigh(0.5 * (m + m.transpose(-1, -2)))
    return (u * e.clamp_min(1e-300).pow(p).unsqueeze(-2)) @ u.transpose(-1, -2)


def block_equalizer(
    cov: torch.Tensor, qmom: torch.Tensor, groups: list[torch.Tensor], max_cond: float = MAX_COND
) -> torch.Tensor:
    """Block-diagonal ``A`` ``[..., d, d]`` (float64, determinant 1): ``eq+``'s form per block, one common scale.

    Args:
        cov, qmom: ``[..., d, d]`` K covariance and query moment (before RoPE).
        groups: channel groups (:func:`block_groups`), a partition of ``0..d-1``.
        max_cond: cap on the condition number of ``A``, as ``eq+``.
    """
    d = cov.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    c = cov.to(torch.float64) + 1e-9 * cov.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    m = qmom.to(torch.float64) + 1e-9 * qmom.diagonal(dim1=-2, dim2=-1).mean(-1)[..., None, None] * eye
    log_e = torch.zeros(*cov.shape[:-1], dtype=torch.float64)  # eigenvalues of P, per channel slot
    vecs = torch.zeros(*cov.shape, dtype=torch.float64)
    for g in groups:
        cb, mb = c[..., g[:, None], g], m[..., g[:, None], g]
        mh = _sym_pow(mb, 0.5)
        pb = mh @ _sym_pow(mh @ cb @ mh, -0.5) @ mh
        e, u = torch.linalg.eigh(0.5 * (pb + pb.transpose(-1, -2)))
        log_e[..., g] = e.clamp_min(1e-300).log()
        vecs[..., g[:, None], g] = u
    log_e = log_e - log_e.mean(-1, keepdim=True)  # determinant 1 (one scale for every block)
    half_span = torch.log(torch.tensor(max_cond, dtype=torch.float64)) / 2
    log_e = log_e.clamp(-2 * half_span, 2 * half_span)
    log_e = log_e - log_e.mean(-1, keepdim=True)
    a = (vecs * (0.5 * log_e).exp().unsqueeze(-2)) @ vecs.transpose(-1, -2)
    return 0.5 * (a + a.transpose(-1, -2))


@dataclass(frozen=True, repr=False)
class BlockEqualized(Equalized):
    """``eqb:B+X`` / ``eqpb:B+X``: ``eq+`` with a block-diagonal K transform (K only)."""

    kinds = ("k",)
    other_kind = "refuse"

    size: int = 0
    pairs: bool = False

    @property
    def prefix(self) -> str:
        return f"{'eqpb' if self.pairs else 'eqb'}:{self.size}"

    def bind(self, layer_idx, kind, calibration=None):  # type: ignore[no-untyped-def]
        if kind != "k":
            raise ValueError(f"{self.spec}: {self.prefix}+ is for K only")
        inner = self.inner.bind(layer_idx, kind, calibration)
        if not hasattr(calibration, "k_covariance") or not hasattr(calibration, "query_moment"):
            raise ValueError(f"{self.spec} needs --calib-text (K and query statistics)")
        cov, qmom = calibration.k_covariance(layer_idx), calibration.query_moment(layer_idx)
        groups = block_groups(cov.shape[-1], self.size, self.pairs)
        matrix = block_equalizer(cov, qmom, groups).to(torch.float32)
        return replace(self, inner=inner, matrix=matrix)


def _factory(pairs: bool):  # type: ignore[no-untyped-def]
    def make(args: str | None, inner: Codec) -> Codec:
        size = count_argument(args, f"{'eqpb' if pairs else 'eqb'} takes a block size >= 1 (eqb:8+tq:3.5)")
        return BlockEqualized(inner, size=size, pairs=pairs)

    return make


def main(argv: list[str]) -> int:
    return run_probe_eval(
        argv,
        "research/scripts/block_eq_probe.py",
        [
            ("eqb", _factory(False), "probe: eq+ with a block-diagonal K transform (B consecutive channels)"),
            ("eqpb", _factory(True), "probe: eq+ with a block-diagonal K transform (B/2 rotary pairs)"),
        ],
    )


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
