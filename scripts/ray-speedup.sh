#!/usr/bin/env bash
# The numbers of docs/serving.md: one real `walshkv recommend` run three ways on this machine,
#   1. in process, torch with 2 threads (what `walshkv recommend` does here without --ray);
#   2. on a local Ray cluster of 2 CPUs (`--ray local --ray-cpus 2`): the candidates cut into 2 tasks,
#      2 worker processes with 1 torch thread each (the driver collects the K mean, with 2 threads);
#   3. in process with 1 torch thread (the thread count of the Ray workers, to compare numbers exactly);
# each timed from the command's start to its end (model loading, the K mean, Ray's start-up included).
# The Python at the end writes docs/results/ray/speedup.json and speedup.md: the wall times, the speed-up,
# whether the winner and the ranking agree, and the largest KLD difference between the runs.
# Needs Ray: pip install "walshkv[ray]". The machine is shared: the load average before and after each
# run is recorded beside its time, with the CPU time the command got (user + sys of it and its children:
# on a machine others load, CPU time over wall time says how much of the machine the run had).
# MODEL, BITS, WINDOWS override the defaults (smollm2-135m, 3.5, 2); RUNS picks the runs (default all
# three, in that order); ROUND=N names a repetition (files NAME-rN, default 1; the summary reports every
# round). Idempotent: a run whose timing file exists is kept (delete it to redo that run).
# The end also writes cost-16-nodes.md: what a 16-node cluster would take for the recommend runs of
# docs/results/presets, from their per-candidate times and candidate counts (on paper, see the page).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${MODEL:-smollm2-135m}
BITS=${BITS:-3.5}
WINDOWS=${WINDOWS:-2}
ROUND=${ROUND:-1}
OUT=docs/results/ray
mkdir -p "$OUT"
export RAY_USAGE_STATS_ENABLED=0
args=(recommend --model "$MODEL" --text python-docs --bits "$BITS" --windows "$WINDOWS" --quiet)

run() {  # NAME THREADS EXTRA...: one timed run, its --json and its timing line
  local name=$1-r$ROUND threads=$2
  shift 2
  local load0 t0 t1
  load0=$(cut -d' ' -f1 /proc/loadavg)
  t0=$(date +%s.%N)
  OMP_NUM_THREADS=$threads walshkv "${args[@]}" -o "$OUT/$name.gguf" --json "$OUT/recommend-$name.json" "$@" \
    > "$OUT/recommend-$name.txt"
  t1=$(date +%s.%N)
  echo "{\"name\": \"$name\", \"round\": $ROUND, \"threads\": $threads, \"wall_s\": $(echo "$t1 - $t0" | bc), \"load_before\": $load0, \"load_after\": $(cut -d' ' -f1 /proc/loadavg), \"argv\": \"walshkv ${args[*]} $*\"}" \
    > "$OUT/timing-$name.json"
  rm -f "$OUT/$name.gguf"
  echo "$name: $(cat "$OUT/timing-$name.json")" >&2
}

for name in ${RUNS:-in-process-2threads ray-local-2cpus in-process-1thread}; do
  [ -f "$OUT/timing-$name-r$ROUND.json" ] && continue
  case $name in
    in-process-2threads) run "$name" 2 ;;
    ray-local-2cpus) run "$name" 2 --ray local --ray-cpus 2 ;;
    in-process-1thread) run "$name" 1 ;;
  esac
done

python - "$OUT" "$MODEL" "$BITS" "$WINDOWS" <<'EOF'
import glob
import json
import math
import re
import statistics
import sys
from pathlib import Path

out, model, bits, windows = Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
RUNS = ("in-process-2threads", "ray-local-2cpus", "in-process-1thread")
LABEL = {
    "in-process-2threads": ("in process", "2"),
    "ray-local-2cpus": ("`--ray local --ray-cpus 2` (2 tasks)", "1 per worker"),
    "in-process-1thread": ("in process", "1"),
}
runs = []  # (round, name, timing, recommend json)
for f in sorted(out.glob("timing-*-r*.json")):
    name, rnd = re.fullmatch(r"timing-(.+)-r(\d+)\.json", f.name).groups()
    runs.append((int(rnd), name, json.loads(f.read_text()), json.loads((out / f"recommend-{name}-r{rnd}.json").read_text())))
runs.sort(key=lambda r: (r[0], RUNS.index(r[1])))
kld = {(r, n): {x["codec"]: x["kld_mean"] for x in d["results"]} for r, n, _, d in runs}
ranking = {tuple(x["codec"] for x in d["results"]) for *_, d in runs}
rows = [
    "| round | run | torch threads | command wall (s) | candidates' evaluation wall (s) | s per candidate "
    "| load average before / after | winner |",
    "|---|---|---|---|---|---|---|---|",
]
for rnd, name, t, d in runs:
    per = sum(x["seconds"] for x in d["results"]) / len(d["results"])
    label, threads = LABEL[name]
    rows.append(
        f"| {rnd} | {label} | {threads} | {t['wall_s']:.1f} | {d['meta']['seconds_total']:.1f} | {per:.1f} "
        f"| {t['load_before']} / {t['load_after']} | "
        f"`{d['winner']}` |"
    )
wall = {name: [t["wall_s"] for _, n, t, _ in runs if n == name] for name in RUNS}
summary = {
    "model": model,
    "bits": bits,
    "windows": windows,
    "candidates": len(runs[0][3]["results"]),
    "runs": [
        {"round": r, "run": n, "wall_s": round(t["wall_s"], 1), "evaluation_wall_s": round(d["meta"]["seconds_total"], 1),
         "load_average_1min": [t["load_before"], t["load_after"]],
         "winner": d["winner"], "ray_jobs": d["meta"].get("executor", {}).get("jobs"), "argv": t["argv"]}
        for r, n, t, d in runs
    ],
    "median_wall_s": {n: round(statistics.median(w), 1) for n, w in wall.items() if w},
    "same_winner_and_ranking_in_every_run": len(ranking) == 1 and len({d["winner"] for *_, d in runs}) == 1,
    "kld_identical_in_every_run": len({json.dumps(v, sort_keys=True) for v in kld.values()}) == 1,
}
ray = "ray-local-2cpus"
for base in ("in-process-2threads", "in-process-1thread"):
    if wall[ray] and wall[base]:
        summary[f"speedup_ray_vs_{base}_median"] = round(statistics.median(wall[base]) / statistics.median(wall[ray]), 2)
(out / "speedup.json").write_text(json.dumps(summary, indent=2) + "\n")
(out / "speedup.md").write_text("\n".join(rows) + "\n")
print(json.dumps(summary, indent=2))
print("\n".join(rows))

# On paper: 16 slots (16 nodes, one task each, each as fast as the machine that measured the file). A round of
# n specs becomes tasks of ceil(n / 16) specs; each task also pays the evaluation's fixed part (reference
# forwards, binding: seconds_total minus the specs' seconds); the driver's K mean and the workers' cold start
# are left out (the same K mean runs in both; a cold start is seconds to a minute, once per worker).
SLOTS = 16
cost = [
    "| model | budget | candidates (+ per-layer moves) | s per spec | fixed s per evaluation | in process (min) "
    "| 16 nodes (min) | speed-up | node-minutes on 16 nodes |",
    "|---|---|---|---|---|---|---|---|---|",
]
for f in sorted(glob.glob("docs/results/presets/*/recommend-*.json")):
    d = json.loads(Path(f).read_text())
    specs = d["results"]
    n = len(specs)
    per = sum(r["seconds"] for r in specs) / n
    fixed = max(0.0, d["meta"]["seconds_total"] - sum(r["seconds"] for r in specs))
    moves = len(d["per_layer"]["moves"]) if d.get("per_layer") else 0
    rounds = [n] + ([moves + 1, 1] if moves else [])  # candidates; moves and their base; the final check
    here = sum(k * per + fixed for k in rounds)
    there = sum(math.ceil(k / SLOTS) * per + fixed for k in rounds)
    busy = sum(min(k, SLOTS) * fixed + k * per for k in rounds)  # node time: every task pays the fixed part
    cost.append(
        f"| {Path(f).parent.name} | {Path(f).stem.split('-')[-1]} | {n}{f' (+ {moves})' if moves else ''} | "
        f"{per:.1f} | {fixed:.0f} | {here / 60:.1f} | {there / 60:.1f} | {here / there:.1f} | {busy / 60:.0f} |"
    )
(out / "cost-16-nodes.md").write_text("\n".join(cost) + "\n")
print("\n".join(cost))
EOF
