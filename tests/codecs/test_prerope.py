"""``prerope+``: K quantized before RoPE (tables, codec, calibration, files, cache positions)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from conftest import ToyTokenizer, logits_in_splits
from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.calibration import MergedCalibration, collect_kv_stats
from walshkv.codecs.spec import parse_cache_spec, parse_codec
from walshkv.data import Text
from walshkv.export import read_kv_mean_center
from walshkv.models import LoadedModel, _describe
from walshkv.ops.rope import RopeTable, apply_rope, rope_tables, undo_rope
from walshkv.preset_file import k_pre_rope, write_preset_file
from walshkv.presets import Preset

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))


# ---- the tables ----------------------------------------------------------------------------------------


def test_rope_round_trips_and_matches_the_models_own(tiny_llama):
    tables = rope_tables(tiny_llama)
    assert tables is not None and len(tables) == 2 and tables[0].head_dim == 16
    k = torch.randn(1, 2, 9, 16)
    assert torch.allclose(undo_rope(apply_rope(k, tables[0], 5), tables[0], 5), k, atol=1e-5)
    # the same map as the model's own rotary module (cos/sin at positions 0..T-1)
    cos, sin = tiny_llama.model.rotary_emb(k, torch.arange(9).view(1, 9))
    half = torch.cat((-k[..., 8:], k[..., :8]), dim=-1)
    assert torch.allclose(apply_rope(k, tables[1]), k * cos[0] + half * sin[0], atol=1e-5)
    # position 0 is the identity; a shifted start is the same as slicing a longer run
    assert torch.allclose(apply_rope(k, tables[0], 0)[:, :, :1], k[:, :, :1])
    long = apply_rope(torch.cat([k, k], dim=2), tables[0], 0)
    assert torch.allclose(long[:, :, 9:], apply_rope(k, tables[0], 9), atol=1e-5)


def test_gemma3_layers_read_their_own_tables(tiny_gemma3):
    tables = rope_tables(tiny_gemma3)
    assert tables is not None and len(tables) == 3
    assert not torch.equal(tables[0].inv_freq, tables[2].inv_freq)  # local and global bases differ
    assert torch.equal(tables[0].inv_freq, tables[1].inv_freq)


def test_a_table_refuses_another_head_dim():
    table = RopeTable(torch.ones(8))
    with pytest.raises(ValueError, match="head_dim 16"):
        apply_rope(torch.zeros(1, 1, 2, 32), table)


# ---- the spec -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("center+prerope+tq:3", "write prerope\\+center\\+tq:3"),
        ("prerope+prerope+tq:3", "write prerope\\+tq:3"),
        ("prerope:2+tq:3", "takes no arguments"),
    ],
)
def test_misplaced_prerope_names_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_codec(spec)


def test_prerope_counts_the_bits_of_its_inner_codec():
    assert parse_codec("prerope+center+tq:3.5").bits_per_element(64) == parse_codec("tq:3.5").bits_per_element(64)


def test_prerope_on_v_or_without_calibration_says_what_to_do():
    with pytest.raises(ValueError, match="prerope\\+ is for K"):
        parse_cache_spec("prerope+tq:3").bind(0, _FakeStats())
    with pytest.raises(ValueError, match=r"is calibrated|needs K statistics before RoPE"):
        parse_cache_spec("prerope+tq:3/tq:3").bind(0, None)
    codec = parse_codec("prerope+tq:3")
    with pytest.raises(ValueError, match="positions"):
        codec.encode(torch.zeros(1, 1, 2, 16))


class _FakeStats:
    def pre_rope(self):
        return self

    def rope_table(self, layer):
        return RopeTable(torch.ones(8))


# ---- calibration, files, cache --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture(scope="module")
def stats(tiny_lm):
    return collect_kv_stats(tiny_lm, TEXT, tokens=128, ctx=64, progress=False)


def test_calibration_keeps_k_before_rope(tiny_lm, stats):
    pre = stats.pre_rope()
    assert pre.k_basis == "pre-rope" and stats.k_basis == "post-rope"
    assert pre.pre_rope() is pre
    # the pre-RoPE mean is the mean of K rotated back by its position, measured directly here
    ids = TEXT.content[:64]
    keys: dict[int, torch.Tensor] = {}

    class _Rec(DynamicCache):
        def update(self, k, v, layer_idx, *args, **kwargs):
            keys[layer_idx] = k.detach().float()
            return super().update(k, v, layer_idx, *args, **kwargs)

    with torch.inference_mode():
        ids_t = torch.tensor([tiny_lm.tokenizer(ids)["input_ids"]])
        tiny_lm.model(input_ids=ids_t, cache=_Rec(config=tiny_lm.model.config))
    want = undo_rope(keys[1], stats.rope_table(1)).mean(dim=(0, 2))
    first = collect_kv_stats(tiny_lm, TEXT, tokens=64, ctx=64, progress=False).pre_rope()
    assert torch.allclose(first.mean("k", 1).float(), want, atol=1e-5)
    assert not torch.allclose(first.mean("k", 1).float(), keys[1].mean(dim=(0, 2)), atol=1e-3)
    assert pre.k_equalizer(0).shape == (2, 16, 16)


def test_a_lossless_prerope_cache_is_the_reference(tiny_llama, stats):
    ids = torch.randint(3, 96, (2, 40))
    with torch.inference_mode():
        ref = tiny_llama(input_ids=ids).logits
    for spec in ("prerope+fp16/fp16", "sink:2:prerope+center+eq+fp32/fp16"):
        cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats)
        got = logits_in_splits(tiny_llama, cache, ids, [17, 18, 40])
        assert torch.allclose(got, ref, atol=2e-3), spec


def test_real_prerope_caches_stay_near_the_reference_and_count_their_bytes(tiny_llama, stats):
    """Quantized for real (tq:3): KLD small; the bytes held are the inner codec's layout, nothing more."""
    ids = torch.randint(3, 96, (1, 48))
    with torch.inference_mode():
        ref = tiny_llama(input_ids=ids).logits.log_softmax(-1)
    # bytes per (layer, kv head, token) of K and V: what tq:3 stores at head_dim 16 (prerope+ adds nothing)
    per_token = parse_codec("center+tq:3").bytes_per_vector(16) + parse_codec("tq:3").bytes_per_vector(16)
    rows = 2 * 2  # layers x kv heads, batch 1
    for spec, sink in (("prerope+center+tq:3/tq:3", 0), ("sink:1:prerope+center+eq+tq:3/tq:3", 1)):
        cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats)
        got = logits_in_splits(tiny_llama, cache, ids, [20, 21, 48]).log_softmax(-1)
        kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1).mean()
        # measured 1.3e-4 (plain) and 8.0e-5 (sink, eq+), the same as these codecs after RoPE; 3-bit V
        # dominates on this model (K alone at 3 bits: 8e-8), 2 bits on both sides give 5.8e-4 (int2: 1.6e-3)
        assert 0 < float(kl) < 3e-4, spec
        held = rows * ((48 - sink) * per_token + sink * 2 * 16 * 2)  # sink tokens: K and V in fp16
        assert cache.nbytes() == cache.layout_nbytes() == held, spec
        assert cache.bits_per_element() == 8 * held / (rows * 48 * 2 * 16)


def test_sliding_layers_keep_their_positions(tiny_gemma3):
    lm = LoadedModel(tiny_gemma3, ToyTokenizer(), "tiny-gemma3", "test", _describe(tiny_gemma3))
    st = collect_kv_stats(lm, TEXT, tokens=64, ctx=32, progress=False)
    ids = torch.randint(3, 96, (1, 20))
    with torch.inference_mode():
        ref = tiny_gemma3(input_ids=ids).logits
    cache = CompressedCache("prerope+fp32/fp16", config=tiny_gemma3.config, calibration=st)
    got = logits_in_splits(tiny_gemma3, cache, ids, [5, 9, *range(10, 21)])  # slides past the window of 6
    assert torch.allclose(got, ref, atol=2e-3)


def test_post_and_pre_rope_statistics_are_not_mixed(tiny_llama, stats):
    with pytest.raises(ValueError, match="before RoPE"):
        CompressedCache("center+tq:3/tq:3", config=tiny_llama.config, calibration=stats.pre_rope())


def test_a_fused_cache_reads_prerope_layers_in_the_kernel(tiny_llama, stats, monkeypatch):
    """Fused prerope+ layers give the decoding path's logits and never decode the whole layer."""
    from walshkv.attention import decode as attn
    from walshkv.cache.layers import CompressedLayer

    spec = "sink:1:prerope+center+eq+tq:3/tq:3"
    ids = torch.randint(3, 96, (2, 30))
    splits = [20, 21, 22, 30]
    tiny_llama.set_attn_implementation("sdpa")
    ref = logits_in_splits(tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=stats), ids, splits)
    enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats, fused=True)
        assert all(layer.fused for layer in cache.layers)

        def forbidden(*args, **kwargs):
            raise AssertionError("a fused prerope+ layer took a decode-everything path")

        monkeypatch.setattr(CompressedLayer, "decoded", forbidden)
        monkeypatch.setattr(attn, "reference_partial", forbidden)
        got = logits_in_splits(tiny_llama, cache, ids, splits)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert torch.allclose(ref, got, atol=1e-4)


def test_a_preset_file_for_prerope_round_trips_and_is_refused_elsewhere(tmp_path: Path, tiny_lm, tiny_llama, stats):
    spec = "sink:1:prerope+center+eq+tq:3.5/tq:3"
    assert k_pre_rope(spec) and not k_pre_rope("center+tq:3/tq:3")
    with pytest.raises(ValueError, match="some layers only"):
        k_pre_rope("layers:prerope+tq:3/tq:3@0;tq:3/tq:3")
    path = tmp_path / "pre.gguf"
    write_preset_file(path, tiny_lm, Preset("walshkv:3.5", 3.5, spec), stats)
    bias = read_kv_mean_center(path, "llama")
    assert bias.k_basis == "pre-rope" and bias.pre_rope() is bias
    pre = stats.pre_rope()
    for layer in range(2):
        assert torch.allclose(bias.plain[layer].float(), pre.mean("k", layer).float(), atol=1e-5)
        assert torch.allclose(bias.k_equalizer(layer), pre.k_equalizer(layer), atol=1e-5)
        assert torch.equal(bias.rope_table(layer).inv_freq, stats.rope_table(layer).inv_freq)
    ids = torch.randint(3, 96, (1, 30))
    a = logits_in_splits(tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=bias), ids, [30])
    b = logits_in_splits(tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=stats), ids, [30])
    assert torch.allclose(a, b, atol=1e-4)
    # a post-RoPE spec refuses the file, a prerope+ spec refuses a post-RoPE file
    with pytest.raises(ValueError, match="before RoPE"):
        CompressedCache("center+tq:3/tq:3", config=tiny_llama.config, calibration=bias)
    post = tmp_path / "post.gguf"
    write_preset_file(post, tiny_lm, Preset("walshkv:3.5", 3.5, "center+tq:3.5/tq:3"), stats)
    with pytest.raises(ValueError, match="after RoPE"):
        CompressedCache(spec, config=tiny_llama.config, calibration=read_kv_mean_center(post, "llama"))
    merged = MergedCalibration(stats, read_kv_mean_center(post, "llama"))
    with pytest.raises(ValueError, match="after RoPE"):
        CompressedCache(spec, config=tiny_llama.config, calibration=merged)


def test_a_fused_preset_cache_with_left_padding_matches_the_decoding_path(tiny_llama, stats):
    """A left-padded batch: prefill with the model's padding mask, then decode steps; fused == decoding path."""
    spec = "sink:1:layers:prerope+center+eq+tq:3.5/tq:3@0;prerope+center+eq+tq:3/tq:2.5"
    ids = torch.randint(3, 96, (2, 26))
    mask = torch.ones(2, 26, dtype=torch.long)
    mask[1, :4] = 0  # row 1: four padding tokens first

    def run(fused: bool) -> torch.Tensor:
        cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats, fused=fused)
        outs = []
        with torch.inference_mode():
            outs.append(tiny_llama(input_ids=ids[:, :20], attention_mask=mask[:, :20], cache=cache).logits)
            for t in range(20, 26):
                outs.append(
                    tiny_llama(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
                )
        return torch.cat(outs, dim=1)

    tiny_llama.set_attn_implementation("sdpa")
    ref = run(False)
    enable_fused_attention(tiny_llama)
    try:
        got = run(True)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    keep = mask.bool()  # padding positions' logits are garbage in both
    assert torch.allclose(ref[keep], got[keep], atol=1e-4)
