"""Tables of docs/presets.md: each preset against every peer at the same bits, and the targets.

Usage: python scripts/presets_table.py docs/results > docs/results/presets/tables.md

Reads, per model, docs/results/presets/MODEL/{eval,builtin}-B.json (``walshkv eval`` of the
preset chosen by ``walshkv recommend`` for that model, and of the built-in spec) and the peers'
rows docs/results/peers/MODEL/rows/*.json (scripts/baselines-reproduce.sh). Both use Austen's Emma,
8 windows of 512 tokens, second half scored; calibration and choice used Python's docs only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from walshkv.presets import PRESET_BUDGETS

BUDGETS = tuple(name.split(":", 1)[1] for name in PRESET_BUDGETS)  # "3", "3.5", "4.5"
MODELS = ("smollm2-135m", "qwen2.5-1.5b", "gemma3-270m")
# (model, preset) -> mean KLD target, from the issue; every preset also needs top-1 >= 85%.
TARGETS = {
    ("qwen2.5-1.5b", "4.5"): 0.012,
    ("qwen2.5-1.5b", "3.5"): 0.03,
    ("smollm2-135m", "3.5"): 0.054,
    ("smollm2-135m", "4.5"): 0.027,
}
TOP1 = 0.85


def family(codec: str) -> str:
    if codec.startswith("hf-"):
        return "Hugging Face QuantizedCache"
    if codec.startswith("kivi"):
        return "KIVI"
    if codec.startswith(("tq", "tqprod")):
        return "TurboQuant-class"
    base = codec.split("/")[0].replace("rot+", "")
    if base.split(":")[0] in {"q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"}:
        return "llama.cpp type"
    return "walshkv"


def _row(r: dict, label: str, fam: str) -> str:
    return (
        f"| {label} | {fam} | {r['bits_per_element']:.3f} | {r['kld_mean']:.6f} | {r['kld_p99']:.4f} | "
        f"{r['top1_agreement']:.2%} | {r['ppl_ratio']:.4f} |"
    )


def model_section(root: Path, model: str) -> list[str]:
    pre = root / "presets" / model
    peers_dir = root / "peers" / model / "rows"
    if not pre.is_dir():
        return []
    presets: dict[str, dict] = {}  # "eval-B" (chosen for this model) / "builtin-B" -> result row
    runs = [p for p in sorted(pre.glob("*.json")) if not p.name.startswith("recommend-")]
    for path in runs:
        kind = "eval" if path.name.startswith("eval-") else "builtin"
        for row in json.loads(path.read_text())["results"]:
            if "preset" in row:
                presets[f"{kind}-{row['preset'].split(':', 1)[1]}"] = row
    peers = []
    peer_windows = set()
    if peers_dir.is_dir():
        for path in sorted(peers_dir.glob("*.json")):
            record = json.loads(path.read_text())
            r = record["result"]
            if family(r["codec"]) != "walshkv":
                peers.append(r)
                peer_windows.add((record["meta"]["windows"], record["meta"]["scored_tokens"]))
    out = [f"### {model}", ""]
    if runs:
        meta = json.loads(runs[0].read_text())["meta"]
        chosen = [b for b in BUDGETS if f"eval-{b}" in presets]
        if len(chosen) == len(BUDGETS):
            how = "each preset's spec chosen for this model by `walshkv recommend` on python-docs"
        elif chosen:
            how = (
                f"{', '.join('walshkv:' + b for b in chosen)} chosen for this model by `walshkv recommend` on "
                "python-docs, built-in specs for the others"
            )
        else:
            how = "built-in specs only (`walshkv recommend` not run for this model yet)"
        out.append(
            f"{meta['windows']} windows of {meta['ctx']} tokens of {meta['text']['name']}, {meta['scored_positions']}; "
            f"{meta['scored_tokens']:,} scored tokens; {how}; K means calibrated on python-docs only."
        )
        other = sorted(w for w in peer_windows if w[0] != meta["windows"])
        if other:
            out.append("")
            out.append(
                "Peer rows here come from fewer windows ("
                + ", ".join(f"{w} windows, {n:,} scored tokens" for w, n in other)
                + "): the first windows of the same text, so the same tokens in part, not in whole."
            )
        out.append("")
    out.append("| codec | what | bits/el | mean KLD | KLD p99 | same top-1 | PPL ratio |")
    out.append("|---|---|---|---|---|---|---|")
    lines = []
    for key, r in presets.items():
        kind, b = key.split("-", 1)
        if kind == "builtin" and presets.get(f"eval-{b}", {}).get("codec") == r["codec"]:
            continue  # the model's choice is the built-in spec: one row
        label = f"**walshkv:{b}** = `{r['codec']}`"
        what = "preset, chosen for this model" if kind == "eval" else "preset, built-in spec"
        lines.append((r["bits_per_element"], 0, _row(r, label, what)))
    for r in peers:
        if r["bits_per_element"] <= 4.5 + 1e-9 or r["codec"] in ("q8_0/q4_0", "rot+q8_0/rot+q4_0"):
            lines.append((r["bits_per_element"], 1, _row(r, f"`{r['codec']}`", family(r["codec"]))))
    out.extend(line for _, _, line in sorted(lines, key=lambda x: (x[0], x[1])))
    out.append("")
    out.extend(_targets(model, presets, peers))
    out.append("")
    return out


def _targets(model: str, presets: dict[str, dict], peers: list[dict]) -> list[str]:
    out = ["| preset | mean KLD | target | top-1 >= 85% | best peer within the budget | verdict |"]
    out.append("|---|---|---|---|---|---|")
    for b in BUDGETS:
        r = presets.get(f"eval-{b}") or presets.get(f"builtin-{b}")
        if r is None:
            continue
        target = TARGETS.get((model, b))
        budget = max(float(b), r["bits_per_element"])  # every peer the preset's budget allows
        fits = [p for p in peers if p["bits_per_element"] <= budget + 1e-9]
        best = min(fits, key=lambda p: p["kld_mean"]) if fits else None
        peer = f"`{best['codec']}` {best['kld_mean']:.6f} ({best['bits_per_element']:.3f} b/el)" if best else "none"
        verdicts = []
        if target is not None:
            verdicts.append("target met" if r["kld_mean"] <= target else "target missed")
        verdicts.append("top-1 ok" if r["top1_agreement"] >= TOP1 else "top-1 below 85%")
        if best is not None:
            verdicts.append("beats every peer" if r["kld_mean"] < best["kld_mean"] else "a peer is better")
        out.append(
            f"| walshkv:{b} | {r['kld_mean']:.6f} | {'<= ' + str(target) if target else 'report'} | "
            f"{r['top1_agreement']:.2%} | {peer} | {'; '.join(verdicts)} |"
        )
    return out


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    root = Path(argv[0] if argv else "docs/results")
    print("### Presets against every peer, on text not used for calibration\n")
    print(
        "Written by `python scripts/presets_table.py docs/results` from `scripts/presets-reproduce.sh` and "
        "`scripts/baselines-reproduce.sh`. Peer rows: every llama.cpp type, KIVI, TurboQuant-class and Hugging "
        "Face QuantizedCache row at <= 4.5 bits per element, plus q8_0 K / q4_0 V (6.5).\n"
    )
    for model in MODELS:
        print("\n".join(model_section(root, model)))
    print("\n".join(sink_section(root)))
    print("\n".join(eq_section(root)))
    print("\n".join(prerope_section(root)))
    print("\n".join(per_layer_section(root)))
    return 0


def _recommend_runs(root: Path):
    """``(model, budget, data)`` for every ``recommend-B.json`` under ``root``."""
    for model in MODELS:
        for path in sorted((root / "presets" / model).glob("recommend-*.json")):
            yield model, path.stem.split("-", 1)[1], json.loads(path.read_text())


def _pairs(root: Path, partner):
    """``(model, budget, other_spec, row, other_row)`` for each recommend row whose ``partner`` was run too."""
    for model, budget, data in _recommend_runs(root):
        results = {r["codec"]: r for r in data["results"]}
        for codec, r in results.items():
            other = partner(codec)
            if other is not None and other != codec and other in results:
                yield model, budget, other, r, results[other]


def sink_section(root: Path) -> list[str]:
    """Each ``sink:1:`` candidate of a ``recommend`` run next to the same spec without it (selection windows)."""
    rows = [
        f"| {model} | {budget} | `{plain}` | {p['bits_per_element']:.3f} | {p['kld_mean']:.5f} | "
        f"{r['bits_per_element']:.3f} | {r['kld_mean']:.5f} | {r['kld_mean'] / p['kld_mean'] - 1:+.0%} |"
        for model, budget, plain, r, p in _pairs(root, lambda c: c.split(":", 2)[2] if c.startswith("sink:") else None)
    ]
    if not rows:
        return []
    return [
        "### The first token in fp16 (`sink:1:`), on the selection windows\n",
        "From `walshkv recommend` (`recommend-B.json`): each `sink:1:` candidate next to the same spec without "
        "it, on python-docs' second half (4 windows of 512 tokens; bits per element measured, the fp16 token "
        "included).\n",
        "| model | budget | spec | bits/el | mean KLD | with sink:1: bits/el | mean KLD | change |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def per_layer_section(root: Path) -> list[str]:
    """What ``recommend --per-layer`` predicted from single-layer moves and what its check measured."""
    rows = []
    for model, budget, data in _recommend_runs(root):
        plan = data.get("per_layer")
        if plan:
            check = {r["codec"]: r["kld_mean"] for r in plan["check"]}
            base = check.get(plan["base"])
            if base is None:
                base = next(r["kld_mean"] for r in data["results"] if r["codec"] == plan["base"])
            ups = sum(1 for m in plan["chosen"] if m["delta"] > 0)
            downs = len(plan["chosen"]) - ups
            predicted = base + sum(m["kld_change"] for m in plan["chosen"])
            layered = next((c for c in check if c != plan["base"]), None)
            measured = f"{check[layered]:.5f} ({check[layered] / base - 1:+.0%})" if layered else "-"
            kept = "per-layer" if plan["spec"] != plan["base"] else "uniform"
            rows.append(
                f"| {model} | {budget} | `{plan['base']}` | {base:.5f} | {ups} / {downs} | {predicted:.5f} | "
                f"{measured} | {kept} | `{data['winner'][:60]}{'...' if len(data['winner']) > 60 else ''}` |"
            )
    if not rows:
        return []
    return [
        "### Per-layer widths (`recommend --per-layer`), on the selection windows\n",
        "From `recommend-B.json` (`per_layer`): the uniform spec the moves start from, the raises / lowerings "
        "applied, the mean KLD the single-layer measurements predict if the layers' effects added up, what the "
        "check measured, which one `--per-layer` kept, and the overall winner.\n",
        "| model | budget | start | mean KLD | raises / lowerings | predicted | measured | kept | winner |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def _wrapper_section(root: Path, partner, title: str, intro: str, header: str) -> list[str]:
    """Each candidate of a ``recommend`` run next to its ``partner`` spec (selection windows)."""
    rows = [
        f"| {model} | {budget} | `{plain}` | {p['bits_per_element']:.3f} | {p['kld_mean']:.5f} | "
        f"{r['kld_mean']:.5f} | {r['kld_mean'] / p['kld_mean'] - 1:+.0%} |"
        for model, budget, plain, r, p in _pairs(root, partner)
    ]
    if not rows:
        return []
    return [
        f"### {title}, on the selection windows\n",
        intro + "\n",
        header,
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def eq_section(root: Path) -> list[str]:
    """Each ``eq+`` candidate of a ``recommend`` run next to the same spec without it (selection windows)."""
    return _wrapper_section(
        root,
        lambda c: c.replace("center+eq+", "center+"),
        "The query-weighted K transform (`eq+`)",
        "From `walshkv recommend` (`recommend-B.json`): each `center+eq+` candidate next to the same spec "
        "with `center+` alone, on python-docs' second half (4 windows of 512 tokens; the same bits: `eq+` "
        "stores nothing in the cache).",
        "| model | budget | spec (without eq+) | bits/el | mean KLD | with eq+: mean KLD | change |",
    )


def prerope_section(root: Path) -> list[str]:
    """Each ``prerope+`` candidate of a ``recommend`` run next to the same spec without it (selection windows)."""
    return _wrapper_section(
        root,
        lambda c: c.replace("prerope+", ""),
        "K before RoPE (`prerope+`)",
        "From `walshkv recommend` (`recommend-B.json`): each `prerope+` candidate next to the same spec "
        "quantizing K after RoPE, on python-docs' second half (4 windows of 512 tokens; the same bits: "
        "`prerope+` stores nothing in the cache).",
        "| model | budget | spec (K after RoPE) | bits/el | mean KLD | with prerope+: mean KLD | change |",
    )


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
