#!/usr/bin/env python3
"""Trellis tables an AVX2 kernel can read without a gather: what the structure costs on a Gaussian source.

tcq's value ``i`` is ``table[state_i]``, a 256-entry float32 lookup (L = 8). AVX-512 VBMI reads it by byte
permutes; AVX2 has only an 8-lane gather, which on a Zen3 EPYC takes about half of a tcq row's decode time
(docs/trellis.md, "Decode speed"). A table that is a *sum of small tables over groups of the state's bits* is read
with register permutes instead (``vpermps`` for 8 float entries, ``pshufb`` for 16 byte entries):

    shipped the table walshkv ships (src/walshkv/ops/trellis_tables.json), not retrained: judged on the same vectors
    full    the shipped kind (256 free entries) trained here, with this script's rounds and vectors
    44      P[s & 15] + Q[s >> 4]                    two 16-entry tables (two pshufb per 32 values as int8)
    332     A[s & 7] + B[(s >> 3) & 7] + C[s >> 6]    three 8-entry tables (three vpermps per 8 values)
    44i8    44 trained as 44, then both tables rounded to integers on one step (the value is an int8 sum,
            |P| + |Q| <= 127: a K row then scores by byte dot products, as rot+int4's does). Rounding inside the
            training loop instead cost 0.4-0.9 dB at 3-4 bits (the Viterbi paths chase the rounding); once at the
            end it costs about nothing

Each kind is trained as the shipped tables are (walshkv.ops.trellis.train_table: unit Gaussian vectors of 64 values,
Viterbi coding, then the table refit; here the refit is a least-squares fit of the small tables to the per-state
means, weighted by the state counts), from one seeded start, and judged on fresh vectors the training never saw, in
dB above D(R) = 2^(-2R) (lower is better). The scalar Lloyd-Max quantizer (tq) at whole widths is the floor every
trellis kind must beat. The coding runs in the C++ kernel's trellis search (walshkv.attention.cpu.tcq_code_rows).

    python research/scripts/trellis_structured.py --out docs/results/trellis/structured   # about 20 min on 2 cores
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from walshkv.attention import cpu
from walshkv.bench.machine import machine_description
from walshkv.ops import trellis
from walshkv.ops.lloyd_max import lloyd_max

KINDS = ("shipped", "full", "44", "332", "44i8")
BITS = (1.5, 2.0, 2.5, 3.0, 3.5, 4.0)
L = 8


def _design(kind: str) -> torch.Tensor:
    """The 0/1 matrix ``M [256, P]`` with ``table = M @ params`` for a kind."""
    s = torch.arange(1 << L)
    if kind == "full":
        return torch.eye(1 << L)
    if kind in ("44", "44i8"):
        groups = [(s & 15, 16), (s >> 4, 16)]
    elif kind == "332":
        groups = [(s & 7, 8), ((s >> 3) & 7, 8), (s >> 6, 4)]
    else:
        raise ValueError(f"unknown kind {kind!r}; kinds: {', '.join(KINDS)}")
    cols = []
    for idx, size in groups:
        cols.append(torch.nn.functional.one_hot(idx, size).float())
    return torch.cat(cols, dim=1)


def _int8(kind: str, params: torch.Tensor, design: torch.Tensor) -> torch.Tensor:
    """44i8: both tables on one integer grid whose step makes the largest |P| + |Q| sum 127."""
    if kind != "44i8":
        return design @ params
    p, q = params[:16], params[16:]
    span = float(p.abs().max() + q.abs().max())
    step = span / 127.0
    return design @ torch.cat([torch.round(p / step), torch.round(q / step)]) * step


def _states(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
    codes = cpu.tcq_code_rows(x, tab, widths, L)
    if codes is None:
        raise RuntimeError("the C++ kernel's trellis search is not available (walshkv.attention.cpu)")
    return trellis.codes_to_states(codes, widths, L)


def train(kind: str, bits: float, samples: int, iterations: int, seed: int) -> tuple[torch.Tensor, list[float]]:
    """One kind's table at one width; returns it and each round's training MSE (before that round's refit)."""
    gen = torch.Generator().manual_seed(seed)
    widths = trellis.step_widths(bits, 64)
    design = _design(kind)
    if kind == "full":
        params = trellis.gaussian_table(L, seed).double()
    else:  # small random tables: a start with no structure of its own (a projection of the full table trains worse)
        params = 0.6 * torch.randn(design.shape[1], generator=gen, dtype=torch.float64)
    history = []
    for _ in range(iterations):
        tab = (design @ params.float()).float()  # the int8 grid only at the end: rounding each round derails training
        x = torch.randn(samples, 64, generator=gen)
        st = _states(x, tab, widths).reshape(-1)
        history.append(float(((x.reshape(-1) - tab[st]) ** 2).mean()))
        n = torch.zeros(1 << L, dtype=torch.float64).index_add_(0, st, torch.ones_like(st, dtype=torch.float64))
        sums = torch.zeros(1 << L, dtype=torch.float64).index_add_(0, st, x.reshape(-1).double())
        w = n.sqrt()
        mean = torch.where(n > 0, sums / n.clamp(min=1), tab.double())
        a = design.double() * w[:, None]
        sol = torch.linalg.lstsq(a, mean * w, driver="gelsd").solution
        params = sol if kind != "full" else torch.where(n > 0, sol, params)
    return _int8(kind, params.float(), design).float(), history


def evaluate(tab: torch.Tensor, bits: float, samples: int, seed: int) -> float:
    """MSE on fresh unit Gaussian vectors (a seed no training round used)."""
    x = torch.randn(samples, 64, generator=torch.Generator().manual_seed(seed))
    widths = trellis.step_widths(bits, 64)
    st = _states(x, tab, widths)
    return float(((x - tab[st]) ** 2).mean())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iterations", type=int, default=60)
    ap.add_argument("--samples", type=int, default=16384, help="vectors of 64 values per training round")
    ap.add_argument("--eval-samples", type=int, default=16384)
    ap.add_argument("--starts", type=int, default=2, help="seeded starts per table; the best by training MSE is kept")
    ap.add_argument("--bits", type=float, action="append", help="widths (default 1.5 .. 4)")
    ap.add_argument("--kind", action="append", choices=KINDS)
    args = ap.parse_args()
    if cpu.load_kernel() is None:
        raise SystemExit("the C++ kernel does not build here; this script needs its trellis search")
    meta = machine_description()  # the commit (and whether the tree is dirty) that runs, read before it runs
    rows = []
    for bits in args.bits or BITS:
        for kind in args.kind or KINDS:
            t0 = time.perf_counter()
            if kind == "shipped":
                tab, history = trellis.table(bits, L), []
            else:  # several starts; the one whose last training round coded best is kept (never the eval set)
                runs = [train(kind, bits, args.samples, args.iterations, seed=s) for s in range(1, args.starts + 1)]
                tab, history = min(runs, key=lambda r: r[1][-1])
            mse = evaluate(tab, bits, args.eval_samples, seed=12345)
            gap = 10 * math.log10(mse / 2 ** (-2 * bits))
            rows.append(
                {
                    "bits": bits,
                    "kind": kind,
                    "mse": mse,
                    "gap_db": gap,
                    "train_mse": history,
                    "table": [float(v) for v in tab.tolist()],
                    "seconds": time.perf_counter() - t0,
                }
            )
            print(f"{bits:g} {kind:5s} {gap:.2f} dB above D(R) ({time.perf_counter() - t0:.0f} s)", flush=True)
    meta.update(
        {
            "starts": args.starts,
            "command": "python research/scripts/trellis_structured.py",
            "iterations": args.iterations,
            "samples": args.samples,
            "eval_samples": args.eval_samples,
            "state_bits": L,
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "structured.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    kinds = args.kind or list(KINDS)
    head = "| bits | " + " | ".join(f"{k} dB" for k in kinds) + " | scalar Lloyd-Max dB |"
    lines = [head, "|---" * (len(kinds) + 2) + "|"]
    for bits in args.bits or BITS:
        cells = []
        for k in kinds:
            r = next(r for r in rows if r["bits"] == bits and r["kind"] == k)
            cells.append(f"{r['gap_db']:.2f}")
        scalar = ""
        if float(bits).is_integer():
            scalar = f"{10 * math.log10(lloyd_max(int(bits), 'gaussian').mse / 2 ** (-2 * bits)):.2f}"
        lines.append(f"| {bits:g} | " + " | ".join(cells) + f" | {scalar} |")
    lines += [
        "",
        f"dB above D(R) on {args.eval_samples} fresh unit Gaussian vectors of 64 values (lower is better); each table "
        f"trained for {args.iterations} rounds of {args.samples} vectors. `{meta['command']}` at {meta['commit']} on "
        f"{meta['cpu']} ({meta['cpu_capability']}).",
    ]
    (args.out / "structured.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
