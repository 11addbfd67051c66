#!/usr/bin/env bash
# Every figure of docs/trellis.md (issue 37: the trellis code tcq). Each step is skipped once its output exists;
# delete an output to rerun it.
#
#   bash docs/trellis-reproduce.sh                        # every stage (about two hours on 2 cores)
#   STAGES="select" bash docs/trellis-reproduce.sh        # one stage
#
# Protocol (docs/trellis.md, "The shipping rule", committed before any selection or holdout row existed):
# selection on python-docs only (recommend: K statistics from its first half, candidates ranked on windows of its
# second half, at 4,096 tokens as the shipped presets were); Emma is the development text; Persuasion the frozen
# holdout, measured once, after the winners have shipped, never used to choose.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-passive}"
OUT=docs/results/trellis
SELECT=docs/results/long-context/select
DATA="${DATA:-../shared/data}"
EMMA="$DATA/austen_emma.txt"
PERSUASION="$DATA/austen_persuasion.txt"
STAGES="${STAGES:-tables rd select ship emma holdout bench decode structured lookup report}"
# (rd-n8 and select-n8, then ship, emma and holdout again: the norm=8 re-selection, run after the stages above;
# then rd-t2, select-qwen25 and select-t2, ship: table set 2 and qwen2.5-1.5b's walshkv:2.5; then select-qwen-tcq, ship; then select-tcq-rest, ship; then select-gemma25, ship;
# then tables-3, rd-t3 and bench-t3: table set 3, the split tables; then tables-4, rd-t4 and bench-t4: table set 4,
# set 2 rounded to bfloat16)
MODEL=smollm2-135m
# walshkv rd on smollm2-135m's and qwen2.5-1.5b's K/V: tcq (one-byte norm) with table set 2 against set $1 at every
# width from 2 to 4.5 bits, to docs/results/rd-tables$1/MODEL (skipped where its rd.json exists)
rd_twin() {
  for model in smollm2-135m qwen2.5-1.5b; do
    args=()
    for w in 2 2.5 3 3.5 4 4.5; do args+=(--codec "tcq:$w:norm=8:tables=2" --codec "tcq:$w:norm=8:tables=$1"); done
    [ -f "docs/results/rd-tables$1/$model/rd.json" ] || walshkv rd --model "$model" --tokens 2048 --quiet \
      --out "docs/results/rd-tables$1/$model" "${args[@]}"
  done
}

# The candidates per preset: the shipped spec (as it stood before this selection), its tcq twin (every tq:W made
# tcq:W), and the twin with K half a bit wider and V half a bit narrower; at 2.5 bits (a new preset) tcq at the
# two splits of the budget and the sink:1 form that pays with V in the four layers walshkv:3 narrows; at 4.5 bits
# tcq at 4 bits on both sides and the two splits of the whole budget. The fast presets: the same with eqd+.
cands() {
  case "$1" in
  2.5) printf '%s\n' 'prerope+center+eq+tcq:2.5/tcq:2' 'prerope+center+eq+tcq:3/tcq:1.5' \
    'sink:1:layers:prerope+center+eq+tcq:2.5/tcq:1.5@5,8,12,14;prerope+center+eq+tcq:2.5/tcq:2' ;;
  3) printf '%s\n' 'sink:1:layers:prerope+center+eq+tq:3/tq:2@5,8,12,14;prerope+center+eq+tq:3/tq:2.5' \
    'sink:1:layers:prerope+center+eq+tcq:3/tcq:2@5,8,12,14;prerope+center+eq+tcq:3/tcq:2.5' \
    'sink:1:layers:prerope+center+eq+tcq:3.5/tcq:1.5@5,8,12,14;prerope+center+eq+tcq:3.5/tcq:2' ;;
  3.5) printf '%s\n' 'sink:1:layers:prerope+center+eq+tq:3.5/tq:2.5@5,8,12;prerope+center+eq+tq:3.5/tq:3' \
    'sink:1:layers:prerope+center+eq+tcq:3.5/tcq:2.5@5,8,12;prerope+center+eq+tcq:3.5/tcq:3' \
    'sink:1:layers:prerope+center+eq+tcq:4/tcq:2@5,8,12;prerope+center+eq+tcq:4/tcq:2.5' ;;
  4.5) printf '%s\n' 'sink:1:prerope+center+eq+rot+iq4_nl/tq:4' 'sink:1:prerope+center+eq+tcq:4/tcq:4' \
    'prerope+center+eq+tcq:4.5/tcq:4' 'prerope+center+eq+tcq:5/tcq:3.5' ;;
  esac
}
fast() { sed 's/prerope+center+eq+/prerope+center+eqd+/g'; }
# every tq:W made tcq:W with the one-byte norm and table set 2
tcq_twin() { sed -E 's/tq:([0-9.]+)/tcq:\1:norm=8:tables=2/g'; }
# named MODEL BITS TAG SPEC...: recommend at 4k on python-docs among the named specs only (skipped once its json exists)
named() {
  local model=$1 bits=$2 tag=$3 json; shift 3
  local args=(); for spec in "$@"; do args+=(--candidate "$spec"); done
  mkdir -p "$SELECT/$model"
  json="$SELECT/$model/recommend-$bits-$tag-ctx4096.json"
  [ -f "$json" ] || walshkv recommend --model "$model" --bits "$bits" --only-candidates "${args[@]}" --ctx 4096 \
    --windows 2 --quiet --json "$json" -o "$SELECT/$model/walshkv-$bits-$tag-ctx4096.gguf"
}
# stage select-n8 (docs/trellis.md, "The norm in one byte: its shipping rule"): the shipped spec (read from the
# package), its norm=8 twin, and the norm=8 spec that spends the freed bits in every layer
n8_twin() { sed -E 's/tcq:([0-9.]+)/tcq:\1:norm=8/g'; }
n8_spend() {
  case "$1" in
  2.5) echo 'sink:1:prerope+center+eq+tcq:2.5:norm=8/tcq:2:norm=8' ;;
  3) echo 'sink:1:prerope+center+eq+tcq:3:norm=8/tcq:2.5:norm=8' ;;
  3.5) echo 'sink:1:prerope+center+eq+tcq:3.5:norm=8/tcq:3:norm=8' ;;
  4.5) echo 'sink:1:prerope+center+eq+tcq:4.5:norm=8/tcq:4:norm=8' ;;
  esac
}
# stage select-t2: a spec's table-set-2 twin (every tcq:W... given :tables=2)
t2_twin() { sed -E 's/(tcq:[0-9.]+(:norm=8)?)/\1:tables=2/g'; }
# stage select-t4: a spec's table-set-4 twin (every tables=2 made tables=4)
t4_twin() { sed 's/tables=2/tables=4/g'; }
# recommend on python-docs at 4k tokens (2 windows) between $4, preset walshkv:$2 of model $1 as it ships, and its
# twin (the filter $5 applied to it), to $SELECT/$1/recommend-$2-$3-ctx4096.json (skipped where that exists)
select_twin() {
  local model=$1 name=$2 tag=$3 bits=${2%-fast} flag=
  [ "$bits" != "$name" ] && flag=--fast
  mkdir -p "$SELECT/$model"
  local json="$SELECT/$model/recommend-$name-$tag-ctx4096.json"
  [ -f "$json" ] && return 0
  walshkv recommend --model "$model" --bits "$bits" $flag --only-candidates --candidate "$4" \
    --candidate "$(echo "$4" | $5)" --ctx 4096 --windows 2 \
    --quiet --json "$json" -o "$SELECT/$model/walshkv-$name-$tag-ctx4096.gguf"
}
# the presets as they shipped before this selection (tq), rows beside the new ones (the same calibration)
before() {
  for spec in 'sink:1:layers:prerope+center+eq+tq:3/tq:2@5,8,12,14;prerope+center+eq+tq:3/tq:2.5' \
    'sink:1:layers:prerope+center+eqd+tq:3/tq:2@5,8,12,14;prerope+center+eqd+tq:3/tq:2.5' \
    'sink:1:layers:prerope+center+eq+tq:3.5/tq:2.5@5,8,12;prerope+center+eq+tq:3.5/tq:3' \
    'sink:1:layers:prerope+center+eqd+tq:3.5/tq:2.5@5,8,12;prerope+center+eqd+tq:3.5/tq:3' \
    'sink:1:prerope+center+eq+rot+iq4_nl/tq:4' 'sink:1:prerope+center+eqd+rot+iq4_nl/tq:4'; do
    printf -- "--codec %s " "$spec"
  done
}

# the presets (as shipped now) beside the specs they replaced and the peers, on text $1 (16 windows of 512), to
# $OUT/$MODEL/$2.json
compare() {
  mkdir -p "$OUT/$MODEL"
  [ -f "$OUT/$MODEL/$2.json" ] || walshkv eval --model "$MODEL" --text "$1" --windows 16 --quiet \
    --calib-text python-docs $(before) \
    --codec walshkv:2.5 --codec walshkv:2.5-fast --codec walshkv:3 --codec walshkv:3-fast --codec walshkv:3.5 \
    --codec walshkv:3.5-fast --codec walshkv:4.5 --codec walshkv:4.5-fast --codec rot+iq4_nl --codec rot+q4_0 \
    --codec rot+q8_0/rot+q4_0 --json "$OUT/$MODEL/$2.json"
}

for stage in $STAGES; do
  case "$stage" in
  tables)
    # the trellis tables (model-independent; the file is committed, so this only re-checks it)
    python scripts/train_trellis_tables.py --check
    ;;
  rd)
    # tq against tcq at the same widths on real K/V, against D(R)
    for model in smollm2-135m qwen2.5-1.5b; do
      [ -f "$OUT/rd-$model/rd.json" ] || walshkv rd --model "$model" --tokens 2048 --quiet --out "$OUT/rd-$model" \
        --codec tq:2 --codec tcq:2 --codec tq:2.5 --codec tcq:2.5 --codec tq:3 --codec tcq:3 --codec tq:3.5 \
        --codec tcq:3.5 --codec tq:4 --codec tcq:4 --codec rot+iq4_nl --codec rot+q4_0
    done
    ;;
  rd-n8)
    # tq and tcq with the norm in one byte (:norm=8) beside their fp16-norm forms, against D(R) (docs/rd.md, "The norm
    # in one byte")
    for model in smollm2-135m qwen2.5-1.5b; do
      args=()
      for c in tq:2.5 tcq:2.5 tq:3 tcq:3 tq:4 tcq:4; do args+=(--codec "$c" --codec "$c:norm=8"); done
      [ -f "docs/results/rd-norm8/$model/rd.json" ] || walshkv rd --model "$model" --tokens 2048 --quiet \
        --out "docs/results/rd-norm8/$model" "${args[@]}"
    done
    ;;
  rd-t2)
    # tcq with the norm in one byte, table set 1 against table set 2 (:tables=2, trained longer), against D(R)
    # (docs/rd.md, "Longer-trained tables")
    for model in smollm2-135m qwen2.5-1.5b; do
      args=()
      for c in tcq:2.5:norm=8 tcq:3:norm=8 tcq:4:norm=8; do args+=(--codec "$c" --codec "$c:tables=2"); done
      [ -f "docs/results/rd-tables2/$model/rd.json" ] || walshkv rd --model "$model" --tokens 2048 --quiet \
        --out "docs/results/rd-tables2/$model" "${args[@]}"
    done
    ;;
  tables-3)
    # table set 3, split tables (P[s & 15] + Q[s >> 4]: an AVX2 CPU reads them by register permutes, no gather);
    # the file is committed, so this trains it only where it is missing (about 25 minutes on one core)
    [ -f src/walshkv/ops/trellis_tables_3.json ] || OMP_NUM_THREADS=1 python scripts/train_trellis_tables.py --set 3 \
      --search cpp --iterations 200 --samples 16384 --starts 2
    ;;
  rd-t3)
    # what the split costs on real K/V: tcq (one-byte norm) with table set 2 against table set 3, against D(R)
    rd_twin 3
    ;;
  bench-t3)
    # decode attention at 16k and 64k on one thread (an idle machine), each model's shapes: the 3.5-bit codes after
    # RoPE and the 3.5-bit fast preset (the block frame), table set 2 against its set-3 twin, built for this CPU and,
    # where it has AVX-512, for AVX2 on the same CPU (WALSHKV_CPU_MARCH=haswell, and torch's AVX2 kernels for SDPA:
    # ATEN_CPU_CAPABILITY=avx2; a stand-in, not an AVX2-only machine)
    for model in ${T3_MODELS:-smollm2-135m qwen2.5-1.5b gemma3-270m}; do
      cal=src/walshkv/calibrations/$model/prerope-plain-keqr_64_64.gguf
      fast=$(python -c "from walshkv.presets import resolve_preset as r; print(r('walshkv:3.5-fast', model='$model').spec)")
      for march in native haswell; do
        out="$OUT/split-bench/$model-$march"
        [ -f "$out/bench.json" ] && continue
        env $([ "$march" = native ] || echo WALSHKV_CPU_MARCH=$march ATEN_CPU_CAPABILITY=avx2) walshkv bench attention \
          --model "$model" \
          --threads 1 --kv-len "${T3_KV_LENS:-16384,65536}" --codec tq:3.5/tq:3 \
          --codec tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2 --codec tcq:3.5:norm=8:tables=3/tcq:3:norm=8:tables=3 \
          --codec "$fast" --codec "$(echo "$fast" | sed 's/tables=2/tables=3/g')" --kv-mean-center "$cal" --quiet \
          --no-plot --out "$out"
      done
    done
    ;;
  tables-4)
    # table set 4: set 2's tables rounded to bfloat16 (the VBMI decoder reads two byte planes of each value, not
    # four); the file is committed, so this writes it only where it is missing (seconds: no training)
    [ -f src/walshkv/ops/trellis_tables_4.json ] || OMP_NUM_THREADS=1 python scripts/train_trellis_tables.py --set 4 \
      --search cpp --samples 16384
    ;;
  rd-t4)
    # what the rounding costs on real K/V: tcq (one-byte norm) with table set 2 against table set 4, against D(R)
    rd_twin 4
    ;;
  bench-t4)
    # decode attention at 16k and 64k on one thread (an idle machine), each model's shapes, the kernel built for
    # this CPU: the 3.5-bit codes after RoPE and the 3.5-bit fast preset (the block frame), table set 2 against its
    # set-4 twin (the two-plane lookup needs VBMI; without it set 4 decodes as set 2 does)
    for model in ${T4_MODELS:-smollm2-135m qwen2.5-1.5b gemma3-270m qwen2.5-0.5b}; do
      cal=src/walshkv/calibrations/$model/prerope-plain-keqr_64_64.gguf
      fast=$(python -c "from walshkv.presets import resolve_preset as r; print(r('walshkv:3.5-fast', model='$model').spec)")
      out="$OUT/bf16-bench/$model"
      [ -f "$out/bench.json" ] && continue
      walshkv bench attention --model "$model" --threads 1 --kv-len "${T4_KV_LENS:-16384,65536}" --codec tq:3.5/tq:3 \
        --codec tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2 --codec tcq:3.5:norm=8:tables=4/tcq:3:norm=8:tables=4 \
        --codec "$fast" --codec "$(echo "$fast" | sed 's/tables=[0-9]/tables=4/g')" --kv-mean-center "$cal" --quiet \
        --no-plot --out "$out"
    done
    ;;
  select-t4)
    # table set 4 in the presets (trellis.md, "Set 4 in the presets"): every shipped preset that reads set 2 against
    # its set-4 twin, on its own selection protocol; scripts/ship_presets.py ships the twin when its KLD is at most
    # 1.01x the shipped spec's (TWIN_RULES), then stage ship-t4. T4_SELECT_MODELS picks the models (the cheapest
    # first: about 2 minutes a run on smollm2-135m, 5 on gemma3-270m, 15-20 on qwen2.5-1.5b, one core)
    for model in ${T4_SELECT_MODELS:-smollm2-135m gemma3-270m qwen2.5-0.5b qwen2.5-1.5b}; do
      mkdir -p "$SELECT/$model"
      for name in $(python -c "from walshkv.presets import model_presets as m; print(' '.join(p.removeprefix('walshkv:') for p, e in m()['$model']['presets'].items() if 'tables=2' in e['spec']))"); do
        select_twin "$model" "$name" t4 \
          "$(python -c "from walshkv.presets import model_presets as m; print(m()['$model']['presets']['walshkv:$name']['spec'])")" \
          t4_twin
      done
    done
    ;;
  ship-t4)
    python scripts/ship_presets.py
    for model in ${T4_SELECT_MODELS:-smollm2-135m gemma3-270m qwen2.5-0.5b qwen2.5-1.5b}; do
      python scripts/ship_calibrations.py --model "$model"
    done
    ;;
  select)
    mkdir -p "$SELECT/$MODEL"
    for bits in 3 3.5 2.5 4.5; do
      for kind in plain fast; do
        if [ "$kind" = fast ]; then suffix=-fast; flag=--fast; list=$(cands "$bits" | fast); else suffix=; flag=; list=$(cands "$bits"); fi
        json="$SELECT/$MODEL/recommend-$bits$suffix-tcq-ctx4096.json"
        [ -f "$json" ] && continue
        args=()
        while IFS= read -r spec; do args+=(--candidate "$spec"); done <<< "$list"
        walshkv recommend --model "$MODEL" --bits "$bits" $flag --only-candidates "${args[@]}" --ctx 4096 --windows 2 \
          --quiet --json "$json" -o "$SELECT/$MODEL/walshkv-$bits$suffix-tcq-ctx4096.gguf"
      done
    done
    ;;
  select-n8)
    mkdir -p "$SELECT/$MODEL"
    for bits in 3 3.5 4.5 2.5; do
      for kind in plain fast; do
        if [ "$kind" = fast ]; then suffix=-fast; flag=--fast; else suffix=; flag=; fi
        json="$SELECT/$MODEL/recommend-$bits$suffix-n8-ctx4096.json"
        [ -f "$json" ] && continue
        shipped=$(python -c "from walshkv.presets import resolve_preset as r; print(r('walshkv:$bits$suffix', model='$MODEL').spec)")
        spend=$(n8_spend "$bits")
        [ "$kind" = fast ] && spend=$(echo "$spend" | fast)
        walshkv recommend --model "$MODEL" --bits "$bits" $flag --only-candidates --candidate "$shipped" \
          --candidate "$(echo "$shipped" | n8_twin)" --candidate "$spend" --ctx 4096 --windows 2 \
          --quiet --json "$json" -o "$SELECT/$MODEL/walshkv-$bits$suffix-n8-ctx4096.gguf"
      done
    done
    ;;
  select-qwen25)
    # qwen2.5-1.5b's walshkv:2.5, a new preset (docs/trellis.md, "Table set 2 and qwen2.5-1.5b's walshkv:2.5"): four
    # named specs at 2.31 bits
    named qwen2.5-1.5b 2.5 t2 'sink:1:prerope+center+eq+tq:2.5:norm=8/tq:2:norm=8' \
      'sink:1:prerope+center+eq+tcq:2.5:norm=8/tcq:2:norm=8' \
      'sink:1:prerope+center+eq+tcq:2.5:norm=8:tables=2/tcq:2:norm=8:tables=2' \
      'sink:1:prerope+center+eq+tcq:3:norm=8:tables=2/tcq:1.5:norm=8:tables=2'
    ;;
  select-qwen-tcq)
    # qwen2.5-1.5b's walshkv:3 and walshkv:4.5 with the trellis code (docs/trellis.md, "qwen2.5-1.5b's walshkv:3 and
    # walshkv:4.5 with the trellis code"): named candidates
    named qwen2.5-1.5b 3 qtcq 'sink:1:prerope+center+eq+tq:3/tq:2.5' \
      'sink:1:prerope+center+eq+tcq:3:norm=8:tables=2/tcq:2.5:norm=8:tables=2'
    named qwen2.5-1.5b 4.5 qtcq 'sink:1:prerope+center+eq+rot+iq4_nl/tq:4' \
      'sink:1:prerope+center+eq+rot+iq4_nl/tcq:4:norm=8:tables=2' 'sink:1:prerope+center+eq+tcq:4.5:norm=8:tables=2/tcq:4:norm=8:tables=2'
    ;;
  select-tcq-rest)
    # the last tq presets with the trellis code (docs/trellis.md, "The last tq presets with the trellis code"):
    # qwen2.5-1.5b's walshkv:3.5, gemma3-270m's walshkv:3 and walshkv:3.5, each among named candidates
    q35='sink:1:layers:prerope+center+eq+tq:3.5/tq:3.5@0-3,25-27;prerope+center+eq+tq:3.5/tq:3'
    named qwen2.5-1.5b 3.5 tcqr "$q35" "$(echo "$q35" | tcq_twin)" 'sink:1:prerope+center+eq+tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2'
    g3='sink:1:layers:prerope+center+eq+tq:4/tq:2@0;prerope+center+eq+tq:3/tq:2.5@1-3,5,7-8,11,13-16;prerope+center+eq+tq:4/tq:2.5@4,9-10,12;prerope+center+eq+tq:3/tq:1.5@6,17;prerope+center+eq+tq:3.5/tq:2'
    named gemma3-270m 3 tcqr "$g3" "$(echo "$g3" | tcq_twin)" 'sink:1:prerope+center+eq+tcq:3:norm=8:tables=2/tcq:2.5:norm=8:tables=2'
    named gemma3-270m 3.5 tcqr 'sink:1:prerope+center+eq+tq:3.5/tq:3' 'sink:1:prerope+center+eq+tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2'
    ;;
  select-gemma25)
    # gemma3-270m's walshkv:2.5 (docs/trellis.md, "gemma3-270m's walshkv:2.5"): named candidates
    named gemma3-270m 2.5 g25 'center+tcq:2.5/tcq:2' 'sink:1:prerope+center+eq+tcq:2.5:norm=8:tables=2/tcq:2:norm=8:tables=2' \
      'sink:1:prerope+center+eq+tcq:3:norm=8:tables=2/tcq:1.5:norm=8:tables=2'
    ;;
  select-t2)
    # every shipped tcq preset against its table-set-2 twin (the same rule)
    for model_bits in smollm2-135m:3 smollm2-135m:3-fast smollm2-135m:3.5 smollm2-135m:3.5-fast smollm2-135m:4.5 \
      smollm2-135m:4.5-fast smollm2-135m:2.5 smollm2-135m:2.5-fast gemma3-270m:4.5; do
      model=${model_bits%%:*} name=${model_bits#*:}
      [ -f "$SELECT/$model/recommend-$name-t2-ctx4096.json" ] && continue
      select_twin "$model" "$name" t2 \
        "$(python -c "from walshkv.presets import resolve_preset as r; print(r('walshkv:$name', model='$model').spec)")" t2_twin
    done
    ;;
  ship)
    # the winners ship (the later run at the same context wins), then the calibrations they read
    python scripts/ship_presets.py
    python scripts/ship_calibrations.py --model "$MODEL"
    ;;
  emma) compare "$EMMA" emma ;;
  holdout) compare "$PERSUASION" persuasion ;;
  bench)
    # decode attention at 16k, one thread (an idle machine): tq against tcq alone and in the 3.5-bit fast preset's
    # spec (the one before the selection and the tcq twin, the same diagonal calibration), rot+int4 as the 4-bit peer
    cal=src/walshkv/calibrations/$MODEL/prerope-plain-keqd.gguf
    [ -f "$OUT/bench-attention/bench.json" ] || walshkv bench attention --model "$MODEL" --threads 1 --kv-len 16384 \
      --codec 'sink:1:layers:prerope+center+eqd+tq:3.5/tq:2.5@5,8,12;prerope+center+eqd+tq:3.5/tq:3' \
      --codec 'sink:1:layers:prerope+center+eqd+tcq:3.5/tcq:2.5@5,8,12;prerope+center+eqd+tcq:3.5/tcq:3' \
      --codec tq:3 --codec tcq:3 --codec rot+int4 --kv-mean-center "$cal" --quiet --out "$OUT/bench-attention"
    ;;
  decode)
    # tcq row decoding in the CPU kernel, this tree's build against the commit before the AVX2 decoder (TcqAvx2)
    [ -f "$OUT/decode-ab/ab.json" ] || python scripts/tcq_decode_ab.py --base 3982e2a --out "$OUT/decode-ab"
    ;;
  structured)
    # tables an AVX2 kernel reads without a gather (sums of small tables over the state's bits), on a Gaussian source
    [ -f "$OUT/structured/structured.json" ] || python research/scripts/trellis_structured.py --out "$OUT/structured"
    ;;
  lookup)
    # what each table form and state convention costs an AVX2 CPU per value (a timing probe beside the kernel)
    [ -f "$OUT/lookup/lookup.json" ] || python research/scripts/tcq_lookup_bench.py --out "$OUT/lookup"
    ;;
  report)
    python scripts/trellis_report.py
    ;;
  *) echo "unknown stage $stage (tables rd select ship emma holdout bench decode structured lookup report rd-n8 select-n8 rd-t2 select-qwen25 select-t2 select-qwen-tcq select-tcq-rest select-gemma25 tables-3 rd-t3 bench-t3)" >&2; exit 2 ;;
  esac
done
