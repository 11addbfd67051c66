#!/usr/bin/env bash
# Every figure in docs/mean-center.md. For each model: calibrate a K mean on Python's docs
# (plain and rotated basis), then evaluate on Austen's Emma (8 windows of 512) with and without
# centering, each codec with the bias file of its own basis.
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
OUT=docs/results/mean-center
mkdir -p "$OUT"
for model in ${MODELS:-smollm2-135m qwen2.5-1.5b}; do
  for basis in plain rot; do
    walshkv calibrate --model "$model" --text python-docs --tokens 8192 --basis "$basis" --quiet \
      -o "$OUT/$model-$basis.gguf"
  done
  walshkv eval --model "$model" --text "$TEXT" --windows 8 --quiet --kv-mean-center "$OUT/$model-plain.gguf" \
    --codec q4_0 --codec center+q4_0 --codec int4 --codec center+int4 --codec int3 --codec center+int3 \
    --codec vht2:5,5,4,3 --codec center+vht2:5,5,4,3 \
    --json "$OUT/$model-plain.json" --markdown "$OUT/$model-plain.md"
  walshkv eval --model "$model" --text "$TEXT" --windows 8 --quiet --kv-mean-center "$OUT/$model-rot.gguf" \
    --codec rot+q4_0 --codec center+rot+q4_0 --codec rot+int4 --codec center+rot+int4 \
    --codec rot+int3 --codec center+rot+int3 \
    --json "$OUT/$model-rot.json" --markdown "$OUT/$model-rot.md"
done
for f in "$OUT"/*-plain.md "$OUT"/*-rot.md; do printf '#### %s\n\n' "$(basename "$f" .md)"; cat "$f"; echo; done > "$OUT/tables.md"
python scripts/update_readme.py "$OUT/tables.md" docs/mean-center.md
