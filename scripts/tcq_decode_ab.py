#!/usr/bin/env python3
"""tcq row decoding in the fused CPU kernel: this tree's build against a base commit's, on one thread.

Builds the kernel twice for this CPU (``-march=native``): from this checkout and from ``--base`` (its headers read
with ``git show``), encodes random rows per spec, and times ``decode_rows`` (every row of a ``[1, 3, tokens, d]``
tensor to float32) in interleaved rounds, so a slow phase of a shared machine slows both builds alike. tq at the
same widths is timed in this tree's build as the yardstick. Reports nanoseconds per value (median and first quartile
over rounds), the base/tree ratio per round (median), and which decoder reads each layout (``tcq_path``).

Writes ``ab.json`` and ``ab.md`` under ``--out``, with the machine and the commit.

    python scripts/tcq_decode_ab.py --base 3982e2a --out docs/results/trellis/decode-ab
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from walshkv.attention import cpu
from walshkv.bench.machine import machine_description
from walshkv.codecs.registry import parse_codec

ROOT = Path(__file__).resolve().parents[1]


def _source_at(rev: str) -> str:
    def read(name: str) -> str:
        path = f"src/walshkv/attention/{name}"
        return subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout

    return cpu.assemble_source(read)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", required=True, help="the commit whose kernel is the baseline (e.g. 3982e2a)")
    ap.add_argument("--spec", action="append", help="tcq spec (repeatable; default tcq:2, tcq:2.5, tcq:3, tcq:4)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=2048, help="rows per kv head (3 kv heads)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=10, help="decode_rows calls per round and case")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    specs = args.spec or ["tcq:2", "tcq:2.5", "tcq:3", "tcq:4"]
    meta = machine_description()  # the commit (and whether the tree is dirty) that runs, read before it runs
    torch.set_num_threads(1)
    base_rev = subprocess.run(
        ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    flags = list(cpu._CFLAGS_NATIVE)
    builds = {"tree": cpu.build_kernel(flags), f"base {base_rev}": cpu.build_kernel(flags, _source_at(args.base))}
    n, d = args.tokens, args.head_dim

    def case(spec: str, packed, build: str) -> dict:
        module = builds[build]
        plan = cpu.cpu_plan(parse_codec("int8"), parse_codec(spec), d, 1.0)
        desc, keep = cpu._desc(packed, plan.v, d, "V", module.FORMATS[plan.v.fmt])
        path = module.tcq_path(desc) if spec.startswith("tcq") else ""
        out = torch.empty(1, 3, n, plan.v.length)
        return {
            "spec": spec,
            "build": build,
            "path": path,
            "module": module,
            "desc": desc,
            "keep": keep,
            "out": out,
            "ns": [],
        }

    cases = []
    for spec in specs:
        x = torch.randn(1, 3, n, d, generator=torch.Generator().manual_seed(0))
        packed = parse_codec(spec).encode(x)
        cases += [case(spec, packed, build) for build in builds]
        twin = spec.replace("tcq", "tq")  # the yardstick, in this tree's build
        cases.append(case(twin, parse_codec(twin).encode(x), "tree"))
    values = 3 * n * d
    for _ in range(args.rounds):
        for c in cases:
            t0 = time.perf_counter()
            for _ in range(args.calls):
                c["module"].decode_rows(c["desc"], [], c["out"].data_ptr(), 1, 3, 0, n, 1)
            c["ns"].append((time.perf_counter() - t0) / args.calls / values * 1e9)
    rows = []
    for c in cases:
        q = sorted(c["ns"])
        row = {
            "spec": c["spec"],
            "build": c["build"],
            "path": c["path"],
            "ns_per_value_median": statistics.median(q),
            "ns_per_value_q1": q[len(q) // 4],
        }
        if c["build"] == "tree" and c["spec"].startswith("tcq"):
            base = next(b for b in cases if b["spec"] == c["spec"] and b["build"] != "tree")
            row["speedup_vs_base"] = statistics.median(b / t for b, t in zip(base["ns"], c["ns"], strict=True))
        rows.append(row)
    meta.update(
        {
            "command": "python scripts/tcq_decode_ab.py --base " + args.base,
            "base": base_rev,
            "head_dim": d,
            "tokens": n,
            "rounds": args.rounds,
            "calls": args.calls,
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ab.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        f"{meta['cpu']} ({meta['cpu_capability']}), one thread, commit {meta['commit']} against base {base_rev}; "
        f"`decode_rows` of [1, 3, {n}, {d}] rows to float32, {args.rounds} interleaved rounds. "
        f"Produced by `{meta['command']}`.",
        "",
        "| spec | build | decoder | ns/value (median) | ns/value (q1) | speedup over base (median of rounds) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        sp = f"{r['speedup_vs_base']:.2f}x" if "speedup_vs_base" in r else ""
        lines.append(
            f"| {r['spec']} | {r['build']} | {r['path']} | {r['ns_per_value_median']:.3f} | "
            f"{r['ns_per_value_q1']:.3f} | {sp} |"
        )
    (args.out / "ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
