#!/usr/bin/env python3
"""Train the tables of the ``tcq`` trellis codes: one set of tables per file in src/walshkv/ops.

One table per bit width of walshkv.ops.trellis.TRELLIS_BITS and state size of STATE_BITS, each trained by
walshkv.ops.trellis.train_table on unit Gaussian samples (vectors of 64 values, the width pattern of tcq at that
width: a half width codes the first half one bit wider) from fixed seeds, the better of ``--starts`` seeded starts
(by the last round's training MSE) kept. Four sets ship (walshkv.ops.trellis.TABLE_SETS), and a shipped set is never
trained again (its codes would decode to other values): set 1, trellis_tables.json, what ``tcq:B`` reads (20
rounds of 8192 vectors, one start, the torch search); set 2, trellis_tables_2.json, what ``tcq:B:tables=2`` reads
(60 rounds of 16384 vectors, two starts, seeds 1 and 2, the C++ search); set 3, trellis_tables_3.json, what
``tcq:B:tables=3`` reads: split tables (walshkv.ops.trellis.SPLIT_SETS, ``P[s & 15] + Q[s >> 4]``, trained under
that structure, train_table_parts; the file holds each table's parts beside its 256 values, which
are their float32 sums); set 4, trellis_tables_4.json, what ``tcq:B:tables=4`` reads: set 2's tables rounded to
bfloat16 (walshkv.ops.trellis.ROUNDED_SETS; no training: ``--set 4`` rounds them and measures the rounded and the
source table on the same ``--samples`` fresh vectors). The tables are model-independent: tcq
codes the rotated, norm-scaled coordinates, which are close to N(0, 1) for any K/V. The file records each table's
training MSE per round, its gap to D(R) in dB and the command, commit, CPU and library versions; a table is stored
as float32 values written exactly (repr of the float32 as a Python float).

    python scripts/train_trellis_tables.py --set 2 --iterations 60 --samples 16384 --starts 2 --out /tmp/t2.json
    python scripts/train_trellis_tables.py --set 3 --search cpp --iterations 60 --samples 16384 --starts 2
    python scripts/train_trellis_tables.py --set 4 --search cpp --samples 16384
    python scripts/train_trellis_tables.py --check   # every set's file has every table, each of the right size

``--out`` writes elsewhere than the set's file (the shipped files are pinned by their sha256 in
tests/ops/test_trellis.py): retraining a shipped set would change what its saved caches and KLD rows decode to, so
better tables ship as a new set with a new spec option instead.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from walshkv.attention import cpu
from walshkv.eval.provenance import code_commit, cpu_meta
from walshkv.ops import trellis

OPS = Path(__file__).resolve().parents[1] / "src" / "walshkv" / "ops"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="check every set's file, train nothing")
    parser.add_argument("--set", type=int, default=1, choices=trellis.TABLE_SETS, help="table set (default 1)")
    parser.add_argument("--out", type=Path, help="write here instead of the set's file")
    parser.add_argument("--starts", type=int, default=1, help="seeded starts per table, the best kept (default 1)")
    parser.add_argument(
        "--search", choices=("torch", "cpp"), default="torch", help="the trellis search: torch (set 1's) or the C++ one"
    )
    parser.add_argument("--iterations", type=int, default=20, help="training rounds per table (default 20)")
    parser.add_argument("--samples", type=int, default=8192, help="vectors per round (default 8192)")
    parser.add_argument(
        "--state-bits",
        type=int,
        action="append",
        choices=trellis.STATE_BITS,
        help="train only the tables of this L (repeatable; the file's other tables are kept)",
    )
    parser.add_argument(
        "--bits", type=float, action="append", help="train only the tables of this width (repeatable; others kept)"
    )
    args = parser.parse_args(argv)
    if args.check:
        for table_set in trellis.TABLE_SETS:
            path = OPS / trellis.table_file(table_set)
            data = json.loads(path.read_text())
            for bits in trellis.TRELLIS_BITS:
                for state_bits in trellis.STATE_BITS:
                    tab = data["tables"].get(trellis.table_key(bits, state_bits))
                    if tab is None or len(tab) != 1 << state_bits:
                        print(f"{path}: table {trellis.table_key(bits, state_bits)} missing or of the wrong size")
                        return 1
                    source = trellis.ROUNDED_SETS.get(table_set)
                    if source is not None:
                        want = trellis.round_bf16(trellis.table(bits, state_bits, source))
                        if not torch.equal(torch.tensor(tab, dtype=torch.float32), want):
                            print(f"{path}: table {trellis.table_key(bits, state_bits)} is not set {source}'s rounded")
                            return 1
                    if table_set in trellis.SPLIT_SETS:
                        parts = torch.tensor(data["parts"][trellis.table_key(bits, state_bits)], dtype=torch.float32)
                        if not torch.equal(trellis.split_table(parts, state_bits), torch.tensor(tab)):
                            print(f"{path}: table {trellis.table_key(bits, state_bits)} is not the sum of its parts")
                            return 1
            print(f"{path}: {len(data['tables'])} tables, all present")
        return 0
    out = args.out or OPS / trellis.table_file(args.set)
    coder = None
    if args.search == "cpp":
        coder = cpu.tcq_code_rows
        if cpu.load_kernel() is None:
            raise SystemExit("--search cpp: the C++ kernel does not build here (walshkv.attention.cpu)")
    torch.manual_seed(0)
    if args.set in trellis.ROUNDED_SETS:
        return _round(out, args, argv, coder)
    partial = out.exists() and (args.state_bits or args.bits)
    old = json.loads(out.read_text()) if partial else {"tables": {}, "stats": {}}
    tables, stats = old["tables"], old["stats"]
    structure = trellis.SPLIT_SETS.get(args.set)
    parts = old.get("parts", {}) if structure else None
    for state_bits in args.state_bits or trellis.STATE_BITS:
        for bits in args.bits or trellis.TRELLIS_BITS:
            key = trellis.table_key(bits, state_bits)
            seeds = range(args.starts) if args.starts == 1 else range(1, args.starts + 1)
            train = trellis.train_table_parts if structure else trellis.train_table
            runs = [
                train(bits, state_bits, samples=args.samples, iterations=args.iterations, seed=seed, coder=coder)
                for seed in seeds
            ]
            tab, history = min(runs, key=lambda run: run[1][-1])
            if parts is not None:
                parts[key] = [float(v) for v in tab.tolist()]
                tab = trellis.split_table(tab, state_bits)
            tables[key] = [float(v) for v in tab.tolist()]
            gap = 10 * math.log10(history[-1] / 2 ** (-2 * bits))
            stats[key] = {"mse_per_round": history, "gap_db": gap, "starts_last_mse": [r[1][-1] for r in runs]}
            print(f"{key}: mse {history[0]:.5f} -> {history[-1]:.5f}, {gap:.2f} dB above D(R)", flush=True)
            _write(out, tables, stats, args, argv, parts)
    print(f"wrote {out}")
    return 0


def _round(out: Path, args: argparse.Namespace, argv: list[str] | None, coder: object) -> int:
    """A rounded set (walshkv.ops.trellis.ROUNDED_SETS): its source set's tables rounded to bfloat16, each measured
    with the source table on the same ``--samples`` fresh unit Gaussian vectors (seed 0 per table)."""
    source = trellis.ROUNDED_SETS[args.set]
    tables, stats = {}, {}
    for state_bits in trellis.STATE_BITS:
        for bits in trellis.TRELLIS_BITS:
            key = trellis.table_key(bits, state_bits)
            src = trellis.table(bits, state_bits, source)
            tab = trellis.round_bf16(src)
            widths = trellis.step_widths(bits, 64)
            x = torch.randn(args.samples, 64, generator=torch.Generator().manual_seed(0))
            mse = trellis._code_round(x, tab, widths, state_bits, coder)[2]
            src_mse = trellis._code_round(x, src, widths, state_bits, coder)[2]
            tables[key] = [float(v) for v in tab.tolist()]
            gap = 10 * math.log10(mse / 2 ** (-2 * bits))
            stats[key] = {"mse_per_round": [mse], "gap_db": gap, "source_mse": src_mse}
            print(f"{key}: mse {mse:.5f} (set {source}: {src_mse:.5f}), {gap:.2f} dB above D(R)", flush=True)
    _write(out, tables, stats, args, argv, None)
    print(f"wrote {out}")
    return 0


def _write(
    out: Path, tables: dict, stats: dict, args: argparse.Namespace, argv: list[str] | None, parts: dict | None
) -> None:
    meta = {
        "command": "python scripts/train_trellis_tables.py " + " ".join(argv or sys.argv[1:]),
        "commit": code_commit(),
        "cpu": cpu_meta()["model"],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "iterations": args.iterations,
        "samples": args.samples,
        "starts": args.starts,
        "search": args.search,
        "table_set": args.set,
        "values_per_vector": 64,
    }
    if args.set in trellis.ROUNDED_SETS:
        meta.update(iterations=0, starts=1, rounded_from=trellis.ROUNDED_SETS[args.set], rounding="bfloat16")
    data = {"meta": meta, "stats": stats, "tables": tables}
    if parts is not None:
        meta["structure"] = trellis.SPLIT_SETS[args.set]
        data["parts"] = parts
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
