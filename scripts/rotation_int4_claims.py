"""The rotation+INT4 document's three claims against walshkv's measurements, as markdown.

Usage: python scripts/rotation_int4_claims.py docs/results/rotation-int4 > docs/results/rotation-int4/claims.md

Reads what scripts/rotation-int4-reproduce.sh wrote: per model the sweep rows of the ``rotation-int4`` grid
(``<root>/<model>/rows/*.json``, with per-window mean KLD) and per CPU the decode-attention bench
(``<root>/bench-<isa>/bench.json``). Each claim is judged by the rule printed next to it; intervals are paired
per-window bootstrap 95% intervals (:func:`walshkv.eval.metrics.bootstrap_ci95` of the per-window differences).
Nothing is typed by hand.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

from walshkv.eval.metrics import paired_difference

BITS = (8, 4, 3, 2)
#: KLD (nats per token) at or below which a cache is called near-lossless here, and the top-1 gap to int8 allowed
NEAR_LOSSLESS_KLD = 0.01
NEAR_LOSSLESS_TOP1_GAP = 0.02
#: "beyond about 1k tokens": the crossover counts as "about 1k" anywhere in this range of cached tokens
ABOUT_1K = (512, 2048)


def load_rows(folder: Path) -> dict[str, dict[str, Any]]:
    """``{spec: result row (with "_meta")}`` of one sweep folder."""
    rows = {}
    for path in sorted(folder.glob("rows/*.json")):
        data = json.loads(path.read_text())
        row = dict(data["result"])
        row["_meta"] = data["meta"]
        rows[row["codec"]] = row
    return rows


def paired(a: dict[str, Any], b: dict[str, Any]) -> tuple[float, list[float]] | None:
    """Mean and bootstrap 95% interval of the per-window KLD of ``a`` minus ``b`` (None: under 3 paired windows)."""
    return paired_difference(a.get("window_kld_mean"), b.get("window_kld_mean"), min_windows=3)


def _row(r: dict[str, Any]) -> str:
    return f"KLD {r['kld_mean']:.4f}, top-1 {r['top1_agreement']:.1%}, {r['bits_per_element']:.3f} b/el"


def _diff(p: tuple[float, list[float]] | None) -> str:
    return "unpaired" if p is None else f"{p[0]:+.4f} [{p[1][0]:+.4f}, {p[1][1]:+.4f}]"


def quality_claims(rows: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    """Claims 1 and 2 on one model's rows: ``[(claim and rule, measured, verdict)]``."""
    out = []
    r4, r8 = rows.get("rot+int4"), rows.get("int8")
    if r4 and r8:
        gap = r8["top1_agreement"] - r4["top1_agreement"]
        near = r4["kld_mean"] <= NEAR_LOSSLESS_KLD and gap <= NEAR_LOSSLESS_TOP1_GAP
        times = r4["kld_mean"] / max(r8["kld_mean"], 1e-12)
        verdict = (
            "holds"
            if near
            else f"does not hold: rot+int4 KLD {r4['kld_mean']:.4f} is {times:.0f}x int8's, "
            f"top-1 {100 * gap:.1f} points behind it"
        )
        out.append(
            (
                f"1. INT4+ROT is near-lossless next to INT8 (rule: rot+int4 mean KLD <= {NEAR_LOSSLESS_KLD} and top-1 "
                f"within {100 * NEAR_LOSSLESS_TOP1_GAP:.0f} points of int8's)",
                f"rot+int4: {_row(r4)}; int8: {_row(r8)}; rot+int4 - int8: {_diff(paired(r4, r8))}",
                verdict,
            )
        )
    gains = {}
    for b in BITS:
        plain, rot = rows.get(f"int{b}"), rows.get(f"rot+int{b}")
        if plain and rot:
            gains[b] = (plain, rot, plain["kld_mean"] / max(rot["kld_mean"], 1e-12), paired(plain, rot))
    if len(gains) >= 2:
        order = [gains[b][2] for b in BITS if b in gains]  # 8 bits first
        rising = all(x < y for x, y in itertools.pairwise(order))
        helps = [b for b, g in gains.items() if g[3] is not None and g[3][1][0] > 0]
        measured = "; ".join(
            f"int{b}: {g[0]['kld_mean']:.4f} -> rot {g[1]['kld_mean']:.4f} (ratio {g[2]:.2f}; int - rot {_diff(g[3])})"
            for b, g in gains.items()
        )
        if rising:
            verdict = "holds: the KLD ratio grows at every step down in bits"
        else:
            peak = max(gains, key=lambda b: gains[b][2])
            verdict = f"does not hold as stated: the ratio is largest at {peak} bits, not rising monotonically"
        if helps:
            verdict += f"; rotation lowers KLD, whole interval above zero, at {', '.join(map(str, sorted(helps)))} bits"
        else:
            verdict += "; no interval of intB - rot+intB lies wholly above zero"
        out.append(
            (
                "2a. rotation helps more at fewer bits (rule: KLD(intB) / KLD(rot+intB) rises as B falls from 8 to 2)",
                measured,
                verdict,
            )
        )
    r2, k2 = rows.get("rot+int2"), rows.get("kivi2")
    if r2 and k2:
        p = paired(r2, k2)
        if p is None:
            verdict = "unjudged: no paired windows"
        elif p[1][0] > 0:
            verdict = "holds: rot+int2 is worse with the whole interval above zero"
        elif p[1][1] < 0:
            verdict = "does not hold: rot+int2 beats kivi2 with the whole interval below zero"
        else:
            verdict = "undecided: the interval contains zero"
        out.append(
            (
                "2b. INT2+ROT still loses to KIVI-2 (rule: paired interval of rot+int2 - kivi2 wholly above zero)",
                f"rot+int2: {_row(r2)}; kivi2 (fp window counted): {_row(k2)}; rot+int2 - kivi2: {_diff(p)}",
                verdict,
            )
        )
    return out


def speed_claim(bench: dict[str, Any]) -> tuple[str, str, str] | None:
    """Claim 3 on one bench run: the shortest measured context from which packed INT4 decodes faster than INT8."""
    rows = bench.get("attention") or []
    ms: dict[str, dict[int, float]] = {}
    for r in rows:
        ms.setdefault(r["method"], {})[int(r["kv_len"])] = float(r["ms"])
    pairs = [(a, b) for a, b in (("rot+int4", "rot+int8"), ("int4", "int8")) if a in ms and b in ms]
    if not pairs:
        return None
    parts, verdicts = [], []
    for four, eight in pairs:
        lens = sorted(set(ms[four]) & set(ms[eight]))
        faster = [ms[eight][n] > ms[four][n] for n in lens]
        cross = next((n for i, n in enumerate(lens) if all(faster[i:])), None)
        parts.append(f"{four} vs {eight}: " + ", ".join(f"{n}: {ms[eight][n] / ms[four][n]:.2f}x" for n in lens))
        if cross is None:
            verdicts.append(f"{four} is never faster than {eight} from some length on")
        elif cross == lens[0]:
            verdicts.append(f"{four} is faster at every measured length (from {cross} tokens)")
        elif ABOUT_1K[0] <= cross <= ABOUT_1K[1]:
            verdicts.append(f"{four} is faster from {cross} tokens on")
        else:
            verdicts.append(f"{four} is faster only from {cross} tokens on")
    ok = all("faster from" in v or "every measured" in v for v in verdicts)
    machine = bench["meta"]["machine"]
    return (
        f"3. packed INT4 decodes faster than INT8 beyond about 1k tokens (rule: the shortest measured length from "
        f"which INT4 stays faster lies at or below {ABOUT_1K[1]}; median ms per decode step, INT8 / INT4)",
        f"{machine['cpu']} ({machine['cpu_capability']}, {machine['torch_threads']} threads): " + "; ".join(parts),
        ("holds: " if ok else "does not hold: ") + "; ".join(verdicts),
    )


def main(root: Path) -> list[str]:
    lines = [
        "### The rotation+INT4 claims, measured",
        "",
        f"Written by `python scripts/rotation_int4_claims.py {root}` from the results of "
        "`scripts/rotation-int4-reproduce.sh`. KLD = mean KL divergence per scored token against the "
        "uncompressed cache (nats); intervals: paired per-window bootstrap 95%.",
        "",
    ]
    for folder in sorted(p for p in root.iterdir() if (p / "rows").is_dir()):
        rows = load_rows(folder)
        if not rows:
            continue
        meta = next(iter(rows.values()))["_meta"]
        cpu = meta.get("cpu") or {}
        commit = meta.get("versions", {}).get("commit", "?")
        lines += [
            f"#### {folder.name}",
            "",
            f"{meta['text']['name']}, {meta['windows']} windows of {meta['ctx']} tokens ({meta['scored_positions']}); "
            f"quantize on write (kivi2: its fp16 window counted in its bits); commit {commit}, "
            f"{cpu.get('model', '?')} ({cpu.get('capability', '?')}).",
            "",
            "| claim (rule) | measured | verdict |",
            "|---|---|---|",
        ]
        lines += [f"| {c} | {m} | {v} |" for c, m, v in quality_claims(rows)]
        lines.append("")
    benches = sorted(root.glob("bench-*/bench.json"))
    if benches:
        lines += ["#### Decode speed", "", "| claim (rule) | measured | verdict |", "|---|---|---|"]
        for path in benches:
            bench = json.loads(path.read_text())
            claim = speed_claim(bench)
            if claim:
                c, m, v = claim
                commit = bench["meta"]["machine"].get("commit", "?")
                lines.append(f"| {c} | {m} (commit {commit}, `{path.parent.name}`) | {v} |")
        lines.append("")
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print("\n".join(main(Path(sys.argv[1]))).rstrip())
