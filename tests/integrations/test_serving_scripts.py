"""scripts/peer_intervals.py and scripts/vllm_cpu_throughput.py's tables: rules on hand-made rows, and the committed
results they produced."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


intervals = _load("peer_intervals")
throughput = _load("vllm_cpu_throughput")


def _row(name: str, windows: list[float], bits: float = 4.0) -> dict:
    return {
        "codec": name,
        "preset": name,
        "bits_per_element": bits,
        "kld_mean": sum(windows) / len(windows),
        "kld_mean_ci95": [min(windows), max(windows)],
        "top1_agreement": 0.9,
        "window_kld_mean": windows,
    }


def test_paired_column_is_each_row_minus_the_anchor(tmp_path: Path) -> None:
    rows = [
        _row("fp16", [0.0, 0.0, 0.0, 0.0], 16),
        _row("walshkv:4.5", [0.01, 0.02, 0.01, 0.02]),
        _row("worse", [0.05, 0.06, 0.05, 0.06], 8),
        _row("tie", [0.011, 0.019, 0.012, 0.018], 8),
    ]
    meta = {"model": {"name": "m"}, "windows": 4, "ctx": 512, "scored_tokens": 1020, "versions": {"commit": "abc"}}
    path = tmp_path / "m-exact.json"
    path.write_text(json.dumps({"meta": meta, "results": rows}))
    text = intervals.table(path)
    assert "#### m, exact prefill" in text and "code abc" in text
    lines = {ln.split(" | ")[0].strip("| "): ln for ln in text.splitlines() if ln.startswith("| ")}
    assert "fp16" not in lines  # the reference row says nothing
    assert lines["walshkv:4.5"].rstrip().endswith("|  |  |")  # no pair with itself
    assert "+0.0400 | [+0.0400, +0.0400]" in lines["worse"]  # every window 0.04 worse: a verdict
    low, high = lines["tie"].split(" | ")[-1].strip("| []").split(", ")
    assert float(low) <= 0 <= float(high)  # straddles zero: a tie


def test_committed_intervals_match_their_files() -> None:
    out = ROOT / "docs" / "results" / "vllm-peers" / "intervals.md"
    for name in ("smollm2-135m-quantized.json", "qwen2.5-1.5b-quantized.json", "lmcache-smollm2-135m.json"):
        assert intervals.table(ROOT / "docs" / "results" / "vllm-peers" / name) in out.read_text()


@pytest.mark.parametrize(
    ("ratios", "verdict"),
    [
        ([0.5, 0.9, 1.1, 1.2], "faster from 4,096 tokens on"),
        ([0.5, 1.1, 0.9, 1.2], "faster from 8,000 tokens on"),  # a dip later moves the crossover
        ([0.5, 0.6, 0.7, 0.8], "not faster at any context measured"),
    ],
)
def test_throughput_verdict_line(ratios: list[float], verdict: str) -> None:
    rows = []
    for ctx, x in zip((512, 2048, 4096, 8000), ratios, strict=True):
        rows.append({"dtype": "auto", "ctx": ctx, "decode_tok_s": 100.0, "prefill_tok_s": 300.0})
        rows.append({"dtype": "walshkv_x", "ctx": ctx, "decode_tok_s": 100.0 * x, "prefill_tok_s": 300.0})
    meta = {"cpu": "c", "threads": 2, "commit": "abc", "requests": 8, "new": 32, "repeats": 1, "prefill": "quantized"}
    text = throughput._table(meta, rows)
    assert text.rstrip().splitlines()[-1].endswith(verdict + ".")
    assert f"{ratios[0]:.2f}x at 512" in text


@pytest.mark.parametrize("name", ["cpu-throughput", "cpu-throughput-xeon"])
def test_committed_throughput_renders_from_its_json(name: str) -> None:
    data = json.loads((ROOT / "docs" / "results" / "vllm" / f"{name}.json").read_text())
    assert throughput._table(data["meta"], data["rows"]) == (ROOT / f"docs/results/vllm/{name}.md").read_text()
    assert "dirty" not in data["meta"]["commit"]


def test_gpu_paged_check_runs_its_correctness_part_on_the_cpu(tmp_path: Path) -> None:
    """The prepared GPU script (scripts/gpu_check.sh step 3) in its smoke mode: the Triton kernel under its
    interpreter, so that a GPU session does not find it broken."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "plugins" / "vllm" / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_paged_check.py"), "--device", "cpu", "--ctx", "40"]
    cmd += ["--requests", "2", "--spec", "rot+int4", "--spec", "tq:4/tq:3", "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads((tmp_path / "paged_check.json").read_text())["rows"]
    assert [r["spec"] for r in rows] == ["rot+int4", "tq:4/tq:3"]
    assert all(r["max_abs_err_vs_reference"] < 1e-4 for r in rows)
