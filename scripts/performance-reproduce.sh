#!/usr/bin/env bash
# Every figure in docs/performance.md: `walshkv bench` (decode attention against torch SDPA, then end-to-end
# generation with smollm2-135m: DynamicCache in fp32 and bf16 against the compressed caches rot+int4, q4_0 and
# the model's walshkv:3.5 preset with its shipped file), pasted into the page. Ratios are measured within one
# run; on a shared machine, run it when the machine is otherwise idle.
#
# Contexts: the longest each model supports. smollm2-135m was trained on max_position_embeddings = 8192
# positions, so its longest context is 8192 - NEW_TOKENS (8176 tokens with the default 16 new tokens); the
# 32k-token runs need a model trained on 32k positions: qwen2.5-1.5b (32768), the opt-in last step (QWEN_CTX).
#
# Expected time on 2 idle cores (AVX2, 2 threads): about 55 minutes without the opt-in steps. The attention part
# takes about 5 minutes; the generation part about 25: at 8176 tokens each row takes 1-3 minutes (prefill
# 35 s for DynamicCache fp32, about 100 s for the compressed caches), except DynamicCache bf16 (about
# 5 minutes: bf16 matmuls are emulated on AVX2, prefill is about 7x slower than fp32); the glibc step (3 runs
# a row) about 15-25 and the tq attention step a few. CTX="1024" for a shorter run (a few minutes).
# QWEN_CTX=4096: adds qwen2.5-1.5b's walshkv:3.5 preset against DynamicCache fp32/bf16 and rot+int4 (about
# 25 minutes more); QWEN_CTX=32768 runs the issue's 32k context (several hours on 2 cores).
#
# OpenMP workers wait passively here (OMP_WAIT_POLICY=passive, unless you set it): on vCPUs that share physical
# cores, spinning workers made every multi-threaded path several times slower (docs/performance.md, "Reading the
# results"); the setting is recorded in each result's machine.omp_wait_policy, next to machine.thread_speedup.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
paste_block() {  # paste $1/bench.md into docs/performance.md's block $2 where the page has one
  if grep -q "<!-- results:$2:start -->" docs/performance.md; then
    python scripts/update_readme.py "$1/bench.md" docs/performance.md "$2"
  else
    echo "$1/bench.md written; docs/performance.md has no results:$2 block to paste it into"
  fi
}
new="${NEW_TOKENS:-16}"
smol_longest=$((8192 - new))
shipped() {  # the calibration file walshkv ships for preset $2 on model $1 (walshkv.shipped, src/walshkv/calibrations)
  python -c "import sys; from walshkv.shipped import shipped_file; print(shipped_file(*sys.argv[1:]).path)" "$1" "$2"
}
smol_preset=(--gen-codec walshkv:3.5 --kv-mean-center "$(shipped smollm2-135m walshkv:3.5)")
out=docs/results/bench
# decode attention (the presets' codecs bound to layer 3 of the shipped file, rot+int4, q4_0, ... against SDPA over
# fp16/bf16/fp32 caches), then generation (DynamicCache fp32 and bf16 against the fused compressed caches)
walshkv bench --kv-len "${KV_LEN:-1024,4096,16384,65536}" --ctx "${CTX:-1024,$smol_longest}" \
  --codec rot+int4 --codec rot+int3 --codec q4_0 --codec q8_0 --codec tq:4/tq:2.5 --codec walshkv:3.5 \
  --gen-codec rot+int4 --gen-codec q4_0 "${smol_preset[@]}" --new-tokens "$new" --quiet --out "$out"
python scripts/update_readme.py "$out/bench.md" docs/performance.md
# the same generation runs under glibc's default allocator settings (the peak-memory target must hold there
# too), DynamicCache fp32 only; 3072 tokens: the shortest prefill that runs every tile shape of the fused prefill,
# where the target's fixed overhead is measured (walshkv.bench.report._memory_target). Peak memory under glibc's
# defaults moves by about 100 MiB between identical runs, so every row runs GLIBC_RUNS times (default 3, about
# 15 minutes) and the table reports medians and the spread
walshkv bench generation --ctx "${CTX_GLIBC:-1024,3072,$smol_longest}" --malloc-mmap-threshold 0 \
  --gen-codec rot+int4 "${smol_preset[@]}" --dynamic-dtype float32 --new-tokens "$new" \
  --gen-runs "${GLIBC_RUNS:-3}" --quiet --no-plot --out docs/results/bench-glibc-default
python scripts/update_readme.py docs/results/bench-glibc-default/bench.md docs/performance.md glibc
# smollm2-135m's other shipped preset (walshkv:4.5, whatever spec its file names: the table in docs/performance.md
# was measured when it was the 512-token winner sink:1:center+rot+iq4_nl/tq:4) and tq variants in the fused
# kernel, against rot+int4 and SDPA in the same run (a few minutes)
walshkv bench attention --kv-len "${KV_LEN_TQ:-4096,16384,65536}" --codec rot+int4 --codec walshkv:4.5 \
  --kv-mean-center "$(shipped smollm2-135m walshkv:4.5)" --codec tq:4/tq:2.5 --codec tq:3.5 \
  --codec tq:5/tq:3.5 --quiet --no-plot --out docs/results/bench-tq
python scripts/update_readme.py docs/results/bench-tq/bench.md docs/performance.md tq
# the shipped walshkv:4.5 since it is chosen at 4k tokens (sink:1:prerope+center+eq+rot+iq4_nl/tq:4, its shipped
# calibration) at 16k, against rot+int4, tq:4 and SDPA
walshkv bench attention --kv-len 16384 --codec walshkv:4.5 --kv-mean-center "$(shipped smollm2-135m walshkv:4.5)" \
  --codec rot+int4 --codec tq:4 --quiet --out docs/results/bench-presets-16k
python scripts/update_readme.py docs/results/bench-presets-16k/bench.md docs/performance.md presets45
# how the kernel maps prerope+ keys: the shipped walshkv:4.5 (eq+: one d x d matrix per key, its torch-matmul bound
# timed alongside) against prerope+ K without eq+ (the codec's Walsh-Hadamard rotation: a fast transform per key,
# fused with RoPE), the same cores without prerope+ and SDPA, at 16k and 64k (a few minutes). Timing only: the
# file's K mean is not used by the specs without center+, which cost the kernel the same
# One block per instruction set (AVX-512 in bench-keymap, AVX2-only CPUs in bench-keymap-avx2): run it on each.
if python -c "import sys, torch; sys.exit(torch.backends.cpu.get_cpu_capability() != 'AVX2')"; then
  isa=-avx2
else
  isa=
fi
keymap=keymap$isa
keymap_out=docs/results/bench-keymap$isa
walshkv bench attention --kv-len "${KV_LEN_KEYMAP:-16384,65536}" --codec walshkv:4.5 \
  --kv-mean-center "$(shipped smollm2-135m walshkv:4.5)" --codec "sink:1:prerope+rot+iq4_nl/tq:4" \
  --codec "sink:1:prerope+tq:4.5/tq:4" --codec rot+iq4_nl/tq:4 --codec tq:4.5/tq:4 --codec rot+int4 --quiet --no-plot \
  --out "$keymap_out"
paste_block "$keymap_out" "$keymap"
# the fast presets (walshkv:B-fast: recommend --fast at 4k tokens, docs/long-context.md; no dense per-key map in
# decode) against the shipped walshkv:3, walshkv:3.5 and walshkv:4.5, rot+int4, q4_0 and SDPA, each preset with its own
# shipped file (no --kv-mean-center), at 16k and 64k (a few minutes); then generation at the longest context,
# walshkv:3.5 and walshkv:3.5-fast against DynamicCache fp32 and bf16 (about 15 minutes). One pair of blocks per
# instruction set (fast and fast-gen; fast-avx2 and fast-gen-avx2)
walshkv bench attention --kv-len "${KV_LEN_FAST:-16384,65536}" --codec walshkv:3 --codec walshkv:3-fast \
  --codec walshkv:3.5 --codec walshkv:3.5-fast --codec walshkv:4.5 --codec walshkv:4.5-fast --codec rot+int4 \
  --codec q4_0 --quiet --no-plot --out "docs/results/bench-fast$isa"
paste_block "docs/results/bench-fast$isa" "fast$isa"
# every model's attention shapes (walshkv bench attention --model: head_dim 64 with GQA 3 for smollm2-135m, 128 with
# GQA 6 for qwen2.5-1.5b, 256 with GQA 4 for gemma3-270m, 64 with GQA 7 for qwen2.5-0.5b), each preset with the calibration walshkv ships for that
# model, against rot+int4, q4_0, the same tq codes stored after RoPE (no per-key map) and SDPA, at 16k and 64k, on
# one thread (SDPA and the kernel alike: what a machine shared with other work disturbs least; THREADS_MODELS=2
# for both cores). One block per model and instruction set (a few minutes each)
# beside them, the 3.5-bit presets' trellis codes stored after RoPE (no frame, no per-key map: what bounds a block-frame
# preset from below) and the same budget's scalar codes (tq:3.5/tq:3)
tcq_after="tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2"
# Both kinds of every budget by their unambiguous names: walshkv:B-max (the per-key map allowed) and walshkv:B-fast
# (the block frame); which one the plain name walshkv:B means follows from these rows (scripts/ship_presets.py, the
# naming rule of docs/presets.md), so rerun ship_presets.py after this step
presets=()
for b in 2.5 3 3.5 4.5; do presets+=(--codec "walshkv:$b-max" --codec "walshkv:$b-fast"); done
for model in ${BENCH_MODELS:-smollm2-135m qwen2.5-1.5b gemma3-270m qwen2.5-0.5b}; do
  walshkv bench attention --model "$model" --threads "${THREADS_MODELS:-1}" --kv-len "${KV_LEN_FAST:-16384,65536}" \
    "${presets[@]}" --codec "tq:3.5/tq:3" \
    --codec "$tcq_after" --codec rot+int4 --codec q4_0 --quiet --no-plot --out "docs/results/bench-model-$model$isa"
  paste_block "docs/results/bench-model-$model$isa" "model-$model$isa"
done
# where a block-frame step spends its time ("Where a block-frame step spends its time"): each part of every model's
# 3.5-bit fast preset step timed alone on one thread, the caches flushed before every timed call (a few minutes)
if [[ -z "$isa" ]]; then
  python research/scripts/blockframe_cost.py --kv-len "${KV_LEN_FAST:-16384,65536}" \
    --json docs/results/research/blockframe-cost/cost.json --markdown docs/results/research/blockframe-cost/cost.md
  python scripts/update_readme.py docs/results/research/blockframe-cost/cost.md docs/performance.md blockframe-cost
fi
# on an AVX-512 CPU, the same three runs with the AVX2 code paths (torch's AVX2 kernels: ATEN_CPU_CAPABILITY=avx2;
# the fused kernel built with -march=haswell: WALSHKV_CPU_MARCH): a stand-in for an AVX2-only machine, on the same
# cores, caches and memory (so not that machine's figures; the bench header names the build). A few minutes each
if [[ -z "$isa" ]]; then
  for model in smollm2-135m qwen2.5-1.5b gemma3-270m; do
    ATEN_CPU_CAPABILITY=avx2 WALSHKV_CPU_MARCH=haswell walshkv bench attention --model "$model" \
      --threads "${THREADS_MODELS:-1}" --kv-len "${KV_LEN_FAST:-16384,65536}" "${presets[@]}" --codec "tq:3.5/tq:3" \
      --codec "$tcq_after" --codec rot+int4 --codec q4_0 --quiet --no-plot --out "docs/results/bench-model-$model-avx2code"
    paste_block "docs/results/bench-model-$model-avx2code" "model-$model-avx2code"
  done
fi
# on a CPU with AMX-BF16 the kernel maps eq+'s keys on tiles (walshkv.attention.cpu.amx_key_map): the same
# eq+ presets with that off (WALSHKV_CPU_AMX=0, the fp32 multiply-adds every other CPU runs), in a run of their own
if python -c "import sys; from walshkv.attention.cpu import amx_key_map; sys.exit(not amx_key_map())"; then
  WALSHKV_CPU_AMX=0 walshkv bench attention --kv-len "${KV_LEN_FAST:-16384,65536}" --codec walshkv:3 \
    --codec walshkv:3.5 --codec walshkv:4.5 --codec rot+int4 --quiet --no-plot --out docs/results/bench-fast-fp32map
  paste_block docs/results/bench-fast-fp32map fast-fp32map
fi
# issue 35's generation target: glibc's default allocator (--malloc-mmap-threshold 0), medians of FAST_GEN_RUNS runs
# (default 3) of every row, rot+int4 beside the presets (about 15 minutes on 2 cores)
walshkv bench generation --ctx "${CTX_FAST:-$smol_longest}" --gen-codec walshkv:3.5 --gen-codec walshkv:3.5-fast \
  --gen-codec rot+int4 --malloc-mmap-threshold 0 --gen-runs "${FAST_GEN_RUNS:-3}" --new-tokens "$new" --quiet \
  --no-plot --out "docs/results/bench-fast-gen$isa"
paste_block "docs/results/bench-fast-gen$isa" "fast-gen$isa"
# opt-in: smollm2-135m past its trained positions (SMOL_CTX_LONG=32768: the issue's 32k context, timing only, the
# text it generates there means nothing), its presets against DynamicCache and rot+int4; about 45 minutes on 2
# cores with AMX, longer on AVX2
if [[ -n "${SMOL_CTX_LONG:-}" ]]; then
  walshkv bench generation --ctx "$SMOL_CTX_LONG" --gen-codec rot+int4 --gen-codec walshkv:3.5 \
    --gen-codec walshkv:3.5-fast --new-tokens "$new" --quiet --no-plot --out "docs/results/bench-gen-long$isa"
  paste_block "docs/results/bench-gen-long$isa" "gen-long$isa"
  # and under glibc's default allocator (DynamicCache fp32's per-step torch.cat is not inflated there)
  walshkv bench generation --ctx "$SMOL_CTX_LONG" --malloc-mmap-threshold 0 --gen-codec rot+int4 \
    --gen-codec walshkv:3.5 --dynamic-dtype float32 --new-tokens "$new" --quiet --no-plot \
    --out "docs/results/bench-gen-long-glibc$isa"
  paste_block "docs/results/bench-gen-long-glibc$isa" "gen-long-glibc$isa"
else
  echo "skipped smollm2-135m at 32k (SMOL_CTX_LONG=32768 to run it)"
fi
# opt-in: qwen2.5-1.5b (max_position_embeddings 32768) with its walshkv:3.5 preset; pasted where the page has
# a <!-- results:qwen:start --> ... <!-- results:qwen:end --> block
if [[ -n "${QWEN_CTX:-}" ]]; then
  walshkv bench generation --model qwen2.5-1.5b --ctx "$QWEN_CTX" --gen-codec rot+int4 \
    --gen-codec walshkv:3.5 --kv-mean-center "$(shipped qwen2.5-1.5b walshkv:3.5)" --new-tokens "$new" \
    --quiet --no-plot --out docs/results/bench-qwen
  paste_block docs/results/bench-qwen qwen
else
  echo "skipped qwen2.5-1.5b (QWEN_CTX=4096 or QWEN_CTX=4096,32768 to run it)"
fi
