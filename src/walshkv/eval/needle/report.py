"""A ``walshkv needle`` result in words, tables, markdown, heatmaps and files.

Tables give each accuracy with its 95% Wilson interval in percent, ``80% [49, 94]``, and each codec's paired
difference from the reference with Newcombe's interval and the exact McNemar p-value
(:mod:`walshkv.eval.needle.cells`); the JSON holds the numbers (``*_ci95`` as ``[low, high]``), the CSV the cells
with each interval as two columns (``*_ci95_low``, ``*_ci95_high``); the heatmaps name each cell's trials.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.needle.cells import BASELINE, NeedleResult, cell_key, mean, trial_key
from walshkv.eval.report import agg_figure, describe_model, write_csv
from walshkv.fileio import save_figure_atomic, write_json_atomic, write_text_atomic

__all__ = [
    "CSV_KEYS",
    "describe_needle",
    "flag_note",
    "format_needle_table",
    "needle_markdown",
    "plot_heatmaps",
    "write_needle_outputs",
]


def describe_needle(meta: Mapping[str, Any]) -> str:
    """The run of a :class:`NeedleResult` in one paragraph."""

    def grid(m: Mapping[str, Any]) -> str:
        lengths = ", ".join(f"{n:,}" for n in m["lengths"])
        depths = ", ".join(f"{d:g}" for d in m["depths"])
        return f"lengths {lengths} tokens (prompt + answer), depths {depths}, {m['samples']} sample(s) each"

    runs = meta.get("runs") or []
    cover = (
        f"{grid(meta)}: {meta['trials']} trials per cache"
        if not runs
        else f"{len(runs)} runs added together ({'; '.join(grid(r) for r in runs)}): {meta['trials']} trials per cache"
    )
    parts = [
        describe_model(meta["model"]),
        f"haystack text {meta['text']['name']}",
        f"tasks {', '.join(meta['tasks'])} ({meta.get('prompt', '?')} prompt)",
        cover,
        f"reference: {meta['reference']}",
        f"prefill: {meta['prefill_note']}, {meta['prefill_chunk']} tokens per forward"
        + (" (fused attention)" if meta.get("fused") else "")
        + (", the haystack shared by the depths of one length and sample reused" if meta.get("share_prefix") else ""),
        f"full-precision window: {meta['residual']} tokens",
        f"scoring: {meta['scoring']}",
        meta["threshold_note"],
    ]
    return "; ".join(parts) + "."


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{x:.0%}"


def _with_ci(x: float | None, ci: Sequence[float] | None) -> str:
    """A share and its 95% interval in percent, ``80% [49, 94]`` (the share alone where there is no interval)."""
    if x is None or x != x or not ci or any(v != v for v in ci):
        return _pct(x)
    return f"{x:.0%} [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]"


def _difference(row: Mapping[str, Any]) -> str:
    """A codec's paired difference from the reference and its interval, in percentage points: ``-20 [-52, +14]``."""
    d, ci = row.get("difference"), row.get("difference_ci95")
    if d is None or ci is None:
        return ""
    return f"{_points(d)} [{_points(ci[0])}, {_points(ci[1])}]"


def _points(x: float) -> str:
    """A difference of shares in signed whole percentage points (``+14``, ``-52``; ``0`` unsigned)."""
    v = round(100 * x)
    return "0" if v == 0 else f"{v:+d}"


def _p_value(p: float | None) -> str:
    if p is None:
        return ""
    return "<0.001" if p < 0.001 else f"{p:.3f}"


def _caches(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["codec"] for r in rows))


def _label(result: NeedleResult, codec: str) -> str:
    """A cache's name in tables and plots: the preset's name where it stands for one (its spec is in the meta)."""
    return result.meta["codecs"].get(codec, {}).get("preset") or codec


def format_needle_table(result: NeedleResult, task: str, fmt: str = "simple") -> str:
    """One task's table: a row per cache (the reference first) with its bits, the accuracy per length over the
    measurable cells, the same over every measurable cell, what it retained, lost and gained there, its paired
    difference from the reference and McNemar's p, and seconds per trial.

    Every accuracy and ``retained`` carries its 95% Wilson interval in percent (``80% [49, 94]``); ``Δ pp``: the
    codec's accuracy minus the reference's on the same trials, in percentage points, with Newcombe's paired 95%
    interval; ``p``: the exact McNemar p-value of the discordant pairs (``lost`` against ``gained``). A length with
    flagged depths (the reference below the threshold) carries ``⚑N`` in the reference's row (N depths left out;
    :func:`flag_note` names them); a length without measurable cells reads ``n/a``.
    """
    summary = [s for s in result.summary if s["task"] == task]
    lengths = sorted({s["length"] for s in summary})
    by = {(s["codec"], s["length"]): s for s in summary}
    over = {o["codec"]: o for o in result.overall if o["task"] == task}
    paired = ["retained", "lost", "gained", "Δ pp", "p"]
    headers = ["cache", "bits/el", *(f"L={n:,}" for n in lengths), "all", *paired, "s/trial"]
    body = []
    for codec in _caches(summary):
        reference = codec == BASELINE
        cells = []
        for n in lengths:
            s = by.get((codec, n))
            if s is None:
                cells.append("")
                continue
            measured = s["measured_accuracy"]
            text = "n/a" if measured is None else _with_ci(measured, s.get("measured_accuracy_ci95"))
            if reference and s["flagged_depths"]:
                text += f" ⚑{len(s['flagged_depths'])}"
            cells.append(text)
        o = over[codec]
        seconds = mean([s["seconds_per_trial"] for s in summary if s["codec"] == codec])
        body.append(
            [
                _label(result, codec),
                f"{result.meta['codecs'][codec]['bits_per_element']:.3f}",
                *cells,
                _with_ci(o["measured_accuracy"], o.get("measured_accuracy_ci95")),
                "" if reference else _with_ci(o["retained"], o.get("retained_ci95")),
                "" if reference else str(o["lost"]),
                "" if reference else str(o["gained"]),
                "" if reference else _difference(o),
                "" if reference else _p_value(o.get("mcnemar_p")),
                f"{seconds:.1f}",
            ]
        )
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def flag_note(result: NeedleResult, task: str) -> str:
    """What the threshold left out of a task's table, and the reference's own accuracy over every depth."""
    ref = [s for s in result.summary if s["task"] == task and s["codec"] == BASELINE]
    cells = {(c["length"], c["depth"]): c for c in result.cells if c["task"] == task and c["codec"] == BASELINE}
    threshold = f"{result.meta['min_baseline']:.0%}"
    own = ", ".join(f"L={s['length']:,} {_with_ci(s['accuracy'], s.get('accuracy_ci95'))}" for s in ref)

    def cell(length: int, depth: float) -> str:
        c = cells[(length, depth)]
        return f"{depth:g} ({_pct(c['accuracy'])}, {c['correct']} of {c['trials']})"

    flagged = [
        f"L={s['length']:,} at depth " + ", ".join(cell(s["length"], d) for d in s["flagged_depths"])
        for s in ref
        if s["flagged_depths"]
    ]
    if not flagged:
        return f"Every cell is measurable: the {BASELINE} model reaches {threshold} at each (over all depths: {own})."
    return (
        f"⚑ left out of every number above, since the {BASELINE} model itself is below {threshold} there: "
        f"{'; '.join(flagged)} (the trials stay in the JSON and CSV). The {BASELINE} model over all depths: {own}."
    )


def needle_markdown(result: NeedleResult) -> str:
    """The markdown report: the run, the command, the threshold, one table per task, the needles lost."""
    meta = result.meta
    lines = [f"# Needle in a haystack: {meta['model']['name']}", "", describe_needle(meta), ""]
    if meta.get("command"):
        lines += [f"Produced by `{meta['command']}`.", ""]
    for i, run in enumerate(meta.get("runs") or [], 1):
        commit = (run.get("versions") or {}).get("commit", "?")
        cpu = (run.get("cpu") or {}).get("model", "?")
        lines += [f"Run {i} (code {commit}, CPU {cpu}): `{run.get('command') or '?'}`.", ""]
    lines += [
        f"Columns: accuracy (exact match) per length over its measurable cells (depths where the {BASELINE} model "
        f"reaches {meta['min_baseline']:.0%}); `all`: over every measurable cell; `retained`: of the trials the "
        f"{BASELINE} model got right there, the share the codec got right too; `lost`: those it got wrong; "
        f"`gained`: trials the {BASELINE} model got wrong and the codec right; `Δ pp`: the codec's accuracy minus the "
        f"{BASELINE} model's on the same trials, in percentage points; `p`: exact McNemar p-value of `lost` against "
        "`gained` (a small p: the disagreements lean one way more than chance would make them); `s/trial`: prefill "
        "and decoding, seconds per trial (depths after the first of a length and sample reuse the haystack they "
        "share, so they cost less).",
        "",
        "Brackets: 95% intervals in percent. Accuracies and `retained`: Wilson score intervals, the trial as the unit "
        "(multivalue: a trial counts as right when every value is found). `Δ pp`: Newcombe's score interval for "
        "paired proportions, since both caches answered the same prompts. Trials of one sample share their needle "
        "across depths and lengths, so the intervals of pooled columns assume more independence than there is: "
        "read them as a lower bound on the uncertainty.",
        "",
    ]
    for task in meta["tasks"]:
        lines += [f"## {task}", "", format_needle_table(result, task, "github"), "", flag_note(result, task), ""]
        ok = {cell_key(c): c["measurable"] for c in result.cells}
        ref = {trial_key(r): r for r in result.trials if r["codec"] == BASELINE}
        misses = [
            r
            for r in result.trials
            if r["task"] == task
            and r["codec"] != BASELINE
            and ok.get(cell_key(r))
            and ref[trial_key(r)]["correct"]
            and not r["correct"]
        ]
        if misses:
            lines += ["Needles the codecs lost (right with the reference, wrong with the codec):", ""]
            lines += ["| cache | length | depth | sample | expected | answer |", "|---|---|---|---|---|---|"]
            for r in misses[:40]:
                answer = " ".join(r["output"].split()).replace("|", "\\|")
                lines.append(
                    f"| {r['codec']} | {r['length']:,} | {r['depth']:g} | {r['sample']} | {r['answers']} | {answer} |"
                )
            if len(misses) > 40:
                lines.append(f"| … {len(misses) - 40} more in the JSON | | | | | |")
            lines.append("")
    return "\n".join(lines)


def plot_heatmaps(result: NeedleResult, path: str | Path) -> Path:
    """Depth x length heatmaps of accuracy: a row of panels per task, a panel per cache (the reference first).

    Each cell is annotated with its accuracy (``multivalue``: the mean share of values found) and its trials
    (``n=5``); cells where the reference is below the threshold are hatched.

    Raises:
        ImportError: matplotlib is missing (the message names ``pip install 'walshkv[plot]'``).
    """
    meta = result.meta
    tasks, caches = meta["tasks"], _caches(result.trials)
    lengths, depths = meta["lengths"], meta["depths"]
    width = max(5.0, 1.6 + len(caches) * (0.8 + 0.55 * len(lengths)))
    fig = agg_figure(figsize=(width, 1.4 + (0.9 + 0.32 * len(depths)) * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), len(caches), squeeze=False)
    cells = {(c["task"], c["codec"], c["length"], c["depth"]): c for c in result.cells}
    image = None
    for i, task in enumerate(tasks):
        for j, codec in enumerate(caches):
            ax = axes[i][j]
            grid = [[cells.get((task, codec, n, d), {}).get("score", float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for y, d in enumerate(depths):
                for x, n in enumerate(lengths):
                    cell = cells.get((task, codec, n, d))
                    if cell is None:
                        continue
                    label = f"{cell['score']:.0%}\nn={cell['trials']}"
                    ax.text(x, y, label, ha="center", va="center", fontsize=6, linespacing=0.9)
                    if not cell["measurable"]:
                        ax.add_patch(_hatch(x - 0.5, y - 0.5))
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths] if j == 0 else [""] * len(depths))
            bits = meta["codecs"][codec]["bits_per_element"]
            ax.set_title(f"{_label(result, codec)}\n{bits:.2f} bits/el", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{task}: needle depth", fontsize=8)
            if i == len(tasks) - 1:
                ax.set_xlabel("context length", fontsize=8)
            ax.tick_params(labelsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy (exact match)", pad=0.02)
    fig.suptitle(
        f"{meta['model']['name']}: needle in a haystack ({meta['text']['name']}); n: trials per cell\nhatched: the "
        f"{BASELINE} model is below {meta['min_baseline']:.0%} there (not measurable)",
        fontsize=9,
    )
    return save_figure_atomic(fig, path, dpi=130)


def _hatch(x: float, y: float) -> Any:
    """A hatched unit square at ``(x, y)`` (a flagged cell)."""
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1.0, 1.0, fill=False, hatch="///", edgecolor="0.35", linewidth=0)


#: The CSV's columns (the cells, one line per (task, cache, length, depth)); an interval ``*_ci95`` of the JSON is
#: two columns here, ``*_ci95_low`` and ``*_ci95_high`` (empty where it is ``None``).
CSV_KEYS = ("task", "codec", "length", "depth", "trials", "correct", "accuracy", "accuracy_ci95_low",
            "accuracy_ci95_high", "score", "baseline_accuracy", "baseline_accuracy_ci95_low",
            "baseline_accuracy_ci95_high", "measurable", "bits_per_element")  # fmt: skip


def _csv_row(cell: Mapping[str, Any], bits: Mapping[str, float]) -> dict[str, Any]:
    """A cell as a CSV line: :data:`CSV_KEYS`, each interval split in two, the cache's bits per element."""
    out: dict[str, Any] = {}
    for key in CSV_KEYS:
        if key == "bits_per_element":
            out[key] = bits[cell["codec"]]
        elif key.endswith(("_ci95_low", "_ci95_high")):
            name, side = key.rsplit("_", 1)
            ci = cell.get(name)
            out[key] = None if ci is None else ci[0 if side == "low" else 1]
        else:
            out[key] = cell[key]
    return out


def write_needle_outputs(
    result: NeedleResult,
    *,
    json: str | Path | None = None,
    csv: str | Path | None = None,
    markdown: str | Path | None = None,
    png: str | Path | None = None,
) -> list[Path]:
    """Write the files asked for: JSON (everything), CSV (the cells, :data:`CSV_KEYS`), markdown (the report), PNG
    (heatmaps; skipped with a note on stderr where matplotlib is missing).

    Returns:
        The paths written.
    """
    written = []
    if json:
        write_json_atomic(json, result.to_json())
        written.append(Path(json))
    if csv:
        bits = {name: c["bits_per_element"] for name, c in result.meta["codecs"].items()}
        write_csv(csv, [_csv_row(c, bits) for c in result.cells])
        written.append(Path(csv))
    if markdown:
        write_text_atomic(markdown, needle_markdown(result))
        written.append(Path(markdown))
    if png:
        try:
            written.append(plot_heatmaps(result, png))
        except ImportError as err:  # every other file is written all the same
            print(f"needle heatmaps skipped: {err}", file=sys.stderr)
    return written
