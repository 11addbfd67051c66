#!/usr/bin/env python3
"""Write src/walshkv/model_presets.json: each known model's measured preset specs, with their provenance.

The specs come from the `walshkv recommend` runs under docs/results/presets/MODEL/recommend-B.json
(``scripts/presets-reproduce.sh`` makes them, at 512 tokens) and docs/results/long-context/select/MODEL/
recommend-B-ctxN.json (``docs/long-context-reproduce.sh`` stage ``select``, at N tokens); selection on python-docs
only, never on Emma or Persuasion. Where a preset was selected at more than one context, the longest one ships:
users compress caches for long prompts, and docs/long-context.md shows a 512-token winner degrading with context.
At the same context, the later run (its meta.date) ships: a re-selection, such as docs/trellis-reproduce.sh's
(the shipped spec against its tcq twins), replaces the run before it.
A re-selection whose rule is a tolerance rather than the lower KLD (:data:`TWIN_RULES`: table set 4's twins,
docs/trellis.md, "Set 4 in the presets") ships its twin when the twin's selection KLD is within the tolerance of the
shipped spec's in that run, whichever recommend ranked first.
Nothing is typed by hand: rerun this script after a new recommend run and commit both.

Names (docs/presets.md, "Which kind the plain name means"): each entry is keyed by how it was selected
(``walshkv:B`` with no limit on decode work, ``walshkv:B-fast`` without a dense per-key map), and ``names`` maps
``walshkv:B`` to ``walshkv:B-fast`` where the naming rule holds: (1) the fast entry's spec decodes attention at
least 2.5x the fastest SDPA at 16k and 64k in every per-model speed block that measured that spec
(docs/results/bench-model-MODEL*/bench.json, each run with the fused kernel built for the CPU it ran on: a
stand-in build for another instruction set, WALSHKV_CPU_MARCH, is reported in docs/performance.md but judges nothing;
none measured: not met), (2) its selection KLD at 4096 tokens is at
most 1.10x the plain entry's, also at 4096 tokens. The rule's third condition (the vLLM plugin holds it wherever it
holds the plain one) is a test of the plugin (plugins/vllm/tests/test_plugin_presets.py). ``naming`` records the
evidence for every budget, met or not.

    python scripts/ship_presets.py            # write the file
    python scripts/ship_presets.py --check    # exit 1 if the file is out of date (the tests run this)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results" / "presets"
LONG = ROOT / "docs" / "results" / "long-context" / "select"
OUT = ROOT / "src" / "walshkv" / "model_presets.json"
SHAPE_KEYS = ("arch", "layers", "q_heads", "kv_heads", "head_dim", "params")
BENCH = ROOT / "docs" / "results"
#: The naming rule's bounds: decode attention against the fastest SDPA (at each of these contexts), and the fast
#: entry's selection KLD against the plain entry's at the rule's selection context.
NAMING_SPEED, NAMING_CTXS, NAMING_KLD_RATIO, NAMING_SELECT_CTX = 2.5, (16384, 65536), 1.10, 4096


def _speed_rows(model: str, spec: str) -> list[tuple[str, int, float]]:
    """``(block, kv_len, x vs fastest SDPA)`` of every per-model speed block row that measured ``spec``."""
    rows = []
    for path in sorted(BENCH.glob(f"bench-model-{model}*/bench.json")):
        run = json.loads(path.read_text())
        if run["meta"]["machine"].get("kernel_march", "native") != "native":
            continue  # another ISA's code on this CPU (WALSHKV_CPU_MARCH): a stand-in, reported, not judged
        for r in run.get("attention", []):
            if r.get("spec") == spec and r.get("kv_len") in NAMING_CTXS:
                rows.append((path.parent.name, int(r["kv_len"]), float(r["speedup_vs_best_sdpa"])))
    return rows


def naming(model: str, presets: dict[str, dict]) -> tuple[dict[str, str], dict[str, dict]]:
    """``(names, evidence)``: the plain names the naming rule moves to the fast entries, and the rule's numbers for
    every budget with both entries (see the module docstring)."""
    names, evidence = {}, {}
    for plain, entry in sorted(presets.items()):
        fast = presets.get(f"{plain}-fast")
        if plain.endswith("-fast") or fast is None:
            continue
        speed = _speed_rows(model, fast["spec"])
        measured = {ctx for _, ctx, _ in speed}
        speed_met = measured == set(NAMING_CTXS) and all(x >= NAMING_SPEED for _, _, x in speed)
        ratio = None
        if (
            entry.get("ctx") == fast.get("ctx") == NAMING_SELECT_CTX
            and entry.get("selection_kld_mean")
            and fast.get("selection_kld_mean") is not None
        ):
            ratio = fast["selection_kld_mean"] / entry["selection_kld_mean"]
        quality_met = ratio is not None and ratio <= NAMING_KLD_RATIO
        evidence[plain] = {
            "speed": [{"block": b, "kv_len": c, "x_vs_fastest_sdpa": round(x, 4)} for b, c, x in speed],
            "speed_met": speed_met,
            "selection_kld_ratio": None if ratio is None else round(ratio, 4),
            "selection_met": quality_met,
            "plain_name_is_fast": speed_met and quality_met,
        }
        if speed_met and quality_met:
            names[plain] = f"{plain}-fast"
    return names, evidence


def _commit_of(path: Path) -> str | None:
    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%h", "--", str(path)], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return out or None


#: Re-selections judged by a tolerance (docs/trellis.md): the run file's tag, the part of a spec that marks the twin,
#: and the most selection KLD the twin may cost, as a ratio to the shipped spec's in the same run
TWIN_RULES: dict[str, tuple[str, float]] = {"-t4-": ("tables=4", 1.01)}


def winner(path: Path, run: dict) -> str:
    """The spec a recommend run ships: its winner, or, for a run under :data:`TWIN_RULES`, the twin when its KLD is
    within the rule's tolerance of the other candidate's."""
    for tag, (mark, tolerance) in TWIN_RULES.items():
        if tag not in path.name:
            continue
        twins = [r for r in run["results"] if mark in r["codec"]]
        others = [r for r in run["results"] if mark not in r["codec"]]
        if len(twins) != 1 or len(others) != 1:
            raise SystemExit(
                f"{path}: a {tag.strip('-')} run ranks one shipped spec and its twin (a spec with {mark!r}); it "
                f"holds {len(others)} and {len(twins)}"
            )
        twin, shipped = twins[0], others[0]
        return twin["codec"] if twin["kld_mean"] <= tolerance * shipped["kld_mean"] else shipped["codec"]
    return run["winner"]


def build() -> dict:
    models: dict[str, dict] = {}
    runs = [(path, json.loads(path.read_text())) for path in sorted(RESULTS.glob("*/recommend-*.json"))]
    runs += [(path, json.loads(path.read_text())) for path in sorted(LONG.glob("*/recommend-*-ctx*.json"))]
    # a longer context's selection wins; at the same context, the later run
    for path, run in sorted(runs, key=lambda pr: (pr[1]["meta"]["ctx"], pr[1]["meta"].get("date") or "")):
        meta = run["meta"]
        model = meta["model"]
        name = model["name"]
        preset = run["preset"]
        chosen = winner(path, run)
        best = next((r for r in run["results"] if r["codec"] == chosen), None)
        entry = models.setdefault(name, {"shape": {k: model[k] for k in SHAPE_KEYS}, "presets": {}})
        if entry["shape"] != {k: model[k] for k in SHAPE_KEYS}:
            raise SystemExit(f"{path}: model {name} has another shape than its other recommend runs")
        entry["presets"][preset] = {
            "spec": chosen,
            "selected_on": meta["text"]["name"],
            "calibrated_on": (meta.get("calibration") or {}).get("text"),
            "ctx": meta["ctx"],
            "windows": meta["windows"],
            "selection_kld_mean": None if best is None else best["kld_mean"],
            "bits_per_element": None if best is None else best["bits_per_element"],
            "candidates": len(run["results"]),
            "per_layer": "per_layer" in run,
            "source": str(path.relative_to(ROOT)),
            "source_commit": _commit_of(path),
            "date": meta.get("date"),
        }
    for name, entry in models.items():
        names, evidence = naming(name, entry["presets"])
        entry["names"] = names
        entry["naming"] = evidence
    return {
        "format": 1,
        "about": "measured preset specs per model, written by scripts/ship_presets.py from docs/results/presets and "
        "docs/results/long-context/select (the longest selection context wins), with the names the naming rule "
        "gives them (docs/presets.md); walshkv.presets.resolve_preset reads it",
        "models": models,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the shipped file differs (source_commit ignored)")
    args = ap.parse_args()
    data = build()
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    if args.check:
        old = json.loads(OUT.read_text()) if OUT.exists() else None

        def strip(d: dict | None) -> object:
            if d is None:
                return None
            return {
                m: (
                    {p: {k: v for k, v in e.items() if k != "source_commit"} for p, e in md["presets"].items()},
                    md.get("names"),
                    md.get("naming"),
                )
                for m, md in d["models"].items()
            }

        if strip(old) != strip(data):
            print(f"{OUT} is out of date: run python scripts/ship_presets.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    counts = ", ".join(
        f"{m} ({len(e['presets'])} presets; plain names on the fast entry: {', '.join(e['names']) or 'none'})"
        for m, e in data["models"].items()
    )
    print(f"wrote {OUT.relative_to(ROOT)}: {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
