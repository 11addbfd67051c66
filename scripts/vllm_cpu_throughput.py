#!/usr/bin/env python3
"""Generation throughput in vLLM on CPU: walshkv cache dtypes against vLLM's own cache, concurrent requests.

Run it with the plugin environment's Python (docs/serving.md, "vLLM"):

    .venv-vllm/bin/python scripts/vllm_cpu_throughput.py --dtype auto --dtype walshkv_rot_int4 --ctx 2048

For each context length and cache dtype, in a process of its own (vLLM keeps global state), it starts
``vllm.LLM`` on smollm2-135m (float32, eager, ``--requests`` concurrent sequences), builds that many prompts of
``ctx`` tokens from different places of Austen's Emma, adds them to the engine at once (``1 + --new`` new tokens
each, EOS ignored) and steps it by hand, timing each step. Prefill is the time until every request has its first
token; decode throughput is ``requests`` over the median pure-decode step (one in which every request gains exactly
one token), over all steps of ``--repeats`` batches after a warm-up. walshkv dtypes use quantize-on-write
prefill (``WALSHKV_VLLM_PREFILL=quantized``), the harness's convention, unless ``--prefill exact``.

Writes docs/results/vllm/cpu-throughput.{json,md} (each dtype's tokens/s and its ratio to ``auto`` in the same run,
the CPU, thread count and code commit, and a last line with each dtype's decode ratios and the context from
which it is faster); ``scripts/update_readme.py`` pastes the table into docs/serving.md. ``--render JSON`` rewrites
the markdown of an earlier run without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path("~/.cache/walshkv/float/smollm2-135m").expanduser()
TEXT = ROOT.parent / "shared" / "data" / "austen_emma.txt"


def _prompts(model: str, ctx: int, n: int) -> list[list[int]]:
    """``n`` prompts of ``ctx`` tokens from evenly spaced places of the text (different prefixes: no prefix
    caching between them)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(TEXT.read_text(encoding="utf-8"))
    step = max(1, (len(ids) - ctx) // max(1, n))
    if len(ids) < ctx + step * (n - 1):
        raise SystemExit(f"{TEXT} has {len(ids)} tokens, too few for {n} prompts of {ctx}")
    return [ids[i * step : i * step + ctx] for i in range(n)]


def _child(dtype: str, ctx: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_space))
    if dtype.startswith("walshkv_"):
        os.environ["WALSHKV_VLLM_CPU"] = "1"  # vLLM's CPU platform ignores --attention-backend
        os.environ.setdefault("WALSHKV_VLLM_PREFILL", args.prefill)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in _prompts(args.model, ctx, args.requests)]
    llm = LLM(
        model=args.model,
        kv_cache_dtype=dtype,
        enforce_eager=True,
        dtype="float32",
        max_model_len=ctx + args.new + 16,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, ctx + args.new + 16),
        enable_prefix_caching=False,
    )

    engine = llm.llm_engine

    def run(tokens: int, cut: int | None = None) -> tuple[float, list[float]]:
        """One batch through the engine, step by step: the seconds until every request has its first token (the
        prefill) and the seconds of each pure decode step (every request gains exactly one token)."""
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(prompts):
            p = p if cut is None else TokensPrompt(prompt_token_ids=p["prompt_token_ids"][:cut])
            engine.add_request(f"r{run.calls}-{i}", p, params)
        run.calls += 1
        seen: dict[str, int] = {}
        steps: list[float] = []
        prefill = None
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            s0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - s0
            before = dict(seen)
            for o in outs:
                seen[o.request_id] = len(o.outputs[0].token_ids)
            if prefill is None and len(seen) == len(prompts):
                prefill = time.perf_counter() - t0
            elif (
                len(before) == len(prompts)
                and len(outs) == len(prompts)
                and all(seen[k] == before[k] + 1 for k in seen)
            ):
                steps.append(dt)
        if len(seen) != len(prompts) or any(v != tokens for v in seen.values()):
            raise SystemExit(f"expected {tokens} tokens from each of {len(prompts)} requests, got {seen}")
        return prefill, steps

    run.calls = 0
    run(3, cut=256)  # warm-up on short prompts: kernels built
    pre, steps = [], []
    for _ in range(args.repeats):
        p, s = run(1 + args.new)
        pre.append(p)
        steps.extend(s)
    p, step = statistics.median(pre), statistics.median(steps)
    result = {
        "dtype": dtype,
        "ctx": ctx,
        "prefill_s": p,
        "decode_step_s": step,
        "decode_steps": len(steps),
        "decode_tok_s": args.requests / step,
        "prefill_tok_s": args.requests * ctx / p,
        "runs": {"prefill_s": pre, "decode_step_s": steps},
        "threads": torch.get_num_threads(),
    }
    print("RESULT " + json.dumps(result), flush=True)


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


def _table(meta: dict, rows: list[dict]) -> str:
    lines = [
        f"vLLM on CPU ({meta['cpu']}, {meta['threads']} threads), code {meta['commit']}; smollm2-135m float32, "
        f"{meta['requests']} concurrent requests, {meta['new']} new tokens each after a prompt of `ctx` tokens "
        f"(Emma), walshkv prefill {meta['prefill']}; decode tok/s is requests over the median decode step "
        f"({meta['repeats']} batch(es)). Produced by "
        "`python scripts/vllm_cpu_throughput.py`.",
        "",
        "| ctx | kv cache dtype | decode tok/s | x auto | prefill tok/s | x auto |",
        "|---|---|---|---|---|---|",
    ]
    base = {r["ctx"]: r for r in rows if r.get("dtype") == "auto" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['ctx']} | {r['dtype']} | failed (see the json) | | | |")
            continue
        b = base.get(r["ctx"])
        dx = f"{r['decode_tok_s'] / b['decode_tok_s']:.2f}" if b else "—"
        px = f"{r['prefill_tok_s'] / b['prefill_tok_s']:.2f}" if b else "—"
        lines.append(
            f"| {r['ctx']:,} | {r['dtype']} | {r['decode_tok_s']:.1f} | {dx} | {r['prefill_tok_s']:.0f} | {px} |"
        )
    for dtype in dict.fromkeys(r["dtype"] for r in rows if r["dtype"] != "auto" and "error" not in r):
        pairs = [
            (r["ctx"], r["decode_tok_s"] / base[r["ctx"]]["decode_tok_s"])
            for r in rows
            if r["dtype"] == dtype and "error" not in r and r["ctx"] in base
        ]
        if not pairs:
            continue
        faster = next((c for c, x in pairs if x >= 1 and all(y >= 1 for cc, y in pairs if cc >= c)), None)
        where = f"faster from {faster:,} tokens on" if faster is not None else "not faster at any context measured"
        ratios = ", ".join(f"{x:.2f}x at {c:,}" for c, x in pairs)
        lines += ["", f"{dtype} decode against auto: {ratios}; {where}."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", action="append", help="kv cache dtype, repeatable (default: auto walshkv_rot_int4)")
    ap.add_argument("--ctx", type=int, action="append", help="prompt tokens, repeatable (default: 2048)")
    ap.add_argument("--requests", type=int, default=8, help="concurrent requests (default 8)")
    ap.add_argument(
        "--new", type=int, default=32, help="new tokens per request, about that many decode steps timed (default 32)"
    )
    ap.add_argument(
        "--repeats", type=int, default=1, help="timed batches (default 1; decode: the median over all their steps)"
    )
    ap.add_argument("--prefill", choices=("quantized", "exact"), default="quantized", help="walshkv prefill mode")
    ap.add_argument("--kv-space", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE in GiB (default 4)")
    ap.add_argument("--model", default=str(MODEL), help="a Hugging Face model folder (walshkv eval writes this one)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results" / "vllm"))
    ap.add_argument("--render", metavar="JSON", help="only write the markdown of an earlier run's json (no runs)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.render:
        data = json.loads(Path(args.render).read_text())
        text = _table(data["meta"], data["rows"])
        Path(args.render).with_suffix(".md").write_text(text)
        print(text)
        return 0
    if args.child:
        _child(args.child[0], int(args.child[1]), args)
        return 0
    if not Path(args.model).is_dir():
        raise SystemExit(
            f"{args.model} is not a model folder: run `walshkv models fetch smollm2-135m --float` (in walshkv's "
            "environment) once to write it"
        )
    passed = [a for a in sys.argv[1:]]
    rows = []
    for ctx in args.ctx or [2048]:
        for dtype in args.dtype or ["auto", "walshkv_rot_int4"]:
            cmd = [sys.executable, __file__, *passed, "--child", dtype, str(ctx)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True)
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                rows.append({"dtype": dtype, "ctx": ctx, "error": (proc.stdout + proc.stderr)[-4000:]})
            else:
                rows.append(json.loads(line[len("RESULT ") :]) | {"wall_s": time.perf_counter() - t0})
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("runs", "error")}), flush=True)
    threads = next((r["threads"] for r in rows if "threads" in r), os.cpu_count())
    meta = {
        "commit": _commit(),
        "cpu": _cpu(),
        "threads": threads,
        "requests": args.requests,
        "new": args.new,
        "repeats": args.repeats,
        "prefill": args.prefill,
        "model": args.model,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (out / "cpu-throughput.md").write_text(_table(meta, rows))
    print(_table(meta, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
