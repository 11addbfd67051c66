"""Tests on the real default model, smollm2-135m (downloaded from PyPI on first use)."""

from __future__ import annotations

import pytest
import torch

from walshkv import CompressedCache
from walshkv.data import load_text
from walshkv.eval import evaluate

pytestmark = pytest.mark.model

PROMPT = "The Python interpreter reads a program and"


def test_loaded_model_matches_registry(smollm2):
    assert smollm2.info["head_dim"] == 64 and smollm2.info["kv_heads"] == 3 and smollm2.info["layers"] == 30
    assert next(smollm2.model.parameters()).dtype == torch.float32


def test_eval_ordering_on_real_model(smollm2):
    text = load_text()
    res = evaluate(smollm2, text, ["int8", "rot+int4", "int4"], ctx=256, windows=2, progress=False)
    kl = {r["codec"]: r["kld_mean"] for r in res.results}
    assert kl["int8"] < kl["rot+int4"] < kl["int4"]
    for r in res.results:
        elements = 30 * 256 * 3 * 64 * 2
        assert r["kv_bytes"] == pytest.approx(r["bits_per_element"] * elements / 8, rel=0.005)


def test_greedy_int8_matches_uncompressed(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    ref = model.generate(ids, max_new_tokens=12, do_sample=False)
    cache = CompressedCache("int8", config=model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert torch.equal(ref[:, : ids.shape[1] + 8], out[:, : ids.shape[1] + 8])
    assert cache.nbytes() == cache.layout_nbytes()


def test_rot_int4_generation_memory(smollm2):
    tok, model = smollm2.tokenizer, smollm2.model
    ids = tok(load_text().content[:2000], return_tensors="pt").input_ids[:, :300]
    cache = CompressedCache("rot+int4", config=model.config)
    model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert cache.get_seq_length() == 319
    assert cache.nbytes() <= 0.30 * cache.fp16_nbytes()


@pytest.mark.slow
def test_rot_int4_2000_token_generation_memory(smollm2):
    """Acceptance: a 2,000-token greedy generation holds <= 30% of an fp16 DynamicCache."""
    tok, model = smollm2.tokenizer, smollm2.model
    ids = tok(PROMPT, return_tensors="pt").input_ids
    cache = CompressedCache("rot+int4", config=model.config)
    out = model.generate(ids, cache=cache, max_new_tokens=2000, min_new_tokens=2000, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 2000
    assert cache.nbytes() <= 0.30 * cache.fp16_nbytes()
