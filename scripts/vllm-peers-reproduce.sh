#!/usr/bin/env bash
# docs/baselines.md's and docs/serving.md's tables of vLLM's and LMCache's own quantized caches (walshkv.codecs.vllm: vLLM 0.32's
# turboquant_* and int4_per_token_head, byte for byte) beside walshkv's presets: Austen's Emma (the development
# text; presets read their shipped calibration, made on python-docs), each model under both prefill conventions:
# quantize on write (walshkv's default), and on EXACT_MODELS (default smollm2-135m) exact prefill too, vLLM's own
# convention: each window's unscored first half is the prompt and attends to its exact K/V while the cache stores
# codes, then the scored tokens are decoded one per forward, each reading only codes (as vLLM's decode does). One
# token per forward is what makes exact prefill slow here: about 70 minutes for smollm2-135m's 8 windows on 2 CPU
# cores (AMD EPYC), against 2-3 minutes quantized on write, so exact prefill runs EXACT_WINDOWS (default 4) windows.
set -euo pipefail
cd "$(dirname "$0")/.."
TEXT=../shared/data/austen_emma.txt
OUT=docs/results/vllm-peers
mkdir -p "$OUT"
CODECS=(fp16 walshkv:4.5 walshkv:3.5 walshkv:3 vllm:turboquant_k8v4 vllm:turboquant_4bit_nc vllm:turboquant_k3v4_nc
  vllm:turboquant_3bit_nc vllm:int4_per_token_head)
for model in ${MODELS:-smollm2-135m gemma3-270m qwen2.5-1.5b}; do
  windows=${WINDOWS:-8}
  [ "$model" = qwen2.5-1.5b ] && windows=${WINDOWS:-2}  # 8 windows take about 30 minutes there
  prefills=quantized
  [[ " ${EXACT_MODELS:-smollm2-135m} " == *" $model "* ]] && prefills="quantized exact"
  for prefill in $prefills; do
    [ "$prefill" = exact ] && windows=${EXACT_WINDOWS:-4}
    walshkv eval --model "$model" --text "$TEXT" --windows "$windows" --prefill "$prefill" --quiet \
      "${CODECS[@]/#/--codec=}" --json "$OUT/$model-$prefill.json" --markdown "$OUT/$model-$prefill.md"
  done
done
for f in "$OUT"/*-quantized.md "$OUT"/*-exact.md; do
  [ -f "$f" ] || continue
  name=$(basename "$f" .md)
  printf '#### %s, prefill %s\n\n' "${name%-*}" "${name##*-}"
  cat "$f"
  echo
done > "$OUT/tables.md"
python scripts/update_readme.py "$OUT/tables.md" docs/baselines.md vllm-peers
python scripts/update_readme.py "$OUT/tables.md" docs/serving.md vllm-peers
# LMCache's own quantizing serdes (fp8, turboquant: walshkv.codecs.vllm.LMCACHE_PEERS) on smollm2-135m, quantize on
# write (LMCache stores a finished prefill's chunks: what a later request reads back is all codes). About 2 minutes.
walshkv eval --model smollm2-135m --text "$TEXT" --windows "${WINDOWS:-8}" --quiet --codec fp16 --codec walshkv:4.5 \
  --codec walshkv:3.5 --codec lmcache:fp8 --codec lmcache:turboquant_k8v4 --codec lmcache:turboquant_4bit_nc \
  --codec lmcache:turboquant_k3v4_nc --codec lmcache:turboquant_3bit_nc \
  --json "$OUT/lmcache-smollm2-135m.json" --markdown "$OUT/lmcache-smollm2-135m.md"
python scripts/update_readme.py "$OUT/lmcache-smollm2-135m.md" docs/serving.md lmcache-peers
# Intervals (window bootstrap) and each engine cache paired with walshkv:4.5, from the files above.
python scripts/peer_intervals.py
python scripts/update_readme.py "$OUT/intervals.md" docs/serving.md peer-intervals
python scripts/update_readme.py "$OUT/intervals.md" docs/baselines.md peer-intervals
