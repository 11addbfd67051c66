"""The one way code above ``cache/`` asks what a cache holds: the same answers for every kind of cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from walshkv.cache import (
    CompressedCache,
    croppable_to_prefix,
    footprint,
    fp_bytes,
    hf_cache_nbytes,
    make_cache,
    prefill_is_exact,
)
from walshkv.codecs import parse_cache_spec


def _fill(model, cache, tokens: int = 12) -> None:
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + tokens).view(1, -1), cache=cache)


@pytest.mark.parametrize("spec", ["int4", "sink:1:rot+int4/int3", "kivi2"])
def test_a_walshkv_cache_reports_its_own_accounting(tiny_llama, spec) -> None:
    cache = CompressedCache(spec, config=tiny_llama.config, max_cache_len=64)
    _fill(tiny_llama, cache)
    held = footprint(cache)
    assert held.kind == "walshkv"
    assert (held.kv_bytes, held.reserved_bytes) == (cache.nbytes(), cache.reserved_nbytes())
    assert held.bits_per_element == cache.bits_per_element()
    assert (held.bits_k, held.bits_v) == cache.bits_per_element_kv()


def test_an_uncompressed_cache_counts_its_tensors(tiny_llama) -> None:
    cache = DynamicCache(config=tiny_llama.config)
    _fill(tiny_llama, cache)
    elements = 2 * 2 * 2 * 12 * 16  # layers x (K, V) x kv heads x tokens x head_dim
    held = footprint(cache)
    assert (held.kind, held.kv_bytes, held.bits_per_element) == ("uncompressed", 4 * elements, 32.0)
    half = footprint(cache, dtype=torch.float16)
    assert (half.kv_bytes, half.bits_per_element) == (2 * elements, 16.0)


def test_a_hugging_face_quantized_cache_counts_codes_scales_and_window(tiny_llama_hd64) -> None:
    cache = make_cache(parse_cache_spec("hf-quanto:4:g=32:r=4"), config=tiny_llama_hd64.config)
    _fill(tiny_llama_hd64, cache, 40)
    kb, vb, n = hf_cache_nbytes(cache)
    held = footprint(cache)
    assert (held.kind, held.kv_bytes) == ("hf-quantized", kb + vb)
    assert held.bits_per_element == pytest.approx(8.0 * (kb + vb) / (2 * n))
    assert 4.0 < held.bits_per_element < 16.0


def test_fp_bytes_caps_sliding_layers_at_their_window(tiny_llama, tiny_gemma3) -> None:
    assert fp_bytes(tiny_llama.config, 100) == 2 * 2 * 2 * 100 * 2 * 16  # 2 layers, fp16, 2 kv heads of 16
    # gemma3: two sliding layers (window 6: at most 5 tokens held) and one full layer, 1 kv head of 32
    assert fp_bytes(tiny_gemma3.config, 100) == 2 * 2 * 32 * (5 + 5 + 100)


def test_prefix_cropping_and_exact_prefill_are_read_from_the_layers(tiny_llama, tiny_gemma3) -> None:
    assert croppable_to_prefix(CompressedCache("int4", config=tiny_llama.config))
    assert not croppable_to_prefix(CompressedCache("int4", config=tiny_llama.config), residual=4)
    assert not croppable_to_prefix(CompressedCache("kivi2", config=tiny_llama.config))
    assert not croppable_to_prefix(CompressedCache("int4", config=tiny_gemma3.config))  # sliding windows
    assert croppable_to_prefix(DynamicCache(config=tiny_llama.config))
    assert prefill_is_exact(CompressedCache("int4", config=tiny_llama.config, prefill="exact"))
    assert not prefill_is_exact(CompressedCache("int4", config=tiny_llama.config))
