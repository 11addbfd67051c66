"""Reports of the PrimePE sweep: the table, ``rope.png`` and the result files of ``walshkv rope sweep``.

Files in the output folder: ``rope.json`` (meta and rows), ``rope.csv``, ``rope.md``, ``rope.png``.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.report import agg_figure, describe_run, write_result_files
from walshkv.fileio import save_figure_atomic
from walshkv_research.rope_sweep import NONE, RopeSweepResult

__all__ = ["describe_rope_run", "format_rope_table", "plot_rope", "write_rope_outputs"]

_CSV_KEYS = (
    "generator",
    "convention",
    "alpha",
    "codec",
    "kld_mean",
    "kld_p99",
    "top1_agreement",
    "ppl",
    "ppl_ref",
    "ppl_ratio",
    "ppl_ratio_ci95",
    "factor_min",
    "factor_max",
    "scored_tokens",
)


def format_rope_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """The rows as a table (generator, convention, alpha, codec, KLD, top-1, PPL, factor range)."""
    body = [
        [
            r["generator"],
            r["convention"],
            f"{r['alpha']:g}",
            r["codec"],
            f"{r['kld_mean']:.4g}",
            f"{r['kld_p99']:.4g}",
            f"{100 * r['top1_agreement']:.1f}%",
            f"{r['ppl']:.4g}",
            f"{r['ppl_ratio']:.4f}",
            f"{r['factor_min']:.3g}..{r['factor_max']:.3g}",
        ]
        for r in rows
    ]
    headers = [
        "generator",
        "convention",
        "alpha",
        "cache",
        "KLD mean",
        "KLD p99",
        "top-1",
        "PPL",
        "PPL ratio",
        "factors",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def describe_rope_run(meta: dict[str, Any]) -> str:
    """One sentence: model, text, windows, scored tokens, pairing and the reference."""
    return describe_run(
        meta,
        f", {meta['scored_tokens']:,} scored tokens ({meta['scored_positions']})",
        [f"pairing {meta['pairing']}", f"reference: {meta['reference']}"],
        model_fields=("arch", "head_dim"),
    )


def plot_rope(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """PPL ratio and mean KLD against alpha, one line per (generator, convention, cache).

    Raises:
        ImportError: matplotlib is not installed.
    """
    base = {r["codec"]: r for r in rows if r["generator"] == NONE}
    lines: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["generator"] != NONE:
            lines.setdefault((r["generator"], r["convention"], r["codec"]), []).append(r)
    fig = agg_figure(figsize=(12, 4.8))
    axes = fig.subplots(1, 2)
    for (gen, conv, cache), rs in sorted(lines.items()):
        pts = ([base[cache]] if cache in base else []) + sorted(rs, key=lambda r: r["alpha"])
        label = f"{gen} / {conv}" + ("" if cache == NONE else f" + {cache}")
        style = "-" if conv == "divide" else "--"
        xs = [r["alpha"] for r in pts]
        axes[0].plot(xs, [r["ppl_ratio"] for r in pts], style, marker="o", ms=3, label=label)
        pos = [r for r in pts if r["kld_mean"] > 0]  # the reference itself (KLD 0) has no place on a log axis
        axes[1].plot([r["alpha"] for r in pos], [r["kld_mean"] for r in pos], style, marker="o", ms=3, label=label)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("alpha")
    axes[0].set_ylabel("PPL / PPL of the unmodified model (log)")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("mean KLD vs the unmodified model (log)")
    axes[1].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)


def write_rope_outputs(result: RopeSweepResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``rope.json``, ``rope.csv``, ``rope.md`` and (with matplotlib) ``rope.png``; return the paths."""
    lines = [f"# PrimePE sweep: {result.meta['model']['name']} on {result.meta['text']['name']}", ""]
    lines += [describe_rope_run(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    lines += [format_rope_table(result.rows, "github"), ""]

    def draw(out: Path) -> list[Path]:
        plot_rope(result.rows, out / "rope.png", describe_rope_run(result.meta))
        return [out / "rope.png"]

    return write_result_files(out_dir, "rope", result.to_json(), result.rows, _CSV_KEYS, lines, draw if plot else None)
