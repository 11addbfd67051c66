"""``walshkv bench``'s report: tables, issue 7's targets checked against a run, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.eval.report import agg_figure
from walshkv.fileio import save_figure_atomic

__all__ = ["bench_markdown", "format_attention_table", "format_generation_table", "plot_bench", "targets"]


def format_attention_table(rows: Sequence[dict[str, Any]], copy_gbs: float, fmt: str = "simple") -> str:
    """Attention rows as a table (``fmt``: a tabulate format), bandwidth as a share of ``copy_gbs``."""
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
    """Generation rows as a table (``fmt``: a tabulate format)."""
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
    """``bench.png``: attention speed against kv_len, decode tokens/s against context; returns ``[path]``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'walshkv[plot]'``).
    """
    att, gen = result.get("attention") or [], result.get("generation") or []
    panels = [p for p in (att, gen) if p]
    fig = agg_figure(figsize=(6.5 * len(panels), 4.5))
    axes = fig.subplots(1, len(panels), squeeze=False)
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
    save_figure_atomic(fig, path, dpi=110)
    return [path]


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
