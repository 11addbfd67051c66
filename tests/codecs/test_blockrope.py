"""``ropeblock:G+`` (K in the block frame) and ``eqr+`` (eq+ fitted after RoPE): math, calibration, files, cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import ToyTokenizer, logits_in_splits
from walshkv.attention import decode as attn
from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.cache.layers import CompressedLayer
from walshkv.calibration import collect_kv_stats
from walshkv.codecs.spec import parse_codec
from walshkv.data import Text
from walshkv.export import read_kv_mean_center
from walshkv.models import LoadedModel, _describe
from walshkv.ops.rope import RopeTable, apply_rope, rope_averaged, turn, undo_rope
from walshkv.preset_file import calibration_needs, k_pre_rope, write_preset_file
from walshkv.presets import Preset, dense_key_map

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
SPEC = "sink:1:ropeblock:8+eqr:8+tq:3.5/tq:3"


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture(scope="module")
def stats(tiny_lm):
    return collect_kv_stats(tiny_lm, TEXT, tokens=128, ctx=64, progress=False)


def test_rope_averaged_is_the_mean_over_positions_of_the_turned_moment():
    d = 16
    table = RopeTable(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))
    a = torch.randn(d, d, dtype=torch.float64)
    m = a @ a.T
    for length in (1, 5, 64):
        turned = torch.stack([turn(torch.eye(d), table, torch.tensor([p] * d)).double().T for p in range(length)])
        brute = (turned @ m @ turned.transpose(-1, -2)).mean(0)
        torch.testing.assert_close(rope_averaged(m, table.inv_freq, length), brute, atol=1e-5, rtol=1e-5)
    # the limit keeps only equal frequencies: the moment of a pair with the others decorrelates
    limit = rope_averaged(m, table.inv_freq, None)
    assert float(limit[0, 1].abs()) < 1e-12 and float(limit[0, d // 2].abs()) < 1e-12
    torch.testing.assert_close(limit[0, 0], (m[0, 0] + m[d // 2, d // 2]) / 2)


def test_a_block_of_one_is_k_before_rope_minus_its_mean(tiny_lm, stats):
    codec = parse_codec("ropeblock:1+fp32").bind(0, "k", stats)
    pre = stats.pre_rope()
    table = pre.rope_table(0)
    k = torch.randn(1, 2, 6, 16)
    _, stored = codec._transform(k, 9)
    expect = undo_rope(k, table, 9) - pre.k_bias(0, "plain").float()[None, :, None, :]
    torch.testing.assert_close(stored, expect, atol=1e-5, rtol=1e-5)
    # a key at the first position of its block is stored turned back to position 0 of the block
    big = parse_codec("ropeblock:4+fp32").bind(0, "k", stats)
    _, stored = big._transform(apply_rope(k, table, 8), 8)  # positions 8..13: blocks 8 and 12
    turned = apply_rope(k, table, 0)[:, :, :4]
    mean = pre.k_bias(0, "plain").float()[None]
    torch.testing.assert_close(stored[:, :, 0] + mean, turned[:, :, 0], atol=1e-5, rtol=1e-5)


def test_specs_classify_as_pre_rope_files_without_a_dense_key_map():
    assert k_pre_rope(SPEC) and not dense_key_map(SPEC)
    needs = calibration_needs(SPEC)
    assert needs is not None and needs.pre_rope and needs.k_eq == "eqr:8:8" and needs.v_eq is None
    assert needs.name == "prerope-plain-keqr_8_8"
    with pytest.raises(ValueError, match="more than one way"):
        calibration_needs("layers:ropeblock:8+eqr:8+tq:3/tq:3@0;ropeblock:8+eqr:16+tq:3/tq:3")


def test_a_preset_file_round_trips_and_names_its_fit(tmp_path: Path, tiny_lm, tiny_llama, stats):
    path = tmp_path / "block.gguf"
    write_preset_file(path, tiny_lm, Preset("walshkv:3.5", 3.5, SPEC), stats)
    bias = read_kv_mean_center(path, "llama")
    assert bias.k_basis == "pre-rope" and bias.k_equalizer_fit == "eqr:8:8"
    ids = torch.randint(3, 96, (1, 30), generator=torch.Generator().manual_seed(3))
    a = logits_in_splits(tiny_llama, CompressedCache(SPEC, config=tiny_llama.config, calibration=bias), ids, [30])
    b = logits_in_splits(tiny_llama, CompressedCache(SPEC, config=tiny_llama.config, calibration=stats), ids, [30])
    assert torch.allclose(a, b, atol=1e-4)
    # another fit, or eq+ before RoPE, refuses the file by name
    with pytest.raises(ValueError, match="eqr:16:16"):
        CompressedCache("ropeblock:16+eqr:16+tq:3/tq:3", config=tiny_llama.config, calibration=bias)
    with pytest.raises(ValueError, match="fitted as eqr:8:8"):
        CompressedCache("prerope+center+eq+tq:3/tq:3", config=tiny_llama.config, calibration=bias)


def test_the_fused_cache_reads_the_block_frame_without_decoding_it(tiny_llama, stats, monkeypatch):
    ids = torch.randint(3, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    splits = [20, 21, 22, 30]
    tiny_llama.set_attn_implementation("sdpa")
    ref = logits_in_splits(tiny_llama, CompressedCache(SPEC, config=tiny_llama.config, calibration=stats), ids, splits)
    enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache(SPEC, config=tiny_llama.config, calibration=stats, fused=True)
        assert all(layer.fused for layer in cache.layers)

        def forbidden(*args, **kwargs):
            raise AssertionError("a fused ropeblock layer took a decode-everything path")

        monkeypatch.setattr(CompressedLayer, "decoded", forbidden)
        monkeypatch.setattr(attn, "reference_partial", forbidden)
        got = logits_in_splits(tiny_llama, cache, ids, splits)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert torch.allclose(ref, got, atol=1e-4)


def test_bad_calibration_is_refused_by_name(tiny_llama, stats):
    with pytest.raises(ValueError, match="is calibrated"):
        CompressedCache(SPEC, config=tiny_llama.config)
    with pytest.raises(ValueError, match="eqr\\+ is for K"):
        parse_codec("eqr:8+tq:3").bind(0, "v", stats)
    codec = parse_codec("ropeblock:8+tq:3").bind(0, "k", stats)
    with pytest.raises(ValueError, match="kv heads of head_dim"):
        codec.encode(torch.randn(1, 3, 4, 16))  # another model's head count
