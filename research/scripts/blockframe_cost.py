"""Where a block-frame decode step spends its time: the per-block query product against everything else.

A fast preset (``walshkv:B-fast``: ``ropeblock:64+eqr:64+``, docs/codecs.md) decodes one step in three parts
(``walshkv.attention.blockframe.block_frame_decode_cpu``): the query turned and mapped to each block's frame is one
product ``[n_blocks, head_dim] @ [head_dim, group x head_dim]`` per kv head (``group x head_dim² / G`` multiply-adds
per key), built from a small per-step matrix (``W``, ``group x head_dim²`` floats), then the fused kernel scores every
block against its own query and adds the mean's row to each decoded key. This script times, in interleaved rounds on
one thread with the caches flushed before every timed call (as a layer's attention starts inside a model; ``--warm``:
each part right after the one before it), for each model's attention shapes (``walshkv bench attention --model``) and
the model's shipped fast preset:

    sdpa-fp32        torch SDPA over an fp32 cache (the fastest SDPA on these CPUs at one thread)
    step             the whole decode step (``walshkv.attention.decode.decode_attention``, as the cache calls it)
    kernel           the fused kernel alone, given the per-block queries
    query product    the per-block query product alone (torch matmul)
    W                building the per-step matrix the product reads
    no frame         the same codes read after RoPE with one query (the preset's codecs with the frame taken off)

``step - kernel`` is what a kernel that built the block queries itself could save at most, if it made the product as
fast as torch's matmul; ``query product`` is what the frame's dense equalizer costs at any speed of the rest.

    python research/scripts/blockframe_cost.py --kv-len 16384,65536 \\
        --json docs/results/research/blockframe-cost/cost.json --markdown docs/results/research/blockframe-cost/cost.md

The output records the code commit and the CPU (as every walshkv result does).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from walshkv.attention import blockframe
from walshkv.attention.cpu import fused_decode_cpu
from walshkv.attention.decode import decode_attention
from walshkv.bench.attention import attention_shapes
from walshkv.bench.generation import shipped_preset_file
from walshkv.bench.machine import COLD_FLUSH_BYTES, interleaved_seconds, machine_description
from walshkv.codecs.spec import parse_cache_spec
from walshkv.export import read_kv_mean_center
from walshkv.presets import name_specs

MODELS = ("smollm2-135m", "qwen2.5-1.5b", "gemma3-270m", "qwen2.5-0.5b")


def _median_ms(fns: dict[str, object], rounds: int, cold: bool) -> dict[str, float]:
    """Median milliseconds of each function over ``rounds`` interleaved rounds (three warm-up calls each first), as
    ``walshkv bench attention`` times them (:func:`walshkv.bench.machine.interleaved_seconds`).

    ``cold``: the caches flushed before every timed call, so each part starts as a layer's attention does in a model
    (the other layers' weights and caches ran in between); else each part runs after the one before it in the round,
    warm with whatever that one left in the caches.
    """
    times = interleaved_seconds(fns, rounds, warmup=3, budget=0.0, flush_bytes=COLD_FLUSH_BYTES if cold else 0)
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def measure(model: str, preset: str, kv_len: int, rounds: int, cold: bool = True) -> dict[str, object]:
    """One model's row: the parts' median milliseconds at ``kv_len`` cached tokens, batch 1."""
    shapes = attention_shapes(model)
    kv, d = shapes["kv_heads"], shapes["head_dim"]
    group = shapes["q_heads"] // kv
    path = shipped_preset_file(model, preset)
    if path is None:
        raise SystemExit(f"{model}: no shipped calibration for {preset}")
    cal = read_kv_mean_center(str(path))
    (named,) = name_specs([preset], cal, model=model)
    spec = named.spec.bind(0, cal)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, kv, kv_len, d, generator=gen)
    v = torch.randn(1, kv, kv_len, d, generator=gen)
    q = torch.randn(1, kv * group, 1, d, generator=gen)
    sink = spec.sink
    pk, pv = spec.k.encode(k, sink), spec.v.encode(v, sink)
    bp = blockframe.block_frame_plan(spec.k, spec.v, d, d**-0.5)
    if bp is None:
        raise SystemExit(f"{model} {preset}: not a block-frame spec the CPU kernel reads ({named.text})")
    g_len = bp.codec.block
    off = sink % g_len
    n_blocks = -(-(off + pk.seq_len) // g_len)
    qg = q.reshape(1, kv, group, d)

    def build_w() -> torch.Tensor:
        return blockframe.block_query_matrix(qg, bp)

    cs = bp.block_angles((sink - off) // g_len, n_blocks)
    w = build_w()
    qb = torch.matmul(cs, w).reshape(1, kv, n_blocks, group, d)
    post = parse_cache_spec(named.text.replace(f"ropeblock:{g_len}+eqr:{g_len}+", ""))
    ppk, ppv = post.k.encode(k, sink), post.v.encode(v, sink)
    kf, vf = k.clone(), v.clone()
    fns = {
        "sdpa-fp32": lambda: torch.nn.functional.scaled_dot_product_attention(q, kf, vf, enable_gqa=True),
        "step": lambda: decode_attention(q, pk, pv, spec.k, spec.v, backend="auto", start=sink),
        "kernel": lambda: fused_decode_cpu(
            qb, bp.plan, pk, pv, query_block=g_len, key_table=bp.table_buffer, block_offset=off, in_buffer=True
        ),
        "query product": lambda: torch.matmul(cs, w),
        "W": build_w,
        "no frame": lambda: decode_attention(q, ppk, ppv, post.k, post.v, backend="auto", start=sink),
    }
    ms = _median_ms(fns, rounds, cold)
    macs = kv * n_blocks * d * group * d
    return {
        "model": model,
        "preset": preset,
        "spec": named.text,
        "kv_len": kv_len,
        "shape": {"head_dim": d, "kv_heads": kv, "group": group},
        "ms": ms,
        "query_product_macs": macs,
        "query_product_gmacs": macs / ms["query product"] / 1e6,
        "rounds": rounds,
        "cold": cold,
    }


def _markdown(rows: list[dict[str, object]], meta: dict[str, object]) -> str:
    head = (
        "| model (head_dim, GQA) | kv_len | SDPA fp32 ms | step ms | kernel ms | query product ms (GMAC/s) | W ms | "
        "step - kernel ms | no frame ms | step x fastest SDPA | no frame x fastest SDPA |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        ms, s = r["ms"], r["shape"]
        lines.append(
            f"| {r['model']} ({s['head_dim']}, {s['group']}) | {r['kv_len']:,} | {ms['sdpa-fp32']:.3f} | "
            f"{ms['step']:.3f} | {ms['kernel']:.3f} | {ms['query product']:.3f} ({r['query_product_gmacs']:.1f}) | "
            f"{ms['W']:.3f} | {ms['step'] - ms['kernel']:.3f} | {ms['no frame']:.3f} | "
            f"{ms['sdpa-fp32'] / ms['step']:.2f} | {ms['sdpa-fp32'] / ms['no frame']:.2f} |"
        )
    machine = meta["machine"]
    foot = (
        f"\nEach model's shipped `{rows[0]['preset']}` (the block frame) on its attention shapes, batch 1, one thread, "
        f"medians of {rows[0]['rounds']} interleaved rounds"
        + (
            ", the caches flushed before every timed call"
            if rows[0].get("cold")
            else ", each part warm from the one before"
        )
        + f"; `no frame`: the same codes read after RoPE with one "
        f"query. `{meta['command']}` at {machine.get('commit', '?')} on {machine.get('cpu', '?')} "
        f"(ISA {machine.get('cpu_capability', '?')}).\n"
    )
    return head + "\n".join(lines) + "\n" + foot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated models (default: %(default)s)")
    ap.add_argument("--preset", default="walshkv:3.5-fast", help="a block-frame preset (default: %(default)s)")
    ap.add_argument("--kv-len", default="16384,65536", help="comma-separated cached tokens (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=15, help="interleaved timed rounds (default: %(default)s)")
    ap.add_argument(
        "--warm",
        action="store_true",
        help="time each part right after the one before it, without flushing the caches between calls (default: "
        "flush before every timed call, as a layer in a model starts cold)",
    )
    ap.add_argument("--json", type=Path, help="write the rows and the machine here")
    ap.add_argument("--markdown", type=Path, help="write the table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meta = {
        "machine": machine_description(),
        "command": "python " + " ".join(["research/scripts/blockframe_cost.py", *sys.argv[1:]]),
    }
    rows = []
    for model in args.models.split(","):
        for n in (int(x) for x in args.kv_len.split(",")):
            rows.append(measure(model, args.preset, n, args.rounds, cold=not args.warm))
            print(json.dumps({k: rows[-1][k] for k in ("model", "kv_len", "ms")}), flush=True)
    md = _markdown(rows, meta)
    print(md)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
