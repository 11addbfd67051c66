#!/usr/bin/env python3
"""Intervals for the engine-peer tables: each row's mean KLD with its 95% window-bootstrap interval, and each
engine cache paired with ``walshkv:4.5`` on the same windows.

Usage:
    python scripts/peer_intervals.py [RESULT.json ...] [--out FILE.md]

Reads ``walshkv eval --json`` files (default: every ``docs/results/vllm-peers/*.json``, which
``scripts/vllm-peers-reproduce.sh`` writes), computes nothing new from the model: the intervals come from each row's
per-window means, stored in the file (:func:`walshkv.eval.metrics.bootstrap_ci95`, windows resampled, 2,000 draws,
seed 0). The paired column is the mean over windows of (engine row's KLD − ``walshkv:4.5``'s KLD) with its bootstrap
interval: above zero means the preset is better on these windows, and an interval that excludes zero makes that a
verdict for this text. The comparison row is fixed in advance (``walshkv:4.5``, the preset of the most bits, still
fewer than any engine cache's), not chosen by the result. With 2 windows a bootstrap interval is only the spread of
two means: read those rows as indicative.

Writes the markdown (default ``docs/results/vllm-peers/intervals.md``); ``scripts/update_readme.py`` pastes it into
docs/serving.md and docs/baselines.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from walshkv.eval.metrics import paired_difference

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "docs" / "results" / "vllm-peers"
ANCHOR = "walshkv:4.5"


def _name(row: dict) -> str:
    return str(row.get("preset") or row["codec"])


def _ci(lo_hi: list[float], fmt: str = "{:.4f}") -> str:
    lo, hi = lo_hi
    return "—" if lo != lo or hi != hi else f"[{fmt.format(lo)}, {fmt.format(hi)}]"


def table(path: Path) -> str:
    """One result file's rows with intervals, as markdown under a heading naming the model and convention."""
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["results"]
    model = meta["model"]["name"] if isinstance(meta.get("model"), dict) else meta.get("model")
    anchor = next((r for r in rows if _name(r) == ANCHOR), None)
    windows = meta.get("windows")
    convention = "exact prefill (the engines' convention)" if path.stem.endswith("-exact") else "quantize on write"
    lines = [
        f"#### {model}, {convention} ({windows} windows of {meta.get('ctx')} tokens, "
        f"{meta.get('scored_tokens'):,} scored; {path.name}, code {meta.get('versions', {}).get('commit', '?')})",
        "",
        f"| cache | bits/el | mean KLD | 95% interval | same top-1 % | KLD − {ANCHOR} | 95% interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = _name(r)
        if name == "fp16":
            continue
        pair = (
            None
            if anchor is None or r is anchor
            else paired_difference(r["window_kld_mean"], anchor["window_kld_mean"])
        )
        diff, dci = ("", "") if pair is None else (f"{pair[0]:+.4f}", _ci(pair[1], "{:+.4f}"))
        lines.append(
            f"| {name} | {r['bits_per_element']:.2f} | {r['kld_mean']:.4f} | {_ci(r['kld_mean_ci95'])} | "
            f"{r['top1_agreement']:.1%} | {diff} | {dci} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="walshkv eval --json files (default: docs/results/vllm-peers)")
    ap.add_argument("--out", type=Path, default=PEERS / "intervals.md")
    args = ap.parse_args()
    order = ("smollm2-135m-quantized", "smollm2-135m-exact", "gemma3-270m", "qwen2.5-1.5b", "lmcache")
    files = args.files or sorted(
        PEERS.glob("*.json"), key=lambda p: next((i for i, o in enumerate(order) if p.stem.startswith(o)), 99)
    )
    if not files:
        raise SystemExit(f"no result files under {PEERS}: run scripts/vllm-peers-reproduce.sh first")
    for f in files:
        if not f.is_file():
            raise SystemExit(f"{f} does not exist; pass walshkv eval --json files")
    body = "\n\n".join(table(f) for f in files)
    note = (
        "Produced by `python scripts/peer_intervals.py` from the result files above (no new model runs): intervals "
        "are 95% bootstraps over windows (2,000 draws, seed 0); the paired column is each cache's KLD minus "
        f"`{ANCHOR}`'s on the same windows (above zero: the preset is better). With 2 windows (qwen2.5-1.5b) an "
        "interval is the spread of two window means: indicative only."
    )
    args.out.write_text(note + "\n\n" + body + "\n")
    print(args.out.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
