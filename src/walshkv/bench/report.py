"""``walshkv bench``'s report: tables, issue 7's targets checked against a run, ``bench.md`` and ``bench.png``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tabulate import tabulate

from walshkv.attention.chunked import KV_CHUNK
from walshkv.eval.report import agg_figure
from walshkv.fileio import save_figure_atomic
from walshkv.presets import dense_key_map

__all__ = [
    "bench_markdown",
    "format_attention_table",
    "format_generation_table",
    "generation_label",
    "plot_bench",
    "targets",
]


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
            _cell(r.get("speedup_vs_best_sdpa"), ".2f"),
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
        "x vs fastest SDPA",
        "cache MiB",
        "GB/s read (% of copy)",
        "encode 1 token ms",
    ]
    table = tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)
    specs = {r["method"]: r["spec"] for r in rows if r.get("spec")}
    return table + "".join(f"\n\n{name} = `{spec}`" for name, spec in specs.items()) + _transform_note(rows, fmt)


def _transform_note(rows: Sequence[dict[str, Any]], fmt: str) -> str:
    """What the ``prerope+`` rows' K transform costs on its own (:func:`walshkv.bench.bench_attention`)."""
    fast = list(dict.fromkeys(r["method"] for r in rows if r.get("k_map") == "hadamard"))
    rows = [r for r in rows if "k_transform_macs" in r]
    note = (
        f"\n\n{', '.join(fast)}: K stored before RoPE without `eq+`, so the CPU kernel maps each key by the core's "
        "Walsh-Hadamard rotation, as a fast Walsh-Hadamard transform (head_dim log2 head_dim additions per key)."
        if fast
        else ""
    )
    if not rows:
        return note
    body = [
        [
            f"{r['kv_len']:,}",
            r["method"],
            r.get("k_map", ""),
            f"{r['k_transform_macs'] / 1e6:,.0f}",
            f"{r['ms']:.3f}",
            f"{r['k_transform_kernel_gmacs']:.1f}",
            f"{r['k_transform_matmul_ms']:.3f}",
            f"{r['k_transform_matmul_gmacs']:.1f}",
            f"{r['k_transform_bound_vs_best_sdpa']:.2f}",
        ]
        for r in rows
    ]
    headers = [
        "kv_len",
        "method",
        "K map",
        "K transform (M multiply-adds)",
        "kernel ms/step",
        "kernel GMAC/s if that were all",
        "torch matmul ms",
        "torch matmul GMAC/s",
        "bound: x vs fastest SDPA",
    ]
    return (
        "\n\nK stored before RoPE (`prerope+`): every step maps each cached key with one head_dim x head_dim matrix "
        "per kv head (`eq+`'s inverse and the codec's rotations folded in) before RoPE, since RoPE depends on the "
        "key's position and cannot move onto the query. The same multiply-adds as one float32 torch matmul, timed "
        "in the same rounds (`k_map` matrix-amx rows, whose kernel maps keys on AMX tiles as three bf16 products "
        "of hi/lo parts: one bf16 torch matmul three times as deep): `bound` is the fastest SDPA's time over the "
        "matmul's, the most a kernel that maps every key at torch's matmul rate could reach, before it reads a "
        "single code.\n\n" + tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True) + note
    )


def _cell(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def generation_label(row: dict[str, Any]) -> str:
    """A generation row's name: ``DynamicCache fp32``, ``fused SPEC``, ``fused walshkv:3.5 = SPEC`` (old rows too)."""
    if row.get("label"):
        return str(row["label"])
    return row["cache"] + ("" if row.get("codec") is None else f" ({row['codec']})")


def format_generation_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """Generation rows as a table (``fmt``: a tabulate format).

    ``update ms`` is the cache's update per decode step (encoding, bookkeeping), ``attn ms`` the attention
    function, ``other ms`` the rest of the step (projections, MLP, norms, logits); medians over the steps.
    """
    body = [
        [
            f"{r['ctx']:,}",
            generation_label(r),
            f"{r['decode_tokens_per_s']:.2f}",
            _cell(r.get("speedup_vs_dynamic"), ".2f"),
            _cell(r.get("speedup_vs_dynamic_bf16"), ".2f"),
            _cell(r.get("step_ms"), ".1f"),
            _cell(r.get("update_ms"), ".2f"),
            _cell(r.get("attn_ms"), ".2f"),
            _cell(r.get("other_ms"), ".2f"),
            f"{r['prefill_seconds']:.1f}",
            _cell(r.get("prefill_vs_dynamic"), ".2f"),
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
        "x vs Dynamic fp32",
        "x vs Dynamic bf16",
        "ms/step",
        "update ms",
        "attn ms",
        "other ms",
        "prefill s",
        "prefill / Dynamic fp32",
        "cache MiB",
        "RSS loaded MiB",
        "peak MiB",
        "peak - loaded - cache MiB",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def format_run_spread(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """The least and most of each row's runs (``run_values``, :func:`walshkv.bench.generation.combine_runs`)."""

    def span(r: dict[str, Any], key: str, scale: float, spec: str) -> str:
        values = [v[key] * scale for v in r["run_values"]]
        return f"{min(values):{spec}} - {max(values):{spec}}"

    body = [
        [
            f"{r['ctx']:,}",
            generation_label(r),
            str(r["runs"]),
            span(r, "step_ms", 1.0, ".1f"),
            span(r, "prefill_seconds", 1.0, ".1f"),
            span(r, "rss_after_load", 2**-20, ".0f"),
            span(r, "peak_rss", 2**-20, ".0f"),
        ]
        for r in rows
    ]
    headers = ["ctx", "cache", "runs", "ms/step", "prefill s", "RSS loaded MiB", "peak MiB"]
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
        for label in dict.fromkeys(generation_label(r) for r in gen):
            pts = sorted((r for r in gen if generation_label(r) == label), key=lambda r: r["ctx"])
            ax.plot([r["ctx"] for r in pts], [r["decode_tokens_per_s"] for r in pts], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("decode tokens / s")
        ax.set_title(f"generation, {gen[0]['model']}", fontsize=9)
        ax.legend(fontsize=6)
    m = result["meta"]["machine"]
    fig.suptitle(f"{m['cpu']}, {m['torch_threads']} torch threads", fontsize=8)
    fig.tight_layout()
    save_figure_atomic(fig, path, dpi=110)
    return [path]


def _best(rows: Sequence[dict[str, Any]], methods: Sequence[str], min_len: int) -> dict[str, Any] | None:
    cand = [r for r in rows if r["method"] in methods and r["kv_len"] >= min_len]
    return min(cand, key=lambda r: r["speedup_vs_sdpa_fp16"]) if cand else None


def targets(result: dict[str, Any]) -> list[str]:
    """Issue 7's targets, and issue 19's for the presets, each checked against the rows of this run (worst case over
    the measured sizes)."""
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
    plain = [r for r in gen if r["cache"] == "fused" and not r.get("preset")]
    long = [r for r in plain if r["ctx"] >= 8192 and r.get("speedup_vs_dynamic") is not None]
    if long:
        worst = min(long, key=lambda r: r["speedup_vs_dynamic"])
        named = f" ({worst['codec']})" if len({r.get("codec") for r in plain}) > 1 else ""
        out.append(
            f"- Decode tokens/s at >= 8k context at least DynamicCache's: worst x{worst['speedup_vs_dynamic']:.2f}"
            f"{named} at {worst['ctx']:,}: {'met' if worst['speedup_vs_dynamic'] >= 1 else 'missed'}."
        )
    codecs = list(dict.fromkeys(r.get("codec") for r in gen if r["cache"] == "fused"))
    for codec in codecs:
        out.extend(_memory_target([r for r in gen if r["cache"] == "fused" and r.get("codec") == codec], codecs))
    out.extend(_preset_targets(gen))
    out.extend(_attention_targets(att, result.get("meta", {}).get("copy_bandwidth_gb_per_s")))
    return out


#: Wrappers that mark a calibrated (preset-style) codec in an attention row's name.
_CALIBRATED = ("prerope+", "ropeblock:", "center+", "eq+", "eqr")


def _dense_row(row: dict[str, Any]) -> bool:
    """Whether an attention row's codec maps each cached key by a dense matrix at every step (``eq+`` before RoPE:
    :func:`walshkv.presets.dense_key_map`); a name that is no spec counts as not."""
    try:
        return dense_key_map(row.get("spec") or row["method"])
    except ValueError:
        return False


def _attention_targets(att: Sequence[dict[str, Any]], copy_gbs: float | None) -> list[str]:
    """Issue 35's decode-attention targets at kv_len >= 16k: the presets (and calibrated codecs) whose keys take a
    dense per-key map, those with none (the fast presets: the block frame, ``eqd+``'s Walsh-Hadamard map), and
    rot+int4 and q4_0, each group at least 2.5x the fastest SDPA of the same round and 25% of the copy bandwidth in
    bytes read."""
    out = []
    long = [r for r in att if r["kv_len"] >= 16384 and r.get("speedup_vs_best_sdpa") is not None]
    if not long:
        return out
    calibrated = [r for r in long if r.get("spec") or any(w in r["method"] for w in _CALIBRATED)]
    dense = [r for r in calibrated if _dense_row(r)]
    groups = (
        ("the presets' codecs with a dense per-key map" if dense else "the presets' codecs", dense, 2.5),
        (
            "the presets' codecs with no dense per-key map" if dense else "the presets' codecs",
            [r for r in calibrated if r not in dense],
            2.5,
        ),
        ("rot+int4 and q4_0", [r for r in long if r["method"] in ("rot+int4", "q4_0")], 2.5),
    )
    for label, rows, want in groups:
        if not rows:
            continue
        worst = min(rows, key=lambda r: r["speedup_vs_best_sdpa"])
        ok = worst["speedup_vs_best_sdpa"] >= want
        line = (
            f"- Decode attention of {label} at kv_len >= 16k at least {want}x the fastest SDPA of the run: worst "
            f"{worst['method']} at {worst['kv_len']:,}: x{worst['speedup_vs_best_sdpa']:.2f}: "
            + ("met" if ok else "missed")
        )
        if copy_gbs:
            share = min(r["gb_per_s"] for r in rows) / copy_gbs
            verdict = "met" if share >= 0.25 else "missed"
            line += f"; bytes read at {100 * share:.0f}% of the copy bandwidth or more (target 25%): {verdict}"
        if "k_transform_bound_vs_best_sdpa" in worst:
            line += (
                f" (its prerope+ K transform alone, as a torch matmul, allows at most "
                f"x{worst['k_transform_bound_vs_best_sdpa']:.2f})"
            )
        out.append(line + ".")
    return out


def _memory_target(fused: Sequence[dict[str, Any]], codecs: Sequence[str | None]) -> list[str]:
    """Issue 7's peak-memory target for the fused rows of one codec (none with fewer than two contexts)."""
    fused = sorted(fused, key=lambda r: r["ctx"])
    # the overhead is measured at the longest context below the checked one whose prefill runs every tile shape of
    # the fused prefill: a later chunk over a whole decoded tile of KV_CHUNK packed keys (at least KV_CHUNK +
    # prefill_chunk tokens: 3,072 by default). Shorter prefills never build those tiles' temporaries, which glibc
    # keeps once freed, so they miss part of that fixed cost (docs/results/bench-glibc-default: walshkv:3.5's
    # overhead 646 MiB at 1,024 tokens, 761 at 3,072).
    big = fused[-1] if fused else None
    smaller = [r for r in fused[:-1] if r["ctx"] >= KV_CHUNK + r.get("prefill_chunk", 1024)]
    smaller = smaller or [r for r in fused[:-1] if r["ctx"] > r.get("prefill_chunk", 1024)] or fused[:-1]
    if big is None or not smaller:
        return []
    small = smaller[-1]
    overhead = small["peak_rss"] - small["rss_after_load"] - 1.15 * small["cache_bytes"]
    limit = big["rss_after_load"] + 1.15 * big["cache_bytes"] + overhead
    threshold = big.get("malloc_mmap_threshold")
    alloc = f"MALLOC_MMAP_THRESHOLD_={threshold}" if threshold else "glibc's default allocator settings"
    named = f" ({generation_label(big)})" if len(codecs) > 1 else ""
    if big.get("runs", 1) > 1:
        alloc += f" (medians of {big['runs']} runs)"
    return [
        f"- Peak memory{named} at {big['ctx']:,} tokens at most (model loaded) + 1.15 x cache + a fixed overhead, "
        f"measured at {small['ctx']:,} tokens as peak - loaded - 1.15 x cache ({overhead / 2**20:.0f} MiB), "
        f"with {alloc}: limit {limit / 2**20:.0f} MiB, peak {big['peak_rss'] / 2**20:.0f} MiB: "
        f"{'met' if big['peak_rss'] <= limit else 'missed'}."
    ]


#: The shortest context the end-to-end preset targets are read at ("8k": smollm2-135m's longest is 8192 - 16).
PRESET_TARGET_CTX = 8000
#: Issue 35's end-to-end targets for a preset: decode at least this many times DynamicCache fp32 / bf16, prefill at
#: most this many times DynamicCache fp32's (SDPA).
PRESET_DECODE_VS_FP32, PRESET_DECODE_VS_BF16, PRESET_PREFILL_MAX = 2.0, 1.5, 1.1


def _preset_targets(gen: Sequence[dict[str, Any]]) -> list[str]:
    """Issue 35's end-to-end targets for the fused preset rows at >= 8k tokens: decode at least 2x DynamicCache
    fp32 and 1.5x DynamicCache bf16, prefill at most 1.1x DynamicCache's (fp32, SDPA)."""
    out = []
    for r in gen:
        if r["cache"] != "fused" or not r.get("preset") or r["ctx"] < PRESET_TARGET_CTX:
            continue
        checks = []
        for key, want, what in (
            (
                "speedup_vs_dynamic",
                PRESET_DECODE_VS_FP32,
                f"decode at least {PRESET_DECODE_VS_FP32:g}x DynamicCache fp32",
            ),
            (
                "speedup_vs_dynamic_bf16",
                PRESET_DECODE_VS_BF16,
                f"decode at least {PRESET_DECODE_VS_BF16:g}x DynamicCache bf16",
            ),
        ):
            if r.get(key) is not None:
                checks.append(f"{what}: x{r[key]:.2f}: {'met' if r[key] >= want else 'missed'}")
        if r.get("prefill_vs_dynamic") is not None:
            x = r["prefill_vs_dynamic"]
            met = "met" if x <= PRESET_PREFILL_MAX else "missed"
            checks.append(f"prefill at most {PRESET_PREFILL_MAX:g}x DynamicCache's: x{x:.2f}: {met}")
        if checks:
            out.append(f"- {r['preset']} ({r['codec']}) at {r['ctx']:,} tokens: " + "; ".join(checks) + ".")
    return out


def bench_markdown(result: dict[str, Any]) -> list[str]:
    """The lines of ``bench.md`` for a result (also used to re-render a saved ``bench.json``)."""
    meta = result["meta"]
    m = meta["machine"]
    lines = [
        "# walshkv bench",
        "",
        f"Machine: {m['cpu']}"
        + (f" (ISA {m['cpu_capability']})" if m.get("cpu_capability") else "")
        + (
            f" (fused kernel built with -march={m['kernel_march']} instead of native: that ISA's code on this CPU)"
            if m.get("kernel_march", "native") != "native"
            else ""
        )
        + f", {m['logical_cpus']} logical CPUs, torch {m['torch']} with "
        f"{m['torch_threads']} threads"
        + (f"; GPU {m['gpu']}" if m.get("gpu") else "")
        + f"; attention timed on {meta.get('device', 'cpu')}. Produced by `{meta['command']}`.",
        "",
    ]
    if result.get("attention"):
        bw = meta["copy_bandwidth_gb_per_s"]
        lines += [f"## Decode attention (copy bandwidth {bw:.1f} GB/s)", ""]
        if shapes := meta.get("attention_model"):
            lines += [
                f"Attention shapes of {shapes['model']}: head_dim {shapes['head_dim']}, {shapes['kv_heads']} kv "
                f"heads, {shapes['q_heads']} query heads (GQA {shapes['q_heads'] // shapes['kv_heads']}); presets "
                "with that model's shipped calibration.",
                "",
            ]
        if meta.get("cold"):
            lines += [
                "Caches flushed before every timed call (`--cold`: 256 MiB written first), so each method starts "
                "cold, as a layer's attention does inside a model.",
                "",
            ]
        lines += [format_attention_table(result["attention"], bw, "github"), ""]
    if result.get("generation"):
        gen = result["generation"]
        first = gen[0]
        caches = ", ".join(dict.fromkeys(r.get("preset") or r["codec"] for r in gen if r.get("codec")))
        lines += [f"## Generation ({first['model']}, {caches})", ""]
        if first.get("cpu_capability"):
            flags = f" ({first['cpu_flags']})" if first.get("cpu_flags") else ""
            lines += [
                f"CPU {first['cpu']}, ISA {first['cpu_capability']}{flags}, {first['torch_threads']} threads.",
                "",
            ]
        lines += [format_generation_table(gen, "github"), ""]
        spread = [r for r in gen if r.get("runs", 1) > 1]
        if spread:
            lines += [
                "Each row above is the median of its runs (fresh processes, the rows taking turns); the runs' "
                "least and most:",
                "",
                format_run_spread(spread, "github"),
                "",
            ]
        if any("update_ms" in r for r in gen):
            lines += [
                "Per decode step (medians): `update ms` in the cache's update (encoding, bookkeeping), `attn ms` "
                "in the attention function, `other ms` the rest of the model. DynamicCache bf16: the model "
                "loaded in bf16 (so its cache holds bf16 K/V); every other row runs the model in fp32.",
                "",
            ]
        sources = dict.fromkeys(
            f"{r.get('preset') or r['codec']}: {r['calibration']}" for r in gen if r.get("calibration")
        )
        if sources:
            lines += ["Calibration: " + "; ".join(sources) + ".", ""]
        cross = meta.get("crossover_context")
        if isinstance(cross, dict):
            cross = "; ".join(f"{name}: {ctx}" for name, ctx in cross.items())
        lines += [
            "Crossover (smallest measured context from which the fused compressed cache decodes at least as "
            f"fast as DynamicCache fp32): {cross}.",
            "",
        ]
        for note in meta.get("notes") or []:
            lines += [note, ""]
    checks = targets(result)
    if checks:
        lines += ["## Targets", "", *checks, ""]
    return lines
