"""The real engine with smollm2-135m's own presets: ``vllm.LLM`` (CPU, float32) serving ``walshkv:3.5-fast`` and
``walshkv:3.5`` through ``--kv-cache-dtype walshkv_spec`` (``$WALSHKV_VLLM_SPEC``, ``$WALSHKV_VLLM_MODEL``: the
calibration the package ships for the preset), against walshkv's ``CompressedCache.from_preset`` on the same tokens.

What the presets add to test_engine.py's ``rot+int4``: ``sink:1:`` (position 0 kept in fp16 beside the pages), K
turned by position (``ropeblock:64+`` or ``prerope+``, the positions taken from vLLM's metadata at write time), the
calibrated equalizer and trellis codes. Exact prefill (vLLM's convention; walshkv ``prefill="exact"``), checked as
test_engine.py checks ``rot+int4``: the prompt's logprobs to float rounding, the bytes stored for every prompt
position past the sink in every layer, and the greedy continuation (decode reads the codes). Tolerances: those of
test_engine.py (the reasons are there); a trellis code on a rounding boundary moves a whole segment of codes, so a
slot that differs is counted, not inspected field by field.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from test_engine import (
    DECODE_TOL,
    MIN_MARGIN,
    PROMPT_EXACT_TOL,
    _diffs,
    _engine,
    _engine_env,
    _result,
    run_reference,
)
from walshkv_reference import MODEL, NEW_TOKENS, TEXT
from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.registration import CPU_ENV
from walshkv_vllm.specs import MODEL_ENV, PREFILL_ENV, SPEC_ENV, resolve_spec

PRESETS = ["walshkv:3.5-fast", "walshkv:3.5"]


def _reference(preset: str, slots_out: str) -> dict[str, Any]:
    request = {"model": MODEL, "spec": preset, "text": TEXT, "new_tokens": NEW_TOKENS, "runs": ["exact"]}
    return run_reference(request | {"slots_out": slots_out})


@pytest.fixture(scope="module", params=PRESETS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    preset = request.param
    files = tmp_path_factory.mktemp("preset")
    reference = _reference(preset, str(files / "walshkv_slots.pt"))
    engine = {
        "model": reference["model_dir"],
        "kv_cache_dtype": "walshkv_spec",
        "token_ids": reference["token_ids"],
        "new_tokens": NEW_TOKENS,
        "slots_out": str(files / "vllm_slots.pt"),
    }
    env = _engine_env(**{CPU_ENV: "1", PREFILL_ENV: "exact", SPEC_ENV: preset, MODEL_ENV: MODEL})
    result = _result(_engine(engine, env))
    return {"preset": preset, "reference": reference, "engine": result, "files": files}


def test_the_engine_serves_the_presets_prompt_and_bytes(served: dict[str, Any]) -> None:
    preset, ref, got = served["preset"], served["reference"]["runs"]["exact"], served["engine"]
    diffs = _diffs(got["prompt_logprobs"], ref["prompt_logprobs"])
    print(f"{preset}: exact prefill, prompt logprobs max |vLLM - walshkv| {max(diffs):.2e}")
    assert max(diffs) <= PROMPT_EXACT_TOL
    ours, theirs = torch.load(served["files"] / "vllm_slots.pt"), torch.load(served["files"] / "walshkv_slots.pt")
    spec = resolve_spec("walshkv_spec", {SPEC_ENV: preset, MODEL_ENV: MODEL})
    layout = SlotLayout.of(spec.k, spec.v, 64, 3)
    tokens = len(served["reference"]["token_ids"])
    assert got["layers_written"] == 30
    assert ours.shape == (30, tokens, 3, layout.slot_bytes)
    assert theirs.shape == (30, tokens - spec.sink, 3, layout.slot_bytes)
    same = (ours[:, spec.sink :] == theirs).all(-1)
    print(f"{preset}: stored slots identical {int(same.sum())}/{same.numel()} ({float(same.float().mean()):.4%})")
    assert float(same.float().mean()) >= 0.99


def test_the_engine_continues_as_walshkv_does(served: dict[str, Any]) -> None:
    preset, ref, got = served["preset"], served["reference"]["runs"]["exact"], served["engine"]
    assert min(ref["margins"]) >= MIN_MARGIN, f"a near tie in the reference's greedy steps: {ref['margins']}"
    assert got["tokens"] == ref["tokens"]
    diffs = _diffs(got["token_logprobs"], ref["token_logprobs"])
    print(f"{preset}: greedy tokens identical; logprobs max |vLLM - walshkv| {max(diffs):.2e}")
    assert max(diffs) <= DECODE_TOL
