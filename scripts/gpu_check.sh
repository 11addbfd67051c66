#!/usr/bin/env bash
# The one prepared GPU check (issue 19): run it on a machine with a CUDA GPU, in under 10 minutes.
#
#  1. the Triton decode kernels compiled for the GPU (not the interpreter) against the pure-torch reference,
#     for every codec of the shipped presets (prerope+center+eq+tq K, tq V, iq4_nl, rot+int4, q4_0), GQA 1/3/6/7,
#     batch 2, lengths that are not a multiple of any block, start positions after sink tokens;
#  2. `walshkv bench attention --device cuda` for the presets' codecs against torch SDPA (flash /
#     efficient attention) over fp16/bf16/fp32 caches at 16k and 64k cached tokens, the copy bandwidth
#     of the GPU measured in the same run;
#  3. scripts/gpu_paged_check.py (issue 36): the vLLM plugin's paged cache on CUDA, 8 requests in one Triton
#     launch against the reference and against SDPA over bf16/fp16, and one write+decode step captured in a
#     CUDA graph and replayed.
#
# Writes docs/results/gpu/{check.json,bench.*,paged_check.json,machine.txt}. Commit them with the device named (the files
# record nvidia-smi's name). Nothing here needs a network: the presets' calibrations ship with walshkv.
#
# Usage: bash scripts/gpu_check.sh            (OUT=dir to write elsewhere; KV_LEN=16384,65536 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-docs/results/gpu}"
mkdir -p "$out"
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || echo "nvidia-smi: not found"
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
  git rev-parse HEAD 2>/dev/null || echo "no git"
} | tee "$out/machine.txt"

python - "$out/check.json" <<'EOF'
"""Triton (compiled) == reference for the presets' codecs, on CUDA tensors."""
import json
import sys
import time

import torch

sys.path.insert(0, "tests/codecs")
from matrix import CalibrationStub  # noqa: E402

from walshkv.attention import decode_attention  # noqa: E402
from walshkv.codecs.registry import parse_codec  # noqa: E402

assert torch.cuda.is_available(), "no CUDA device"
dev = "cuda"
rows, worst = [], 0.0
pairs = [
    ("prerope+center+eq+tq:3.5", "tq:3"),
    ("prerope+center+eq+tq:3", "tq:2.5"),
    ("center+rot+iq4_nl", "tq:4"),
    ("center+eq+tq:3", "tq:2.5"),
    ("rot+int4", "rot+int4"),
    ("q4_0", "q4_0"),
]
for d, kv in ((64, 3), (128, 2)):
    stub = CalibrationStub(d, kv)
    for ks, vs in pairs:
        try:
            kc, vc = parse_codec(ks).bind(1, "k", stub), parse_codec(vs).bind(1, "v", stub)
        except ValueError as exc:
            rows.append({"k": ks, "v": vs, "head_dim": d, "error": str(exc)})
            continue
        for g in (1, 3, 6, 7):
            for n, start in ((37, 0), (1000, 1), (4133, 1)):
                k = torch.randn(2, kv, n, d)
                v = torch.randn(2, kv, n, d)
                q = torch.randn(2, kv * g, 1, d)
                pk, pv = kc.encode(k.to(dev), start), vc.encode(v.to(dev), start)
                want = decode_attention(q.to(dev), pk, pv, kc, vc, backend="reference", start=start)
                t0 = time.perf_counter()
                try:
                    got = decode_attention(q.to(dev), pk, pv, kc, vc, backend="triton", start=start)
                    torch.cuda.synchronize()
                    err = float((got.float() - want.float()).abs().max())
                    row = {"k": ks, "v": vs, "head_dim": d, "group": g, "tokens": n, "max_abs_err": err}
                    worst = max(worst, err)
                except Exception as exc:  # a finding either way: record it and go on
                    row = {"k": ks, "v": vs, "head_dim": d, "group": g, "tokens": n, "error": repr(exc)[:300]}
                row["seconds"] = time.perf_counter() - t0
                rows.append(row)
                print(row, flush=True)
json.dump({"device": torch.cuda.get_device_name(0), "worst_abs_err": worst, "rows": rows}, open(sys.argv[1], "w"),
          indent=1)
print("worst |triton - reference|:", worst, "errors:", sum("error" in r for r in rows))
EOF

# walshkv:3.5 reads the calibration walshkv ships for smollm2-135m (the attention bench's shapes)
walshkv bench attention --device cuda --kv-len "${KV_LEN:-16384,65536}" \
  --codec walshkv:3.5 \
  --codec rot+int4 --codec q4_0 --codec tq:4/tq:2.5 --repeats 20 --quiet --no-plot --out "$out" \
  || echo "bench failed (see above): a finding too"
PYTHONPATH=plugins/vllm/src${PYTHONPATH:+:$PYTHONPATH} python scripts/gpu_paged_check.py --out "$out" \
  || echo "paged check failed (see above): a finding too"
echo "wrote $out"
