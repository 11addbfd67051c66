#!/usr/bin/env python3
"""Write docs/trellis.md's result blocks from docs/results/trellis (docs/trellis-reproduce.sh, stage report).

Blocks (each a file under docs/results/trellis, pasted with scripts/update_readme.py):
    gaussian   each trained table's gap to D(R) on unit Gaussian vectors, both table sets, against scalar Lloyd-Max
    rd         tq against tcq on real K/V (rd-MODEL/rd.json), dB above D(R) with every stored bit counted
    select     the selection runs (docs/results/long-context/select/MODEL/recommend-*-tcq-ctx4096.json)
    select-n8  the norm=8 re-selection runs (recommend-*-n8-ctx4096.json; their holdout: docs/long-context.md)
    select-t2  table set 2 and qwen2.5-1.5b's walshkv:2.5 (recommend-*-t2-ctx4096.json of the three models)
    select-qwen-tcq  qwen2.5-1.5b's walshkv:3 and walshkv:4.5 with tcq (recommend-*-qtcq-ctx4096.json)
    select-tcq-rest  qwen2.5-1.5b's walshkv:3.5, gemma3-270m's 3 and 3.5 with tcq (recommend-*-tcqr-ctx4096.json)
    select-gemma25  gemma3-270m's walshkv:2.5 (recommend-2.5-g25-ctx4096.json)
    emma       the presets and the specs they replaced on Emma (development text)
    holdout    the same on Persuasion (the frozen holdout), with the issue's targets and paired intervals
    bench      decode attention at 16k, one thread: tq against tcq (bench-attention/bench.md as written)
    decode     tcq row decoding, this tree's kernel against a base commit's (decode-ab/ab.md as written)
    structured tables an AVX2 kernel reads without a gather, on a Gaussian source (structured/structured.md)
    lookup     what each table form and state convention costs an AVX2 CPU per value (lookup/lookup.md)

A block whose inputs do not exist yet is skipped with a note; nothing is typed by hand.

    python scripts/trellis_report.py
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from walshkv.eval.metrics import paired_difference
from walshkv.ops import trellis
from walshkv.ops.lloyd_max import lloyd_max

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "results" / "trellis"
SELECT = ROOT / "docs" / "results" / "long-context" / "select"
TABLES = ROOT / "src" / "walshkv" / "ops" / "trellis_tables.json"
PAGE = ROOT / "docs" / "trellis.md"
MODEL = "smollm2-135m"
# the specs each preset stood for before the tcq selection (docs/trellis-reproduce.sh, before())
BEFORE = {
    "walshkv:3": "sink:1:layers:prerope+center+eq+tq:3/tq:2@5,8,12,14;prerope+center+eq+tq:3/tq:2.5",
    "walshkv:3-fast": "sink:1:layers:prerope+center+eqd+tq:3/tq:2@5,8,12,14;prerope+center+eqd+tq:3/tq:2.5",
    "walshkv:3.5": "sink:1:layers:prerope+center+eq+tq:3.5/tq:2.5@5,8,12;prerope+center+eq+tq:3.5/tq:3",
    "walshkv:3.5-fast": "sink:1:layers:prerope+center+eqd+tq:3.5/tq:2.5@5,8,12;prerope+center+eqd+tq:3.5/tq:3",
    "walshkv:4.5": "sink:1:prerope+center+eq+rot+iq4_nl/tq:4",
    "walshkv:4.5-fast": "sink:1:prerope+center+eqd+rot+iq4_nl/tq:4",
}
# issue 37's targets: (preset, peer, what the peer is)
TARGETS = [
    ("walshkv:3", "rot+iq4_nl", "llama.cpp's best rotated 4.5-bit type"),
    ("walshkv:3-fast", "rot+iq4_nl", "llama.cpp's best rotated 4.5-bit type"),
    ("walshkv:4.5", "rot+q8_0/rot+q4_0", "the rotated q8_0/q4_0 pair (6.5 bits)"),
    ("walshkv:4.5-fast", "rot+q8_0/rot+q4_0", "the rotated q8_0/q4_0 pair (6.5 bits)"),
    ("walshkv:2.5", "rot+q4_0", "rotated q4_0 (4.5 bits)"),
    ("walshkv:2.5-fast", "rot+q4_0", "rotated q4_0 (4.5 bits)"),
]


def _where(meta: dict) -> str:
    """``COMMIT on CPU`` of a result's meta."""
    return f"{meta.get('versions', {}).get('commit', '?')} on {meta.get('cpu', {}).get('model', '?')}"


def _db(x: float, digits: int) -> str:
    """``x`` with ``digits`` decimals, a value that rounds to zero written as zero (no ``-0.00``)."""
    return f"{0.0 if abs(x) < 0.5 * 10**-digits else x:.{digits}f}"


def _cost_cell(data: dict, key: str, gap_diff: float) -> str:
    """A derived set's cost over the free set in dB, as a table cell: a rounded set's on the vectors it was measured
    on with its source table (``source_mse``, three decimals), a trained set's as the difference of the last training
    rounds' gaps (two)."""
    stats = data["stats"][key]
    if "source_mse" in stats:
        return f" | {_db(10 * math.log10(stats['mse_per_round'][-1] / stats['source_mse']), 3)}"
    return f" | {gap_diff:.2f}"


def gaussian() -> str:
    """Each table set's gap to D(R) on a Gaussian source; the best free set (256 values) against the scalar quantizer
    and the first set, and each split set (walshkv.ops.trellis.SPLIT_SETS) against the best free set: what the split
    costs."""
    sets = {n: json.loads((TABLES.parent / trellis.table_file(n)).read_text()) for n in trellis.TABLE_SETS}
    first = trellis.TABLE_SETS[0]
    free = [n for n in trellis.TABLE_SETS if n not in trellis.SPLIT_SETS and n not in trellis.ROUNDED_SETS][-1]
    split = [n for n in trellis.TABLE_SETS if n in trellis.SPLIT_SETS or n in trellis.ROUNDED_SETS]
    heads = " | ".join(f"set {n} dB above D(R)" for n in sets)
    split_heads = "".join(
        f" | set {n} ({'split' if n in trellis.SPLIT_SETS else 'bfloat16'}) cost over set {free}, dB" for n in split
    )
    lines = [
        f"| bits | {heads} | scalar Lloyd-Max dB above D(R) | set {free} gain over scalar, dB "
        f"| set {free} over set {first}, dB{split_heads} |",
        "|---|" + "---|" * (len(sets) + 3 + len(split)),
    ]
    for key in sets[first]["stats"]:
        bits = float(key.split("/")[0])
        gap = {n: data["stats"][key]["gap_db"] for n, data in sets.items()}
        cells = " | ".join(f"{g:.2f}" for g in gap.values())
        costs = "".join(_cost_cell(sets[n], key, gap[n] - gap[free]) for n in split)
        if bits.is_integer():
            scalar = 10 * math.log10(lloyd_max(int(bits), "gaussian").mse / 2 ** (-2 * bits))
            gain, longer = scalar - gap[free], gap[first] - gap[free]
            lines.append(f"| {bits:g} | {cells} | {scalar:.2f} | {gain:.2f} | {longer:.2f}{costs} |")
        else:
            half = "(half width: no single scalar quantizer)"
            lines.append(f"| {bits:g} | {cells} | {half} | | {gap[first] - gap[free]:.2f}{costs} |")
    lines.append("")
    for n, data in sets.items():
        meta = data["meta"]
        starts = meta.get("starts", 1)
        if n in trellis.ROUNDED_SETS:
            lines.append(
                f"Set {n} (`{trellis.table_file(n)}`): set {meta['rounded_from']}'s tables rounded to "
                f"{meta['rounding']}, no training; each measured on {meta['samples']} fresh unit Gaussian vectors of "
                f"{meta['values_per_vector']} values; `{meta['command'].strip()}` at {meta['commit']} on {meta['cpu']} "
                f"(torch {meta['torch']}, {meta['torch_threads']} threads)."
            )
            continue
        lines.append(
            f"Set {n} (`{trellis.table_file(n)}`): unit Gaussian vectors of {meta['values_per_vector']} values, "
            f"{meta['samples']} per round, {meta['iterations']} rounds"
            + (f", the better of {starts} seeded starts" if starts > 1 else "")
            + (f", split `{trellis.SPLIT_SETS[n]}` (P[s & 15] + Q[s >> 4])" if n in trellis.SPLIT_SETS else "")
            + f"; `{meta['command'].strip()}` at {meta['commit']} on {meta['cpu']} (torch {meta['torch']}, "
            f"{meta['torch_threads']} threads)."
        )
    lines.append("")
    names = "; ".join(f"set {n} is `tcq:B:tables={n}`" for n in trellis.TABLE_SETS if n != first)
    lines.append(
        f"Each figure is the last training round's MSE, measured on that round's fresh vectors before its update (so "
        f"a little above what the table it ships codes). Set {first} is what `tcq:B` reads; {names}."
    )
    return "\n".join(lines)


def _rd_block(
    path_of, head: str, widths: tuple[str, ...], pair, sign: float, peers: tuple[str, ...] = (), digits: int = 2
) -> str | None:
    """One table per model of a rd run (``path_of(model)``): per width the two codecs ``pair(width)``, their K and
    V gaps to D(R) and ``sign x (first - second)``; then the ``peers`` rows."""
    blocks = []
    for model in ("smollm2-135m", "qwen2.5-1.5b"):
        path = path_of(model)
        if not path.exists():
            continue
        run = json.loads(path.read_text())
        rows = {r["codec"]: r for r in run["results"]}
        lines = [f"**{model}** ({_where(run['meta'])}):", "", head, "|---|---|---|---|---|---|---|"]
        for w in widths:
            a, b = (rows.get(c) for c in pair(w))
            if a is None or b is None:
                continue
            dk, dv = (_db(sign * (a[f] - b[f]), digits) for f in ("gap_db_k", "gap_db_v"))
            lines.append(
                f"| {w} | {a['bits_per_element']:.3f} | {a['gap_db_k']:.2f} | {b['gap_db_k']:.2f} | "
                f"{a['gap_db_v']:.2f} | {b['gap_db_v']:.2f} | {dk} / {dv} |"
            )
        for peer in peers:
            r = rows.get(peer)
            if r is not None:
                lines.append(
                    f"| {peer} | {r['bits_per_element']:.3f} | {r['gap_db_k']:.2f} | | {r['gap_db_v']:.2f} | | |"
                )
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) if blocks else None


def rd() -> str | None:
    return _rd_block(
        lambda model: OUT / f"rd-{model}" / "rd.json",
        "| width | bits stored | tq K dB | tcq K dB | tq V dB | tcq V dB | tcq gain K / V, dB |",
        ("2", "2.5", "3", "3.5", "4"),
        lambda w: (f"tq:{w}", f"tcq:{w}"),
        1.0,
        ("rot+iq4_nl", "rot+q4_0"),
    )


def select(
    kind: str = "tcq",
    stage: str = "select",
    models: tuple[str, ...] = (MODEL,),
    script: str = "docs/trellis-reproduce.sh",
) -> str | None:
    """The selection runs ``MODEL/recommend-*-KIND-ctx4096.json`` (``script``, stage ``stage``); a model column where
    there is more than one model."""
    runs = [path for model in models for path in sorted((SELECT / model).glob(f"recommend-*-{kind}-ctx4096.json"))]
    if not runs:
        return None
    many = len(models) > 1
    lines = [
        ("| model " if many else "") + "| preset | candidate | bits | selection KLD (python-docs, 2 x 4k) | |",
        ("|---" if many else "") + "|---|---|---|---|---|",
    ]
    where = []
    for path in runs:
        run = json.loads(path.read_text())
        where.append(_where(run["meta"]))
        for r in sorted(run["results"], key=lambda r: r["kld_mean"]):
            mark = "**ships**" if r["codec"] == run["winner"] else ""
            lines.append(
                (f"| {run['meta']['model']['name']} " if many else "")
                + f"| {run['preset']} | `{r['codec']}` | {r['bits_per_element']:.3f} | {r['kld_mean']:.4f} | {mark} |"
            )
    lines.append("")
    lines.append(
        f"`walshkv recommend --only-candidates --ctx 4096 --windows 2` on python-docs ({script}, "
        f"stage {stage}), {', '.join(dict.fromkeys(where))}."
    )
    return "\n".join(lines)


def _eval_block(path: Path, targets: bool) -> str | None:
    if not path.exists():
        return None
    run = json.loads(path.read_text())
    rows = run["results"]
    by_preset = {r.get("preset") or r["codec"]: r for r in rows}
    by_codec = {r["codec"]: r for r in rows}
    lines = ["| row | spec | bits | mean KLD [95%] | p99 | top-1 |", "|---|---|---|---|---|---|"]
    for r in rows:
        name = r.get("preset") or ""
        lo, hi = r["kld_mean_ci95"]
        lines.append(
            f"| {name} | `{r['codec']}` | {r['bits_per_element']:.3f} | {r['kld_mean']:.4f} [{lo:.4f}, {hi:.4f}] | "
            f"{r['kld_p99']:.3f} | {r['top1_agreement']:.2%} |"
        )
    lines += ["", "| preset | against | difference [95%, paired over windows] | |", "|---|---|---|---|"]
    # (preset, the row it is measured against, how the table names that row, a target of issue 37?)
    pairs = [(p, old, "the tq spec it replaced", False) for p, old in BEFORE.items()]
    pairs += [  # issue 35: is a fast preset as good as the dense one before it?
        (p, BEFORE[p.removesuffix("-fast")], "the dense tq preset before (issue 35: no worse)", False)
        for p in ("walshkv:3-fast", "walshkv:3.5-fast", "walshkv:4.5-fast")
    ]
    if targets:
        pairs += [(p, peer, f"{what}, `{peer}` (target: no worse)", True) for p, peer, what in TARGETS]
    for preset, other, label, target in pairs:
        a, b = by_preset.get(preset), by_codec.get(other)
        if a is None or b is None or a["codec"] == other:
            continue
        d = paired_difference(a["window_kld_mean"], b["window_kld_mean"])
        if d is None:
            continue
        (low, high) = d[1]
        if target:
            verdict = "**met**" if low <= 0 else "missed"
        else:
            verdict = "better" if high < 0 else "worse" if low > 0 else "within the interval"
        lines.append(f"| {preset} | {label} | {d[0]:+.4f} [{low:+.4f}, {high:+.4f}] | {verdict} |")
    meta = run["meta"]
    lines.append("")
    lines.append(
        f"{meta['model']['name']}, {meta['text']['name']}, {meta['windows']} windows of {meta['ctx']} tokens (quantize "
        f"on write); {_where(meta)}."
        + (" A target is met when the interval of the difference reaches zero or below." if targets else "")
    )
    return "\n".join(lines)


def twin_set_rd(twin: int, cost: str, digits: int = 2) -> str | None:
    """Table set ``twin`` against set 2 on real K/V (docs/trellis-reproduce.sh, stage rd-tTWIN): dB above D(R) and
    what set ``twin`` costs (``cost`` names it: the split, the rounding) with ``digits`` decimals."""
    return _rd_block(
        lambda model: ROOT / "docs" / "results" / f"rd-tables{twin}" / model / "rd.json",
        f"| width | bits stored | set 2 K dB | set {twin} K dB | set 2 V dB | set {twin} V dB "
        f"| {cost} cost K / V, dB |",
        ("2", "2.5", "3", "3.5", "4", "4.5"),
        lambda w: (f"tcq:{w}:norm=8:tables=2", f"tcq:{w}:norm=8:tables={twin}"),
        -1.0,
        digits=digits,
    )


def split_bench(folder: str = "split-bench", twin: int = 3, stage: str = "bench-t3") -> str | None:
    """Decode attention with table set 2 against its set-``twin`` twin (``stage``): x the fastest SDPA of each run."""
    runs = sorted((OUT / folder).glob("*/bench.json"))
    if not runs:
        return None
    lines = [
        f"| model | kernel built for | kv_len | tq:3.5/tq:3 | tcq 3.5, set 2 | tcq 3.5, set {twin} "
        f"| fast preset, set 2 | fast preset, set {twin} | set {twin} / set 2 time: tcq, fast preset |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    where = set()
    for path in runs:
        run = json.loads(path.read_text())
        meta = run["meta"]["machine"]
        march = meta.get("kernel_march", "native")
        built = "this CPU (native)" if march == "native" else f"`-march={march}` (stand-in)"
        where.add(f"{meta.get('commit', '?')} on {meta.get('cpu', '?')} ({meta.get('cpu_capability', '?')})")
        model = path.parent.name.removesuffix(f"-{march}")
        by_len: dict[int, list[dict]] = {}
        for r in run["attention"]:
            if r["backend"] != "torch":
                by_len.setdefault(int(r["kv_len"]), []).append(r)
        for n, rows in sorted(by_len.items()):

            def pick(pred, rows=rows):
                return next((r for r in rows if pred(r.get("spec", r["method"]))), None)

            tq = pick(lambda s: s == "tq:3.5/tq:3")
            t2 = pick(lambda s: s.startswith("tcq:3.5") and "tables=2" in s)
            t3 = pick(lambda s: s.startswith("tcq:3.5") and f"tables={twin}" in s)
            f2 = pick(lambda s: "ropeblock" in s and "tables=2" in s)
            f3 = pick(lambda s: "ropeblock" in s and f"tables={twin}" in s)
            cells = ["" if r is None else f"{r['speedup_vs_best_sdpa']:.2f}" for r in (tq, t2, t3, f2, f3)]
            ratio = ", ".join(f"{b['ms'] / a['ms']:.2f}" for a, b in ((t2, t3), (f2, f3)) if a and b)
            lines.append(f"| {model} | {built} | {n:,} | " + " | ".join(cells) + f" | {ratio} |")
    lines += [
        "",
        "x the fastest SDPA of each run (one thread; medians of interleaved rounds; `walshkv bench attention --model "
        f"MODEL --threads 1`, docs/trellis-reproduce.sh stage {stage}); the fast preset is the model's shipped "
        f"`walshkv:3.5-fast` (the block frame) and its twin with every `tables=2` made `tables={twin}`. "
        + "; ".join(sorted(where))
        + ".",
    ]
    return "\n".join(lines)


def _written(path: Path) -> str | None:
    """A block written by its own command (a bench or probe's markdown), as it stands, or None before it runs."""
    return path.read_text().strip() if path.exists() else None


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    blocks = {
        "gaussian": gaussian(),
        "rd": rd(),
        "select": select(),
        "select-n8": select("n8", "select-n8"),
        "select-t2": select("t2", "select-qwen25 and select-t2", ("qwen2.5-1.5b", MODEL, "gemma3-270m")),
        "select-qwen-tcq": select("qtcq", "select-qwen-tcq", ("qwen2.5-1.5b",)),
        "select-tcq-rest": select("tcqr", "select-tcq-rest", ("qwen2.5-1.5b", "gemma3-270m")),
        "select-gemma25": select("g25", "select-gemma25", ("gemma3-270m",)),
        "emma": _eval_block(OUT / MODEL / "emma.json", targets=False),
        "holdout": _eval_block(OUT / MODEL / "persuasion.json", targets=True),
        "bench": _written(OUT / "bench-attention" / "bench.md"),
        "decode": _written(OUT / "decode-ab" / "ab.md"),
        "structured": _written(OUT / "structured" / "structured.md"),
        "lookup": _written(OUT / "lookup" / "lookup.md"),
        "split-rd": twin_set_rd(3, "split"),
        "split-bench": split_bench(),
        "bf16-rd": twin_set_rd(4, "rounding", digits=3),
        "bf16-bench": split_bench("bf16-bench", 4, "bench-t4"),
    }
    # qwen2.5-0.5b's first presets (docs/presets.md, "qwen2.5-0.5b's presets: the shipping rule")
    q05 = select("q05", "select-qwen05", ("qwen2.5-0.5b",), "docs/long-context-reproduce.sh")
    pages = [(f"trellis-{name}", body, PAGE) for name, body in blocks.items()]
    pages.append(("qwen05-select", q05, ROOT / "docs" / "presets.md"))
    for name, body, page in pages:
        if body is None:
            print(f"{name}: no results yet, skipped", file=sys.stderr)
            continue
        path = OUT / f"{name.removeprefix('trellis-')}.md"
        path.write_text(body + "\n")
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "update_readme.py"), str(path), str(page), name], check=True
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
