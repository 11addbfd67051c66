"""Time one decode step of attention: torch SDPA over float caches against decode_attention over packed ones.

    python benchmarks/decode_attention.py --kv-lens 1024,16384 --json out.json

Shape: smollm2-135m's attention (batch 1, 3 kv heads, 9 query heads, head_dim 64) at each kv length.
Every method runs in the same process, interleaved round by round (so load on a shared machine hits
them alike), after a warm-up; in each round a method is called once untimed and then timed, so every
method is measured with its own data just read (warm caches; a real decode step, which streams the
other layers in between, sees colder ones). The table shows medians, ratios against SDPA over fp16
and fp32 caches measured in the same run, and the effective bandwidth (cache bytes read per second)
against the machine's copy bandwidth, measured here as STREAM does (``dst.copy_(src)`` of 256 MB:
bytes read plus bytes written per second). Each packed result is checked against SDPA on the
decoded cache.
Not imported by the package.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from walshkv.codecs.spec import parse_codec
from walshkv.ops.attention import decode_attention
from walshkv.ops.attention_cpu import kernel_available

CODECS = ("rot+int4", "int4", "rot+int3", "int8", "q4_0", "q8_0")
FLOATS = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
BATCH, KV_HEADS, Q_HEADS, HEAD_DIM = 1, 3, 9, 64


def copy_bandwidth(mbytes: int = 256, repeats: int = 5) -> float:
    """STREAM-style copy bandwidth in GB/s: (bytes read + bytes written) / median time."""
    n = mbytes * 2**20 // 4
    src = torch.rand(n)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / statistics.median(times) / 1e9


def interleaved_medians(fns: dict[str, Callable[[], object]], warmup: int, min_rounds: int, budget_s: float) -> dict:
    """Median seconds per call of each function, timed round-robin (one untimed call before each timed one)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_rounds or (time.perf_counter() - start < budget_s and rounds < 200):
        for name, fn in fns.items():
            fn()  # untimed: every method is timed with its own data just touched, whatever ran before it
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_length(t: int, args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator().manual_seed(t)
    k = torch.randn(BATCH, KV_HEADS, t, HEAD_DIM, generator=gen)
    v = torch.randn(BATCH, KV_HEADS, t, HEAD_DIM, generator=gen)
    q = torch.randn(BATCH, Q_HEADS, 1, HEAD_DIM, generator=gen)
    fns: dict[str, Callable[[], object]] = {}
    nbytes: dict[str, int] = {}
    errors: dict[str, float] = {}
    for name, dt in FLOATS.items():
        kd, vd, qd = k.to(dt), v.to(dt), q.to(dt)
        fns[f"sdpa-{name}"] = lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)
        nbytes[f"sdpa-{name}"] = 2 * kd.numel() * kd.element_size()
    qx = q.to(FLOATS[args.q_dtype])
    backends = [("auto", "")] + ([("reference", " (reference)")] if args.reference else [])
    for spec in args.codecs:
        codec = parse_codec(spec)
        pk, pv = codec.encode(k), codec.encode(v)
        want = F.scaled_dot_product_attention(qx.float(), codec.decode(pk), codec.decode(pv), enable_gqa=True)
        for backend, suffix in backends:
            name = spec + suffix

            def run(pk=pk, pv=pv, codec=codec, backend=backend) -> torch.Tensor:
                return decode_attention(qx, pk, pv, codec, codec, backend=backend)

            fns[name] = run
            nbytes[name] = pk.nbytes() + pv.nbytes()
            errors[name] = float((run().float() - want).abs().max())
    med = interleaved_medians(fns, args.warmup, args.min_rounds, args.budget)
    rows = []
    for name, sec in med.items():
        rows.append(
            {
                "kv_len": t,
                "method": name,
                "median_us": sec * 1e6,
                "vs_sdpa_fp16": med["sdpa-fp16"] / sec,
                "vs_sdpa_fp32": med["sdpa-fp32"] / sec,
                "cache_bytes": nbytes[name],
                "effective_GBps": nbytes[name] / sec / 1e9,
                "max_abs_err_vs_sdpa_on_decoded": errors.get(name),
            }
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-lens", default="1024,4096,16384,65536", help="comma-separated kv lengths")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec specs")
    ap.add_argument("--q-dtype", default="fp32", choices=sorted(FLOATS), help="query dtype for decode_attention")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--min-rounds", type=int, default=7, help="timed calls per method, at least")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per kv length (more rounds)")
    ap.add_argument("--reference", action="store_true", help="also time the pure-torch reference backend")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()
    args.codecs = [c for c in args.codecs.split(",") if c]
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel = kernel_available()  # builds the C++ kernel before any timing
    bw = copy_bandwidth()
    rows: list[dict] = []
    for t in (int(x) for x in args.kv_lens.split(",") if x):
        rows += bench_length(t, args)
    for r in rows:
        r["fraction_of_copy_bandwidth"] = r["effective_GBps"] / bw
    print(
        f"batch {BATCH}, {KV_HEADS} kv heads, {Q_HEADS} query heads, head_dim {HEAD_DIM}; "
        f"torch threads {torch.get_num_threads()}; fused CPU kernel {'built' if kernel else 'UNAVAILABLE'}; "
        f"copy bandwidth {bw:.1f} GB/s (read + write)"
    )
    head = f"{'kv_len':>7} {'method':<22} {'median us':>10} {'x fp16':>7} {'x fp32':>7} {'MB read':>8} {'GB/s':>6}"
    print(head + f" {'% copy':>7} {'max err':>8}")
    for r in rows:
        err = "" if r["max_abs_err_vs_sdpa_on_decoded"] is None else f"{r['max_abs_err_vs_sdpa_on_decoded']:.1e}"
        print(
            f"{r['kv_len']:>7} {r['method']:<22} {r['median_us']:>10.1f} {r['vs_sdpa_fp16']:>7.2f} "
            f"{r['vs_sdpa_fp32']:>7.2f} {r['cache_bytes'] / 1e6:>8.2f} {r['effective_GBps']:>6.2f} "
            f"{100 * r['fraction_of_copy_bandwidth']:>6.1f}% {err:>8}"
        )
    print("x fp16 / x fp32: speed relative to SDPA over an fp16 / fp32 cache in this run (>1 = faster)")
    if args.json:
        meta = {
            "shape": {"batch": BATCH, "kv_heads": KV_HEADS, "q_heads": Q_HEADS, "head_dim": HEAD_DIM},
            "q_dtype": args.q_dtype,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(),
            "fused_kernel": kernel,
            "copy_GBps_read_plus_write": bw,
            "timing": "median of interleaved rounds after warm-up",
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
