"""Reports of ``walshkv spectrum``: the table, the heatmaps and the result files.

Files in the output folder: ``spectrum.json``, ``spectrum.csv``, ``spectrum.md``, ``spectrum.png`` (heatmaps,
layer x band, per kind and order) and ``spectrum-coefficients.png`` (share per coefficient).
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.report import agg_figure, describe_run, write_result_files
from walshkv.fileio import save_figure_atomic
from walshkv_research.spectrum import KIND_LABELS, SPECTRUM_ORDERS, SpectrumResult

__all__ = ["describe_spectrum_run", "format_spectrum_table", "plot_spectrum", "write_spectrum_outputs"]


def format_spectrum_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """One line per (kind, order): band shares, flatness, coefficients for 90% energy."""
    body = [
        [
            KIND_LABELS.get(r["kind"], r["kind"]),
            r["order"],
            " / ".join(f"{100 * v:.1f}" for v in r["band_share"]),
            f"{r['flatness']:.3f}",
            f"{100 * r['frac90_wht']:.1f}%",
            f"{100 * r['frac90_identity']:.1f}%",
        ]
        for r in rows
    ]
    headers = ["vectors", "order", "energy % per band (first..last)", "flatness", "90% energy: WHT", "channels"]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def describe_spectrum_run(meta: dict[str, Any]) -> str:
    """One sentence: model, text, windows, vectors per layer and head, K channel order."""
    return describe_run(
        meta,
        f" ({meta.get('tokens')} vectors per layer and head)",
        [f"K channel order {meta.get('channel_order')}"],
    )


def plot_spectrum(result: SpectrumResult, out: Path) -> list[Path]:
    """Heatmaps (layer x band, per kind and order) and per-coefficient share curves.

    Raises:
        ImportError: matplotlib is not installed.
    """
    kinds = list(result.per_layer)
    fig = agg_figure(figsize=(4 * len(kinds) + 1, 8), constrained_layout=True)
    axes = fig.subplots(len(SPECTRUM_ORDERS), len(kinds), squeeze=False)
    vmax = max(max(max(r) for r in result.per_layer[k][o]) for k in kinds for o in SPECTRUM_ORDERS)
    im = None
    for i, order in enumerate(SPECTRUM_ORDERS):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            im = ax.imshow(result.per_layer[kind][order], aspect="auto", vmin=0, vmax=vmax, cmap="viridis")
            ax.set_title(f"{KIND_LABELS[kind]}, {order} order", fontsize=9)
            ax.set_xlabel("band")
            ax.set_ylabel("layer")
    assert im is not None
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of energy")
    fig.suptitle(textwrap.fill(describe_spectrum_run(result.meta), 160), fontsize=8)
    heat = out / "spectrum.png"
    save_figure_atomic(fig, heat, dpi=110)
    fig = agg_figure(figsize=(12, 4.2))
    axes = fig.subplots(1, len(SPECTRUM_ORDERS))
    for ax, order in zip(axes, SPECTRUM_ORDERS, strict=True):
        for kind in kinds:
            ax.plot(result.coefficients[kind][order], label=KIND_LABELS[kind])
        ax.set_yscale("log")
        ax.set_xlabel(f"WHT coefficient ({order} order)")
        ax.set_ylabel("share of energy (mean over layers, heads)")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(describe_spectrum_run(result.meta), 160), fontsize=8)
    fig.tight_layout()
    curves = out / "spectrum-coefficients.png"
    save_figure_atomic(fig, curves, dpi=110)
    return [heat, curves]


_CSV_KEYS = (
    "kind",
    "order",
    "bands",
    "first_band_share",
    "last_band_share",
    "flatness",
    "frac90_wht",
    "frac90_identity",
)


def write_spectrum_outputs(result: SpectrumResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``spectrum.json``, ``.csv``, ``.md`` and the two PNGs; return the paths written."""
    bands = [f"band{i}" for i in range(result.rows[0]["bands"])]
    rows = [{**r, **dict(zip(bands, r["band_share"], strict=True))} for r in result.rows]
    lines = [f"# WHT spectrum: {result.meta.get('model', {}).get('name')}", "", describe_spectrum_run(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    lines += [format_spectrum_table(result.rows, "github"), ""]
    return write_result_files(
        out_dir,
        "spectrum",
        result.to_json(),
        rows,
        [*_CSV_KEYS, *bands],
        lines,
        (lambda out: plot_spectrum(result, out)) if plot else None,
    )
