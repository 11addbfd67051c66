"""Probe: ``eq+`` restricted to a diagonal transform, so ``prerope+`` keys keep the kernel's fast Walsh-Hadamard map.

The shipped presets' K is ``prerope+center+eq+...``: ``eq+``'s dense ``A⁻¹`` makes the decode kernel map every
cached key with a ``d x d`` matrix (docs/performance.md), which caps them below SDPA's speed on AVX2 CPUs. Without
``eq+`` the map is the codec's Walsh-Hadamard rotation and the kernel runs a fast transform instead; a *diagonal*
``A`` keeps that form (it folds into the column signs). This script runs any ``walshkv`` command with the ``eq+``
fit replaced by the best diagonal one (``P_cc = sqrt(M_cc / C_cc)``, ``A = P^½``, determinant 1, the same
condition cap), so every ``eq+`` in the specs given is diagonal. Not a codec of the package: a measurement.

    python research/scripts/diag_eq_probe.py eval --model smollm2-135m --text ../shared/data/austen_emma.txt \\
        --ctx 512 --windows 16 --calib-text python-docs --codec "sink:1:prerope+center+eq+rot+iq4_nl/tq:4"
"""

from __future__ import annotations

import sys

import torch

import walshkv.calibration as calibration
from walshkv.cli import main as cli
from walshkv.ops import equalize


def diagonal_equalizer(cov: torch.Tensor, qmom: torch.Tensor, max_cond: float = equalize.MAX_COND) -> torch.Tensor:
    """The diagonal ``A`` ``[..., d, d]`` minimising the score error of an isotropic-noise codec (float64)."""
    c = torch.diagonal(cov.to(torch.float64), dim1=-2, dim2=-1).clamp_min(1e-30)
    m = torch.diagonal(qmom.to(torch.float64), dim1=-2, dim2=-1).clamp_min(1e-30)
    log_p = 0.5 * (m.log() - c.log())
    log_p = log_p - log_p.mean(-1, keepdim=True)
    span = torch.log(torch.tensor(max_cond, dtype=torch.float64))  # cond(P) <= max_cond², as for eq+
    log_p = log_p.clamp(-span, span)
    log_p = log_p - log_p.mean(-1, keepdim=True)
    return torch.diag_embed((0.5 * log_p).exp())


def main(argv: list[str]) -> int:
    calibration.fit_equalizer = diagonal_equalizer  # read at call time: every eq+ fitted from here on is diagonal
    return cli(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
