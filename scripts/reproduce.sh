#!/usr/bin/env bash
# Regenerates every result file under docs/results/ and the README's results table.
# Run from the repository root with walshkv installed; needs ../shared/data (the Austen texts).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=docs/results
SHARED=../shared/data

# README table and issue-2 acceptance: the default codec list on smollm2-135m, 8 windows of 512.
walshkv eval --model smollm2-135m --text "$SHARED/austen_prideprejudice.txt" --windows 8 --quiet \
  --json "$OUT/smollm2-prideprejudice.json" --markdown "$OUT/smollm2-prideprejudice.md"

# Same protocol and text as ../shared/peers/llamacpp-smollm2-emma.md (llama.cpp's own numbers).
walshkv eval --model smollm2-135m --text "$SHARED/austen_emma.txt" --windows 8 --quiet \
  --codec int8 --codec rot+int4 --codec rot+int8/rot+int4 --codec rot+int3 \
  --json "$OUT/smollm2-emma.json" --markdown "$OUT/smollm2-emma.md"

# Rate-distortion on real K/V (docs/rd.md).
OMP_NUM_THREADS=1 walshkv rd --model smollm2-135m --text "$SHARED/austen_emma.txt" --tokens 2048 --quiet \
  --out "$OUT/rd/smollm2"

python scripts/update_readme.py "$OUT/smollm2-prideprejudice.md"
