"""The fault matrix of docs/reliability.md, counted by running it: one row per test file, its tests and failures.

Usage:
    python scripts/reliability_counts.py [--out docs/results/reliability]   # then paste:
    python scripts/update_readme.py docs/results/reliability/fault-matrix.md docs/reliability.md fault-matrix

Each file of :data:`MATRIX` runs on its own (``python -m pytest FILE -q -m "not slow"``, as CI runs it); the
table takes the counts pytest prints (passed, failed, skipped, errors) and the summary lines the fuzz and the
file matrix print themselves. ``fault-matrix.json`` holds the same numbers with the code commit and the CPU.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from walshkv.eval.provenance import code_commit, cpu_meta
from walshkv.fileio import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[1]

#: (part, file, what is tried). Keep the descriptions true when a file changes.
MATRIX: tuple[tuple[str, str, str], ...] = (
    (
        "codec fuzz",
        "tests/codecs/test_fuzz.py",
        "hypothesis, every entry of `tests/codecs/matrix.py`: random finite blocks `[1-2, 1-3, 1-17, head_dim]` in "
        "fp16/bf16/fp32, per-vector magnitudes 1e-3 .. 1e3 (Gaussian, uniform, heavy-tailed, spike), zero and "
        "constant vectors, random start positions; encode never raises, decode is finite in the input's dtype, "
        "every vector's error is within its family's bound, `Packed.nbytes()` equals the layout's bytes x vectors",
    ),
    (
        "fp16 range",
        "tests/codecs/test_fp16_range.py",
        "every matrix entry at 7 magnitudes up to 65504 (and 3 in fp32), Gaussian/spike/flat/constant blocks: "
        "decoded finite, or refused naming 65504 and fp32",
    ),
    (
        "codec contract",
        "tests/codecs/test_contract.py",
        "round trip, bytes == layout, NaN/Inf refusal, dtypes, head sizes, positions, wrapper order, for every entry",
    ),
    (
        "spec limits",
        "tests/codecs/test_spec_limits.py",
        "layer ranges past any model, wrapper chains past the grammar, `sink:`/`layers:` nested in themselves, a "
        "codec wrapped thousands of times in code: refused at parse time, before anything is built; a rotation "
        "that overflows finite K/V names itself, not the input",
    ),
    (
        "cache faults",
        "tests/cache/test_faults.py",
        "NaN at prefill and decode in every layer position, residual and sink windows, fused and unfused, beams, "
        "padding, crop; a refused step rolled back in every layer",
    ),
    (
        "cache writes",
        "tests/cache/test_write_checks.py",
        "a model with more layers than the cache's config, K/V with other kv heads or head size, layer indices "
        "that are not an index, a `max_cache_len` past the machine: named before any layer changes",
    ),
    (
        "another model's calibration",
        "tests/test_identity.py",
        "a calibration file, statistics and merged calibration of a model with equal shapes but another config, "
        "through the constructor and `from_preset`; files older than the recorded config; a damaged recorded config",
    ),
    (
        "persistence",
        "tests/cache/test_persist.py",
        "save/restore bit-exact for the fixed-size codecs and the presets, continued generation, every corruption "
        "kind refused by reason (docs/persistence.md), a full disk during save (the path named, the old file kept); "
        "entropy-coded files (`at_rest='rans'`) bit-exact for every matrix codec, a blob that does not decode refused",
    ),
    (
        "rANS blobs",
        "tests/ops/test_rans.py",
        "the bits-at-rest coder: round trips at stream boundaries and extreme histograms; truncated blobs, other "
        "magic or version, a damaged frequency table and changed words refused (`RansError`), never decoded to garbage",
    ),
    (
        "file matrix",
        "tests/export/test_file_matrix.py",
        "a full calibration/preset file (K mean, eq+ K and V transforms, RoPE tables, preset keys): truncation at "
        "every 97th byte and in each of the last 64, random bytes, four flips in each tensor's data, another model "
        "(shape, name, architecture, through the cache too), a directory, a missing path, a FIFO, a path under a file",
    ),
    (
        "atomic writes",
        "tests/test_fileio.py",
        "temporary file + rename: an existing file survives errors, a full disk and a file-size limit",
    ),
    (
        "CLI matrix",
        "tests/cli/test_cli_errors.py",
        "bad arguments, missing/unreadable/read-only/full outputs: exit 2 and one line naming the path and the fix, "
        "before any work",
    ),
    (
        "paged cache (vLLM core)",
        "plugins/vllm/tests/test_paged.py",
        "slot writes and block-table reads against walshkv's own decode; slots and block ids past the pages (or "
        "negative), fewer block-table rows than requests, row offsets past the queries: refused by name; the "
        "write CUDA uses (checks on the device) stores the host write's bytes, reads no value back to the host, "
        "and refuses a slot past the pages and NaN/Inf by message",
    ),
    (
        "paged decode (Triton)",
        "tests/attention/test_paged_triton.py",
        "every request in one launch against each alone (Triton's interpreter); block ids past the pages or "
        "negative, too few blocks, an empty request, a NaN query: device-side asserts that name the problem; the "
        "step reads no value back to the host",
    ),
    (
        "kernel build lock",
        "tests/attention/test_build_lock.py",
        "a build lock left by a killed build is removed with a warning (a real build behind it), a live build is "
        "waited for with a bound, then refused naming the lock",
    ),
    (
        "long generation",
        "tests/test_long_generation.py",
        "smollm2-135m, `walshkv:3.5` calibrated on 1,024 python-docs tokens: 300 greedy tokens (default run; 4,000 "
        "with `-m slow`): every step's logits finite, `nbytes() == layout_nbytes()` every 100 steps, bits per "
        "element equal to the spec's `bits_at`",
    ),
)

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
_EXTRA = re.compile(r"^(codec fuzz|file matrix): (.*)$", re.M)


def run_file(path: str) -> dict:
    """Run one matrix file as CI does; its counts, the line it prints about itself, and the seconds it took."""
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", path, "-q", "-m", "not slow", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    counts = {kind.rstrip("s") if kind.startswith("error") else kind: int(n) for n, kind in _COUNT.findall(tail)}
    extra = _EXTRA.search(done.stdout)
    return {
        "file": path,
        "returncode": done.returncode,
        "counts": counts,
        "summary": tail,
        "self_report": extra[2] if extra else None,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [
        f"Counted by `python scripts/reliability_counts.py` at {meta['commit']} on {meta['cpu']['model']} "
        f'({meta["date"]}); each file run alone as CI runs it (`-m "not slow"`).',
        "",
        "| part | file | what is tried | tests (this run) | failures |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        c = row["counts"]
        tests = f"{c.get('passed', 0) + c.get('failed', 0) + c.get('error', 0)} tests"
        if row["self_report"]:
            tests += f"; {row['self_report']}"
        if c.get("skipped"):
            tests += f"; {c['skipped']} skipped"
        bad = c.get("failed", 0) + c.get("error", 0) + (1 if row["returncode"] not in (0, 5) and not c else 0)
        lines.append(f"| {row['part']} | `{row['file']}` | {row['what']} | {tests} | {bad} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/results/reliability", help="folder for fault-matrix.md/.json")
    args = parser.parse_args(argv)
    out = ROOT / args.out
    out.mkdir(parents=True, exist_ok=True)
    commit = code_commit()  # the code the runs below test, read before anything is written
    rows = []
    for part, path, what in MATRIX:
        row = run_file(path)
        row.update(part=part, what=what)
        rows.append(row)
        print(f"{part}: {row['summary']} ({row['seconds']} s)", file=sys.stderr, flush=True)
    meta = {"commit": commit, "cpu": cpu_meta(), "date": time.strftime("%Y-%m-%d")}
    write_json_atomic(out / "fault-matrix.json", {"meta": meta, "rows": rows})
    write_text_atomic(out / "fault-matrix.md", markdown(rows, meta))
    print(f"wrote {out / 'fault-matrix.md'} and fault-matrix.json", file=sys.stderr)
    return 0 if all(r["returncode"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
