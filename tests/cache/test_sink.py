"""``sink:N:SPEC``: the first N tokens of each full-attention layer kept in fp16, every bit counted."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import logits_in_splits
from walshkv.cache import CompressedCache, CompressedLayer, enable_fused_attention
from walshkv.codecs.spec import CacheSpec, LayeredCacheSpec, parse_cache_spec
from walshkv.recommend import candidates_for


class RandomBias:
    """A ``center+`` calibration: one random ``[kv_heads, head_dim]`` K mean per layer (any basis)."""

    def __init__(self, layers: int = 2, heads: int = 2, head_dim: int = 16) -> None:
        self.bias = 3.0 * torch.randn(layers, heads, head_dim, generator=torch.Generator().manual_seed(7)) + 2.0

    def k_bias(self, layer: int, basis: str) -> torch.Tensor:
        return self.bias[layer]

    def check_matches(self, *args, **kwargs) -> None:
        pass


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(3, 90, (2, n), generator=torch.Generator().manual_seed(seed))


_logits = logits_in_splits


# ---- the spec -----------------------------------------------------------------------------------------


def test_sink_spec_round_trips_and_counts_its_bits():
    spec = parse_cache_spec("sink:1:center+tq:4/tq:2.5")
    assert isinstance(spec, CacheSpec) and spec.sink == 1
    assert spec.spec == "sink:1:center+tq:4/tq:2.5"
    assert parse_cache_spec(spec.spec).spec == spec.spec
    assert spec.bits_per_element(64) == 3.5  # per compressed token
    assert spec.bits_at(64, 512) == pytest.approx((16 + 511 * 3.5) / 512)
    assert spec.bits_at(64, 1) == 16.0
    layered = parse_cache_spec("sink:2:layers:tq:4@0;tq:3")
    assert isinstance(layered, LayeredCacheSpec) and layered.sink == 2
    assert parse_cache_spec(layered.spec).spec == layered.spec
    assert layered.bind(0).spec == "sink:2:tq:4" and layered.bind(1).sink == 2
    per_token = (4.25 + 29 * 3.25) / 30
    assert layered.bits_at(64, 512, 30) == pytest.approx((2 * 16 + 510 * per_token) / 512)
    with pytest.raises(ValueError, match="num_layers"):
        layered.bits_at(64, 512)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sink:0:tq:4", "tokens >= 1"),
        ("sink:x:tq:4", "tokens >= 1"),
        ("sink:tq:4", "sink:N:SPEC"),
        ("sink:1:hf-quanto:4", "Hugging Face"),
        ("sink:1:sink:2:tq:4", "twice"),
        ("layers:sink:1:tq:4@0;tq:3", "before layers:"),
        ("sink:1:kivi2", "KIVI"),
    ],
)
def test_bad_sink_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_cache_spec(spec)


def test_candidates_count_the_sink_at_the_context():
    # 3.5 bits per compressed token plus one fp16 token: over the 3.5 budget at any context
    for ctx in (512, 4096):
        assert "sink:1:center+tq:4/tq:2.5" not in candidates_for(3.5, 64, ["sink:1:center+tq:4/tq:2.5"], 30, ctx=ctx)
    # 3.25 + (16 - 3.25) / 512 fits at 512 tokens; 3.5 bits per token for 1 token does not
    assert "sink:1:center+tq:4/tq:2" in candidates_for(3.5, 64, ["sink:1:center+tq:4/tq:2"], 30, ctx=512)
    assert "sink:1:center+tq:4/tq:2" not in candidates_for(3.5, 64, ["sink:1:center+tq:4/tq:2"], 30, ctx=1)


# ---- the layer ----------------------------------------------------------------------------------------


def test_layer_keeps_the_first_tokens_in_fp16_and_counts_them():
    layer = CompressedLayer("sink:3:rot+int4/int2")
    k, v = torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    out_k, out_v = layer.update(k[:, :, :2], v[:, :, :2])  # two tokens: both in the sink
    assert torch.equal(out_k, k[:, :, :2].half().float()) and torch.equal(out_v, v[:, :, :2].half().float())
    assert layer.packed_k is None and layer.sink_k.dtype == torch.float16
    out_k, out_v = layer.update(k[:, :, 2:], v[:, :, 2:])  # one more sink token, seven encoded
    assert layer.sink_k.shape[-2] == 3 and layer.packed_k.seq_len == 7 and layer.get_seq_length() == 10
    assert torch.equal(out_k[:, :, :3], k[:, :, :3].half().float())
    assert not torch.equal(out_v[:, :, 3:], v[:, :, 3:].half().float())  # the rest is compressed
    assert layer.nbytes() == layer.layout_nbytes()
    kb, ke, vb, ve = layer.bit_counts()
    spec = parse_cache_spec("sink:3:rot+int4/int2")
    assert (kb + vb) / (ke + ve) == pytest.approx(spec.bits_at(16, 10))
    layer.crop(-8)  # keep 2 tokens: inside the sink
    assert layer.get_seq_length() == 2 and layer.packed_k is None and layer.keys.shape[-2] == 0
    assert layer.sink_k.shape[-2] == 2
    layer.batch_select_indices(torch.tensor([1]))
    assert layer.sink_k.shape[0] == 1


def test_a_refused_block_leaves_the_sink_unchanged():
    layer = CompressedLayer("sink:4:int4")
    k = torch.randn(1, 2, 6, 16)
    layer.update(k[:, :, :2], k[:, :, :2])
    bad = k[:, :, 2:].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        layer.update(bad, bad)
    huge = k[:, :, 2:] * 1e6
    with pytest.raises(ValueError, match="overflow fp16"):
        layer.update(huge, huge)
    assert layer.sink_k.shape[-2] == 2 and layer.get_seq_length() == 2


@pytest.mark.parametrize("spec", ["int2", "center+int2", "center+rot+int2"])
def test_an_all_sink_cache_is_the_fp16_cache(tiny_llama, spec):
    # every token in the sink: the model sees fp16 K/V (centered K: shifted by the same vector for all keys)
    ids = _ids(20)
    ref = _logits(tiny_llama, DynamicCache(config=tiny_llama.config), ids, [12, 13, 20])
    cache = CompressedCache(f"sink:32:{spec}", config=tiny_llama.config, calibration=RandomBias())
    got = _logits(tiny_llama, cache, ids, [12, 13, 20])
    assert (got - ref).abs().max() < 2e-3
    assert cache.bits_per_element() == 16.0
    low = _logits(tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=RandomBias()), ids, [20])
    assert (low - ref).abs().max() > 10 * (got - ref).abs().max()  # int2 alone is far off


def test_sliding_layers_take_no_sink(tiny_gemma3):
    cache = CompressedCache("sink:2:int8", config=tiny_gemma3.config)
    sinks = {type(layer).__name__: layer.sink for layer in cache.layers}
    assert sinks["CompressedSlidingWindowLayer"] == 0 and sinks["CompressedLayer"] == 2


@pytest.mark.parametrize(("spec", "residual"), [("sink:2:rot+int4", 0), ("sink:1:center+rot+int4/int3", 3)])
def test_fused_attention_reads_the_sink(tiny_llama, spec, residual):
    ids = _ids(30, seed=4)
    splits = [17, 18, 19, 25, 30]  # prefill, two decode steps, two more blocks
    tiny_llama.set_attn_implementation("sdpa")
    ref = _logits(
        tiny_llama,
        CompressedCache(spec, config=tiny_llama.config, residual=residual, calibration=RandomBias()),
        ids,
        splits,
    )
    enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache(spec, config=tiny_llama.config, residual=residual, calibration=RandomBias(), fused=True)
        got = _logits(tiny_llama, cache, ids, splits)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert torch.allclose(ref, got, atol=2e-5), float((ref - got).abs().max())


def test_a_preset_file_can_choose_a_sink_spec(tiny_llama):
    calibration = RandomBias()
    calibration.meta = {"walshkv.preset.name": "walshkv:3.5", "walshkv.preset.spec": "sink:1:center+tq:3.5/tq:3"}
    cache = CompressedCache.from_preset(tiny_llama, "walshkv:3.5", calibration=calibration)
    assert cache.cache_spec.spec == "sink:1:center+tq:3.5/tq:3"
    enable_fused_attention(tiny_llama)
    try:
        fused = CompressedCache.from_preset(tiny_llama, "walshkv:3.5", calibration=calibration, fused=True)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert fused.fused and fused.cache_spec.spec == cache.cache_spec.spec
    assert all(layer.sink == 1 for layer in cache.layers)
    _logits(tiny_llama, cache, _ids(12), [12])
    assert cache.bits_per_element() == pytest.approx(cache.cache_spec.bits_at(16, 12))
