"""``walshkv bench``: decode attention and end-to-end generation speed, as ratios against baselines
measured in the same run (these machines are shared and noisy, so absolute times mean little).

1. **Attention** (``--part attention``): one decode step (one query token per sequence, GQA) against
   ``kv_len`` cached tokens of random K/V. Baselines: torch SDPA over fp16, bf16 and fp32 caches (query
   in the cache's dtype). Each codec: :func:`walshkv.ops.attention.decode_attention` straight from the
   packed codes (fp32 query). The methods of one ``kv_len`` are timed in interleaved rounds (each
   round calls every method once), so a slow phase of a shared machine slows the baselines and the
   codecs alike. Per row: median time per step, the ratio against SDPA-fp16 and SDPA-fp32 (median
   over rounds of the per-round ratio; above 1: faster), the cache bytes the step reads and the
   effective GB/s they imply,
   against this machine's copy bandwidth measured in the same run (``dst.copy_(src)`` of 256 MB).
2. **Generation** (``--part generation``): the model reads ``ctx`` tokens of text (prefill in chunks of
   ``--prefill-chunk``, so no ctx x ctx mask is ever built) and then greedily generates ``--new-tokens``
   tokens one at a time, with a ``DynamicCache`` (fp32, torch SDPA) and with ``CompressedCache(codec,
   fused=True)`` (attention straight from the packed codes). Each run is a fresh subprocess, so its
   peak resident memory (``VmHWM``) is its own. Per row: decode tokens per second, prefill seconds,
   cache bytes, resident memory after loading the model, peak, and the peak's excess over
   (memory after loading + cache bytes): the fixed overhead. The crossover is the smallest measured
   context at which the compressed cache decodes at least as fast as ``DynamicCache``. The compressed
   cache is built with ``max_cache_len = ctx + new_tokens`` (its store is allocated once;
   ``--no-reserve``: grown by 1/8 when full). Every child runs with glibc's
   ``MALLOC_MMAP_THRESHOLD_`` set to ``--malloc-mmap-threshold`` bytes (default 65536; 0 keeps glibc's
   default): allocations above it are mapped and returned to the system when freed. With glibc's
   default, the heap keeps freed blocks of the growing per-chunk tensors (for either cache), and the
   peak grows with context by more than the cache does; both settings are in docs/performance.md.

Outputs in ``--out``: ``bench.json``, ``bench.csv``, ``bench.md`` and ``bench.png``.
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
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_ATTENTION_CODECS",
    "add_bench_parser",
    "bench_attention",
    "bench_generation",
    "copy_bandwidth",
    "machine_description",
]

DEFAULT_ATTENTION_CODECS: tuple[str, ...] = (
    "rot+int4",
    "int4",
    "rot+int3",
    "rot+int8",
    "q4_0",
    "q8_0",
    "vht2:5,5,4,3",
    "tq:4/tq:2.5",
)
DEFAULT_KV_LENS: tuple[int, ...] = (1024, 4096, 16384, 65536)
DEFAULT_CONTEXTS: tuple[int, ...] = (1024, 8192, 32768)
SDPA_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def machine_description() -> dict[str, Any]:
    """CPU model, cores visible to torch, memory, library versions."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def _median_seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, budget: float = 2.0, device: str = "cpu"
) -> float:
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or (len(times) < 3 * repeats and time.perf_counter() - started < budget):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - started > 4 * budget and len(times) >= 3:
            break
    return statistics.median(times)


def _interleaved_seconds(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2, budget: float = 3.0, device: str = "cpu"
) -> dict[str, list[float]]:
    """Per-call seconds of every function, timed in rounds that call each function once, in turn.

    At least ``repeats`` rounds, and up to ``3 * repeats`` while within ``budget`` seconds.
    """
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    started = time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < 3 * repeats and time.perf_counter() - started < budget):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """The device's copy bandwidth in GB/s (bytes read + written per second), ``dst.copy_(src)``."""
    n = megabytes * 2**20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    sec = _median_seconds(lambda: dst.copy_(src), repeats, warmup=1, device=device)
    return 2 * src.numel() * 4 / sec / 1e9


@torch.inference_mode()
def bench_attention(
    kv_lens: Sequence[int] = DEFAULT_KV_LENS,
    codecs: Sequence[str] = DEFAULT_ATTENTION_CODECS,
    *,
    head_dim: int = 64,
    kv_heads: int = 3,
    q_heads: int = 9,
    batch: int = 1,
    repeats: int = 7,
    seed: int = 0,
    device: str = "cpu",
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Time one decode step per method and kv_len (see the module docstring).

    ``device="cuda"`` times the same steps on a GPU (SDPA on CUDA tensors against the Triton backend,
    which ``decode_attention`` picks for CUDA tensors; codecs it does not read use the reference).

    Returns:
        Rows ``{"kv_len", "method", "ms", "cache_bytes", "gb_per_s", "speedup_vs_sdpa_fp16",
        "speedup_vs_sdpa_fp32", "backend"}``; codec rows also ``encode_ms``, the time to write one
        token's K and V (what every decode step adds).
    """
    from tqdm.auto import tqdm

    from walshkv.codecs import parse_cache_spec
    from walshkv.ops.attention import decode_attention
    from walshkv.ops.attention_cpu import cpu_supports
    from walshkv.ops.attention_triton import triton_supports

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this torch has no CUDA device; use --device cpu")
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    fast = (
        (lambda c: triton_supports(c, head_dim)) if device.startswith("cuda") else (lambda c: cpu_supports(c, head_dim))
    )
    specs = {c: parse_cache_spec(c) for c in codecs}
    for spec in specs.values():
        spec.check_head_dim(head_dim)
    gen = torch.Generator().manual_seed(seed)
    rows: list[dict[str, Any]] = []
    jobs = len(kv_lens) * (len(SDPA_DTYPES) + len(codecs))
    bar = tqdm(total=jobs, desc="bench attention", unit="case", disable=not progress)
    for n in kv_lens:
        k = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device)
        v = torch.randn(batch, kv_heads, n, head_dim, generator=gen).to(device)
        q = torch.randn(batch, q_heads, 1, head_dim, generator=gen).to(device)
        fns: dict[str, Callable[[], Any]] = {}
        info: dict[str, tuple[int, str]] = {}  # method -> (cache bytes, backend)
        for name, dt in SDPA_DTYPES.items():
            kc, vc, qc = k.to(dt), v.to(dt), q.to(dt)

            def sdpa(qc: torch.Tensor = qc, kc: torch.Tensor = kc, vc: torch.Tensor = vc) -> torch.Tensor:
                return torch.nn.functional.scaled_dot_product_attention(qc, kc, vc, enable_gqa=True)

            fns[f"sdpa-{name}"] = sdpa
            info[f"sdpa-{name}"] = (2 * kc.numel() * kc.element_size(), "torch")
        encode_ms: dict[str, float] = {}
        for spec_name, spec in specs.items():
            pk, pv = spec.k.encode(k), spec.v.encode(v)
            kernel = "triton" if device.startswith("cuda") else "cpu"

            def fused(pk: Any = pk, pv: Any = pv, spec: Any = spec, q: torch.Tensor = q) -> torch.Tensor:
                return decode_attention(q, pk, pv, spec.k, spec.v)

            fns[spec_name] = fused
            info[spec_name] = (pk.nbytes() + pv.nbytes(), kernel if fast(spec.k) and fast(spec.v) else "reference")
            k1, v1 = k[:, :, -1:], v[:, :, -1:]  # writing one decode step's token (quantize on write)
            encode_ms[spec_name] = 1e3 * _median_seconds(
                lambda s=spec, a=k1, b=v1: (s.k.encode(a), s.v.encode(b)), repeats, device=device
            )
        times = _interleaved_seconds(fns, repeats, device=device)
        for method, ts in times.items():
            nbytes, backend = info[method]
            row = _row(n, method, statistics.median(ts), nbytes, backend)
            # paired ratios: each round times every method once, so a slow phase of a shared machine
            # hits the baseline and the method alike; the median over rounds of the per-round ratio
            row["speedup_vs_sdpa_fp16"] = statistics.median(b / t for b, t in zip(times["sdpa-fp16"], ts, strict=True))
            row["speedup_vs_sdpa_fp32"] = statistics.median(b / t for b, t in zip(times["sdpa-fp32"], ts, strict=True))
            row["rounds"] = len(ts)
            if method in encode_ms:
                row["encode_ms"] = encode_ms[method]
            rows.append(row)
            bar.update()
    bar.close()
    return rows


def _row(n: int, method: str, sec: float, nbytes: int, backend: str) -> dict[str, Any]:
    return {
        "kv_len": n,
        "method": method,
        "seconds": sec,
        "ms": 1e3 * sec,
        "cache_bytes": nbytes,
        "gb_per_s": nbytes / sec / 1e9,
        "backend": backend,
    }


# ---------------------------------------------------------------------------------------------------------
# End-to-end generation (one subprocess per run)
# ---------------------------------------------------------------------------------------------------------


def _vm(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


@torch.inference_mode()
def _generation_child(job: dict[str, Any]) -> dict[str, Any]:
    """One generation run (called in a fresh process by :func:`bench_generation`)."""
    from transformers import DynamicCache

    from walshkv.cache import CompressedCache, enable_fused_attention
    from walshkv.data import load_text
    from walshkv.models import load_model

    torch.manual_seed(0)
    lm = load_model(job["model"], progress=False)
    model = lm.model
    text = load_text(job["text"]).content
    ids = lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    ctx = job["ctx"]
    while ids.shape[1] < ctx:  # repeat the text for contexts longer than it
        ids = torch.cat([ids, ids], dim=1)
    ids = ids[:, :ctx]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if job["cache"] == "dynamic":
        model.set_attn_implementation("sdpa")
        cache: Any = DynamicCache(config=model.config)
    else:
        fused = job["cache"] == "fused"
        if fused:
            enable_fused_attention(model)
        reserve = ctx + job["new_tokens"] if job.get("reserve") else None
        cache = CompressedCache(job["codec"], config=model.config, fused=fused, max_cache_len=reserve)
    rss_loaded = _vm("VmRSS")
    t0 = time.perf_counter()
    out = None
    for s in range(0, ctx, job["prefill_chunk"]):
        out = model(input_ids=ids[:, s : s + job["prefill_chunk"]], cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    assert out is not None
    token = out.logits[:, -1:].argmax(-1)
    steps = []
    for _ in range(job["new_tokens"]):
        t1 = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t1)
    cache_bytes = (
        cache.nbytes()
        if hasattr(cache, "nbytes")
        else sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    )
    decode_s = statistics.median(steps)
    return {
        **job,
        "weights_bytes": weights,
        "prefill_seconds": prefill,
        "decode_seconds_median": decode_s,
        "decode_tokens_per_s": 1.0 / decode_s,
        "cache_bytes": cache_bytes,
        "cache_reserved_bytes": cache.reserved_nbytes() if hasattr(cache, "reserved_nbytes") else cache_bytes,
        "rss_after_load": rss_loaded,
        "peak_rss": _vm("VmHWM"),
        "peak_minus_loaded_minus_cache": _vm("VmHWM") - rss_loaded - cache_bytes,
        "torch_threads": torch.get_num_threads(),
    }


def bench_generation(
    model: str = "smollm2-135m",
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    codec: str = "rot+int4",
    *,
    text: str = "python-docs",
    new_tokens: int = 16,
    prefill_chunk: int = 1024,
    decoded: bool = False,
    decoded_max_ctx: int = 8192,
    reserve: bool = True,
    malloc_mmap_threshold: int = 65536,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Decode speed and peak memory of ``DynamicCache`` against the fused compressed cache per context.

    Args:
        model: registry name or path.
        contexts: context lengths (tokens read before generating).
        codec: the compressed cache's spec.
        text: text the context is cut from (repeated if shorter).
        new_tokens: tokens generated one at a time (the median step is reported).
        prefill_chunk: tokens per prefill forward.
        decoded: also run the compressed cache without fusion (every step decodes the whole cache, as
            most Python KV-quantization tools do), at contexts up to ``decoded_max_ctx``.
        decoded_max_ctx: the longest context the non-fused run is measured at.
        reserve: build the compressed cache with ``max_cache_len = ctx + new_tokens``.
        malloc_mmap_threshold: ``MALLOC_MMAP_THRESHOLD_`` for the child processes (glibc), 0 = unset.
        progress: show a progress bar.

    Returns:
        One row per (context, cache) with the fields of the module docstring.
    """
    from tqdm.auto import tqdm

    kinds = ["dynamic", "fused", "decoded"] if decoded else ["dynamic", "fused"]
    jobs = [
        {
            "model": model,
            "text": text,
            "ctx": c,
            "cache": kind,
            "codec": None if kind == "dynamic" else codec,
            "new_tokens": new_tokens,
            "prefill_chunk": prefill_chunk,
            "reserve": reserve and kind != "dynamic",
            "malloc_mmap_threshold": malloc_mmap_threshold,
        }
        for c in contexts
        for kind in kinds
        if kind != "decoded" or c <= decoded_max_ctx
    ]
    rows = []
    for job in tqdm(jobs, desc="bench generation", unit="run", disable=not progress):
        code = "import json, sys; from walshkv.bench import _generation_child; " + (
            "print(json.dumps(_generation_child(json.loads(sys.argv[1]))))"
        )
        env = dict(os.environ)
        if malloc_mmap_threshold:
            env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
        else:
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, check=False, env=env
        )
        if proc.returncode != 0:
            raise RuntimeError(f"generation run {job} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for c in contexts:
        ref = next(r for r in rows if r["ctx"] == c and r["cache"] == "dynamic")
        for r in rows:
            if r["ctx"] == c:
                r["speedup_vs_dynamic"] = r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    return rows


def crossover(rows: Sequence[dict[str, Any]], kind: str = "fused") -> int | None:
    """The smallest measured context from which on the ``kind`` cache decodes at least as fast as DynamicCache."""
    ctxs = sorted({r["ctx"] for r in rows if r["cache"] == kind})
    ok = [c for c in ctxs if next(r for r in rows if r["ctx"] == c and r["cache"] == kind)["speedup_vs_dynamic"] >= 1]
    for c in ctxs:
        if all(x in ok for x in ctxs if x >= c):
            return c
    return None


# ---------------------------------------------------------------------------------------------------------
# Reports and CLI
# ---------------------------------------------------------------------------------------------------------


def format_attention_table(rows: Sequence[dict[str, Any]], copy_gbs: float, fmt: str = "simple") -> str:
    from tabulate import tabulate

    body = [
        [
            f"{r['kv_len']:,}",
            r["method"],
            r["backend"],
            f"{r['ms']:.3f}",
            f"{r['speedup_vs_sdpa_fp16']:.2f}",
            f"{r['speedup_vs_sdpa_fp32']:.2f}",
            f"{r['cache_bytes'] / 2**20:.2f}",
            f"{r['gb_per_s']:.1f} ({100 * r['gb_per_s'] / copy_gbs:.0f}%)",
            f"{r['encode_ms']:.3f}" if "encode_ms" in r else "",
        ]
        for r in rows
    ]
    headers = [
        "kv_len",
        "method",
        "backend",
        "ms/step",
        "x vs SDPA fp16",
        "x vs SDPA fp32",
        "cache MiB",
        "GB/s read (% of copy)",
        "encode 1 token ms",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def format_generation_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    from tabulate import tabulate

    body = [
        [
            f"{r['ctx']:,}",
            r["cache"] + ("" if r["codec"] is None else f" ({r['codec']})"),
            f"{r['decode_tokens_per_s']:.2f}",
            f"{r['speedup_vs_dynamic']:.2f}",
            f"{r['prefill_seconds']:.1f}",
            f"{r['cache_bytes'] / 2**20:.1f}",
            f"{r['rss_after_load'] / 2**20:.0f}",
            f"{r['peak_rss'] / 2**20:.0f}",
            f"{r['peak_minus_loaded_minus_cache'] / 2**20:.0f}",
        ]
        for r in rows
    ]
    headers = [
        "ctx",
        "cache",
        "decode tok/s",
        "x vs Dynamic",
        "prefill s",
        "cache MiB",
        "RSS loaded MiB",
        "peak MiB",
        "peak - loaded - cache MiB",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def plot_bench(result: dict[str, Any], path: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    att, gen = result.get("attention") or [], result.get("generation") or []
    panels = [p for p in (att, gen) if p]
    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.5), squeeze=False)
    i = 0
    if att:
        ax = axes[0][i]
        for m in dict.fromkeys(r["method"] for r in att):
            pts = [r for r in att if r["method"] == m]
            ax.plot(
                [r["kv_len"] for r in pts],
                [r["speedup_vs_sdpa_fp16"] for r in pts],
                marker="o",
                label=m,
                ls="--" if m.startswith("sdpa") else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1, color="grey", lw=0.8)
        ax.set_xlabel("kv_len (tokens)")
        ax.set_ylabel("speed vs SDPA over an fp16 cache (x, log)")
        ax.set_title("decode attention, one step", fontsize=9)
        ax.legend(fontsize=7)
        i += 1
    if gen:
        ax = axes[0][i]
        for kind in dict.fromkeys(r["cache"] for r in gen):
            pts = sorted((r for r in gen if r["cache"] == kind), key=lambda r: r["ctx"])
            ax.plot([r["ctx"] for r in pts], [r["decode_tokens_per_s"] for r in pts], marker="o", label=kind)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"generation, {gen[0]['model']}", fontsize=9)
        ax.legend(fontsize=8)
    m = result["meta"]["machine"]
    fig.suptitle(f"{m['cpu']}, {m['torch_threads']} torch threads", fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)
    return [path]


def _ints(text: str) -> list[int]:
    try:
        values = [int(x.replace("k", "000").replace("K", "000")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, e.g. 1024,4096, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return values


def _best(rows: Sequence[dict[str, Any]], methods: Sequence[str], min_len: int) -> dict[str, Any] | None:
    cand = [r for r in rows if r["method"] in methods and r["kv_len"] >= min_len]
    return min(cand, key=lambda r: r["speedup_vs_sdpa_fp16"]) if cand else None


def targets(result: dict[str, Any]) -> list[str]:
    """Issue 7's targets, each checked against the rows of this run (worst case over the measured sizes)."""
    out = []
    att = result.get("attention") or []
    for label, methods, want in (("4-bit", ("rot+int4", "int4"), 2.5), ("3-bit", ("rot+int3", "int3"), 3.0)):
        worst = _best(att, methods, 16384)
        if worst is not None:
            ok = worst["speedup_vs_sdpa_fp16"] >= want
            out.append(
                f"- Decode attention over a {label} cache at kv_len >= 16k at least {want}x SDPA over fp16: worst "
                f"{worst['method']} at {worst['kv_len']:,}: x{worst['speedup_vs_sdpa_fp16']:.2f}: "
                f"{'met' if ok else 'missed'}."
            )
    gen = result.get("generation") or []
    long = [r for r in gen if r["cache"] == "fused" and r["ctx"] >= 8192]
    if long:
        worst = min(long, key=lambda r: r["speedup_vs_dynamic"])
        out.append(
            f"- Decode tokens/s at >= 8k context at least DynamicCache's: worst x{worst['speedup_vs_dynamic']:.2f} "
            f"at {worst['ctx']:,}: {'met' if worst['speedup_vs_dynamic'] >= 1 else 'missed'}."
        )
    fused = sorted((r for r in gen if r["cache"] == "fused"), key=lambda r: r["ctx"])
    # the overhead is measured at the longest context below the checked one that has more than one
    # prefill chunk (a one-chunk prefill never attends over packed keys, so it misses that fixed cost)
    big = fused[-1] if fused else None
    smaller = [r for r in fused[:-1] if r["ctx"] > r.get("prefill_chunk", 1024)] or fused[:-1]
    if big is not None and smaller:
        small = smaller[-1]
        overhead = small["peak_rss"] - small["rss_after_load"] - 1.15 * small["cache_bytes"]
        limit = big["rss_after_load"] + 1.15 * big["cache_bytes"] + overhead
        threshold = big.get("malloc_mmap_threshold")
        alloc = f"MALLOC_MMAP_THRESHOLD_={threshold}" if threshold else "glibc's default allocator settings"
        out.append(
            f"- Peak memory at {big['ctx']:,} tokens at most (model loaded) + 1.15 x cache + a fixed overhead, "
            f"measured at {small['ctx']:,} tokens as peak - loaded - 1.15 x cache ({overhead / 2**20:.0f} MiB), "
            f"with {alloc}: limit {limit / 2**20:.0f} MiB, peak {big['peak_rss'] / 2**20:.0f} MiB: "
            f"{'met' if big['peak_rss'] <= limit else 'missed'}."
        )
    return out


def bench_markdown(result: dict[str, Any]) -> list[str]:
    """The lines of ``bench.md`` for a result (also used to re-render a saved ``bench.json``)."""
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        "# walshkv bench",
        "",
        f"Machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} with "
        f"{m['torch_threads']} threads"
        + (f"; GPU {m['gpu']}" if m.get("gpu") else "")
        + f"; attention timed on {meta.get('device', 'cpu')}. Produced by `{meta['command']}`.",
        "",
    ]
    if result.get("attention"):
        bw = meta["copy_bandwidth_gb_per_s"]
        lines += [f"## Decode attention (copy bandwidth {bw:.1f} GB/s)", ""]
        lines += [format_attention_table(result["attention"], bw, "github"), ""]
    if result.get("generation"):
        gen = result["generation"]
        codec = next(r["codec"] for r in gen if r["codec"])
        lines += [f"## Generation ({gen[0]['model']}, {codec})", "", format_generation_table(gen, "github"), ""]
        lines += [
            "Crossover (smallest measured context from which the fused compressed cache decodes at least as "
            f"fast as DynamicCache): {meta.get('crossover_context')}.",
            "",
        ]
    checks = targets(result)
    if checks:
        lines += ["## Targets", "", *checks, ""]
    return lines


def _cmd_bench(args: argparse.Namespace) -> int:
    from walshkv.eval.outputs import command_line, write_result_files

    meta: dict[str, Any] = {
        "machine": machine_description(),
        "command": command_line(args),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    result: dict[str, Any] = {"meta": meta}
    if args.part in ("all", "attention"):
        meta["device"] = args.device
        if args.device.startswith("cuda") and torch.cuda.is_available():
            meta["machine"]["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        meta["copy_bandwidth_gb_per_s"] = copy_bandwidth(device=args.device)
        att = bench_attention(
            args.kv_len,
            args.codec or DEFAULT_ATTENTION_CODECS,
            repeats=args.repeats,
            device=args.device,
            progress=not args.quiet,
        )
        result["attention"] = att
        print(format_attention_table(att, meta["copy_bandwidth_gb_per_s"]))
    if args.part in ("all", "generation"):
        gen = bench_generation(
            args.model,
            args.ctx,
            args.gen_codec,
            new_tokens=args.new_tokens,
            prefill_chunk=args.prefill_chunk,
            decoded=args.decoded,
            reserve=not args.no_reserve,
            malloc_mmap_threshold=args.malloc_mmap_threshold,
            progress=not args.quiet,
        )
        result["generation"] = gen
        meta["crossover_context"] = crossover(gen)
        print(format_generation_table(gen))
        print(f"crossover: {meta['crossover_context']}")
    for line in targets(result):
        print(line)
    rows = [*(result.get("attention") or []), *(result.get("generation") or [])]
    keys = sorted({k for r in rows for k in r})
    written = write_result_files(
        args.out,
        "bench",
        result,
        rows,
        keys,
        bench_markdown(result),
        None if args.no_plot else (lambda out: plot_bench(result, out / "bench.png")),
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv bench``."""
    from walshkv.models import DEFAULT_MODEL

    bp = sub.add_parser(
        "bench",
        help="decode attention from packed codes vs torch SDPA, and generation speed/memory vs DynamicCache",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  walshkv bench --part attention --kv-len 1024,16384\n"
        "  walshkv bench --part generation --ctx 1024,8192 --new-tokens 16",
    )
    bp.add_argument("--part", choices=["all", "attention", "generation"], default="all", help="what to measure")
    bp.add_argument("--kv-len", type=_ints, default=list(DEFAULT_KV_LENS), help="attention: cached tokens")
    bp.add_argument("--codec", action="append", metavar="SPEC", help="attention: codec (repeatable)")
    bp.add_argument("--repeats", type=int, default=7, help="attention: timed repeats per case (median)")
    bp.add_argument(
        "--device",
        default="cpu",
        help="attention: cpu (fused C++ kernel) or cuda[:N] (Triton kernel; pip install 'walshkv[gpu]')",
    )
    bp.add_argument("--model", default=DEFAULT_MODEL, help="generation: model")
    bp.add_argument("--ctx", type=_ints, default=list(DEFAULT_CONTEXTS), help="generation: context lengths")
    bp.add_argument("--gen-codec", default="rot+int4", help="generation: the compressed cache's spec")
    bp.add_argument("--new-tokens", type=int, default=16, help="generation: tokens generated per run")
    bp.add_argument("--prefill-chunk", type=int, default=1024, help="generation: tokens per prefill forward")
    bp.add_argument(
        "--decoded",
        action="store_true",
        help="generation: also run the compressed cache decoding the whole cache every step",
    )
    bp.add_argument(
        "--no-reserve",
        action="store_true",
        help="generation: let the compressed cache grow (by 1/8 when full) instead of max_cache_len=ctx+new",
    )
    bp.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=65536,
        metavar="BYTES",
        help="generation: glibc MALLOC_MMAP_THRESHOLD_ for the runs (default 65536: freed blocks above it go "
        "back to the system instead of fragmenting the heap; 0: glibc's default)",
    )
    bp.add_argument("--out", default="bench", metavar="DIR", help="output folder")
    bp.add_argument("--no-plot", action="store_true", help="skip bench.png")
    bp.add_argument("--quiet", action="store_true", help="no progress bars")
    bp.set_defaults(func=_cmd_bench)
