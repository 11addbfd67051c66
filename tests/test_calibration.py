"""Calibration statistics (KVStats, collect_kv_stats) and calibrated vht2 codecs in the cache."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from conftest import ToyTokenizer
from walshkv import CompressedCache
from walshkv.calibration import KVStats, MergedCalibration, collect_kv_stats
from walshkv.codecs.calibration import Calibration, Statistics
from walshkv.codecs.spec import parse_cache_spec
from walshkv.codecs.vht2 import VHT2Codec, allocate_bits
from walshkv.data import Text, make_windows
from walshkv.export import KMeanBias
from walshkv.models import LoadedModel, _describe
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.orders import variance_order

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # the tiny llama of conftest.py


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture(scope="module")
def stats(tiny_lm) -> KVStats:
    """Statistics over two 64-token windows (read-only: shared by the tests of this module)."""
    return collect_kv_stats(tiny_lm, TEXT, tokens=128, ctx=64, progress=False)


def _forward(model, cache, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, cache=cache, use_cache=True).logits


def _ids(tiny_lm, ctx: int = 64) -> torch.Tensor:
    return make_windows(tiny_lm.tokenizer, TEXT.content, ctx, 1).ids[:1]


# ---- KVStats -------------------------------------------------------------------------------------


def test_stats_shapes_and_metadata(stats: KVStats) -> None:
    assert (stats.model, stats.text, stats.tokens) == ("tiny-llama", "toy-calib", 128)
    assert (stats.num_layers, stats.num_kv_heads, stats.head_dim) == (LAYERS, KV_HEADS, HEAD_DIM)
    assert stats.counts is not None and stats.counts.tolist() == [128.0, 128.0]
    for kind in ("k", "v"):
        for layer in range(LAYERS):
            for basis in ("plain", "wht"):
                assert stats.mean(kind, layer, basis).shape == (KV_HEADS, HEAD_DIM)
                var = stats.variance(kind, layer, basis)
                assert var.shape == (KV_HEADS, HEAD_DIM)
                assert var.dtype == torch.float64
                assert bool((var >= 0).all())
                assert float(var.sum()) > 0


def test_tokens_round_down_to_whole_windows(tiny_lm) -> None:
    assert collect_kv_stats(tiny_lm, TEXT, tokens=100, ctx=64, progress=False).tokens == 64
    one = collect_kv_stats(tiny_lm, TEXT, tokens=10, ctx=32, progress=False)  # at least one window
    assert one.tokens == 32
    assert one.counts is not None and one.counts.tolist() == [32.0, 32.0]


def test_plain_mean_is_the_mean_of_what_the_cache_received(tiny_llama, tiny_lm) -> None:
    """One window (tokens == ctx): the moments equal those of the K/V a DynamicCache stores."""
    stats = collect_kv_stats(tiny_lm, TEXT, tokens=64, ctx=64, progress=False)
    cache = DynamicCache(config=tiny_llama.config)
    _forward(tiny_llama, cache, _ids(tiny_lm))
    for layer in range(LAYERS):
        keys = cache.layers[layer].keys.to(torch.float64)  # [1, kv_heads, 64, head_dim], after RoPE
        values = cache.layers[layer].values.to(torch.float64)
        assert keys.shape == (1, KV_HEADS, 64, HEAD_DIM)
        torch.testing.assert_close(stats.mean("k", layer), keys.mean(dim=(0, 2)), rtol=0, atol=1e-6)
        torch.testing.assert_close(stats.mean("v", layer), values.mean(dim=(0, 2)), rtol=0, atol=1e-6)
        torch.testing.assert_close(
            stats.variance("k", layer, "plain"), keys.var(dim=(0, 2), unbiased=False), rtol=0, atol=1e-6
        )
        wht = hadamard_transform(keys)
        torch.testing.assert_close(
            stats.variance("k", layer, "wht"), wht.var(dim=(0, 2), unbiased=False), rtol=0, atol=1e-6
        )


def test_wht_basis_is_consistent_with_plain(stats: KVStats) -> None:
    for kind in ("k", "v"):
        for layer in range(LAYERS):
            plain = stats.mean(kind, layer, "plain")
            # the transform is linear: mean of WHT = WHT of mean
            torch.testing.assert_close(stats.mean(kind, layer, "wht"), hadamard_transform(plain), rtol=0, atol=1e-9)
            # and orthonormal: total variance per head is preserved
            torch.testing.assert_close(
                stats.variance(kind, layer, "wht").sum(-1),
                stats.variance(kind, layer, "plain").sum(-1),
                rtol=1e-9,
                atol=1e-9,
            )


def test_default_bases(stats: KVStats) -> None:
    assert torch.equal(stats.mean("k", 0), stats.mean("k", 0, "plain"))
    assert torch.equal(stats.variance("k", 0), stats.variance("k", 0, "wht"))


@pytest.mark.parametrize("layer", [-1, 2, 40])
def test_layer_out_of_range(stats: KVStats, layer: int) -> None:
    with pytest.raises(ValueError, match="2 layers; layer"):
        stats.mean("k", layer)
    with pytest.raises(ValueError, match="layers"):
        stats.variance("v", layer)


def test_bad_kind_or_basis(stats: KVStats) -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        stats.mean("q", 0)
    with pytest.raises(ValueError, match="basis one of"):
        stats.variance("k", 0, "dct")


def test_check_matches(stats: KVStats) -> None:
    stats.check_matches(LAYERS, KV_HEADS, HEAD_DIM)
    for shape in ((3, KV_HEADS, HEAD_DIM), (LAYERS, 1, HEAD_DIM), (LAYERS, KV_HEADS, 64)):
        with pytest.raises(ValueError, match="calibrate on this model"):
            stats.check_matches(*shape, model="other-model")
    with pytest.raises(ValueError, match=r"'tiny-llama' has \(layers, kv_heads, head_dim\) = \(2, 2, 16\)"):
        stats.check_matches(24, 4, 64, model="other-model")


def test_sliding_window_model_stats(tiny_gemma3, toy_tokenizer) -> None:
    lm = LoadedModel(tiny_gemma3, toy_tokenizer, "tiny-gemma3", "test", _describe(tiny_gemma3))
    stats = collect_kv_stats(lm, TEXT, tokens=32, ctx=32, progress=False)
    assert (stats.num_layers, stats.num_kv_heads, stats.head_dim) == (3, 1, 32)
    assert stats.counts is not None and stats.counts.tolist() == [32.0] * 3  # sliding layers see every token
    assert stats.variance("k", 2).shape == (1, 32)


# ---- calibrated codecs in CompressedCache --------------------------------------------------------


def test_variance_order_cache_runs_and_binds_per_layer(tiny_llama, tiny_lm, stats: KVStats) -> None:
    spec = "vht2:5,5,4,3:order=variance/vht2:3"
    cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats)
    logits = _forward(tiny_llama, cache, _ids(tiny_lm))
    assert torch.isfinite(logits).all()
    ks = [layer.spec.k for layer in cache.layers]
    assert [k.spec for k in ks] == [
        "vht2:5,5,4,3:order=variance[k0]",
        "vht2:5,5,4,3:order=variance[k1]",
    ]
    for i, k in enumerate(ks):
        assert isinstance(k, VHT2Codec) and not k.needs_calibration
        assert torch.equal(k.perm(HEAD_DIM), variance_order(stats.variance("k", i).mean(dim=0)))
        assert k.bytes_per_vector(HEAD_DIM) == 3 + 3 + 2 + 2 + 8
    assert not torch.equal(ks[0].perm(HEAD_DIM), ks[1].perm(HEAD_DIM))
    assert all(layer.spec.v is cache.cache_spec.v for layer in cache.layers)  # V needs no calibration
    assert cache.cache_spec.spec == spec  # the unbound spec is untouched
    assert cache.nbytes() == cache.layout_nbytes() == LAYERS * KV_HEADS * 64 * (18 + 8)
    assert cache.bits_per_element_kv() == (18 * 8 / HEAD_DIM, 8 * 8 / HEAD_DIM)


def test_variance_order_beats_a_bad_order_at_a_small_skeleton(tiny_llama, tiny_lm, stats: KVStats) -> None:
    """Keeping the highest-variance WHT coefficients loses less than keeping the first ones."""
    ids = _ids(tiny_lm)
    ref = _forward(tiny_llama, DynamicCache(config=tiny_llama.config), ids)
    errs = {}
    for order in ("variance", "natural"):
        cache = CompressedCache(f"vht2:8:order={order}:sk=6/fp32", config=tiny_llama.config, calibration=stats)
        errs[order] = float((_forward(tiny_llama, cache, ids) - ref).pow(2).mean())
    assert errs["variance"] < errs["natural"]


def test_auto_cache_runs_within_budget(tiny_llama, tiny_lm, stats: KVStats) -> None:
    cache = CompressedCache("vht2:auto@4", config=tiny_llama.config, calibration=stats)
    _forward(tiny_llama, cache, _ids(tiny_lm))
    for i, layer in enumerate(cache.layers):
        for kind, codec in (("k", layer.spec.k), ("v", layer.spec.v)):
            assert codec.spec == f"vht2:auto@4[{kind}{i}]"
            var = stats.variance(kind, i).mean(dim=0)
            assert codec.bands(HEAD_DIM) == allocate_bits(var[variance_order(var)], 4)
            assert codec.bits_per_element(HEAD_DIM) <= 4
    assert cache.nbytes() == cache.layout_nbytes()
    bits_k, bits_v = cache.bits_per_element_kv()
    assert 0 < bits_k <= 4 and 0 < bits_v <= 4


def test_lazy_layers_bind_with_calibration(tiny_llama, tiny_lm, stats: KVStats) -> None:
    cache = CompressedCache("vht2:4,3:order=variance", calibration=stats)  # no config: layers made on use
    _forward(tiny_llama, cache, _ids(tiny_lm))
    assert [layer.spec.k.spec for layer in cache.layers] == [
        "vht2:4,3:order=variance[k0]",
        "vht2:4,3:order=variance[k1]",
    ]
    assert [layer.spec.v.spec for layer in cache.layers] == [
        "vht2:4,3:order=variance[v0]",
        "vht2:4,3:order=variance[v1]",
    ]
    assert cache.nbytes() == cache.layout_nbytes()


@pytest.mark.parametrize("spec", ["vht2:5,5,4,3:order=variance/vht2:3", "vht2:3/vht2:auto@4", "vht2:auto@3"])
def test_calibrated_spec_without_calibration_raises(tiny_llama, spec: str) -> None:
    assert parse_cache_spec(spec).needs_calibration  # parsing alone is fine
    with pytest.raises(ValueError, match="--calib-text"):
        CompressedCache(spec, config=tiny_llama.config)
    with pytest.raises(ValueError, match="--calib-text"):
        CompressedCache(spec)


def test_calibration_for_another_model_is_refused(tiny_llama, tiny_gemma3, toy_tokenizer) -> None:
    lm = LoadedModel(tiny_gemma3, toy_tokenizer, "tiny-gemma3", "test", _describe(tiny_gemma3))
    other = collect_kv_stats(lm, TEXT, tokens=32, ctx=32, progress=False)
    with pytest.raises(ValueError, match="calibrate on this model"):
        CompressedCache("vht2:4:order=variance", config=tiny_llama.config, calibration=other)


def test_uncalibrated_spec_ignores_calibration(tiny_llama, tiny_lm, stats: KVStats) -> None:
    cache = CompressedCache("vht2:5,5,4,3/vht2:3", config=tiny_llama.config, calibration=stats)
    _forward(tiny_llama, cache, _ids(tiny_lm))
    assert all(layer.spec is cache.cache_spec for layer in cache.layers)


# ---- the Calibration protocol ------------------------------------------------------------------------


def test_statistics_files_and_merged_calibration_satisfy_the_protocol(stats: KVStats) -> None:
    """What ``bind`` reads (walshkv.codecs.calibration): statistics provide every part, a file the file parts."""
    bias = KMeanBias(torch.zeros(LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.float64), "plain", "llama", "f.gguf")
    merged = MergedCalibration(stats, bias)
    for obj in (stats, merged):
        assert isinstance(obj, Statistics) and isinstance(obj, Calibration)
    assert isinstance(bias, Calibration) and not isinstance(bias, Statistics)  # a file holds no per-channel moments
    assert merged.k_basis == bias.k_basis == stats.k_basis == "post-rope"


def test_too_many_calibration_tokens_name_the_limit(tiny_lm) -> None:
    limit = r"asked for 1,000,000 tokens .* calibrate on at most [\d,]+ tokens \(--tokens\)"
    with pytest.raises(ValueError, match=limit):
        collect_kv_stats(tiny_lm, TEXT, tokens=1_000_000, ctx=64, progress=False)
