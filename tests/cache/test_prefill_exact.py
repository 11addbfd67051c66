"""prefill="exact": a prompt attends to its own K/V as computed while the cache stores it compressed."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import logits_in_splits
from walshkv.cache import CompressedCache, enable_fused_attention


def _logits(model, cache, ids, splits):
    return logits_in_splits(model, cache, ids, splits)


@pytest.mark.parametrize("fused", [False, True])
def test_an_exact_prefill_is_the_uncompressed_prompt_then_decodes_compressed(tiny_llama, fused):
    ids = torch.randint(3, 96, (2, 24))
    with torch.inference_mode():
        ref = tiny_llama(input_ids=ids, cache=DynamicCache(config=tiny_llama.config)).logits
    spec = "sink:1:rot+int4/int3"
    tiny_llama.set_attn_implementation("sdpa")
    quantized = _logits(tiny_llama, CompressedCache(spec, config=tiny_llama.config), ids, [16, *range(17, 25)])
    if fused:
        enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache(spec, config=tiny_llama.config, prefill="exact", fused=fused)
        got = _logits(tiny_llama, cache, ids, [16, *range(17, 25)])
        # a second multi-token block sees the first one compressed, its own tokens exact
        cache2 = CompressedCache(spec, config=tiny_llama.config, prefill="exact", fused=fused)
        two = _logits(tiny_llama, cache2, ids, [8, 16])
        unfused = CompressedCache(spec, config=tiny_llama.config, prefill="exact")
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert torch.allclose(got[:, :16], ref[:, :16], atol=1e-4)  # the prompt: exact
    assert not torch.allclose(got[:, 16:], ref[:, 16:], atol=1e-3)  # decode steps read compressed K/V
    assert not torch.allclose(got[:, 16:], quantized[:, 16:], atol=1e-4)  # ... over K/V of an exact prompt
    assert torch.allclose(two[:, :8], ref[:, :8], atol=1e-4)
    assert not torch.allclose(two[:, 8:], ref[:, 8:16], atol=1e-3)
    assert torch.allclose(two, _logits(tiny_llama, unfused, ids, [8, 16]), atol=1e-4)  # fused == unfused
    assert cache.nbytes() == cache.layout_nbytes()  # stored compressed all the same


def test_prefill_is_checked(tiny_llama):
    with pytest.raises(ValueError, match="quantized, exact"):
        CompressedCache("int4", config=tiny_llama.config, prefill="fast")
    with pytest.raises(ValueError, match="prefill='quantized'"):
        CompressedCache("kivi2", config=tiny_llama.config, prefill="exact")
