#!/usr/bin/env python3
"""Write docs/long-context.md from the runs of docs/long-context-reproduce.sh (nothing typed by hand).

Reads, under --results (docs/results/long-context):

- ``kld/MODEL/ctxN/rows/*.json``: `walshkv sweep --grid long-context` rows on Emma (the development text);
- ``needle/MODEL/needle.json``: `walshkv needle` runs (retrieval; their markdown and heatmaps are linked);
- ``holdout/MODEL/{austen_emma,austen_persuasion}/rows/*.json``: the final presets and peers at 512 tokens on
  Emma and on the frozen holdout Persuasion.

Writes the page, ``kld-MODEL.png`` (mean KLD against context length per codec; needs matplotlib) and
``summary.json`` (every number of the page, with the runs' commits and CPUs).

Targets are judged on the holdout with paired per-window bootstrap intervals
(:func:`walshkv.eval.metrics.bootstrap_ci95` of the per-window KLD differences, preset minus peer): *met* when
the whole interval is below zero, *missed* when it is above, *undecided* when it straddles zero.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from walshkv.eval.metrics import paired_difference
from walshkv.presets import BUILTIN, model_presets, public_name

ROOT = Path(__file__).resolve().parents[1]
PAGE_DIR = ROOT / "docs"  # links in the page are relative to its folder (set by main)


def _link(path: Path) -> str:
    return os.path.relpath(path, PAGE_DIR)


# (preset, peers it must beat or match: "le" = mean KLD at or below each peer's), judged on the holdout.
# The moonshot targets of issue 20 come first; the 512-token targets of docs/presets.md after them.
TARGETS: list[tuple[str, str, list[str]]] = [
    ("moonshot", "walshkv:3", ["rot+iq4_nl", "rot+q4_0"]),
    ("moonshot", "walshkv:4.5", ["rot+q8_0/rot+q4_0"]),
    ("moonshot", "walshkv:2.5", ["rot+q4_0"]),
    ("peers at similar bits", "walshkv:3", ["kivi2", "tq:3"]),
    ("peers at similar bits", "walshkv:3.5", ["tq:3", "kivi2"]),
    ("peers at similar bits", "walshkv:4.5", ["rot+iq4_nl", "rot+q4_0", "iq4_nl", "q4_0", "tq:4", "kivi4"]),
]
# The winners of `recommend --ctx 4096` (stage select, python-docs only) are judged against their preset's
# 512-token winner too (docs/results/presets/MODEL/recommend-B.json): see _select_targets.
PRESET_RUNS = ROOT / "docs" / "results" / "presets"


def _winner_512(model: str, preset: str) -> str | None:
    """The spec ``walshkv recommend`` chose for ``preset`` at 512 tokens (docs/presets.md), or ``None``."""
    path = PRESET_RUNS / model / f"recommend-{preset.split(':', 1)[1]}.json"
    return json.loads(path.read_text())["winner"] if path.is_file() else None


def _select_targets(results: Path, model: str) -> list[tuple[str, str, list[str]]]:
    """``("4k vs 512 selection", 4k winner, [512 winner])`` per ``recommend --ctx 4096`` run (stage select),
    each by its label in the tables (a shipped preset's name, else its spec)."""
    names, out = _name_of(model), []
    for path in sorted((results / "select" / model).glob("recommend-*-ctx4096.json")):
        if not re.fullmatch(r"recommend-[0-9.]+-ctx4096\.json", path.name):  # re-selections: _reselection_targets
            continue
        run = json.loads(path.read_text())
        old = _winner_512(model, run["preset"])
        if old and old != run["winner"]:
            out.append(("4k vs 512 selection", names.get(run["winner"], run["winner"]), [names.get(old, old)]))
    return out


# Re-selections among named candidates (docs/trellis-reproduce.sh, stages select, select-n8, select-t2,
# select-qwen-tcq and select-tcq-rest): the runs' file tags, the target's name, and how the spec that shipped before
# it is told apart among the candidates.
RESELECTIONS: list[tuple[tuple[str, ...], str, Any]] = [
    (("tcq", "qtcq", "tcqr"), "tcq re-selection", lambda spec: "tcq:" not in spec),
    (("n8",), "norm=8 re-selection", lambda spec: "norm=8" not in spec),
    (("t2",), "tables=2 re-selection", lambda spec: "tables=2" not in spec),
]


def _reselection_targets(results: Path, model: str) -> list[tuple[str, str, list[str]]]:
    """``(kind, winner, [the spec it replaced])`` per re-selection run whose winner is new, each by its label in the
    tables (a shipped preset's name, else its spec). The spec it replaced is the one candidate of the run of the
    earlier kind (tq among tcq, an fp16 norm among ``norm=8``); a run with none or several names no target."""
    names, out, folder = _name_of(model), [], results / "select" / model
    for tags, kind, before in RESELECTIONS:
        for path in (p for tag in tags for p in sorted(folder.glob(f"recommend-*-{tag}-ctx4096.json"))):
            run = json.loads(path.read_text())
            old = [r["codec"] for r in run["results"] if before(r["codec"])]
            if len(old) == 1 and old[0] != run["winner"]:
                out.append((kind, names.get(run["winner"], run["winner"]), [names.get(old[0], old[0])]))
    return out


def _rows(folder: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(folder.glob("rows/*.json")):
        data = json.loads(path.read_text())
        row = dict(data["result"])
        row["_meta"] = data["meta"]
        out.append(row)
    return out


def _name_of(model: str) -> dict[str, str]:
    """``{spec: preset name}`` of the model's shipped presets, each by the name users give it (``walshkv:B-max`` for
    a dense-map entry whose plain name the naming rule gave to the block frame: walshkv.presets.public_name), and of
    the built-in specs (``walshkv:B (built-in)``, or ``walshkv:B`` on a model with no presets)."""
    entry = model_presets().get(model)
    if entry is None:  # a model walshkv has not measured: its walshkv:B is the built-in spec (walshkv.presets.BUILTIN)
        return {spec: name for name, spec in BUILTIN.items()}
    # rows of the built-in specs measured before the model's presets were selected (qwen2.5-0.5b) keep their names
    names = {spec: f"{name} (built-in)" for name, spec in BUILTIN.items()}
    return names | {p["spec"]: public_name(model, key) for key, p in entry["presets"].items()}


def _pair(model: str, fast_key: str) -> tuple[str, str]:
    """``(labels)`` of a budget's two entries, the dense-map one first: ``("walshkv:3.5", "walshkv:3.5-fast")``, or
    ``("walshkv:3.5-max", "walshkv:3.5")`` where the naming rule moved the plain name."""
    return public_name(model, fast_key.removesuffix("-fast")), public_name(model, fast_key)


def _label(row: dict[str, Any], names: dict[str, str]) -> str:
    return names.get(row["codec"], row["codec"])


def _fmt(x: float | None, digits: int = 4) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _ci(row: dict[str, Any], key: str, digits: int = 4, scale: float = 1.0) -> str:
    """`` [low, high]`` of a row's bootstrap interval, or ``""`` under 3 windows (too few to resample)."""
    if len(row.get("window_kld_mean") or []) < 3:
        return ""
    ci = row.get(key)
    if not ci or any(c is None or (isinstance(c, float) and math.isnan(c)) for c in ci):
        return ""
    return f" [{ci[0] * scale:.{digits}f}, {ci[1] * scale:.{digits}f}]"


def _provenance(rows: list[dict[str, Any]]) -> tuple[set[str], set[str]]:
    """The code commits and CPUs (name and the vector extension torch used) of the rows' runs."""
    commits, cpus = set(), set()
    for r in rows:
        meta = r["_meta"]
        commits.add(str(meta.get("versions", {}).get("commit", "?")))
        cpu = meta.get("cpu") or {}
        cpus.add(f"{cpu.get('model', '?')} ({cpu.get('capability', '?')})")
    return commits, cpus


def kld_section(results: Path, figures: Path, summary: dict[str, Any]) -> list[str]:
    lines = ["## KL divergence against context length", ""]
    root = results / "kld"
    if not root.is_dir():
        return [*lines, "No runs yet: `STAGES=kld bash docs/long-context-reproduce.sh`.", ""]
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        model = model_dir.name
        names = _name_of(model)
        by_ctx: dict[int, list[dict[str, Any]]] = {}
        for ctx_dir in model_dir.glob("ctx*"):
            rows = _rows(ctx_dir)
            if rows:
                by_ctx[int(ctx_dir.name[3:])] = rows
        short = results / "holdout" / model / "austen_emma"  # the 512-token column: the holdout stage's Emma run
        if 512 not in by_ctx and (rows := _rows(short)):
            by_ctx[512] = rows
        if not by_ctx:
            continue
        ctxs = sorted(by_ctx)
        table: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
        for ctx, rows in by_ctx.items():
            for r in rows:
                table[_label(r, names)][ctx] = r
        all_rows = [r for rows in by_ctx.values() for r in rows]
        commits, cpus = _provenance(all_rows)
        meta0 = by_ctx[ctxs[0]][0]["_meta"]
        lines += [f"### {model}", ""]
        lines.append(
            "Emma (development text), the second half of each window scored; windows per context: "
            + ", ".join(f"{c}: {by_ctx[c][0]['_meta']['windows']}" for c in ctxs)
            + f". Reference: {meta0.get('reference', 'uncompressed DynamicCache, fp32')}. "
            f"Presets calibrated on {meta0.get('calibration', {}).get('text', 'python-docs')}. "
            f"Code {', '.join(sorted(commits))}; CPU {', '.join(sorted(cpus))}."
        )
        lines.append("")
        lines.append(
            "Mean KLD (nats) with its 95% bootstrap interval over windows where there are 3 windows or more; "
            "`sink:1:` specs (the presets) cost fewer bits per element at longer windows (their one fp16 token "
            "is shared by more tokens). A dash: not run at that context (the core grid beyond 2k)."
        )
        lines.append("")
        head = (
            f"| codec | bits/el @ {ctxs[0]} | "
            + " | ".join(f"KLD @ {c}" for c in ctxs)
            + " | "
            + " | ".join(f"top-1 % @ {c}" for c in ctxs)
        )
        lines += [head + " |", "|" + "---|" * (2 + 2 * len(ctxs))]
        order = sorted(table, key=lambda k: -table[k][min(table[k])]["bits_per_element"])
        summary.setdefault("kld", {})[model] = {}
        for label in order:
            cells = table[label]
            bits = cells[min(cells)]["bits_per_element"]
            kl = [(_fmt(cells[c]["kld_mean"]) + _ci(cells[c], "kld_mean_ci95")) if c in cells else "—" for c in ctxs]
            t1 = [_fmt(100 * cells[c]["top1_agreement"], 2) if c in cells else "—" for c in ctxs]
            lines.append(f"| {label} | {bits:.3f} | " + " | ".join(kl) + " | " + " | ".join(t1) + " |")
            summary["kld"][model][label] = {
                str(c): {k: cells[c].get(k) for k in ("kld_mean", "kld_mean_ci95", "top1_agreement", "kld_p99")}
                for c in ctxs
                if c in cells
            }
        lines.append("")
        png = _plot(model, ctxs, table, order, figures)
        if png:
            lines += [f"![mean KLD against context, {model}]({_link(png)})", ""]
    return lines


def _plot(model: str, ctxs: list[int], table: dict, order: list[str], figures: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for label in order:
        if label == "fp16":
            continue
        xs = [c for c in ctxs if c in table[label]]
        ys = [max(table[label][c]["kld_mean"], 1e-6) for c in xs]
        style = "-o" if label.startswith("walshkv:") else "--."
        ax.plot(xs, ys, style, label=label, linewidth=2 if label.startswith("walshkv:") else 1)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens per window; second half scored)")
    ax.set_ylabel("mean KLD vs uncompressed (nats)")
    ax.set_title(f"{model}: KLD against context length (Emma)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    figures.mkdir(parents=True, exist_ok=True)
    path = figures / f"kld-{model}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


#: Needle runs kept in a folder beside a model's grid, and what each is (stage needle of the reproduce script).
NEEDLE_PARTS = {
    "walshkv-3-4k": "walshkv:3 as re-selected at 4k tokens (the grid above ran the 512-token spec)",
    "presets-5": "the shipped presets, 5 samples per cell (Wilson intervals; a one-sample grid above ran older specs)",
}


def needle_section(results: Path, summary: dict[str, Any]) -> list[str]:
    lines = ["## Retrieval: needle in a haystack", ""]
    root = results / "needle"
    found = False
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []:
        md = model_dir / "needle.md"
        parts = sorted(p for p in model_dir.iterdir() if p.is_dir() and (p / "needle.md").is_file())
        if not md.is_file() and not parts:
            continue
        found = True
        lines += [f"### {model_dir.name}", ""]
        if md.is_file():
            body = [("##" + ln if ln.startswith("#") else ln) for ln in md.read_text().strip().splitlines()]
            lines += [*[ln for ln in body if not ln.startswith("### Needle")], ""]
        else:
            lines += ["No one-sample grid (stage `needle`) for this model; its runs:", ""]
        for png in sorted(model_dir.glob("*.png")):
            lines += [f"![{png.stem}]({_link(png)})", ""]
        js = model_dir / "needle.json"
        if js.is_file():
            summary.setdefault("needle", {})[model_dir.name] = _link(js)
        for part in parts:
            # a later run beside the model's grid (a re-selected preset): its own tables, under the model's
            text = (part / "needle.md").read_text().strip().splitlines()
            sub = [("###" + ln if ln.startswith("#") else ln) for ln in text]
            lines += [f"#### {model_dir.name}: {NEEDLE_PARTS.get(part.name, part.name)}", ""]
            lines += [ln for ln in sub if not ln.startswith("#### Needle")] + [""]
            for png in sorted(part.glob("*.png")):
                lines += [f"![{png.stem}]({_link(png)})", ""]
            if (part / "needle.json").is_file():
                summary.setdefault("needle", {})[f"{model_dir.name}/{part.name}"] = _link(part / "needle.json")
    if not found:
        lines += ["No runs yet: `STAGES=needle bash docs/long-context-reproduce.sh`.", ""]
    return lines


def select_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """``recommend --ctx 4096`` runs (stage select): where the 512-token winner ranks at 4k, and what ships."""
    lines = ["## Do the 512-token winners stay best at 4k? (`recommend --ctx 4096`, python-docs only)", ""]
    root = results / "select"
    found = False
    for path in sorted(root.glob("*/recommend-*-ctx4096.json")) if root.is_dir() else []:
        found = True
        model = path.parent.name
        run = json.loads(path.read_text())
        meta = run["meta"]
        shipped = {p["spec"] for p in model_presets().get(model, {"presets": {}})["presets"].values()}
        old = _winner_512(model, run["preset"])
        rows = sorted(run["results"], key=lambda r: r["kld_mean"])
        lines += [
            f"### {model}, {run['preset']}",
            "",
            f"{len(rows)} candidates on {meta['windows']} windows of {meta['ctx']} tokens of {meta['text']['name']} "
            f"(K mean from {(meta.get('calibration') or {}).get('text')}); winner `{run['winner']}`. "
            f"Code {meta['versions']['commit']}; CPU {meta.get('cpu', {}).get('model', '?')}.",
            "",
            "| rank | spec | bits/el | mean KLD | shipped | chosen at 512 |",
            "|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(rows, 1):
            mark = "yes" if r["codec"] in shipped else ""
            at512 = "yes" if r["codec"] == old else ""
            lines.append(
                f"| {i} | `{r['codec']}` | {r['bits_per_element']:.3f} | {r['kld_mean']:.4f} | {mark} | {at512} |"
            )
        summary.setdefault("select", {})[f"{model}/{run['preset']}"] = {
            "winner": run["winner"],
            "ranking": [(r["codec"], r["kld_mean"]) for r in rows],
        }
        lines.append("")
    if not found:
        lines += ["No runs yet: `STAGES=select bash docs/long-context-reproduce.sh`.", ""]
    return lines


_HOLDOUT_TEXTS = ("austen_persuasion", "austen_emma")


def _plain_selection(model: str, budget: str) -> tuple[str, float] | None:
    """The shipped plain preset's spec and selection KLD (model_presets.json: its recommend run's winner row)."""
    entry = model_presets().get(model, {}).get("presets", {}).get(f"walshkv:{budget}")
    if not entry or entry.get("selection_kld_mean") is None or entry.get("ctx") != 4096:
        return None
    return entry["spec"], entry["selection_kld_mean"]


def frame_select_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """Stage select-frame: each model's walshkv:B-fast ranked again with the block-frame twin (issue 35's rule)."""
    runs = sorted((results / "select").glob("*/recommend-*-fast-frame-ctx4096.json"))
    if not runs:
        return []
    lines = [
        "## The fast presets with K in the block frame (stage `select-frame`)",
        "",
        'The rule, written before these runs (presets.md, "K in the block frame"): today\'s `walshkv:B-fast`, the '
        "plain preset's `eqd+` twin and its block-frame twin (`ropeblock:64+eqr:64+`), ranked by `recommend --fast "
        "--only-candidates` on python-docs at 4096 tokens (2 windows); the lowest selection KLD ships. `plain` is the "
        "shipped `walshkv:B`'s own selection KLD on the same protocol (its 4k recommend run), for scale: "
        "`twin / plain` is what the block frame costs against the per-key map on the selection text.",
        "",
        "| model | preset | block-frame twin | eqd+ twin | today's fast spec | plain `walshkv:B` | twin / plain "
        "| ships |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in runs:
        run = json.loads(path.read_text())
        model = run["meta"]["model"]["name"]
        preset = run["preset"]
        budget = preset.removeprefix("walshkv:").removesuffix("-fast")
        rows = {r["codec"]: r["kld_mean"] for r in run["results"]}
        twin = next((k for k in rows if "ropeblock:" in k), None)
        eqd = next((k for k in rows if "eqd+" in k), None)
        other = [k for k in rows if k not in (twin, eqd)]
        plain = _plain_selection(model, budget)
        ratio = rows[twin] / plain[1] if twin and plain else None
        winner = "block frame" if run["winner"] == twin else "eqd+ twin" if run["winner"] == eqd else "today's"
        lines.append(
            f"| {model} | {preset} | {_fmt(rows.get(twin))} | {_fmt(rows.get(eqd))} | "
            f"{_fmt(rows[other[0]]) if other else '(the eqd+ twin)'} | {_fmt(plain[1]) if plain else '—'} | "
            f"{f'{ratio:.2f}' if ratio else '—'} | {winner} |"
        )
        summary.setdefault("select_frame", {})[f"{model}/{preset}"] = {
            "twin": rows.get(twin),
            "eqd_twin": rows.get(eqd),
            "plain": plain[1] if plain else None,
            "winner": run["winner"],
            "source": str(path.relative_to(results)),
        }
    metas = [json.loads(p.read_text())["meta"] for p in runs]
    commits = sorted({m.get("versions", {}).get("commit", "?") for m in metas})
    cpus = sorted({m.get("cpu", {}).get("model", "?") for m in metas})
    lines += ["", f"Code commit of these runs: {', '.join(commits)}; CPU: {', '.join(cpus)}.", ""]
    return lines


def fast_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """The fast presets (stages select-fast and fast): each next to its plain preset on the same windows."""
    lines = ["## The fast presets: what decoding without a per-key matrix costs (`recommend --fast`)", ""]
    found = False
    for model, entry in sorted(model_presets().items()):
        names = _name_of(model)
        fast = sorted(n for n in entry["presets"] if n.endswith("-fast"))
        if not fast:
            continue
        found = True
        hold = {t: {_label(r, names): r for r in _rows(results / "holdout" / model / t)} for t in _HOLDOUT_TEXTS}
        ctxs = (4096, 8192)
        kld = {c: {_label(r, names): r for r in _rows(results / "kld" / model / f"ctx{c}")} for c in ctxs}
        pers, emma = hold["austen_persuasion"], hold["austen_emma"]
        meta = next(iter(pers.values()))["_meta"] if pers else {}
        lines += [
            f"### {model}",
            "",
            "`walshkv:B-fast` is chosen like `walshkv:B` (`recommend --ctx 4096` on python-docs only) among the "
            "specs the fused kernels decode without a dense `head_dim x head_dim` map per cached key: K stored "
            "before RoPE with `eqd+` (the best diagonal transform, folded into the fast Walsh-Hadamard map) in "
            "place of `eq+`, or K in the block frame (`ropeblock:64+eqr:64+`: the query turned and mapped once per "
            "block of 64 keys; stage `select-frame`, the rule in presets.md). Speed: "
            '[performance.md](performance.md), section "The fast presets". Persuasion '
            "and Emma at 512 tokens: "
            f"{meta.get('windows', '?')} windows; Emma at 4k and 8k: the KLD table's windows. "
            "`fast - plain`: per-window paired bootstrap on Persuasion."
            + (
                f' On this model the naming rule (presets.md, "Which kind the plain name means") gives '
                f"{', '.join(f'`{n}`' for n in sorted(entry.get('names', {})))} to the block frame; the presets "
                "with the per-key map keep their specs as `walshkv:B-max`."
                if entry.get("names")
                else ""
            ),
            "",
            "| preset | spec | Persuasion KLD | fast - plain [95%] | Emma KLD at 512 | at 4096 | at 8192 |",
            "|---|---|---|---|---|---|---|",
        ]
        for key in fast:
            plain, name = _pair(model, key)
            diff, paired = "—", None
            if name in pers and plain in pers:
                paired = paired_difference(pers[name].get("window_kld_mean"), pers[plain].get("window_kld_mean"))
                if paired is not None:
                    mean, (lo, hi) = paired
                    diff = f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}]"
            for label, entry_key in ((plain, key.removesuffix("-fast")), (name, key)):
                spec = entry["presets"].get(entry_key, {}).get("spec", "?")
                p, e = pers.get(label), emma.get(label)
                cells = [
                    f"{_fmt(p['kld_mean'])}{_ci(p, 'kld_mean_ci95')}" if p else "—",
                    diff if label == name else "",
                    f"{_fmt(e['kld_mean'])}{_ci(e, 'kld_mean_ci95')}" if e else "—",
                    *(_fmt(kld[c][label]["kld_mean"]) if label in kld[c] else "—" for c in ctxs),
                ]
                lines.append(f"| {label} | `{spec}` | " + " | ".join(cells) + " |")
                numbers = {"persuasion": p and p["kld_mean"], "emma512": e and e["kld_mean"]}
                numbers |= {f"emma{c}": kld[c][label]["kld_mean"] for c in ctxs if label in kld[c]}
                if label == name and paired is not None:
                    numbers["persuasion_diff_vs_plain"] = {"mean": paired[0], "ci95": list(paired[1])}
                summary.setdefault("fast", {})[f"{model}/{label}"] = numbers
        lines.append("")
    if not found:
        lines += ['No fast preset ships yet: `STAGES="select-fast fast" bash docs/long-context-reproduce.sh`.', ""]
    return lines


def _persuasion_runs(root: Path) -> list[tuple[str, dict[str, Any], set[str], set[str], dict[str, Any]]]:
    """``(model, rows by label, commits, cpus, meta)`` of each model's Persuasion rows under ``root``."""
    out = []
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        model = model_dir.name
        pers = {_label(r, _name_of(model)): r for r in _rows(model_dir / "austen_persuasion")}
        if pers:
            commits, cpus = _provenance(list(pers.values()))
            out.append((model, pers, commits, cpus, next(iter(pers.values()))["_meta"]))
    return out


def fast_4k_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """Stage holdout-4k-fast: each block-frame preset against its plain preset on the same 4k holdout windows."""
    root = results / "holdout-4k-fast"
    if not root.is_dir():
        return []
    lines = ["### The fast presets on the holdout at 4,096 tokens (stage `holdout-4k-fast`)", ""]
    for model, pers, commits, cpus, meta in _persuasion_runs(root):
        lines += [
            f"**{model}**: {meta['windows']} windows of {meta['ctx']} tokens of Persuasion, second half scored; both "
            f"presets of a budget on the same windows in one run; code {', '.join(sorted(commits))}; CPU "
            f"{', '.join(sorted(cpus))}. Issue 35's quality target: the fast preset within the interval of the plain "
            "one, or better (`fast - plain`, paired per window: `tie` when the interval holds zero). These rows "
            "choose nothing.",
            "",
            "| budget | with the per-key map (`walshkv:B` or `-max`) KLD [95%] | block frame (`walshkv:B-fast`, or "
            "`walshkv:B` where the naming rule moved it) KLD [95%] | fast - plain [95%] | fast / plain | verdict |",
            "|---|---|---|---|---|---|",
        ]
        verdicts = {}
        keys = [k for k in model_presets().get(model, {}).get("presets", {}) if k.endswith("-fast")]
        for key in sorted(keys, key=lambda k: float(k.split(":")[1].removesuffix("-fast"))):
            plain, fast = _pair(model, key)
            if plain not in pers or fast not in pers:
                continue
            judged = _judge(pers[fast], pers[plain])
            if judged is None:
                continue
            mean, lo, hi, verdict = judged
            word = {"met": "fast better", "missed": "fast trails", "undecided": "tie"}[verdict]
            ratio = pers[fast]["kld_mean"] / pers[plain]["kld_mean"]
            budget = key.split(":")[1].removesuffix("-fast")
            lines.append(
                f"| {budget} | {_fmt(pers[plain]['kld_mean'])}{_ci(pers[plain], 'kld_mean_ci95')} | "
                f"{_fmt(pers[fast]['kld_mean'])}{_ci(pers[fast], 'kld_mean_ci95')} | "
                f"{mean:+.4f} [{lo:+.4f}, {hi:+.4f}] | {ratio:.2f} | {word} |"
            )
            verdicts[key] = {"name": fast, "diff": mean, "ci95": [lo, hi], "ratio": ratio, "verdict": word}
        summary.setdefault("fast_4k", {})[model] = verdicts
        lines.append("")
    return lines


def _frames(spec: str) -> tuple[str, str]:
    """(where a K spec's codes are, where its mean is taken) for the frame probe's specs."""
    k = spec.split(":", 2)[-1] if spec.startswith("sink:") else spec
    k = k.split("/")[0]
    if k.startswith("ropecenter"):
        pairs = k.split("+")[0].partition(":")[2]
        return "after RoPE", "before RoPE, turned to each position" + (f" ({pairs} pairs kept)" if pairs else "")
    if k.startswith("prerope+center"):
        return "before RoPE", "before RoPE"
    return "after RoPE", "after RoPE"


def frame_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """The frame probe (stage frame): which frame of ``prerope+center+`` keeps K's error flat with context."""
    lines = ["## Which frame holds with context: the codes' or the mean's? (stage frame, Emma)", ""]
    runs = {}
    for path in sorted((results / "frame").glob("smollm2-135m-ctx*.json")) if (results / "frame").is_dir() else []:
        run = json.loads(path.read_text())
        runs[int(run["meta"]["ctx"])] = run
    if not runs:
        return [*lines, "No runs yet: `STAGES=frame bash docs/long-context-reproduce.sh`.", ""]
    ctxs = sorted(runs)
    first = runs[ctxs[0]]
    lines += [
        "`research/scripts/ropecenter_probe.py` adds one K wrapper for this measurement, `ropecenter+`: K is stored",
        "after RoPE, minus the calibrated pre-RoPE K mean turned to each key's position (the residual is",
        "`prerope+center+`'s turned by RoPE). smollm2-135m, V `tq:4`, one sink token, K mean from python-docs; "
        + _windows_code_cpu(runs, [first["meta"]["versions"]["commit"]])
        + ".",
        "",
        "| K spec | codes stored | mean taken | "
        + " | ".join(f"mean KLD at {c}" for c in ctxs)
        + " | "
        + " | ".join(f"top-1 at {c}" for c in ctxs)
        + " |",
        "|---|---|---|" + "---|" * (2 * len(ctxs)),
    ]
    by_codec = {c: {r["codec"]: r for r in runs[c]["results"]} for c in ctxs}
    for r in first["results"]:
        codes, mean = _frames(r["codec"])
        cells = [by_codec[c].get(r["codec"]) for c in ctxs]
        kld = [(_fmt(x["kld_mean"]) + _ci(x, "kld_mean_ci95")) if x else "—" for x in cells]
        top = [f"{100 * x['top1_agreement']:.1f}%" if x else "—" for x in cells]
        lines.append(f"| `{r['codec']}` | {codes} | {mean} | " + " | ".join(kld + top) + " |")
        klds = {c: (x or {}).get("kld_mean") for c, x in zip(ctxs, cells, strict=True)}
        summary.setdefault("frame", {})[r["codec"]] = klds
    return [*lines, ""]


def _map_cost(spec: str) -> str:
    """What a decode step does per cached key for a K spec of the block-frame stage."""
    k = (spec.split(":", 2)[-1] if spec.startswith("sink:") else spec).split("/")[0]
    if k.startswith(("blockrope:", "blockropec:")):
        g = int(k.split("+")[0].partition(":")[2])
        if k.startswith("blockropec:"):
            return f"one bias product (head_dim); the query mapped once per block of {g} keys"
        return f"none: the query mapped once per block of {g} keys"
    if "+eqd+" in k:
        return "a fast Walsh-Hadamard transform, RoPE"
    if "+eq+" in k:
        return "a dense head_dim x head_dim map, RoPE"
    return "?"


def _windows_code_cpu(runs: dict[int, Any], commits: list[str]) -> str:
    """``N windows of C tokens, ...; Code X; CPU Y (ISA)`` for runs keyed by context length."""
    first = runs[min(runs)]["meta"]
    cpu = first.get("cpu", {})
    return (
        ", ".join(f"{runs[c]['meta']['windows']} windows of {c} tokens" for c in sorted(runs))
        + f". Code {', '.join(commits)}; CPU {cpu.get('model', '?')} ({cpu.get('capability', '?')})"
    )


def frame_blockrope_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """The block frame (stage frame-blockrope): eq+'s quality with the query folded once per block, and its speed."""
    lines = ["## K in the block frame: eq+ with the query mapped once per block (stage frame-blockrope, Emma)", ""]
    folder = results / "frame-blockrope"
    runs = {}
    paths = sorted(folder.glob("emma-*.json"), key=lambda p: (len(p.stem), p.stem)) if folder.is_dir() else []
    for path in paths:  # emma-CTX.json first, then emma-CTX-*.json
        run = json.loads(path.read_text())
        ctx = int(run["meta"]["ctx"])
        if ctx in runs:  # more rows at the same length (the same windows: paired with the eq+ row)
            runs[ctx] = {**runs[ctx], "results": runs[ctx]["results"] + run["results"]}
        else:
            runs[ctx] = run
    if not runs:
        return [*lines, "No runs yet: `STAGES=frame-blockrope bash docs/long-context-reproduce.sh`.", ""]
    ctxs = sorted(runs)
    first = runs[ctxs[0]]
    commits = sorted({json.loads(p.read_text())["meta"]["versions"]["commit"] for p in paths})
    lines += [
        "`prerope+` stores K before RoPE, so each decode step turns every cached key to its position, and with",
        "`eq+` maps it by a dense `head_dim x head_dim` matrix first: the per-key map that caps the presets' speed",
        "(issue 35). `research/scripts/ropecenter_probe.py` adds `blockrope:G+`: a key at position `p` is turned back",
        "only by its block's first position `p0 = G floor(p / G)` (inside a block it keeps RoPE's turn by its offset),",
        "minus the pre-RoPE mean turned and averaged over a block's offsets; `eqr:G+` is `eq+` fitted to K and query",
        "moments averaged over those `G` offsets (`blockrope:1+eqr:1+` is `prerope+center+eq+`, bit for bit). The",
        "score is `(A⁻ᵀ R(p0)ᵀ q) · codes + (R(p0)ᵀ q) · mean`: the query is turned and mapped once per block and",
        "query head, and each key is scored as a K stored after RoPE is. `blockropec:G+` subtracts the mean turned",
        "to each key's own offset `j` instead (`R(j) mu`, exact centring): its score term `(R(p0)ᵀ q) · R(j) mu` is",
        "`(A⁻ᵀ R(p0)ᵀ q) · A R(j) mu`: the kernel adds row `j` of a `G x head_dim` table (`A R(j) mu`) to each",
        "decoded key before scoring it, one add per element and kv head. smollm2-135m, K `tcq:3.5`, V `tcq:3` (norm=8,",
        "table set 2), one sink token, calibration from python-docs; "
        + _windows_code_cpu(runs, commits)
        + ". `- eq+`: paired per-window difference from the `eq+` row (bootstrap, 95%), where a run has 3 windows "
        "or more.",
        "",
        "| K spec | per cached key, each step | "
        + " | ".join(f"mean KLD at {c} | - eq+ at {c}" for c in ctxs)
        + " | "
        + " | ".join(f"top-1 at {c}" for c in ctxs)
        + " |",
        "|---|---|" + "---|---|" * len(ctxs) + "---|" * len(ctxs),
    ]
    by_codec = {c: {r["codec"]: r for r in runs[c]["results"]} for c in ctxs}
    eq_row = {c: next((r for r in runs[c]["results"] if "prerope+center+eq+" in r["codec"]), None) for c in ctxs}
    for r in first["results"]:
        cells = []
        for c in ctxs:
            x = by_codec[c].get(r["codec"])
            if x is None:
                cells += ["—", ""]
                continue
            judged = None if eq_row[c] is None or x is eq_row[c] else _judge(x, eq_row[c])
            diff = "" if judged is None else f"{judged[0]:+.4f} [{judged[1]:+.4f}, {judged[2]:+.4f}]"
            if judged is not None and runs[c]["meta"]["windows"] < 3:  # too few windows for a paired interval
                diff = f"{judged[0]:+.4f} ({runs[c]['meta']['windows']} windows: no interval)"
            cells += [_fmt(x["kld_mean"]) + _ci(x, "kld_mean_ci95"), diff]
        top = [(lambda x: f"{100 * x['top1_agreement']:.1f}%" if x else "—")(by_codec[c].get(r["codec"])) for c in ctxs]
        lines.append(f"| `{r['codec']}` | {_map_cost(r['codec'])} | " + " | ".join(cells + top) + " |")
        summary.setdefault("frame_block", {})[r["codec"]] = {
            c: (by_codec[c].get(r["codec"]) or {}).get("kld_mean") for c in ctxs
        }
    lines.append("")
    groups: dict[tuple[str, int, int], list[tuple[dict[str, Any], dict[str, Any]]]] = {}
    for path in sorted(folder.glob("*-emma-*.json"), key=lambda p: (len(p.stem), p.stem)):  # MODEL-emma-CTX first
        run = json.loads(path.read_text())
        meta = run["meta"]
        name = meta["model"]["name"] if isinstance(meta["model"], dict) else meta["model"]
        key = (name, int(meta["ctx"]), int(meta["windows"]))  # rows of the same windows are paired across files
        groups.setdefault(key, []).extend((meta, r) for r in run["results"])
    if groups:
        lines += [
            "The same frames on the other models (Emma, one sink token, calibration from python-docs; qwen2.5-1.5b at",
            "3 bits, K `tcq:3` and V `tcq:2.5`, its llama.cpp K types' standing test; gemma3-270m, head_dim 256, at",
            "3.5 bits as above). `- eq+` as above.",
            "",
            "| model | tokens x windows | K spec | per cached key, each step | mean KLD | - eq+ | top-1 | code, CPU |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for (name, ctx, windows), rows in sorted(groups.items()):
            eq = next((r for _, r in rows if "prerope+center+eq+" in r["codec"]), None)
            for meta, r in rows:
                judged = None if eq is None or r is eq else _judge(r, eq)
                diff = "" if judged is None else f"{judged[0]:+.4f} [{judged[1]:+.4f}, {judged[2]:+.4f}]"
                if judged is not None and windows < 3:
                    diff = f"{judged[0]:+.4f} ({windows} windows: no interval)"
                lines.append(
                    f"| {name} | {ctx} x {windows} | `{r['codec']}` | {_map_cost(r['codec'])} "
                    f"| {_fmt(r['kld_mean'])}{_ci(r, 'kld_mean_ci95')} | {diff} | {100 * r['top1_agreement']:.1f}% | "
                    f"{meta['versions']['commit']}, {meta.get('cpu', {}).get('capability', '?')} |"
                )
                summary.setdefault("frame_block_models", {}).setdefault(name, {})[f"{r['codec']}@{ctx}"] = r["kld_mean"]
        lines.append("")
    speeds = sorted(  # by head_dim (smollm2-135m's shapes first), the CPU's own build before another -march
        (json.loads(p.read_text()) for p in folder.glob("speed-*.json")),
        key=lambda r: (r["meta"]["shapes"]["head_dim"], r["meta"].get("march", "native") != "native"),
    )
    if speeds:
        meta = speeds[0]["meta"]
        lines += [
            f"Decode speed (`{meta['command']}`, and the same for each model's attention shapes; code {meta['code']}; "
            f"CPU {meta['cpu'].get('model', '?')} ({meta['cpu'].get('capability', '?')}), {meta['threads']} threads): "
            f"one step over random K/V, K `{meta['k_codec']}`, V `{meta['v_codec']}`. `post-RoPE`: the same codecs "
            "read with one query (no per-block fold: the frame's upper bound); `blockrope:G`: the query turned back "
            "and mapped per block in one torch product (`eq+`'s inverse and the codec's rotations folded together), "
            "then one fused-kernel call that scores each block of keys against its own query (`query_block`), each "
            "decoded key plus its offset's row of a `G x head_dim` table in the codes' basis (`key_table`: `A` times "
            "the block's mean in every row); `blockropec:G`: the table holds `A` times the mean turned to each offset "
            "(each row checked against attention over the decoded keys turned to their positions: `max abs err`). "
            "Ratios against the fastest SDPA of the same rounds.",
            "",
            "| model (head_dim, kv heads, GQA) | kv_len | method | ms/step | x fastest SDPA | GB/s | max abs err |",
            "|---|---|---|---|---|---|---|",
        ]
        for sp in speeds:
            sh = sp["meta"]["shapes"]
            march = sp["meta"].get("march", "native")
            model = f"{sp['meta']['model']} ({sh['head_dim']}, {sh['kv_heads']}, {sh['q_heads'] // sh['kv_heads']})" + (
                "" if march == "native" else f", kernel built with -march={march}"
            )
            for r in sp["rows"]:
                err = "" if r.get("max_abs_err") is None else f"{r['max_abs_err']:.1e}"
                lines.append(
                    f"| {model} | {r['kv_len']:,} | {r['method']} | {r['ms']:.3f} | "
                    f"{r['speedup_vs_best_sdpa']:.2f} | {r['gb_per_s']:.1f} | {err} |"
                )
                summary.setdefault("frame_block_speed", {}).setdefault(sp["meta"]["model"], {})[
                    f"{r['method']}@{r['kv_len']}"
                ] = r["speedup_vs_best_sdpa"]
        lines.append("")
    benches = [json.loads(p.read_text()) for p in folder.glob("bench-presets-*/bench.json")]
    benches.sort(key=lambda b: b["meta"].get("attention_model", {}).get("head_dim", 0))
    if benches:
        machine = benches[0]["meta"]["machine"]
        lines += [
            "Each model's shipped 3.5-bit spec (smollm2-135m's fast twin too) and the same codes after RoPE in "
            "walshkv's own bench (`" + benches[0]["meta"]["command"] + "`, the same for each model; its own SDPA "
            f"rounds; code {machine['commit']}; CPU {machine['cpu']} ({machine['cpu_capability']}), "
            f"{machine['torch_threads']} threads):",
            "",
            "| model | kv_len | method | spec | ms/step | x fastest SDPA | GB/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in benches:
            model = b["meta"].get("attention_model", {}).get("model", "?")
            for r in b["attention"]:
                if r["method"].startswith("sdpa"):
                    continue
                spec = r.get("spec") or ""
                lines.append(
                    f"| {model} | {r['kv_len']:,} | {r['method']} | {f'`{spec}`' if spec else ''} | {r['ms']:.3f} | "
                    f"{r['speedup_vs_best_sdpa']:.2f} | {r['gb_per_s']:.1f} |"
                )
        lines.append("")
    return lines


def _judge(row: dict[str, Any], peer: dict[str, Any]) -> tuple[float, float, float, str] | None:
    """``row - peer`` over their paired windows: mean, 95% interval and verdict (met: the interval below zero,
    missed: above, else undecided), or None when the two rows share no windows."""
    paired = paired_difference(row.get("window_kld_mean"), peer.get("window_kld_mean"))
    if paired is None:
        return None
    mean, (lo, hi) = paired
    return mean, lo, hi, "met" if hi < 0 else "missed" if lo > 0 else "undecided"


def holdout_section(results: Path, summary: dict[str, Any]) -> list[str]:
    lines = ["## The frozen holdout: Persuasion next to Emma", ""]
    root = results / "holdout"
    if not root.is_dir():
        return [*lines, "No runs yet: `STAGES=holdout bash docs/long-context-reproduce.sh`.", ""]
    for model_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        model = model_dir.name
        names = _name_of(model)
        texts = {d.name: {_label(r, names): r for r in _rows(d)} for d in sorted(model_dir.iterdir()) if d.is_dir()}
        emma, pers = texts.get("austen_emma", {}), texts.get("austen_persuasion", {})
        if not pers:
            continue
        commits, cpus = _provenance([*emma.values(), *pers.values()])
        meta = next(iter(pers.values()))["_meta"]
        lines += [f"### {model}", ""]
        builtin = (
            " No selected presets: the `walshkv:B` rows are the built-in specs any model walshkv has not measured "
            "gets (calibrated on python-docs in the run), not specs chosen for this model."
            if model not in model_presets()
            else ""
        )
        lines.append(
            f"{meta['windows']} windows of {meta['ctx']} tokens per text, second half scored; 95% intervals: "
            "percentile bootstrap over windows (2,000 resamples). "
            f"Code {', '.join(sorted(commits))}; CPU {', '.join(sorted(cpus))}.{builtin}"
        )
        lines += [
            "",
            "| codec | bits/el | Emma KLD | Emma top-1 % | Persuasion KLD | Persuasion top-1 % |",
            "|---|---|---|---|---|---|",
        ]
        order = sorted(pers, key=lambda k: -pers[k]["bits_per_element"])
        for label in order:
            p = pers[label]
            e = emma.get(label)
            lines.append(
                f"| {label} | {p['bits_per_element']:.3f} | "
                + (f"{_fmt(e['kld_mean'])}{_ci(e, 'kld_mean_ci95')}" if e else "—")
                + " | "
                + (f"{_fmt(100 * e['top1_agreement'], 2)}{_ci(e, 'top1_ci95', 2, 100)}" if e else "—")
                + f" | {_fmt(p['kld_mean'])}{_ci(p, 'kld_mean_ci95')} | "
                + f"{_fmt(100 * p['top1_agreement'], 2)}{_ci(p, 'top1_ci95', 2, 100)} |"
            )
        lines += ["", "Targets, judged on Persuasion (preset minus peer, per-window paired bootstrap):", ""]
        lines += [
            "| target | preset | bits/el | peer | bits/el | KLD difference [95%] | verdict |",
            "|---|---|---|---|---|---|---|",
        ]
        verdicts = []
        for kind, preset, peers in [*TARGETS, *_select_targets(results, model), *_reselection_targets(results, model)]:
            if preset not in pers:
                continue
            for peer in peers:
                if peer not in pers:
                    continue
                judged = _judge(pers[preset], pers[peer])
                if judged is None:
                    continue
                mean, lo, hi, verdict = judged
                verdicts.append(
                    {"target": kind, "preset": preset, "peer": peer, "diff": mean, "ci95": [lo, hi], "verdict": verdict}
                )
                pb, qb = pers[preset]["bits_per_element"], pers[peer]["bits_per_element"]
                lines.append(
                    f"| {kind} | {preset} | {pb:.3f} | {peer} | {qb:.3f} | {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] | "
                    f"{verdict} |"
                )
        summary.setdefault("holdout", {})[model] = {
            "persuasion": {
                k: {kk: v.get(kk) for kk in ("kld_mean", "kld_mean_ci95", "top1_agreement", "top1_ci95")}
                for k, v in pers.items()
            },
            "emma": {
                k: {kk: v.get(kk) for kk in ("kld_mean", "kld_mean_ci95", "top1_agreement", "top1_ci95")}
                for k, v in emma.items()
            },
            "verdicts": verdicts,
        }
        lines.append("")
    return lines


def holdout_4k_section(results: Path, summary: dict[str, Any]) -> list[str]:
    """The moonshot targets on Persuasion at 4,096 tokens (stage holdout-4k), per model that has the run."""
    root = results / "holdout-4k"
    if not root.is_dir():
        return []
    lines = ["### The targets at 4,096 tokens (Persuasion)", ""]
    for model, pers, commits, cpus, meta in _persuasion_runs(root):
        lines += [
            f"**{model}**: {meta['windows']} windows of {meta['ctx']} tokens of Persuasion, second half scored "
            f"(stage `holdout-4k`); code {', '.join(sorted(commits))}; CPU {', '.join(sorted(cpus))}.",
            "",
            "| codec | bits/el | KLD [95%] | top-1 % [95%] |",
            "|---|---|---|---|",
        ]
        for label in sorted(pers, key=lambda k: -pers[k]["bits_per_element"]):
            p = pers[label]
            lines.append(
                f"| {label} | {p['bits_per_element']:.3f} | {_fmt(p['kld_mean'])}{_ci(p, 'kld_mean_ci95')} | "
                f"{_fmt(100 * p['top1_agreement'], 2)}{_ci(p, 'top1_ci95', 2, 100)} |"
            )
        lines += [
            "",
            "| target | preset | peer | KLD difference [95%, paired over windows] | verdict |",
            "|---|---|---|---|---|",
        ]
        verdicts = []
        for kind, preset, peers in TARGETS:
            if kind != "moonshot" or preset not in pers:
                continue
            for peer in peers:
                judged = _judge(pers[preset], pers.get(peer) or {})
                if judged is None:
                    continue
                mean, lo, hi, verdict = judged
                verdicts.append({"preset": preset, "peer": peer, "diff": mean, "ci95": [lo, hi], "verdict": verdict})
                lines.append(f"| {kind} | {preset} | {peer} | {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] | {verdict} |")
        summary.setdefault("holdout_4k", {})[model] = verdicts
        lines.append("")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(ROOT / "docs" / "results" / "long-context"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "long-context.md"))
    ap.add_argument(
        "--intro",
        default=str(ROOT / "docs" / "long-context.intro.md"),
        help="hand-written protocol and findings, pasted above the generated sections",
    )
    ap.add_argument(
        "--outro",
        default=str(ROOT / "docs" / "long-context.outro.md"),
        help="hand-written closing section (what was and was not run), pasted at the end",
    )
    args = ap.parse_args()
    global PAGE_DIR
    PAGE_DIR = Path(args.out).resolve().parent
    results = Path(args.results).resolve()
    summary: dict[str, Any] = {}
    intro = Path(args.intro)
    lines = [intro.read_text().rstrip(), ""] if intro.is_file() else ["# Long context", ""]
    lines.append("<!-- generated by scripts/long_context_report.py from docs/results/long-context: do not edit -->")
    lines.append("")
    lines += kld_section(results, results, summary)
    lines += select_section(results, summary)
    lines += frame_section(results, summary)
    lines += frame_blockrope_section(results, summary)
    lines += frame_select_section(results, summary)
    lines += fast_section(results, summary)
    lines += fast_4k_section(results, summary)
    lines += needle_section(results, summary)
    lines += holdout_section(results, summary)
    lines += holdout_4k_section(results, summary)
    outro = Path(args.outro)
    if outro.is_file():
        lines += [outro.read_text().rstrip(), ""]
    Path(args.out).write_text("\n".join(lines).rstrip() + "\n")
    (results / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"wrote {args.out} and {results / 'summary.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
