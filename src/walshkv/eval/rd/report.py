"""``walshkv rd``'s results: the bounds they are compared with, tables, plots and files.

:func:`walshkv.eval.rd.measure_rd` measures; this module holds what it returns (:class:`RDResult`) and what
becomes of it: :func:`format_rd_table`, :func:`plot_rd` (needs matplotlib), :func:`write_rd_outputs`
(``rd.json``, ``rd.csv``, ``rd.md``, ``rd.png``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.metrics import is_finite_number
from walshkv.eval.report import agg_figure, describe_run, write_result_files
from walshkv.fileio import save_figure_atomic
from walshkv.ops.lloyd_max import lloyd_max

__all__ = [
    "RDResult",
    "describe_rd",
    "format_rd_table",
    "lloyd_max_points",
    "plot_rd",
    "shannon_bound",
    "write_rd_outputs",
]


def shannon_bound(bits: float) -> float:
    """D(R) = 2^(-2R): the distortion-rate function of a memoryless unit-variance Gaussian source."""
    return 2.0 ** (-2.0 * bits)


def lloyd_max_points(max_bits: int = 4) -> list[tuple[int, float]]:
    """``(bits, mse)`` of the unit-Gaussian Lloyd-Max scalar quantizer at 1 .. ``max_bits`` bits."""
    return [(b, lloyd_max(b).mse) for b in range(1, max_bits + 1)]


@dataclass
class RDResult:
    """``meta`` describes the run; ``rows`` has one dict per codec (see the module docstring)."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.rows}


_TABLE_COLUMNS = (
    ("codec", "codec", None),
    ("bits_k", "bits K", ".4g"),
    ("bits_v", "bits V", ".4g"),
    ("nmse_k", "nMSE K", ".4g"),
    ("nmse_v", "nMSE V", ".4g"),
    ("gap_db_k", "dB over bound K", ".2f"),
    ("gap_db_v", "dB over bound V", ".2f"),
    ("logit_rel_mse", "logit rel MSE", ".4g"),
    ("logit_slope", "logit slope", ".4f"),
)


def _cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt is None:
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    return format(value, fmt)


def format_rd_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """The rows as a text table (``fmt``: a tabulate format, e.g. ``"github"``)."""
    cols = [c for c in _TABLE_COLUMNS if any(c[0] in r for r in rows)]
    body = [[_cell(r.get(key), f) for key, _, f in cols] for r in rows]
    errors = [f"{r['codec']}: {r['error']}" for r in rows if r.get("error")]
    table = tabulate(body, headers=[h for _, h, _ in cols], tablefmt=fmt, disable_numparse=True)
    return table + ("\n\nfailed: " + "; ".join(errors) if errors else "")


def _family(spec: str) -> str:
    """The codec family a spec is coloured by in the plot."""
    if spec.startswith("tqprod"):
        return "tqprod"
    if spec.startswith("tq"):
        return "tq"
    if re.match(r"^(rot|rrot(:\d+)?)\+int\d$", spec):
        return "rot+int"
    if re.match(r"^int\d$", spec):
        return "int"
    if spec.startswith("vht2") or spec in ("vzc",) or spec.startswith("sqfree"):
        return "vht2"
    if re.match(r"^q\d", spec):
        return "llama.cpp"
    return "other"


_COLORS = {
    "int": "tab:gray",
    "rot+int": "tab:blue",
    "tq": "tab:red",
    "tqprod": "tab:purple",
    "vht2": "tab:green",
    "llama.cpp": "tab:orange",
    "other": "tab:brown",
}


def plot_rd(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Normalised MSE (log) against stored bits per element for K and V, with the Gaussian bound
    ``2^(-2R)`` and the Lloyd-Max scalar points; plus the K logit error and slope where measured.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'walshkv[plot]'``).
    """
    good = [r for r in rows if not r.get("error")]
    with_logits = [r for r in good if is_finite_number(r.get("logit_rel_mse"))]
    nrows = 2 if with_logits else 1
    fig = agg_figure(figsize=(14, 5.6 * nrows), layout="constrained")
    axes = fig.subplots(nrows, 2, squeeze=False)
    bits_all = [r[k] for r in good for k in ("bits_k", "bits_v") if is_finite_number(r.get(k))] or [1.0, 8.0]
    lo, hi = min(0.75, min(bits_all) - 0.25), max(bits_all) + 0.5
    lm_pts = lloyd_max_points(4)

    def scatter(ax: Any, key_x: str, key_y: str, log: bool) -> None:
        seen: set[str] = set()
        pts = sorted(
            (
                r
                for r in good
                if is_finite_number(r.get(key_x)) and is_finite_number(r.get(key_y)) and (r[key_y] > 0 or not log)
            ),
            key=lambda r: (r[key_x], r[key_y]),
        )
        # codecs that land on the same point (e.g. two names for one quantizer) share one label
        groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
        for r in pts:
            groups.setdefault((round(r[key_x], 9), float(f"{r[key_y]:.9g}")), []).append(r)
        for i, ((x, y), members) in enumerate(groups.items()):
            fam = _family(members[0]["codec"])
            ax.scatter(x, y, s=30, color=_COLORS[fam], zorder=4, label=None if fam in seen else fam)
            seen.add(fam)
            ax.annotate(
                " = ".join(r["codec"] for r in members),
                (x, y),
                xytext=(5, 6 if i % 2 == 0 else -11),
                textcoords="offset points",
                fontsize=7,
                color=_COLORS[fam],
                zorder=5,
            )
        if log:
            ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.grid(True, which="both", alpha=0.25)

    for col, (kind, key_x, key_y) in enumerate((("K", "bits_k", "nmse_k"), ("V", "bits_v", "nmse_v"))):
        ax = axes[0][col]
        xs = [lo + (hi - lo) * i / 200 for i in range(201)]
        ax.plot(xs, [shannon_bound(x) for x in xs], color="black", lw=1.2, label="Gaussian bound 2^(-2R)", zorder=2)
        ax.plot(
            [b for b, _ in lm_pts],
            [m for _, m in lm_pts],
            ls="none",
            marker="x",
            ms=9,
            mew=2,
            color="black",
            label="Lloyd-Max scalar, N(0,1)",
            zorder=3,
        )
        scatter(ax, key_x, key_y, log=True)
        ax.set_xlabel("stored bits per element (codes, scales, norms)")
        ax.set_ylabel(f"normalised MSE of {kind}  (sum err² / sum x², mean over layers)")
        ax.set_title(f"{kind}: distortion against rate")
        ax.legend(fontsize=8, loc="lower left")
    if with_logits:
        ax = axes[1][0]
        scatter(ax, "bits_k", "logit_rel_mse", log=True)
        ax.set_xlabel("K bits per element")
        ax.set_ylabel("attention logits: sum (<q,k̂>-<q,k>)² / sum <q,k>²")
        ax.set_title("K with the model's real queries: logit error")
        ax.legend(fontsize=8, loc="lower left")
        ax = axes[1][1]
        ax.axhline(1.0, color="black", lw=1, label="unbiased (slope 1)")
        scatter(ax, "bits_k", "logit_slope", log=False)
        ax.set_xlabel("K bits per element")
        ax.set_ylabel("slope of <q,k̂> on <q,k> (least squares)")
        ax.set_title("K: logit shrinkage (below 1) or inflation (above 1)")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    save_figure_atomic(fig, path, dpi=110)


_CSV_KEYS = (
    "codec",
    "bits_k",
    "bits_v",
    "bits_per_element",
    "nmse_k",
    "nmse_v",
    "nmse",
    "gap_db_k",
    "gap_db_v",
    "logit_rel_mse",
    "logit_slope",
    "error",
)


def describe_rd(meta: dict[str, Any]) -> str:
    """The run of an :class:`RDResult` in one sentence (model, text, windows, tokens captured)."""
    return describe_run(meta, f" ({meta['tokens_captured']:,} tokens captured per layer)", ())


def write_rd_outputs(result: RDResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``rd.json``, ``rd.csv``, ``rd.md`` and (with matplotlib) ``rd.png``; return the paths written."""
    lines = [f"# Rate-distortion: {result.meta['model']['name']} on {result.meta['text']['name']}", ""]
    lines += [describe_rd(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    commit = result.meta.get("versions", {}).get("commit")
    cpu = result.meta.get("cpu") or {}
    if commit or cpu:
        lines += [f"Code {commit or '?'}; CPU {cpu.get('model', '?')} ({cpu.get('capability', '?')}).", ""]
    lines += [format_rd_table(result.rows, "github"), ""]
    if result.meta.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"`{s['codec']}` ({s['reason']})" for s in result.meta["skipped"]), ""]
    lines += [
        "Columns: see docs/rd.md in the walshkv repository. Lloyd-Max reference (unit Gaussian, computed): "
        + ", ".join(f"{b} bit: {m:.4g}" for b, m in result.meta["reference"]["lloyd_max_gaussian"].items())
        + ".",
        "",
    ]

    def draw(out: Path) -> list[Path]:
        plot_rd(result.rows, out / "rd.png", describe_rd(result.meta))
        return [out / "rd.png"]

    return write_result_files(out_dir, "rd", result.to_json(), result.rows, _CSV_KEYS, lines, draw if plot else None)
