"""CI-sized checks on the two larger real models: qwen2.5-1.5b (the standing collapse) and gemma3-270m.

Part of the default run (``pytest -m "not slow"``, as CI runs it): one 512-token window each, a few codecs.
The full qwen check is slow-marked (tests/test_qwen_standing.py: 2 windows, every non-collapsing codec);
docs/results/qwen1.5b-emma.md and gemma3-emma.md hold 4-window tables. Each model's tests are one class
with a class-scoped model, so a model is freed when its class ends: the 7 GB of qwen2.5-1.5b in float32
do not stay in memory for the rest of the session.

Bounds are set from one measured run (python-docs, window 0; calibration: the first 1024 tokens of Austen's
Emma; measured at c81b343 on an AMD EPYC with AVX-512, 2 cores), with margins of about 2x: a regression that
doubles an error fails. The margins are noted next to each constant.
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from conftest import SHARED
from walshkv import CompressedCache, parse_cache_spec
from walshkv.calibration import collect_kv_stats
from walshkv.data import load_text
from walshkv.eval import evaluate
from walshkv.models import load_model

pytestmark = pytest.mark.model

CTX = 512
PROMPT = "The Python interpreter reads a program and"

# qwen2.5-1.5b: a llama.cpp K type below 8 bits collapses (its K channels carry a large offset from the K
# bias); the same block format after center+rot, and the 4.5-bit preset, do not. Measured on window 0:
#   q4_0                                 top-1 0.133  KLD 4.71
#   center+rot+q4_0                      top-1 0.949  KLD 0.0181
#   walshkv:4.5 (= center+tq:5/tq:3.5)   top-1 0.937  KLD 0.0203
QWEN_COLLAPSING = ["q4_0"]
QWEN_NON_COLLAPSING = ["center+rot+q4_0", "walshkv:4.5"]
QWEN_COLLAPSED_TOP1 = 0.25  # measured 0.133: 1.9x margin
QWEN_COLLAPSED_KLD = 2.5  # measured 4.71: 1.9x margin
QWEN_KEPT_TOP1 = 0.9  # measured 0.937-0.949: 1.6x the disagreement (0.063); stricter than the issue-8 bar, 0.85
QWEN_KEPT_KLD = 0.04  # measured 0.0181-0.0203: 2x margin
QWEN_KLD_RATIO = 120.0  # collapsed / kept, measured 232: 1.9x margin

# gemma3-270m (5 of 6 layers slide over 512 tokens), window 0:
#   fp16 KLD 4.3e-7 top-1 1.000; int8 KLD 0.0069 top-1 0.953; rot+int4 KLD 0.255 top-1 0.761;
#   sink:1:rot+int4 KLD 0.271 top-1 0.757
GEMMA_CODECS = ["fp16", "int8", "rot+int4", "sink:1:rot+int4"]
GEMMA_FP16_KLD = 1e-6  # measured 4.3e-7: 2.3x margin
GEMMA_INT8_KLD = 0.012  # measured 0.0069: 1.7x margin
GEMMA_INT4_KLD = 0.5  # rot+int4 and its sink variant, measured 0.255-0.271: 1.8x margin


def _load(name: str) -> Iterator[Any]:
    """Load a registry model for one module's tests and free it afterwards."""
    if os.environ.get("WALSHKV_SKIP_MODEL_TESTS"):
        pytest.skip("WALSHKV_SKIP_MODEL_TESTS is set")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lm = load_model(name, progress=False)
    yield lm
    del lm
    gc.collect()


# Class scope: each model is freed when its class's tests end, before the next model loads.
@pytest.fixture(scope="class")
def qwen() -> Iterator[Any]:
    yield from _load("qwen2.5-1.5b")


@pytest.fixture(scope="class")
def gemma3() -> Iterator[Any]:
    yield from _load("gemma3-270m")


def _layer_tokens(config: Any, tokens: int) -> list[tuple[int, bool]]:
    """``(tokens held, is_sliding)`` of each decoder layer after ``tokens`` tokens (transformers' rule:
    a sliding layer keeps the last ``sliding_window - 1``)."""
    cfg = config.get_text_config(decoder=True)
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    return [(min(tokens, window - 1), True) if t == "sliding_attention" else (tokens, False) for t in types]


def _expected_bytes(spec: str, config: Any, tokens: int) -> int:
    """Bytes a cache of ``spec`` must hold after ``tokens`` tokens, from the codecs' per-vector sizes and the
    model's layer types alone (sink tokens in fp16 on full-attention layers only)."""
    parsed = parse_cache_spec(spec)
    cfg = config.get_text_config(decoder=True)
    heads, d = cfg.num_key_value_heads, getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    packed = parsed.k.bytes_per_vector(d) + parsed.v.bytes_per_vector(d)
    total = 0
    for held, sliding in _layer_tokens(config, tokens):
        sink = 0 if sliding else min(parsed.sink, held)
        total += heads * (sink * 2 * d * 2 + (held - sink) * packed)
    return total


class TestQwen:
    """qwen2.5-1.5b (float32, about 7 GB): the standing collapse, CI-sized."""

    def test_qwen_llama_cpp_k_type_collapses_and_walshkv_does_not(self, qwen) -> None:
        emma = SHARED / "data" / "austen_emma.txt"
        if not emma.is_file():
            pytest.skip("needs ../shared/data/austen_emma.txt for calibration")
        stats = collect_kv_stats(qwen, load_text(str(emma)), tokens=1024, progress=False)
        codecs = QWEN_COLLAPSING + QWEN_NON_COLLAPSING
        res = evaluate(qwen, load_text(), codecs, ctx=CTX, windows=1, calibration=stats, progress=False)
        rows = dict(zip(codecs, res.results, strict=True))  # walshkv:4.5's row is named by the spec it stands for
        shape = qwen.shape
        elements = shape.layers * CTX * shape.kv_heads * shape.head_dim * 2
        for spec, row in rows.items():
            assert row["kv_bytes"] == _expected_bytes(spec, qwen.model.config, CTX), row
            assert row["bits_per_element"] == pytest.approx(8 * row["kv_bytes"] / elements, rel=1e-12), row
        for spec in QWEN_COLLAPSING:
            assert rows[spec]["top1_agreement"] < QWEN_COLLAPSED_TOP1, rows[spec]
            assert rows[spec]["kld_mean"] > QWEN_COLLAPSED_KLD, rows[spec]
        for spec in QWEN_NON_COLLAPSING:
            assert rows[spec]["top1_agreement"] >= QWEN_KEPT_TOP1, rows[spec]
            assert rows[spec]["kld_mean"] < QWEN_KEPT_KLD, rows[spec]
        worst_kept = max(rows[s]["kld_mean"] for s in QWEN_NON_COLLAPSING)
        assert min(rows[s]["kld_mean"] for s in QWEN_COLLAPSING) > QWEN_KLD_RATIO * worst_kept


class TestGemma3:
    """gemma3-270m: BOS first, sliding-window layers, greedy generation."""

    def test_gemma3_eval_one_window(self, gemma3) -> None:
        res = evaluate(gemma3, load_text(), GEMMA_CODECS, ctx=CTX, windows=1, progress=False)
        assert res.meta["bos_first_token"] is True  # walshkv's windows put gemma3's BOS first, as llama.cpp does
        kl = {r["codec"]: r["kld_mean"] for r in res.results}
        assert kl["fp16"] < GEMMA_FP16_KLD
        assert kl["int8"] < GEMMA_INT8_KLD
        assert kl["int8"] < kl["rot+int4"] < GEMMA_INT4_KLD
        assert kl["sink:1:rot+int4"] < GEMMA_INT4_KLD
        for row in res.results:  # sliding layers hold 511 of the 512 tokens; sink tokens only on full layers
            assert row["kv_bytes"] == _expected_bytes(row["codec"], gemma3.model.config, CTX), row
        assert res.results[0]["kv_bytes"] == res.results[0]["kv_bytes_fp16"]

    def test_gemma3_bytes_equal_layout_after_sliding(self, gemma3) -> None:
        """Prefill a whole window, then decode past it: every layer, sliding ones included, holds what its
        layout says, and the sliding layers stay at ``sliding_window - 1`` tokens."""
        model, tok = gemma3.model, gemma3.tokenizer
        ids = tok(load_text().content[:6000], return_tensors="pt").input_ids[:, :CTX]
        assert ids.shape[1] == CTX and ids[0, 0] == tok.bos_token_id  # the tokenizer walshkv loaded adds BOS
        spec, steps = "sink:1:rot+int4", 4
        cache = CompressedCache(spec, config=model.config)
        with torch.inference_mode():
            out = model(input_ids=ids, cache=cache)
            for _ in range(steps):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), cache=cache)
        assert cache.get_seq_length() == CTX + steps
        expected = _layer_tokens(model.config, CTX + steps)
        assert any(sliding for _, sliding in expected) and not all(sliding for _, sliding in expected)
        cfg = model.config.get_text_config(decoder=True)
        for layer, (held, sliding) in zip(cache.layers, expected, strict=True):
            assert layer.is_sliding == sliding
            assert layer.num_elements() == cfg.num_key_value_heads * held * 2 * cfg.head_dim
            assert layer.nbytes() == layer.layout_nbytes()
        assert cache.nbytes() == cache.layout_nbytes() == _expected_bytes(spec, model.config, CTX + steps)

    def test_gemma3_greedy_int8_matches_uncompressed(self, gemma3) -> None:
        model, tok = gemma3.model, gemma3.tokenizer
        ids = tok(PROMPT, return_tensors="pt").input_ids
        assert ids[0, 0] == tok.bos_token_id
        ref = model.generate(ids, cache=DynamicCache(config=model.config), max_new_tokens=12, do_sample=False)
        cache = CompressedCache("int8", config=model.config)
        out = model.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
        assert torch.equal(ref[:, : ids.shape[1] + 8], out[:, : ids.shape[1] + 8])
        assert cache.nbytes() == cache.layout_nbytes()
