"""How well each basis reconstructs real K/V (and synthetic signals) from part
of its coefficients, and the LLL experiment on quantized index vectors.

Signals: K after RoPE, K before RoPE and V captured on real text (:mod:`walshkv.eval.capture`), at most
``vectors`` tokens per (layer, kv-head), and synthetic ``prime-harmonic``, ``chirp`` and ``noise``
vectors of length head_dim (:func:`walshkv_research.reconstruct.synthetic_signals`). Bases:
:func:`walshkv_research.bases.default_bases` (Walsh-Hadamard, DCT-II, real Fourier, a Vilenkin-Chrestenson
basis with head_dim zero-padded to a product of 3s and 5s, the exact-length radix-4 Vilenkin basis,
identity). Modes as in :mod:`walshkv_research.reconstruct`; ``fixed`` positions and the ``signs+amp``
amplitude profile are computed per (layer, kv-head) of the real vectors (on the same vectors: an upper
bound on what a calibrated table would give). Every row: mean Pearson correlation over vectors and
relative MSE (sum of squared errors over sum of squares).

LLL (``--lll``, needs fpylll: ``pip install -e 'research[lll]'``): for blocks of ``rows`` consecutive tokens
of one (layer, kv-head), the K vectors' WHT coefficients are quantized to ``bits``-bit signed integers
(one absmax scale per vector), stacked as the rows of an integer matrix ``B`` and LLL-reduced,
``B' = U B`` with ``U`` unimodular. Reported: mean row norm after / before, and the bits an entry needs
before (``B``) and after (``B'`` plus ``U``, which recovering the codes requires).

The reports are :mod:`walshkv_research.reconstruct_report`'s; the command line is
:mod:`walshkv_research.cli.reconstruct`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from walshkv.ops.hadamard import hadamard_transform
from walshkv_research.bases import default_bases, make_basis
from walshkv_research.reconstruct import (
    MODES,
    SIGN_MODES,
    correlation,
    kept_count,
    reconstruct,
    relative_mse,
)

__all__ = ["DEFAULT_FRACTIONS", "SIGNAL_LABELS", "lll_measure", "measure_reconstruction", "signal_groups"]

DEFAULT_FRACTIONS: tuple[float, ...] = (0.1, 0.25, 0.43, 0.5, 0.75, 1.0)
SIGNAL_LABELS = {
    "k_post": "K after RoPE",
    "k_pre": "K before RoPE",
    "v": "V",
    "prime-harmonic": "prime-harmonic (synthetic)",
    "chirp": "chirp (synthetic)",
    "noise": "white noise (synthetic)",
}


def signal_groups(x: torch.Tensor, vectors: int) -> torch.Tensor:
    """``[layers, heads, T, d]`` -> ``[groups, <= vectors, d]`` (tokens evenly spread over T)."""
    t = x.shape[-2]
    if t > vectors:
        idx = torch.linspace(0, t - 1, vectors).round().long()
        x = x[..., idx, :]
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def measure_reconstruction(
    signals: dict[str, torch.Tensor],
    *,
    bases: Sequence[str] | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    modes: Sequence[str] = MODES,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Reconstruction rows for every signal set, basis, mode and fraction.

    Args:
        signals: ``{name: [groups, vectors, d]}``; ``fixed`` positions and ``signs+amp`` amplitudes are
            computed per group.
        bases: basis names (default :func:`~walshkv_research.bases.default_bases` of ``d``).
        fractions: kept fractions in ``(0, 1]``.
        modes: modes from :data:`~walshkv_research.reconstruct.MODES`.
        progress: show a progress bar.

    Returns:
        Rows ``{"signal", "basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse"}``.
    """
    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose among {', '.join(MODES)}")
    for f in fractions:
        kept_count(f, 1)
    dims = {x.shape[-1] for x in signals.values()}
    if len(dims) != 1:
        raise ValueError(f"every signal set must have the same length, got {sorted(dims)}")
    d = dims.pop()
    names = list(bases or default_bases(d))
    built = [make_basis(n, d) for n in names]  # bad names fail before any work
    jobs = [
        (sig, b, m, f)
        for sig in signals
        for b in built
        for m in modes
        for f in ([None] if m in SIGN_MODES else list(fractions))
    ]
    rows = []
    for sig, basis, mode, f in tqdm(jobs, desc="reconstruct", unit="case", disable=not progress):
        x = signals[sig].to(torch.float64)
        x_hat = torch.stack([reconstruct(g, basis, f, mode) for g in x])
        rows.append(
            {
                "signal": sig,
                "basis": basis.name,
                "mode": mode,
                "fraction": f,
                "kept": None if f is None else kept_count(f, d),
                "coefficients": basis.n,
                "correlation": correlation(x.reshape(-1, d), x_hat.reshape(-1, d)),
                "relative_mse": relative_mse(x, x_hat),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# LLL on quantized index vectors
# ---------------------------------------------------------------------------------------------------------


def _entry_bits(m: torch.Tensor) -> float:
    """Bits a signed integer entry needs to hold every value of ``m`` (two's complement)."""
    top = int(m.abs().max()) if m.numel() else 0
    return float(math.ceil(math.log2(top + 1)) + 1) if top else 1.0


def lll_measure(
    x: torch.Tensor, *, bits: int = 4, rows: int = 16, blocks: int = 32, delta: float = 0.99
) -> dict[str, Any]:
    """LLL-reduce blocks of quantized WHT index vectors and report norms and bits (module docstring).

    Args:
        x: ``[groups, tokens, d]`` real vectors (e.g. K); WHT needs ``d`` a power of two.
        bits: signed code width (codes in ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]``).
        rows: consecutive tokens per block (rows of the lattice basis), at most ``d``.
        blocks: number of blocks, spread evenly over the groups.
        delta: LLL's Lovasz parameter.

    Returns:
        A dict with the mean norm ratio, entry bits before/after, bits of ``U`` and per-block numbers.
    """
    try:
        from fpylll import LLL, IntegerMatrix
    except ImportError as exc:
        raise ImportError("the LLL measurement needs fpylll: pip install -e 'research[lll]'") from exc

    g, t, d = x.shape
    if rows > d or rows < 2 or t < rows:
        raise ValueError(f"--lll-rows must be in [2, head_dim={d}] and at most the tokens per head ({t}), got {rows}")
    qmax = 2 ** (bits - 1) - 1
    c = hadamard_transform(x.to(torch.float64))
    scale = c.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / qmax
    codes = torch.round(c / scale).clamp(-qmax, qmax).to(torch.int64)
    picks = [(i % g, (i // g * rows) % (t - rows + 1)) for i in range(blocks)]
    ratios, before_bits, after_bits, u_bits, ranks = [], [], [], [], []
    for grp, start in picks:
        b = codes[grp, start : start + rows]
        mat = IntegerMatrix.from_matrix(b.tolist())
        u = IntegerMatrix.identity(rows)
        LLL.reduction(mat, u, delta=delta)
        red = torch.tensor([[mat[i, j] for j in range(d)] for i in range(rows)], dtype=torch.int64)
        um = torch.tensor([[u[i, j] for j in range(rows)] for i in range(rows)], dtype=torch.int64)
        nz = red.abs().sum(dim=-1) > 0  # LLL moves dependent rows to zero rows at the front
        ranks.append(int(nz.sum()))
        norm_before = b.double().norm(dim=-1).mean()
        norm_after = red[nz].double().norm(dim=-1).mean() if bool(nz.any()) else torch.tensor(0.0)
        ratios.append(float(norm_after / norm_before))
        before_bits.append(_entry_bits(b))
        after_bits.append(_entry_bits(red))
        u_bits.append(_entry_bits(um))
    n = len(picks)
    mean = lambda xs: sum(xs) / n  # noqa: E731
    bits_before = rows * d * mean(before_bits)
    bits_after = rows * d * mean(after_bits) + rows * rows * mean(u_bits)
    return {
        "code_bits": bits,
        "rows": rows,
        "head_dim": d,
        "blocks": n,
        "delta": delta,
        "rank_mean": mean(ranks),
        "norm_ratio_mean": mean(ratios),
        "norm_ratio_min": min(ratios),
        "norm_ratio_max": max(ratios),
        "entry_bits_before": mean(before_bits),
        "entry_bits_after": mean(after_bits),
        "entry_bits_u": mean(u_bits),
        "block_bits_before": bits_before,
        "block_bits_after_with_u": bits_after,
        "storage_ratio": bits_after / bits_before,
    }
