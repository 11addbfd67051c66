"""``walshkv bench --part generation``: decode speed and peak memory, compressed cache against DynamicCache.

Each run is a fresh subprocess (:func:`_generation_child`), so its peak resident memory is its own; see
:mod:`walshkv.bench` for what a row holds.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.data import load_text
from walshkv.defaults import DEFAULT_MODEL, DEFAULT_TEXT
from walshkv.models import load_model

__all__ = ["DEFAULT_CONTEXTS", "bench_generation", "crossover"]

DEFAULT_CONTEXTS: tuple[int, ...] = (1024, 8192, 32768)


def _vm(key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) of this process's ``/proc/self/status``, in bytes (0 if absent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


@torch.inference_mode()
def _generation_child(job: dict[str, Any]) -> dict[str, Any]:
    """One generation run (called in a fresh process by :func:`bench_generation`)."""
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
    model: str = DEFAULT_MODEL,
    contexts: Sequence[int] = DEFAULT_CONTEXTS,
    codec: str = "rot+int4",
    *,
    text: str = DEFAULT_TEXT,
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
        One row per (context, cache) with the fields of :mod:`walshkv.bench`'s docstring.
    """
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
        code = "import json, sys; from walshkv.bench.generation import _generation_child; " + (
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
