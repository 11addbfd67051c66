#!/usr/bin/env python
"""Bytes per token in LMCache's L2 with the walshkv serde, against LMCache's naive (no serde) and fp8 serdes.

For each model shape (walshkv's model registry: layers, KV heads, head size) and spec, serializes one LMCache chunk
``[2, layers, 256, kv_heads * head_dim]`` of random bfloat16 K/V with the walshkv serde and counts the bytes it
wrote (header included, which ``estimate_serialized_size`` must equal); LMCache's own serdes are measured through
LMCache: no serde stores the chunk's bytes (2 per element at fp16/bf16), its ``fp8`` serde reports its size with
``estimate_serialized_size``. Calibrated specs use a synthetic calibration file of the model's shape: sizes do not
depend on the calibration's values. Writes docs/results/lmcache/sizes.json and sizes.md (the table
docs/serving.md pastes between ``<!-- results:lmcache-sizes:start -->`` markers).

Run: ``python scripts/lmcache-sizes.py`` (needs ``lmcache==0.5.6``, see docs/serving.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache's usage telemetry is on by default
os.environ.setdefault("DO_NOT_TRACK", "1")

import argparse
import json
import tempfile
from pathlib import Path

import torch

from walshkv.export import write_kv_mean_center
from walshkv.integrations.lmcache import ChunkCodec, SerdeOptions
from walshkv.models import MODELS

ROOT = Path(__file__).resolve().parents[1]
MODEL_NAMES = ("smollm2-135m", "qwen2.5-1.5b")
SPECS = ("q8_0", "q8_0/q4_0", "q4_0", "rot+int4", "tq:4/tq:3", "center+tq:4/tq:2.5", "center+tq:3.5/tq:2")
CHUNK = 256  # LMCache's default chunk size (tokens per L2 object)


def synthetic_calibration(path: Path, layers: int, heads: int, head_dim: int) -> str:
    write_kv_mean_center(path, torch.zeros(layers, heads, head_dim), arch="llama", basis="plain", model="sizes")
    return str(path)


def measure(model: str, spec: str, workdir: Path) -> dict:
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationSerializer

    info = MODELS[model]
    shape = torch.Size([2, info.layers, CHUNK, info.kv_heads * info.head_dim])
    calibration = None
    if spec.startswith("center+"):
        calibration = synthetic_calibration(workdir / f"{model}.gguf", info.layers, info.kv_heads, info.head_dim)
    codec = ChunkCodec(SerdeOptions(spec=spec, head_dim=info.head_dim, calibration=calibration))
    kv = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    estimate = codec.serialized_size(shape, kv.dtype)
    buf = torch.empty(estimate, dtype=torch.uint8)
    written = codec.serialize(kv, buf)
    if written != estimate:
        raise AssertionError(f"{spec}: wrote {written} bytes, estimated {estimate}")
    naive = kv.numel() * kv.element_size()
    fp8 = Fp8QuantizationSerializer().estimate_serialized_size(MemoryLayoutDesc(shapes=[shape], dtypes=[kv.dtype]))
    bits = (codec.spec.k.bits_per_element(info.head_dim) + codec.spec.v.bits_per_element(info.head_dim)) / 2
    return {
        "model": model,
        "layers": info.layers,
        "kv_heads": info.kv_heads,
        "head_dim": info.head_dim,
        "spec": codec.spec.spec,
        "bits_per_element": bits,
        "chunk_tokens": CHUNK,
        "chunk_bytes": written,
        "bytes_per_token": written / CHUNK,
        "naive_bf16_bytes_per_token": naive / CHUNK,
        "fp8_serde_bytes_per_token": fp8 / CHUNK,
        "ratio_vs_bf16": naive / written,
    }


def markdown(rows: list[dict]) -> str:
    """The table docs/serving.md pastes (tests/test_docs.py checks that it equals sizes.md)."""
    lines = [
        "| model (layers × kv heads × head_dim) | spec | bits/el | bytes/token | naive bf16 | fp8 serde | × smaller "
        "than bf16 |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} ({r['layers']}×{r['kv_heads']}×{r['head_dim']}) | `{r['spec']}` | "
            f"{r['bits_per_element']:.3g} | {r['bytes_per_token']:.1f} | {r['naive_bf16_bytes_per_token']:.0f} | "
            f"{r['fp8_serde_bytes_per_token']:.0f} | {r['ratio_vs_bf16']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "lmcache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(model, spec, Path(tmp)) for model in MODEL_NAMES for spec in SPECS]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sizes.json").write_text(json.dumps({"chunk_tokens": CHUNK, "rows": rows}, indent=2) + "\n")
    (args.out / "sizes.md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
