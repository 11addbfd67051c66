"""KIVI: asymmetric quantization math, the token-grouped cache layer, and its accounting."""

from __future__ import annotations

import pytest
import torch

from walshkv import CompressedCache, parse_cache_spec, parse_codec
from walshkv.cache import KiviLayer
from walshkv.codecs.kivi import dequantize_asymmetric, quantize_asymmetric


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_asymmetric_error_bound(bits):
    x = torch.randn(5, 7, 32) * 3 + 1
    q, s, z = quantize_asymmetric(x, bits, dim=-1)
    assert q.dtype == torch.uint8 and int(q.max()) <= (1 << bits) - 1
    assert s.dtype == torch.float16 and z.dtype == torch.float16
    err = (dequantize_asymmetric(q, s, z) - x).abs()
    # rounding error <= scale/2, plus the fp16 rounding of the zero point
    assert bool((err <= s.float() / 2 + z.float().abs() * 1e-3 + 1e-6).all())


def test_asymmetric_zero_and_constant_vectors():
    for x in (torch.zeros(2, 16), torch.full((2, 16), 3.25)):
        q, s, z = quantize_asymmetric(x, 2, dim=-1)
        out = dequantize_asymmetric(q, s, z)
        assert torch.isfinite(out).all() and torch.allclose(out, x, atol=1e-3)


def test_asymmetric_overflow_is_refused():
    with pytest.raises(ValueError, match="fp16"):
        quantize_asymmetric(torch.tensor([[-1e6, 1e6]]), 2, dim=-1)


def test_spec_parsing():
    assert parse_codec("kivi2").spec == "kivi2"
    assert parse_codec("kivi4:g=64:r=128").spec == "kivi4:g=64:r=128"
    assert parse_cache_spec("kivi2").spec == "kivi2"
    for bad in ("kivi2:x=1", "kivi2:g=a", "kivi2:g=0", "kivi3"):
        with pytest.raises(ValueError):
            parse_codec(bad)


def test_kivi_cache_groups_window_and_bytes():
    cache = CompressedCache("kivi2")
    k, v = torch.randn(2, 3, 100, 64), torch.randn(2, 3, 100, 64)
    out_k, out_v = cache.update(k, v, 0)
    layer = cache.layers[0]
    assert isinstance(layer, KiviLayer)
    assert layer.packed_k.seq_len == 2 and layer.packed_v.seq_len == 64  # 2 K groups of 32 tokens
    assert layer.keys.shape[2] == 36 and layer.keys.dtype == torch.float16  # R <= window < R + G
    assert torch.equal(out_k[:, :, 64:], k[:, :, 64:].half().float())
    assert cache.get_seq_length() == 100
    assert cache.nbytes() == cache.layout_nbytes()
    # K group: per channel over the 32 tokens of the group (tokens pass through the fp16 window first)
    k16, v16 = k.half().float(), v.half().float()
    q, s, z = quantize_asymmetric(k16[:, :, :32], 2, dim=2)
    assert torch.allclose(out_k[:, :, :32], dequantize_asymmetric(q, s, z), atol=1e-6)
    # V: per token, groups of 32 channels
    qv, sv, zv = quantize_asymmetric(v16[:, :, :64].reshape(2, 3, 64, 2, 32), 2, dim=-1)
    assert torch.allclose(out_v[:, :, :64], dequantize_asymmetric(qv, sv, zv).reshape(2, 3, 64, 64), atol=1e-6)


def test_kivi_bits_approach_b_plus_scale_overhead():
    cache = CompressedCache("kivi2")
    k = torch.randn(1, 2, 32 * 64 + 32, 64)
    cache.update(k, k.clone(), 0)
    bits_k, bits_v = cache.bits_per_element_kv()
    # codes 2 bits + fp16 scale and zero per 32 values (1 bit) + a 32-token fp16 window
    window = 32 * 16 / (32 * 65)
    assert bits_k == pytest.approx(3 * 64 / 65 + window)
    assert bits_v == pytest.approx(3 * 64 / 65 + window)
    assert cache.bits_per_element() == pytest.approx(8 * cache.nbytes() / cache.num_elements())


def test_kivi_with_tiny_model_generate_and_beams(tiny_llama, tiny_gemma3):
    ids = torch.randint(3, 96, (2, 40))
    cache = CompressedCache("kivi2:g=8:r=8", config=tiny_llama.config)
    out = tiny_llama.generate(ids, cache=cache, max_new_tokens=12, do_sample=False)
    assert out.shape == (2, 52) and cache.nbytes() == cache.layout_nbytes()
    beams = CompressedCache("kivi4:g=8:r=8", config=tiny_llama.config)
    tiny_llama.generate(ids[:1], cache=beams, max_new_tokens=6, num_beams=3, do_sample=False)
    assert beams.layers[0].packed_v.batch_size == 3
    with pytest.raises(RuntimeError, match="cropped"):
        cache.crop(-2)
    sliding = CompressedCache("kivi2", config=tiny_gemma3.config)  # gemma3: its sliding layers hold their window
    assert [layer.is_sliding for layer in sliding.layers] == [True, True, False]


def test_kivi_refuses_nan():
    cache = CompressedCache("kivi2")
    k = torch.randn(1, 1, 8, 32)
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        cache.update(k, torch.randn(1, 1, 8, 32), 0)
    assert cache.get_seq_length() == 0
