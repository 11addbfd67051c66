#!/usr/bin/env bash
# Every figure in docs/rotation-int4.md: the rotation+INT4 document's three claims measured with today's codecs
# and kernels, then judged by scripts/rotation_int4_claims.py.
#   quality: the `rotation-int4` sweep grid (int8..int2 with and without rot+, kivi2) on Austen's Emma (the
#            development text), 16 windows of 512 tokens on smollm2-135m and 8 on qwen2.5-1.5b; quantize on write
#   speed:   walshkv bench attention for int8/int4 with and without rot+ at 256..16k cached tokens, into
#            bench-<isa> (one folder per instruction set: run it on an AVX2 and an AVX-512 machine for both)
# Resumable: the sweeps skip finished rows; BENCH=0 skips the bench. On 2 CPU cores: about 10 minutes for
# smollm2-135m (more on a shared machine), over an hour for qwen2.5-1.5b and 5 for the bench.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
OUT=docs/results/rotation-int4
TEXT="${DATA:-../shared/data}/austen_emma.txt"
MODELS="${MODELS:-smollm2-135m}"  # MODELS="smollm2-135m qwen2.5-1.5b": qwen too (8 windows, about ten times the time)
for model in $MODELS; do
  case "$model" in qwen2.5-1.5b) windows=8 ;; *) windows=16 ;; esac
  walshkv sweep --model "$model" --text "$TEXT" --grid rotation-int4 --ctx 512 --windows "$windows" --chunk 9 --reuse-rows --quiet \
    --out "$OUT/$model"
done
if [ "${BENCH:-1}" != 0 ]; then
  isa=$(python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())")
  walshkv bench attention --kv-len 256,512,1024,2048,4096,16384 --codec int8 --codec rot+int8 \
    --codec int4 --codec rot+int4 --quiet --out "$OUT/bench-$isa"
fi
python scripts/rotation_int4_claims.py "$OUT" > "$OUT/claims.md"
python scripts/update_readme.py "$OUT/claims.md" docs/rotation-int4.md
