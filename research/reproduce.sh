#!/usr/bin/env bash
# Every figure in research/README.md (PrimePE and the spectral lab). Idempotent: finished result folders
# are kept, so an interrupted run resumes. Text: Austen's Emma (../shared/data), 512-token windows.
#   1. `walshkv spectrum`: WHT energy of K (before and after RoPE) and V per layer and band (4 windows).
#   2. `walshkv reconstruct --lll`: kept-fraction reconstruction in Walsh, DCT, Fourier, Vilenkin and
#      identity bases, for K, V and synthetic signals, and the LLL experiment (4 windows).
#   3. `walshkv rope sweep`: alphas 0..1 for the composite and prime generators under both conventions,
#      with the published pairing (on smollm2-135m also the matched pairing, and composed with a KV
#      codec), 8 windows. smollm2-135m: about 6 minutes per sweep on 2 cores; qwen2.5-1.5b: about 35.
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
R=docs/results/research
run() { [ -f "$1/$2" ] || { shift 2; "$@"; }; }
for model in ${MODELS:-smollm2-135m qwen2.5-1.5b}; do
  run "$R/spectrum-$model" spectrum.json walshkv spectrum --model "$model" --text "$TEXT" --tokens 2048 \
    --quiet --out "$R/spectrum-$model"
  run "$R/reconstruct-$model" reconstruct.json walshkv reconstruct --model "$model" --text "$TEXT" \
    --tokens 2048 --lll --quiet --out "$R/reconstruct-$model"
  run "$R/rope-$model-published" rope.json walshkv rope sweep --model "$model" --text "$TEXT" --windows 8 \
    --quiet --out "$R/rope-$model-published"
  if [ "$model" = qwen2.5-1.5b ]; then  # its small-alpha perplexity gain, re-checked on other text
    run "$R/rope-$model-check" rope.json walshkv rope sweep --model "$model" --text python-docs --windows 8 \
      --alpha 0,0.05,0.1 --generator composite --convention divide --quiet --out "$R/rope-$model-check"
  fi
  if [ "$model" = smollm2-135m ]; then
    run "$R/rope-$model-matched" rope.json walshkv rope sweep --model "$model" --text "$TEXT" --windows 8 \
      --pairing matched --quiet --out "$R/rope-$model-matched"
    run "$R/rope-$model-codec" rope.json walshkv rope sweep --model "$model" --text "$TEXT" --windows 8 \
      --alpha 0,0.05,0.1,0.2 --convention divide --codec rot+q4_0 --quiet --out "$R/rope-$model-codec"
  fi
done
