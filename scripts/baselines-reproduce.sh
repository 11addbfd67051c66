#!/usr/bin/env bash
# Every table in docs/baselines.md: the `peers` sweep preset on each model, 8 windows of 512 tokens
# of Austen's Emma, centered codecs using the rotated-basis K mean calibrated on Python's docs
# (scripts/mean-center-reproduce.sh writes those files; this script makes them if missing).
# Hugging Face's QuantizedCache rows (hf-*) are fed as in generation: one scored token per forward
# on smollm2-135m; 32 per forward on qwen2.5-1.5b (one at a time would take hours on 2 CPU cores
# there). The extra full-precision context that costs is measured and printed under each table, and
# docs/results/peers/hf-decode-chunk.md compares 1 and 32 tokens per forward on smollm2-135m.
# gemma3-270m: its sliding-window layers rule out hf-* and KIVI (left out, named under its table).
# On 2 CPU cores: about 35 minutes for smollm2-135m, 20 for qwen2.5-1.5b (2 windows), 15 for
# gemma3-270m. Resumable (rows are written 12 specs at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
for model in ${MODELS:-smollm2-135m qwen2.5-1.5b gemma3-270m}; do
  bias="docs/results/mean-center/$model-rot.gguf"
  [ -f "$bias" ] || walshkv calibrate --model "$model" --text python-docs --tokens 8192 --basis rot --quiet -o "$bias"
  decode_chunk=1 windows=${WINDOWS:-8}
  # qwen2.5-1.5b: 2 windows (510 scored tokens) unless WINDOWS says otherwise; 8 take about 3 hours
  if [ "$model" = qwen2.5-1.5b ]; then decode_chunk=32 windows=${WINDOWS:-2}; fi
  walshkv sweep --model "$model" --text "$TEXT" --grid peers --windows "$windows" --chunk 12 --quiet \
    --kv-mean-center "$bias" --decode-chunk "$decode_chunk" --out "docs/results/peers/$model"
done
# How much feeding 32 tokens per forward flatters transformers' QuantizedCache (smollm2-135m; the
# one-token rows are the peers sweep's own)
chunked=docs/results/peers/hf-decode-chunk-32.json
if [ -d docs/results/peers/smollm2-135m/rows ] && [ ! -f "$chunked" ]; then
  walshkv eval --model smollm2-135m --text "$TEXT" --windows "${WINDOWS:-8}" --feed decode --decode-chunk 32 \
    --codec hf-quanto:4 --codec hf-quanto:2 --codec hf-hqq:4 --codec hf-hqq:3 --codec hf-fp8 --quiet --json "$chunked"
fi
for f in docs/results/peers/*/results.md; do
  printf '### %s\n\n' "$(basename "$(dirname "$f")")"
  sed -e 's/^# Sweep: peers$//' -e 's#](pareto.png)#](results/peers/'"$(basename "$(dirname "$f")")"'/pareto.png)#' "$f"
  echo
done > docs/results/peers/tables.md
if [ -f "$chunked" ]; then
  python scripts/hf_decode_chunk.py docs/results/peers/smollm2-135m/rows "$chunked" >> docs/results/peers/tables.md
fi
python scripts/update_readme.py docs/results/peers/tables.md docs/baselines.md
