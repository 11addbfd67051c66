"""Long-generation drift on the real default model: a shipped preset over thousands of greedy steps.

smollm2-135m (max context 8k) generates 4,000 tokens (``slow``; 300 in the default run) after a python-docs
prompt, into ``CompressedCache.from_preset(model, "walshkv:3.5", calibration=collect_kv_stats(...))`` (the 4,000
tokens with ``fused=True``: the reference attention decodes the whole cache at every step). Every
step's logits are finite; the bytes the cache holds equal its codecs' layout (checked every 100 steps and at
the end); and its bits per element are the spec's ``bits_at`` for the tokens it holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.calibration import KVStats, collect_kv_stats
from walshkv.codecs.spec import parse_cache_spec
from walshkv.data import load_text
from walshkv.models import LoadedModel

PRESET = "walshkv:3.5"
PROMPT_TOKENS = 64
CHECK_EVERY = 100

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def stats(smollm2: LoadedModel) -> KVStats:
    return collect_kv_stats(smollm2, load_text(), tokens=1024, progress=False)


def _prompt(lm: LoadedModel) -> torch.Tensor:
    """``[1, PROMPT_TOKENS]``: python-docs after the 1,024 calibration tokens (the calibration never saw it)."""
    ids = lm.tokenizer(load_text().content, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids[4096 : 4096 + PROMPT_TOKENS]])


def _check_bytes(cache: CompressedCache, lm: LoadedModel) -> None:
    assert cache.nbytes() == cache.layout_nbytes()
    tokens = cache.get_seq_length()
    want = parse_cache_spec(cache.preset.spec).bits_at(lm.shape.head_dim, tokens, lm.shape.layers)
    assert cache.bits_per_element() == pytest.approx(want, rel=1e-12)


def _generate(lm: LoadedModel, stats: KVStats, new_tokens: int, fused: bool = False) -> CompressedCache:
    """Greedy decoding, one token a step, every step's logits checked finite."""
    model = lm.model
    cache = CompressedCache.from_preset(model, PRESET, calibration=stats, fused=fused)
    ids = _prompt(lm)
    with torch.inference_mode():
        logits = model(input_ids=ids, cache=cache, use_cache=True).logits[:, -1]
        for step in range(new_tokens):
            assert bool(torch.isfinite(logits).all()), f"non-finite logits at step {step} ({ids.shape[1] + step})"
            if step % CHECK_EVERY == 0:
                _check_bytes(cache, lm)
            token = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=token, cache=cache, use_cache=True).logits[:, -1]
    assert bool(torch.isfinite(logits).all())
    assert cache.get_seq_length() == PROMPT_TOKENS + new_tokens
    _check_bytes(cache, lm)
    return cache


def test_300_tokens_with_a_preset_stay_finite_and_the_bytes_equal_the_layout(
    smollm2: LoadedModel, stats: KVStats
) -> None:
    _generate(smollm2, stats, 300)


@pytest.fixture
def fused_attention(smollm2: LoadedModel) -> Iterator[None]:
    """The fused attention on the session's model for one test, then the model's own attention again."""
    before = smollm2.model.config._attn_implementation
    enable_fused_attention(smollm2.model)
    try:
        yield
    finally:
        smollm2.model.set_attn_implementation(before)


@pytest.mark.slow
def test_4000_tokens_with_a_preset_stay_finite_and_the_bytes_equal_the_layout(
    smollm2: LoadedModel, stats: KVStats, fused_attention: None
) -> None:
    """Fused: attention reads the packed codes (the reference path decodes every token at every step, hours here)."""
    cache = _generate(smollm2, stats, 4000, fused=True)
    assert smollm2.model.config.max_position_embeddings >= PROMPT_TOKENS + 4000
    assert cache.preset.spec == parse_cache_spec(cache.preset.spec).spec
