#!/usr/bin/env python3
"""Train the tables of the ``tcq`` trellis codes: src/walshkv/ops/trellis_tables.json.

One table per bit width of walshkv.ops.trellis.TRELLIS_BITS and state size of STATE_BITS, each trained by
walshkv.ops.trellis.train_table on unit Gaussian samples (vectors of 64 values, the width pattern of tcq at that
width: a half width codes the first half one bit wider) from a fixed seed. The tables are model-independent: tcq
codes the rotated, norm-scaled coordinates, which are close to N(0, 1) for any K/V. The file records each table's
training MSE per round, its gap to D(R) in dB and the command, commit, CPU and library versions; a table is stored
as float32 values written exactly (repr of the float32 as a Python float).

    python scripts/train_trellis_tables.py           # every table (about 10 minutes on 2 cores)
    python scripts/train_trellis_tables.py --check   # the file has every table, each of the right size

Retraining changes what existing tcq codes decode to: saved caches of tcq specs would then decode differently, so
the file's sha256 is part of what a saved tcq cache records (docs/trellis.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from walshkv.eval.provenance import code_commit, cpu_meta
from walshkv.ops import trellis

OUT = Path(__file__).resolve().parents[1] / "src" / "walshkv" / "ops" / "trellis_tables.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="check the file, train nothing")
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
        data = json.loads(OUT.read_text())
        for bits in trellis.TRELLIS_BITS:
            for state_bits in trellis.STATE_BITS:
                tab = data["tables"].get(trellis.table_key(bits, state_bits))
                if tab is None or len(tab) != 1 << state_bits:
                    print(f"{OUT}: table {trellis.table_key(bits, state_bits)} missing or of the wrong size")
                    return 1
        print(f"{OUT}: {len(data['tables'])} tables, all present")
        return 0
    torch.manual_seed(0)
    partial = OUT.exists() and (args.state_bits or args.bits)
    old = json.loads(OUT.read_text()) if partial else {"tables": {}, "stats": {}}
    tables, stats = old["tables"], old["stats"]
    for state_bits in args.state_bits or trellis.STATE_BITS:
        for bits in args.bits or trellis.TRELLIS_BITS:
            key = trellis.table_key(bits, state_bits)
            tab, history = trellis.train_table(bits, state_bits, samples=args.samples, iterations=args.iterations)
            tables[key] = [float(v) for v in tab.tolist()]
            gap = 10 * math.log10(history[-1] / 2 ** (-2 * bits))
            stats[key] = {"mse_per_round": history, "gap_db": gap}
            print(f"{key}: mse {history[0]:.5f} -> {history[-1]:.5f}, {gap:.2f} dB above D(R)", flush=True)
            _write(tables, stats, args, argv)
    print(f"wrote {OUT}")
    return 0


def _write(tables: dict, stats: dict, args: argparse.Namespace, argv: list[str] | None) -> None:
    meta = {
        "command": "python scripts/train_trellis_tables.py " + " ".join(argv or sys.argv[1:]),
        "commit": code_commit(),
        "cpu": cpu_meta()["model"],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "iterations": args.iterations,
        "samples": args.samples,
        "values_per_vector": 64,
    }
    OUT.write_text(json.dumps({"meta": meta, "stats": stats, "tables": tables}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
