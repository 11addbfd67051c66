#!/usr/bin/env bash
# Every figure in docs/vht2.md: the VHT2 sweep presets on smollm2-135m and qwen2.5-1.5b,
# 8 windows of 512 tokens of Austen's Emma, calibrated codecs calibrated on Python's docs
# (never the evaluation text), then the claims table (scripts/vht2_claims.py).
# Resumable: rerunning skips finished rows. On 2 CPU cores: about 15 minutes for smollm2 and 35
# for qwen2.5-1.5b. On qwen2.5-1.5b the 21-row vht2-bits grid is left out unless FULL=1
# (the pattern claims are covered by vht2-claims).
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
sweep() {  # model grid
  walshkv sweep --model "$1" --text "$TEXT" --grid "$2" --windows 8 --chunk 32 \
    --calib-text python-docs --calib-tokens 8192 --quiet --out "docs/results/vht2/$1/$2"
}
MODELS=${MODELS:-"smollm2-135m qwen2.5-1.5b"}
for model in $MODELS; do
  GRIDS="vht2-claims vht2-bits vht2-bands vht2-sk vht2-orders vht2-v"
  if [ "$model" = qwen2.5-1.5b ] && [ "${FULL:-0}" != 1 ]; then
    GRIDS="vht2-claims vht2-bands vht2-sk vht2-orders vht2-v"
  fi
  for grid in $GRIDS; do sweep "$model" "$grid"; done
done
python scripts/vht2_claims.py docs/results/vht2 > docs/results/vht2/claims.md
python scripts/update_readme.py docs/results/vht2/claims.md docs/vht2.md
