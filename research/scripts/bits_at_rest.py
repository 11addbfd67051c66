#!/usr/bin/env python3
"""Bits at rest: how much shorter a saved cache gets when its bytes are entropy-coded (issue 37, "Bits at rest").

A cache in memory stores every code in a fixed number of bits, which the kernels read in place. A saved file or an
LMCache chunk is read once, on load, so it can hold the same codes entropy-coded. This measures the gain per cache
spec on real K/V: for each spec, a fresh cache of the model reads each window of the text (quantize on write, as
``walshkv eval``), and the tensors a save would write (:func:`walshkv.cache.persist.saved_tensors`: packed fields,
scales, norms, fp16 sink tokens) are coded by :func:`walshkv.ops.rans.encode_rows`, one rANS model per byte column
class of each tensor. Every blob is decoded again and compared with the tensor, byte for byte, before it counts.

Reported per spec: bits per element in memory (the saved tensors' bytes over the K and V elements they stand for)
and at rest (the coded blobs, frequency tables and stream states counted), the share saved, and the order-0 bound
of the same byte models (their empirical entropy at the best column period: what an ideal coder with those models
would reach, tables not counted; rows that coding would not shorten are stored as they are, so a spec can sit
above its bound by the tables' cost). Presets use the
calibration shipped for the model (made on python-docs); the text is Austen's Emma, the development text.

    python research/scripts/bits_at_rest.py --out docs/results/bits-at-rest
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from walshkv.bench.machine import machine_description
from walshkv.cache import CompressedCache, make_cache
from walshkv.cache.persist import saved_tensors
from walshkv.data import load_text, make_windows
from walshkv.models import load_model
from walshkv.ops.rans import PERIODS, decode_rows, encode_rows, order0_bits
from walshkv.presets import is_preset

SPECS = (
    "walshkv:4.5",
    "walshkv:3.5",
    "walshkv:3",
    "walshkv:3.5-fast",
    "rot+q8_0/rot+q4_0",
    "rot+q4_0",
    "rot+iq4_nl",
    "tq:4",
    "tq:3",
    "int4",
    "kivi4",
    "vllm:turboquant_k3v4_nc",
)
TEXT = str(Path(__file__).resolve().parents[2].parent / "shared" / "data" / "austen_emma.txt")


def _rows(t: torch.Tensor) -> np.ndarray:
    """A saved tensor ``[batch, heads, tokens, *field]`` as bytes, one row per stored vector."""
    lead = t.shape[0] * t.shape[1] * t.shape[2]
    return t.contiguous().view(torch.uint8).reshape(lead, -1).numpy()


def _measure(cache: CompressedCache, totals: dict[str, float]) -> None:
    for name, t in saved_tensors(cache).items():
        if t.numel() == 0:
            continue
        rows = _rows(t)
        blob = encode_rows(rows)
        if not np.array_equal(decode_rows(blob), rows):
            raise SystemExit(f"{name}: the coded bytes do not decode to the tensor")
        # codes: packed uint8 fields; side: the other packed fields (fp16 scales, norms); fp16: windows and sinks
        kind = "codes" if t.dtype == torch.uint8 and ".packed_" in name else "side" if ".packed_" in name else "fp16"
        totals[f"mem_{kind}"] += rows.size
        totals[f"rest_{kind}"] += len(blob)
        # the byte models' ideal: their order-0 entropy at the best period, no tables (stored rows included)
        usable = [p for p in PERIODS if p <= rows.shape[1]]
        totals["bound"] += min(sum(order0_bits(rows[:, c::p]) for c in range(p)) for p in usable) / 8


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default=TEXT)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--spec", action="append", help=f"cache spec or preset, repeatable (default: {' '.join(SPECS)})")
    args = ap.parse_args()
    meta = machine_description()  # the commit that runs, read before it runs
    lm = load_model(args.model, progress=False)
    text = load_text(args.text)
    win = make_windows(lm.tokenizer, text.content, args.ctx, args.windows)
    shape = lm.shape
    specs = args.spec or list(SPECS)
    rows = []
    started = time.perf_counter()
    for spec in tqdm(specs, desc="bits at rest", unit="spec"):
        totals = dict.fromkeys(("mem_codes", "mem_side", "mem_fp16", "rest_codes", "rest_side", "rest_fp16"), 0.0)
        totals["bound"] = 0.0
        elements = 0
        name = spec
        for w in range(win.ids.shape[0]):
            if is_preset(spec):
                cache = CompressedCache.from_preset(lm.model, spec)
                name = f"{spec} = {cache.preset.spec}"
            else:
                cache = make_cache(spec, config=lm.model.config)
            with torch.inference_mode():
                lm.model(input_ids=win.ids[w : w + 1], cache=cache, use_cache=True)
            elements += shape.layers * shape.kv_heads * args.ctx * shape.head_dim * 2
            _measure(cache, totals)
            del cache
        mem = totals["mem_codes"] + totals["mem_side"] + totals["mem_fp16"]
        rest = totals["rest_codes"] + totals["rest_side"] + totals["rest_fp16"]
        rows.append(
            {
                "spec": name,
                "bits_in_memory": 8 * mem / elements,
                "bits_at_rest": 8 * rest / elements,
                "saved": 1 - rest / mem,
                "codes_saved": 1 - totals["rest_codes"] / totals["mem_codes"] if totals["mem_codes"] else 0.0,
                "side_saved": 1 - totals["rest_side"] / totals["mem_side"] if totals["mem_side"] else 0.0,
                "order0_bound_bits": 8 * totals["bound"] / elements,
                "bytes_in_memory": int(mem),
                "bytes_at_rest": int(rest),
            }
        )
    meta.update(
        {
            "command": "python research/scripts/bits_at_rest.py --out " + str(args.out),
            "model": lm.name,
            "text": text.name,
            "ctx": args.ctx,
            "windows": int(win.ids.shape[0]),
            "seconds": time.perf_counter() - started,
        }
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{lm.name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [
        "| cache spec | bits/element in memory | at rest (rANS) | saved | codes saved | scales/norms saved | "
        "order-0 bound |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        side = f"{100 * r['side_saved']:.1f}%" if r["side_saved"] else "-"
        lines.append(
            f"| `{r['spec']}` | {r['bits_in_memory']:.3f} | {r['bits_at_rest']:.3f} | {100 * r['saved']:.1f}% | "
            f"{100 * r['codes_saved']:.1f}% | {side} | {r['order0_bound_bits']:.3f} |"
        )
    lines += [
        "",
        f"{lm.name}, {meta['windows']} windows of {args.ctx} tokens of {text.name}, each cache filled by quantize on "
        "write, the tensors a save writes coded by `walshkv.ops.rans.encode_rows` (one order-0 model per byte column "
        "class, frequency tables and stream states counted) and decoded back byte for byte. `codes`: packed uint8 "
        "fields; `scales/norms`: the other packed fields; fp16 sink tokens count in the totals; order-0 bound: the "
        "byte models' entropy at the best column period, tables not counted (a field that coding would not shorten "
        "is stored as it is, so a spec can sit above it). "
        f"`{meta['command']}` at {meta['commit']} on {meta['cpu']} ({meta['cpu_capability']}), "
        f"{meta['seconds']:.0f} s.",
    ]
    (args.out / f"{lm.name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
