"""Reports of ``walshkv reconstruct``: the tables, ``reconstruct.png`` and the result files.

Files in the output folder: ``reconstruct.json`` (meta, with the LLL numbers, and rows), ``reconstruct.csv``,
``reconstruct.md`` (a table per kept fraction, the LLL table) and ``reconstruct.png``.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.report import agg_figure, describe_run, write_result_files
from walshkv.fileio import save_figure_atomic
from walshkv_research.reconstruct_run import SIGNAL_LABELS

__all__ = [
    "describe_reconstruct_run",
    "format_lll_table",
    "format_reconstruct_table",
    "plot_reconstruction",
    "write_reconstruct_outputs",
]

_CSV_KEYS = ("signal", "basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse")


def format_reconstruct_table(rows: Sequence[dict[str, Any]], fraction: float | None = 0.5, fmt: str = "simple") -> str:
    """Correlation (relative MSE) per signal and basis at one fraction for topk/fixed, plus the sign modes."""
    signals = list(dict.fromkeys(r["signal"] for r in rows))
    bases = list(dict.fromkeys(r["basis"] for r in rows))
    cols = [("topk", fraction), ("fixed", fraction), ("signs", None), ("signs+amp", None)]
    cols = [c for c in cols if any(r["mode"] == c[0] and r["fraction"] == c[1] for r in rows)]
    index = {(r["signal"], r["basis"], r["mode"], r["fraction"]): r for r in rows}
    body = []
    for s in signals:
        for b in bases:
            cells = []
            for m, f in cols:
                r = index.get((s, b, m, f))
                cells.append("" if r is None else f"{r['correlation']:.3f} ({r['relative_mse']:.3f})")
            body.append([SIGNAL_LABELS.get(s, s), b, *cells])
    headers = ["signal", "basis", *[m if f is None else f"{m} f={f:g}" for m, f in cols]]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def format_lll_table(lll: dict[str, dict[str, Any]], fmt: str = "simple") -> str:
    """One line per K kind: rank, row norm after/before, entry bits, bits of ``U``, storage after/before."""
    body = [
        [
            SIGNAL_LABELS.get(kind, kind),
            f"{r['blocks']} x {r['rows']} x {r['head_dim']}, {r['code_bits']}-bit",
            f"{r['rank_mean']:.1f}",
            f"{r['norm_ratio_mean']:.3f} ({r['norm_ratio_min']:.3f}..{r['norm_ratio_max']:.3f})",
            f"{r['entry_bits_before']:.2f} -> {r['entry_bits_after']:.2f}",
            f"{r['entry_bits_u']:.2f}",
            f"{r['storage_ratio']:.3f}",
        ]
        for kind, r in lll.items()
    ]
    headers = [
        "vectors",
        "blocks x rows x dim",
        "rank",
        "row norm after/before",
        "entry bits",
        "U entry bits",
        "storage after (with U) / before",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def plot_reconstruction(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Correlation against kept fraction (topk), one panel per signal, one line per basis.

    Raises:
        ImportError: matplotlib is not installed.
    """
    signals = list(dict.fromkeys(r["signal"] for r in rows))
    cols = 3
    nrow = math.ceil(len(signals) / cols)
    fig = agg_figure(figsize=(13, 3.6 * nrow))
    axes = fig.subplots(nrow, cols, squeeze=False)
    for ax, sig in zip([a for row in axes for a in row], signals, strict=False):
        for basis in dict.fromkeys(r["basis"] for r in rows):
            pts = sorted(
                (r for r in rows if r["signal"] == sig and r["basis"] == basis and r["mode"] == "topk"),
                key=lambda r: r["fraction"],
            )
            if pts:
                ax.plot([r["fraction"] for r in pts], [r["correlation"] for r in pts], marker="o", ms=3, label=basis)
        ax.set_title(SIGNAL_LABELS.get(sig, sig), fontsize=9)
        ax.set_xlabel("kept fraction (largest coefficients per vector)")
        ax.set_ylabel("correlation")
        ax.grid(alpha=0.3)
    for ax in [a for row in axes for a in row][len(signals) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)


def describe_reconstruct_run(meta: dict[str, Any]) -> str:
    """One sentence: model, text, windows, vectors per head, K channel order, the synthetic signals."""
    return describe_run(
        meta,
        f", {meta.get('vectors_per_head')} vectors per (layer, kv-head), K channel order {meta.get('channel_order')}",
        [f"synthetic: {meta.get('synthetic_vectors')} vectors of each kind (seed {meta.get('seed')})"],
        model_fields=("head_dim",),
    )


def write_reconstruct_outputs(
    rows: Sequence[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path, plot: bool = True
) -> list[Path]:
    """Write ``reconstruct.json``, ``.csv``, ``.md`` (a table per fraction, the LLL table) and ``.png``."""
    lines = [f"# Reconstruction: {meta.get('model', {}).get('name')}", "", describe_reconstruct_run(meta), ""]
    if meta.get("command"):
        lines += [f"Produced by `{meta['command']}`.", ""]
    for f in sorted({r["fraction"] for r in rows if r["fraction"] is not None}):
        lines += [
            f"## Kept fraction {f:g}: correlation (relative MSE)",
            "",
            format_reconstruct_table(rows, f, "github"),
        ]
        lines += [""]
    if meta.get("lll"):
        lines += ["## LLL on quantized WHT index vectors of K", "", format_lll_table(meta["lll"], "github"), ""]

    def draw(out: Path) -> list[Path]:
        plot_reconstruction(rows, out / "reconstruct.png", describe_reconstruct_run(meta))
        return [out / "reconstruct.png"]

    payload = {"meta": meta, "results": list(rows)}
    return write_result_files(out_dir, "reconstruct", payload, rows, _CSV_KEYS, lines, draw if plot else None)
