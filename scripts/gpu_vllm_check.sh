#!/usr/bin/env bash
# GPU check of the walshkv vLLM plugin (plugins/vllm): serve smollm2-135m through vLLM with each walshkv_* cache
# dtype and compare next-token distributions with vLLM's own bf16 cache on a fixed prompt set.
#
# Writes $OUT/vllm_check.json: per cache dtype, the mean/max KL divergence (nats) of the teacher-forced next-token
# distributions (prompt logprobs, top-K of the bf16 run with the rest of the mass in one bucket) against the bf16
# cache, the greedy-continuation agreement, the KV cache capacity vLLM reports, and the wall time.
#
# Needs: an NVIDIA GPU; vLLM 0.32 (CUDA) importable by $VLLM_PYTHON, or network to pip-install it into
# $VENV; the smollm2-135m Hugging Face folder at $MODEL (walshkv writes it to ~/.cache/walshkv/float/smollm2-135m
# on first `walshkv eval`). The machine this is meant for has no network: provision vLLM and the model first.
#
# Prefill: WALSHKV_VLLM_PREFILL=quantized, so that the prompt tokens attend to the cache as stored (with the
# default, exact, one prefill never reads the cache and the KLD would be 0 by construction).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/walshkv_vllm_check}"
mkdir -p "$OUT"
MODEL="${MODEL:-$HOME/.cache/walshkv/float/smollm2-135m}"
DTYPES="${DTYPES:-walshkv_q8_0 walshkv_rot_int4 walshkv_q4_0 walshkv_tq4 walshkv_tq3}"
TOPK="${TOPK:-20}"
VENV="${VENV:-/tmp/walshkv-vllm-gpu}"

if [ -z "${VLLM_PYTHON:-}" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q "vllm==0.32.0"
  VLLM_PYTHON="$VENV/bin/python"
fi
# walshkv without its transformers pin (vLLM has its own), the plugin, and what the codecs need
"$VLLM_PYTHON" -m pip install -q --no-deps -e . -e ./plugins/vllm
"$VLLM_PYTHON" -m pip install -q gguf ninja triton
[ -f "$MODEL/config.json" ] || { echo "no model folder at $MODEL (set MODEL=...)" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt" || true

cat > "$OUT/check.py" <<'PY'
import json, math, os, subprocess, sys, time

MODEL, TOPK, OUT = sys.argv[1], int(sys.argv[2]), sys.argv[3]
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. " * 8,
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n" * 3,
    "In 1905 Albert Einstein published four papers that changed physics: on the photoelectric effect, "
    "on Brownian motion, on special relativity and on the equivalence of mass and energy. " * 3,
    "Python's list type is a mutable sequence. Lists may be constructed in several ways: using a pair of "
    "square brackets to denote the empty list, using square brackets separating items with commas. " * 3,
]


def run(dtype):
    """One vLLM engine per cache dtype, in a subprocess (a fresh engine, and the GPU memory freed after)."""
    code = f"""
import json, os, time
from vllm import LLM, SamplingParams
t = time.time()
llm = LLM(model={MODEL!r}, dtype="bfloat16", kv_cache_dtype={dtype!r}, enforce_eager=True, max_model_len=1024,
          max_logprobs={TOPK}, gpu_memory_utilization=0.3, enable_prefix_caching=False,
          attention_backend=None if {dtype!r} == "auto" else "CUSTOM")
tf = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=1, prompt_logprobs={TOPK}, temperature=0.0))
gen = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=32, temperature=0.0))
rows = [[{{str(k): v.logprob for k, v in pos.items()}} for pos in o.prompt_logprobs[1:]] for o in tf]
blocks = getattr(llm.llm_engine.vllm_config.cache_config, "num_gpu_blocks", None)
print("JSON" + json.dumps({{"rows": rows, "gen": [list(o.outputs[0].token_ids) for o in gen],
                           "num_gpu_blocks": blocks, "s": time.time() - t}}))
"""
    env = dict(os.environ, WALSHKV_VLLM_PREFILL="quantized")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    for line in p.stdout.splitlines():
        if line.startswith("JSON"):
            return json.loads(line[4:])
    return {"error": (p.stderr or p.stdout)[-4000:]}


def kld(ref, got):
    """KL(ref || got) over ref's top-K tokens plus one bucket for the rest (got's missing tokens share its rest)."""
    p = {k: math.exp(v) for k, v in ref.items()}
    q_known = {k: math.exp(v) for k, v in got.items()}
    p_rest = max(1e-12, 1.0 - sum(p.values()))
    q_rest = max(1e-12, 1.0 - sum(q_known.values()))
    missing = [k for k in p if k not in q_known]
    q = {k: q_known.get(k, q_rest / (len(missing) + 1)) for k in p}
    q_other = q_rest / (len(missing) + 1) if missing else q_rest
    return sum(pk * math.log(pk / max(q[k], 1e-12)) for k, pk in p.items()) + p_rest * math.log(p_rest / q_other)


ref = run("auto")
report = {"model": MODEL, "topk": TOPK, "reference": "auto (bf16 cache)", "results": {}}
if "error" in ref:
    report["reference_error"] = ref["error"]
else:
    report["reference_blocks"] = ref["num_gpu_blocks"]
for dtype in sys.argv[4:]:
    res = run(dtype)
    if "error" in res or "error" in ref:
        report["results"][dtype] = {"error": res.get("error", "reference failed")}
        continue
    klds = [kld(a, b) for ra, rb in zip(ref["rows"], res["rows"]) for a, b in zip(ra, rb)]
    agree = [sum(x == y for x, y in zip(a, b)) / max(1, len(a)) for a, b in zip(ref["gen"], res["gen"])]
    report["results"][dtype] = {
        "kld_mean": sum(klds) / len(klds),
        "kld_max": max(klds),
        "positions": len(klds),
        "greedy_agreement": sum(agree) / len(agree),
        "num_gpu_blocks": res["num_gpu_blocks"],
        "seconds": res["s"],
    }
with open(os.path.join(OUT, "vllm_check.json"), "w") as fh:
    json.dump(report, fh, indent=2)
print(json.dumps(report, indent=2))
PY

# shellcheck disable=SC2086
"$VLLM_PYTHON" "$OUT/check.py" "$MODEL" "$TOPK" "$OUT" $DTYPES
