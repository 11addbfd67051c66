#!/usr/bin/env bash
# Every figure in docs/performance.md: `walshkv bench` (decode attention against torch SDPA, then
# generation with smollm2-135m against DynamicCache), pasted into the page. Ratios are measured within
# one run; on a shared machine, run it when the machine is otherwise idle. About 30 minutes on 2 cores
# (the 32k-token contexts take most of it). CTX="1024,8192" for a shorter run.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/results/bench
walshkv bench --kv-len "${KV_LEN:-1024,4096,16384,65536}" --ctx "${CTX:-1024,8192,32768}" --decoded \
  --new-tokens "${NEW_TOKENS:-16}" --quiet --out "$out"
python scripts/update_readme.py "$out/bench.md" docs/performance.md
# the same generation runs under glibc's default allocator settings, at 1k and 8k (a few minutes)
walshkv bench --part generation --ctx "${CTX_GLIBC:-1024,8192}" --malloc-mmap-threshold 0 \
  --new-tokens "${NEW_TOKENS:-16}" --quiet --no-plot --out docs/results/bench-glibc-default
python scripts/update_readme.py docs/results/bench-glibc-default/bench.md docs/performance.md glibc
# the presets' codec (tq, TurboQuant-class Lloyd-Max codes) in the fused kernel, against rot+int4 and SDPA
# in the same run (a few minutes)
walshkv bench --part attention --kv-len "${KV_LEN_TQ:-4096,16384,65536}" --codec rot+int4 --codec tq:4/tq:2.5 \
  --codec tq:3.5 --codec tq:5/tq:3.5 --quiet --no-plot --out docs/results/bench-tq
python scripts/update_readme.py docs/results/bench-tq/bench.md docs/performance.md tq
