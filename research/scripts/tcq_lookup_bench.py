#!/usr/bin/env python3
"""How fast an AVX2 CPU decodes a 3-bit trellis row in each table form and state convention: a timing probe.

docs/trellis.md ("Decode speed") finds that on an AVX2-only CPU a tcq row costs about three times a tq row, half of
it in the gather through the 256-entry table and most of the rest in the taps that build each state. This probe
(``tcq_lookup_bench.cpp`` beside it, built for this CPU) times the alternatives on the same rows, each variant
checked against a torch reference first:

    gather_taps     walshkv's tcq as the kernel decodes it (TcqAvx2): newest-low states from three taps, a gather
    p44_taps        the same states, the table P[s & 15] + Q[s >> 4] read by vpermps pairs (no gather)
    gather_window   states as one 8-bit window of the stream (newest code high): one tap, then the gather
    p44_window      window states and the P + Q table by vpermps pairs
    i8_44_window    window states packed to bytes, int8 P and Q by byte shuffles, widened to float
    tq              tq:3 (one vpermps per 8 codes): the yardstick

Every row (64 values at 3 bits, 24 bytes) is decoded into a 32-row tile that stays in L1, as in the fused attention;
the times are nanoseconds per value on one thread, medians over interleaved rounds. The formats behind the window
and P + Q variants do not exist in walshkv yet (docs/trellis.md, "Tables an AVX2 kernel reads without a gather").

    python research/scripts/tcq_lookup_bench.py --out docs/results/trellis/lookup
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from walshkv.bench.machine import machine_description

HERE = Path(__file__).resolve().parent
VARIANTS = ("gather_taps", "p44_taps", "gather_window", "p44_window", "i8_44_window", "tq")
D, K = 64, 3


def _codes(row: torch.Tensor) -> torch.Tensor:
    """[n, 24] uint8 -> [n, 64] int64 codes (LSB-first)."""
    bits = ((row[:, :, None].long() >> torch.arange(8)) & 1).reshape(row.shape[0], -1)  # [n, 192]
    return (bits.reshape(-1, D, K) << torch.arange(K)).sum(-1)


def _states(row: torch.Tensor, window: bool) -> torch.Tensor:
    c = _codes(row)
    if not window:  # newest-low: c_i | c_{i-1} << 3 | c_{i-2} << 6, mod 256, wrapped
        return (c | (torch.roll(c, 1, 1) << 3) | (torch.roll(c, 2, 1) << 6)) & 0xFF
    bits = ((row[:, :, None].long() >> torch.arange(8)) & 1).reshape(row.shape[0], -1)
    ends = torch.arange(D) * K + K  # value i's window: stream bits [3i + 3 - 8, 3i + 3), wrapped
    idx = (ends[:, None] - 8 + torch.arange(8)) % (D * K)
    return (bits[:, idx] << torch.arange(8)).sum(-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, default=3 * 16384, help="rows per call (16k tokens x 3 kv heads)")
    ap.add_argument("--rounds", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    meta = machine_description()  # the commit that runs, read before it runs
    if meta["cpu_capability"] not in ("AVX2", "AVX512"):
        raise SystemExit(f"this probe needs AVX2 (torch reports {meta['cpu_capability']})")
    mod = cpp_extension.load(
        name="walshkv_tcq_lookup_bench",
        sources=[str(HERE / "tcq_lookup_bench.cpp")],
        extra_cflags=["-O3", "-march=native", "-std=c++20"],
        verbose=False,
    )
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (args.rows, D * K // 8), dtype=torch.uint8, generator=gen)
    table = torch.randn(256, generator=gen)
    p, q = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    p8 = torch.randint(-60, 61, (16,), dtype=torch.int8, generator=gen)
    q8 = torch.randint(-60, 61, (16,), dtype=torch.int8, generator=gen)
    levels = torch.randn(8, generator=gen)
    tables = (table, p, q, p8, q8, levels)
    head = codes[:32]
    for v in VARIANTS:  # each variant's first tile against the torch reference
        first = torch.zeros(32 * D)
        mod.run(v, codes[:32].contiguous(), *tables, first)
        if v == "tq":
            want = levels[_codes(head)]
        else:
            s = _states(head, "window" in v)
            if v.startswith("gather"):
                want = table[s]
            elif v.startswith("p44"):
                want = p[s & 15] + q[s >> 4]
            else:
                want = (p8[s & 15].int() + q8[s >> 4].int()).to(torch.int8).float()
        if not torch.equal(first.reshape(32, D), want.float()):
            raise SystemExit(f"{v}: the probe's values differ from the reference")
    none = torch.zeros(0)
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for v in VARIANTS:
            t0 = time.perf_counter()
            mod.run(v, codes, *tables, none)
            times[v].append((time.perf_counter() - t0) / (args.rows * D) * 1e9)
    rows = []
    for v in VARIANTS:
        med = statistics.median(times[v])
        ratio = statistics.median(a / b for a, b in zip(times[v], times["tq"], strict=True))
        rows.append({"variant": v, "ns_per_value": med, "x_tq": ratio})
    meta.update({"command": "python research/scripts/tcq_lookup_bench.py", "rows": args.rows, "rounds": args.rounds})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lookup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "| variant | state | lookup | ns/value (median) | x tq's time (median of rounds) |",
        "|---|---|---|---|---|",
    ]
    what = {
        "gather_taps": ("newest-low, 3 taps (walshkv's tcq)", "gather, 256 float32"),
        "p44_taps": ("newest-low, 3 taps", "P + Q, vpermps pairs"),
        "gather_window": ("one window", "gather, 256 float32"),
        "p44_window": ("one window", "P + Q, vpermps pairs"),
        "i8_44_window": ("one window, as bytes", "P + Q, int8 byte shuffles"),
        "tq": ("(tq:3 codes)", "vpermps, 8 levels"),
    }
    for r in rows:
        st, lk = what[r["variant"]]
        lines.append(f"| {r['variant']} | {st} | {lk} | {r['ns_per_value']:.3f} | {r['x_tq']:.2f} |")
    lines += [
        "",
        f"{args.rows} rows of 64 values at 3 bits, decoded into an L1-resident tile, one thread, {args.rounds} "
        f"interleaved rounds. `{meta['command']}` at {meta['commit']} on {meta['cpu']} ({meta['cpu_capability']}).",
    ]
    (args.out / "lookup.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
