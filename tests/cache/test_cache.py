"""CompressedCache: quantize on write, real bytes, generate paths, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from walshkv import CompressedCache, parse_codec
from walshkv.cache import CompressedLayer, CompressedSlidingWindowLayer


def _kv(batch=2, heads=2, seq=5, dim=16):
    return torch.randn(batch, heads, seq, dim), torch.randn(batch, heads, seq, dim)


def test_update_returns_decoded_block_not_the_input():
    """Quantize on write: even the first (current) block comes back through the codec."""
    cache = CompressedCache("int4")
    k, v = _kv()
    out_k, out_v = cache.update(k, v, 0)
    codec = parse_codec("int4")
    assert torch.equal(out_k, codec.decode(codec.encode(k)))
    assert torch.equal(out_v, codec.decode(codec.encode(v)))
    assert not torch.allclose(out_k, k)


def test_update_appends_and_decodes_every_token():
    cache = CompressedCache("rot+int8")
    k1, v1 = _kv(seq=5)
    k2, v2 = _kv(seq=1)
    cache.update(k1, v1, 0)
    out_k, _ = cache.update(k2, v2, 0)
    codec = parse_codec("rot+int8")
    expect = torch.cat([codec.decode(codec.encode(k1)), codec.decode(codec.encode(k2))], dim=2)
    assert torch.allclose(out_k, expect)
    assert cache.get_seq_length() == 6


class SpyCodec:
    """Wraps a codec and counts the tokens it encodes."""

    def __init__(self, inner):
        self.inner = inner
        self.tokens = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, x, start=0):
        self.tokens += x.shape[2]
        return self.inner.encode(x, start)


def test_model_prefill_sees_compressed_kv(tiny_llama):
    """A forward from an empty cache must differ from the reference: the block itself is compressed."""
    ids = torch.randint(3, 96, (1, 24))
    with torch.inference_mode():
        ref = tiny_llama(ids).logits
        cache = CompressedCache("int2", config=tiny_llama.config)
        spy = SpyCodec(cache.cache_spec.k)
        for layer in cache.layers:
            layer.spec = type(layer.spec)(spy, layer.spec.v)
        got = tiny_llama(ids, cache=cache).logits
    assert spy.tokens == 24 * tiny_llama.config.num_hidden_layers
    assert (ref - got).abs().max() > 1e-3


@pytest.mark.parametrize("spec", ["fp16", "int8", "int4", "rot+int3", "int2/int8", "rrot:3+int5"])
@pytest.mark.parametrize("residual", [0, 3])
def test_nbytes_matches_layout(tiny_llama, spec, residual):
    ids = torch.randint(3, 96, (2, 11))
    cache = CompressedCache(spec, config=tiny_llama.config, residual=residual)
    with torch.inference_mode():
        tiny_llama(ids, cache=cache)
        tiny_llama(ids[:, :1], cache=cache)
    assert cache.nbytes() == cache.layout_nbytes() > 0
    assert cache.bits_per_element() == pytest.approx(8 * cache.nbytes() / cache.num_elements())
    if residual == 0:
        k, v = cache.cache_spec.k, cache.cache_spec.v
        assert cache.bits_per_element() == pytest.approx((k.bits_per_element(16) + v.bits_per_element(16)) / 2)
    layer = cache.layers[0]
    assert layer.keys.shape[2] == residual
    assert layer.packed_k.seq_len == 12 - residual
    assert layer.packed_k.tensors[next(iter(layer.packed_k.tensors))].dtype in (
        torch.uint8,
        torch.float16,
        torch.bfloat16,
        torch.float32,
    )


def test_residual_window_is_exact_and_counted():
    cache = CompressedCache("int2", residual=4)
    k, v = _kv(seq=10)
    out_k, _ = cache.update(k, v, 0)
    assert torch.equal(out_k[:, :, -4:], k[:, :, -4:])
    assert not torch.allclose(out_k[:, :, :6], k[:, :, :6])
    no_window = CompressedCache("int2")
    no_window.update(k, v, 0)
    assert cache.bits_per_element() > no_window.bits_per_element()


def test_stores_packed_uint8_not_floats():
    cache = CompressedCache("rot+int4")
    k, v = _kv(seq=7, dim=64)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    assert layer.packed_k.tensors["codes"].dtype == torch.uint8
    assert layer.packed_k.tensors["codes"].shape == (2, 2, 7, 32)
    assert layer.packed_k.tensors["scale"].dtype == torch.float16
    assert layer.keys.numel() == 0


def test_generate_greedy_fp32_codec_matches_dynamic_cache(tiny_llama):
    ids = torch.randint(3, 96, (1, 12))
    ref = tiny_llama.generate(ids, max_new_tokens=12, do_sample=False)
    out = tiny_llama.generate(
        ids, cache=CompressedCache("fp32", config=tiny_llama.config), max_new_tokens=12, do_sample=False
    )
    assert torch.equal(ref, out)


def test_generate_greedy_int8_matches_first_tokens(tiny_llama):
    ids = torch.randint(3, 96, (1, 12))
    ref = tiny_llama.generate(ids, max_new_tokens=8, do_sample=False)
    out = tiny_llama.generate(
        ids, cache=CompressedCache("int8", config=tiny_llama.config), max_new_tokens=8, do_sample=False
    )
    assert torch.equal(ref[:, :16], out[:, :16])


def test_generate_sampling_matches_with_lossless_codec(tiny_llama):
    ids = torch.randint(3, 96, (1, 8))
    torch.manual_seed(5)
    ref = tiny_llama.generate(ids, max_new_tokens=10, do_sample=True, top_k=20)
    torch.manual_seed(5)
    out = tiny_llama.generate(
        ids, cache=CompressedCache("fp32", config=tiny_llama.config), max_new_tokens=10, do_sample=True, top_k=20
    )
    assert torch.equal(ref, out)


def test_generate_batch_left_padding(tiny_llama):
    ids = torch.randint(3, 96, (2, 10))
    mask = torch.ones_like(ids)
    ids[1, :4] = 0
    mask[1, :4] = 0
    kwargs = {"attention_mask": mask, "max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    ref = tiny_llama.generate(ids, **kwargs)
    out = tiny_llama.generate(ids, cache=CompressedCache("fp32", config=tiny_llama.config), **kwargs)
    assert torch.equal(ref, out)
    cache = CompressedCache("rot+int4", config=tiny_llama.config)
    out4 = tiny_llama.generate(ids, cache=cache, **kwargs)
    assert out4.shape == ref.shape
    assert cache.layers[0].packed_k.batch_size == 2


def test_beam_search_reorders_packed_cache(tiny_llama):
    ids = torch.randint(3, 96, (1, 10))
    kwargs = {"max_new_tokens": 8, "num_beams": 3, "do_sample": False}
    ref = tiny_llama.generate(ids, **kwargs)
    out = tiny_llama.generate(ids, cache=CompressedCache("fp32", config=tiny_llama.config), **kwargs)
    assert torch.equal(ref, out)
    cache = CompressedCache("rot+int8", config=tiny_llama.config)
    tiny_llama.generate(ids, cache=cache, **kwargs)
    assert cache.layers[0].packed_k.batch_size == 3


def test_reorder_selects_codes_exactly():
    cache = CompressedCache("int4", residual=2)
    k, v = _kv(batch=3, seq=6)
    cache.update(k, v, 0)
    before = cache.layers[0].packed_k.tensors["codes"].clone()
    window = cache.layers[0].keys.clone()
    idx = torch.tensor([2, 2, 0])
    cache.reorder_cache(idx)
    assert torch.equal(cache.layers[0].packed_k.tensors["codes"], before[idx])
    assert torch.equal(cache.layers[0].keys, window[idx])


def test_crop_removes_tokens_and_bytes(tiny_llama):
    ids = torch.randint(3, 96, (1, 10))
    cache = CompressedCache("int4", config=tiny_llama.config, residual=2)
    with torch.inference_mode():
        tiny_llama(ids, cache=cache)
    full = cache.nbytes()
    cache.crop(-3)
    assert cache.get_seq_length() == 7
    assert cache.nbytes() == cache.layout_nbytes() < full
    cache.crop(5)  # legacy form: the length to keep
    assert cache.get_seq_length() == 5
    with torch.inference_mode():
        tiny_llama(ids[:, :2], cache=cache, position_ids=torch.tensor([[5, 6]]))
    assert cache.get_seq_length() == 7


def test_sliding_window_model_matches_and_keeps_window(tiny_gemma3):
    ids = torch.randint(3, 96, (1, 10))
    ref = tiny_gemma3.generate(ids, max_new_tokens=12, do_sample=False)
    cache = CompressedCache("fp32", config=tiny_gemma3.config)
    out = tiny_gemma3.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert torch.equal(ref, out)
    assert isinstance(cache.layers[0], CompressedSlidingWindowLayer)
    assert isinstance(cache.layers[2], CompressedLayer) and not cache.layers[2].is_sliding
    assert cache.layers[0]._stored_length() == 5  # sliding_window - 1
    assert cache.layers[2]._stored_length() == 21
    assert cache.nbytes() == cache.layout_nbytes()


def test_sliding_window_compressed_generation_runs(tiny_gemma3):
    ids = torch.randint(3, 96, (2, 9))
    cache = CompressedCache("rot+int4", config=tiny_gemma3.config)
    out = tiny_gemma3.generate(ids, cache=cache, max_new_tokens=10, do_sample=False)
    assert out.shape == (2, 19)
    with pytest.raises(RuntimeError, match="sliding"):
        cache.crop(-2)


def test_nan_is_refused_and_cache_unchanged():
    cache = CompressedCache("int4")
    k, v = _kv()
    cache.update(k, v, 0)
    before = (cache.get_seq_length(), cache.nbytes())
    bad = k.clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"layer 0 .*NaN"):
        cache.update(bad, v, 0)
    inf = v.clone()
    inf[1, 1, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="Inf"):
        cache.update(k, inf, 0)
    assert (cache.get_seq_length(), cache.nbytes()) == before


def test_zero_vectors_decode_without_nan():
    cache = CompressedCache("rot+int3")
    k = torch.zeros(1, 2, 4, 16)
    out_k, out_v = cache.update(k, k.clone(), 0)
    assert torch.isfinite(out_k).all() and torch.equal(out_k, k) and torch.equal(out_v, k)


def test_large_values_scales_stay_finite():
    cache = CompressedCache("int8")
    k = torch.randn(1, 2, 4, 16) * 1e6
    out_k, _ = cache.update(k, k.clone(), 0)
    assert torch.isfinite(cache.layers[0].packed_k.tensors["scale"].float()).all()
    assert torch.allclose(out_k, k, rtol=0.02, atol=1e6 * 0.02)
    with pytest.raises(ValueError, match="fp16"):
        cache.update(k * 100, k * 100, 0)
    with pytest.raises(ValueError, match="fp16"):
        CompressedCache("fp16").update(torch.full((1, 1, 1, 16), 1e5), torch.zeros(1, 1, 1, 16), 0)


def test_non_power_of_two_head_dim_with_rotation_is_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=96,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=48,
        num_hidden_layers=1,
        vocab_size=32,
        intermediate_size=64,
    )
    with pytest.raises(ValueError, match="power-of-two"):
        CompressedCache("rot+int4", config=cfg)
    CompressedCache("int4", config=cfg)  # fine without rotation
    with pytest.raises(ValueError, match="power-of-two"):
        CompressedCache("rot+int4").update(*_kv(dim=48), 0)


def test_shape_mismatch_is_refused():
    cache = CompressedCache("int4")
    cache.update(*_kv(), 0)
    with pytest.raises(ValueError, match="does not match"):
        cache.update(*_kv(heads=3), 0)
    with pytest.raises(ValueError, match=r"\[batch, num_kv_heads, seq_len, head_dim\]"):
        cache.update(torch.randn(2, 5, 16), torch.randn(2, 5, 16), 0)


def test_bad_spec_and_residual():
    with pytest.raises(ValueError, match="int4"):
        CompressedCache("int9")
    with pytest.raises(ValueError, match="residual"):
        CompressedCache("int4", residual=-1)


def test_compressed_smaller_than_dynamic_fp16(tiny_llama):
    ids = torch.randint(3, 96, (1, 40))
    cache = CompressedCache("rot+int4", config=tiny_llama.config)
    ref = DynamicCache(config=tiny_llama.config)
    with torch.inference_mode():
        tiny_llama(ids, cache=cache)
        tiny_llama(ids, cache=ref)
    fp16_bytes = sum(layer.keys.numel() * 2 + layer.values.numel() * 2 for layer in ref.layers)
    assert cache.fp16_nbytes() == fp16_bytes
    # head_dim 16: (8 code bytes + 2 scale bytes) / 32 fp16 bytes
    assert cache.nbytes() / fp16_bytes == pytest.approx(10 / 32)


def test_packed_store_grows_in_place_and_bounded():
    """Writes land in a preallocated store (no torch.cat of the cache per step); growth is by 1/8."""
    from walshkv.cache.store import GRANULE, GROWTH

    cache = CompressedCache("int4")
    k, v = _kv(batch=1, seq=100)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    ptr = layer.packed_k.tensors["codes"].data_ptr()
    capacity = layer._store_k.seq_len
    assert capacity % GRANULE == 0 and capacity >= 100
    grown = 0
    for _ in range(400):
        k1, v1 = _kv(batch=1, seq=1)
        cache.update(k1, v1, 0)
        held = layer.packed_k.seq_len
        if layer._store_k.seq_len != capacity:  # a write that did not fit: one copy into a larger store
            grown += 1
            assert layer._store_k.seq_len <= GROWTH * capacity + GRANULE
            capacity = layer._store_k.seq_len
            ptr = layer.packed_k.tensors["codes"].data_ptr()
        assert layer.packed_k.tensors["codes"].data_ptr() == ptr  # otherwise written in place
        assert held <= capacity <= max(GROWTH * held, held) + GRANULE
    assert 0 < grown < 40
    assert cache.nbytes() == cache.layout_nbytes()  # nbytes counts the tokens held, not the capacity
    assert cache.nbytes() < cache.reserved_nbytes() <= GROWTH * cache.nbytes() + 2 * GRANULE * 34
    ref = torch.cat([parse_codec("int4").decode(parse_codec("int4").encode(t)) for t in (k,)], dim=2)
    assert torch.equal(cache.layers[0].spec.k.decode(layer.packed_k.slice_seq(0, 100)), ref)


def test_max_cache_len_reserves_once(tiny_llama):
    ids = torch.randint(3, 96, (1, 12))
    cache = CompressedCache("int4", config=tiny_llama.config, max_cache_len=20)
    kw = {"max_new_tokens": 8, "do_sample": False}
    ref = tiny_llama.generate(ids, cache=CompressedCache("int4", config=tiny_llama.config), **kw)
    out = tiny_llama.generate(ids, cache=cache, **kw)
    assert torch.equal(ref, out)
    layer = cache.layers[0]
    assert layer._store_k.seq_len == 20 and layer.packed_k.seq_len == 19  # (the last token is never fed back)
    assert cache.reserved_nbytes() > cache.nbytes() == cache.layout_nbytes()
    with pytest.raises(ValueError, match="max_cache_len"):
        CompressedCache("int4", max_cache_len=0)


def test_crop_then_write_reuses_the_store_and_beam_reorder_reallocates():
    cache = CompressedCache("int8")
    k, v = _kv(batch=2, seq=30)
    cache.update(k, v, 0)
    layer = cache.layers[0]
    store = layer._store_k
    cache.crop(-10)
    k2, v2 = _kv(batch=2, seq=5)
    cache.update(k2, v2, 0)
    assert layer._store_k is store and layer.packed_k.seq_len == 25
    codec = parse_codec("int8")
    want = torch.cat([codec.decode(codec.encode(k[:, :, :20])), codec.decode(codec.encode(k2))], dim=2)
    assert torch.equal(codec.decode(layer.packed_k), want)
    cache.reorder_cache(torch.tensor([1, 1]))
    assert layer._store_k is None
    cache.update(*_kv(batch=2, seq=1), 0)
    assert torch.equal(codec.decode(layer.packed_k)[:, :, :25], want[[1, 1]])
