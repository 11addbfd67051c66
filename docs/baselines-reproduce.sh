#!/usr/bin/env bash
# Every table in docs/baselines.md: the `peers` sweep preset on each model, 8 windows of 512 tokens
# of Austen's Emma, centered codecs using the rotated-basis K mean calibrated on Python's docs
# (docs/mean-center-reproduce.sh writes those files; this script makes them if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
for model in ${MODELS:-smollm2-135m qwen2.5-1.5b}; do
  bias="docs/results/mean-center/$model-rot.gguf"
  [ -f "$bias" ] || walshkv calibrate --model "$model" --text python-docs --tokens 8192 --basis rot --quiet -o "$bias"
  walshkv sweep --model "$model" --text "$TEXT" --grid peers --windows "${WINDOWS:-8}" --chunk 40 --quiet \
    --kv-mean-center "$bias" --out "docs/results/peers/$model"
done
for f in docs/results/peers/*/results.md; do
  printf '### %s\n\n' "$(basename "$(dirname "$f")")"
  sed -e 's/^# Sweep: peers$//' -e 's#](pareto.png)#](results/peers/'"$(basename "$(dirname "$f")")"'/pareto.png)#' "$f"
  echo
done > docs/results/peers/tables.md
python scripts/update_readme.py docs/results/peers/tables.md docs/baselines.md
