"""The Pareto front of result rows (mean KLD against bits per element) and its plot."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from walshkv.eval.metrics import is_finite_number
from walshkv.eval.report import agg_figure
from walshkv.fileio import save_figure_atomic

__all__ = ["pareto_front", "plot_pareto"]

#: A result row: :class:`walshkv.eval.ResultRow`, or any mapping with ``bits_per_element`` and ``kld_mean``.
Row = TypeVar("Row", bound=Mapping[str, Any])


def _usable(row: Mapping[str, Any]) -> bool:
    """Whether the row has finite ``bits_per_element`` and ``kld_mean``."""
    return is_finite_number(row.get("bits_per_element")) and is_finite_number(row.get("kld_mean"))


def pareto_front(rows: Sequence[Row]) -> list[Row]:
    """Rows no other row beats: none has fewer-or-equal ``bits_per_element`` and a lower ``kld_mean``.

    Ties (same bits and KLD) keep the first row. Rows with a missing or non-finite value are ignored.

    Args:
        rows: result rows with ``bits_per_element`` and ``kld_mean``.

    Returns:
        The front, by increasing bits (so by strictly decreasing KLD).
    """
    usable = [r for r in rows if _usable(r)]
    ordered = sorted(enumerate(usable), key=lambda ir: (ir[1]["bits_per_element"], ir[1]["kld_mean"], ir[0]))
    front: list[Row] = []
    best = math.inf
    for _, r in ordered:
        if r["kld_mean"] < best:
            front.append(r)
            best = r["kld_mean"]
    return front


def plot_pareto(rows: Sequence[Mapping[str, Any]], path: str | Path, title: str) -> None:
    """Plot mean KLD (log scale) against bits per element, the Pareto front as a labelled step line.

    Uses matplotlib's Agg canvas directly (no pyplot state, no display). Rows with KLD 0 cannot sit on
    a log axis; they are named in a note under the plot.

    Args:
        rows: result rows (``codec``, ``bits_per_element``, ``kld_mean``).
        path: PNG file to write.
        title: plot title.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'walshkv[plot]'``).
    """
    front = pareto_front(rows)
    front_ids = {id(r) for r in front}
    shown = [r for r in rows if _usable(r) and r["kld_mean"] > 0]
    shown_ids = {id(r) for r in shown}
    hidden = [str(r.get("codec")) for r in rows if id(r) not in shown_ids]

    fig = agg_figure(figsize=(10, 6.5), layout="constrained")
    ax = fig.add_subplot()
    others = [r for r in shown if id(r) not in front_ids]
    ax.scatter(
        [r["bits_per_element"] for r in others],
        [r["kld_mean"] for r in others],
        s=22,
        color="0.6",
        label="other specs",
        zorder=2,
    )
    fshown = [r for r in front if id(r) in shown_ids]
    if fshown:
        xs = [r["bits_per_element"] for r in fshown]
        ys = [r["kld_mean"] for r in fshown]
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.5, zorder=3, label="Pareto front")
        ax.scatter(xs, ys, s=36, color="tab:blue", zorder=4)
        for i, r in enumerate(fshown):
            dy = 9 if i % 2 == 0 else -15
            ax.annotate(
                r["codec"],
                (r["bits_per_element"], r["kld_mean"]),
                xytext=(6, dy),
                textcoords="offset points",
                fontsize=8.5,
                color="tab:blue",
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
                zorder=5,
            )
    if shown:
        ax.set_yscale("log")
        xs_all = [r["bits_per_element"] for r in shown]
        span = max(xs_all) - min(xs_all) or 1.0
        ax.set_xlim(min(xs_all) - 0.04 * span, max(xs_all) + 0.25 * span)
    else:
        ax.text(0.5, 0.5, "no row with a positive mean KLD", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("stored bits per K/V element (scales included)")
    ax.set_ylabel("mean KLD vs uncompressed cache (nats/token, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.legend(loc="upper right", fontsize=8.5)
    if hidden:
        fig.text(0.01, 0.005, "not on the log axis (KLD 0 or missing): " + ", ".join(hidden), fontsize=8)
    save_figure_atomic(fig, path, dpi=150)
