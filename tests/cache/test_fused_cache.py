"""CompressedCache(..., fused=True): attention reads the packed codes, with the same results."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from walshkv.attention.chunked import chunked_attention
from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.codecs import parse_cache_spec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))

from matrix import CalibrationStub


@pytest.fixture(scope="module")
def gqa_llama():
    """head_dim 64, 6 query heads over 2 KV heads (GQA ratio 3)."""
    from conftest import _tiny_llama

    return _tiny_llama(5, hidden_size=192, num_attention_heads=6, num_key_value_heads=2, head_dim=64)


def _run(model, spec, residual, fused, ids, splits, calibration=None):
    model.set_attn_implementation("sdpa")
    if fused:
        enable_fused_attention(model)
    cache = CompressedCache(spec, config=model.config, residual=residual, fused=fused, calibration=calibration)
    outs, s = [], 0
    with torch.inference_mode():
        for e in splits:
            outs.append(model(input_ids=ids[:, s:e], cache=cache).logits)
            s = e
    model.set_attn_implementation("sdpa")
    return outs, cache


@pytest.mark.parametrize(
    ("spec", "residual"),
    [("rot+int4", 0), ("int4", 0), ("q4_0", 0), ("q8_0", 0), ("rot+int4/int3", 5), ("vht2:5,5,4,3", 0), ("int8", 3)],
)
def test_fused_matches_the_decoding_path(gqa_llama, spec, residual):
    ids = torch.randint(3, 90, (2, 41), generator=torch.Generator().manual_seed(1))
    splits = [23, 24, 25, 33, 41]  # prefill, two decode steps, two more blocks
    ref, cache_ref = _run(gqa_llama, spec, residual, False, ids, splits)
    got, cache = _run(gqa_llama, spec, residual, True, ids, splits)
    for a, b in zip(ref, got, strict=True):
        # float rounding only (kernel vs reference summation order): 2.2e-5 seen on an AVX-512 machine
        assert torch.allclose(a, b, atol=5e-5), float((a - b).abs().max())
    assert cache.nbytes() == cache_ref.nbytes()  # the same packed store


def test_fused_generate_and_sliding_layers(tiny_gemma3):
    ids = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        tiny_gemma3.set_attn_implementation("sdpa")
        ref = tiny_gemma3.generate(
            ids, cache=CompressedCache("int8", config=tiny_gemma3.config), max_new_tokens=6, do_sample=False
        )
        enable_fused_attention(tiny_gemma3)  # sliding layers keep running SDPA on decoded K/V
        got = tiny_gemma3.generate(
            ids, cache=CompressedCache("int8", config=tiny_gemma3.config, fused=True), max_new_tokens=6, do_sample=False
        )
        tiny_gemma3.set_attn_implementation("sdpa")
    assert torch.equal(ref, got)


def test_fused_needs_the_attention_function(tiny_llama):
    tiny_llama.set_attn_implementation("sdpa")
    with pytest.raises(ValueError, match="enable_fused_attention"):
        CompressedCache("int4", config=tiny_llama.config, fused=True)
    with pytest.raises(ValueError, match="enable_fused_attention"):
        CompressedCache("int4", fused=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_attention_against_sdpa(dtype):
    gen = torch.Generator().manual_seed(3)
    spec = parse_cache_spec("rot+int4")
    k, v = torch.randn(2, 2, 37, 64, generator=gen), torch.randn(2, 2, 37, 64, generator=gen)
    pk, pv = spec.k.encode(k[:, :, :30]), spec.v.encode(v[:, :, :30])
    q = torch.randn(2, 6, 9, 64, generator=gen).to(dtype)  # the last 9 positions (28..36)
    full_k = torch.cat([spec.k.decode(pk), k[:, :, 30:]], dim=-2)
    full_v = torch.cat([spec.v.decode(pv), v[:, :, 30:]], dim=-2)
    mask = torch.ones(9, 37, dtype=torch.bool).tril(28)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), full_k, full_v, attn_mask=mask, enable_gqa=True)
    got = chunked_attention(
        q, pk, pv, spec.k, spec.v, offset=28, window_k=k[:, :, 30:], window_v=v[:, :, 30:], q_block=4, kv_chunk=8
    )
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert got.dtype == dtype and torch.allclose(got.float(), ref, atol=tol)
    padded = mask.clone().expand(2, 1, 9, 37).clone()
    padded[1, :, :, :3] = False  # the second sequence starts with 3 padding tokens
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), full_k, full_v, attn_mask=padded, enable_gqa=True)
    got = chunked_attention(
        q,
        pk,
        pv,
        spec.k,
        spec.v,
        offset=28,
        window_k=k[:, :, 30:],
        window_v=v[:, :, 30:],
        mask=padded,
        q_block=4,
        kv_chunk=8,
    )
    assert torch.allclose(got.float(), ref, atol=tol)


def test_fused_attention_with_other_caches_and_padding(gqa_llama):
    """The fused attention function also serves DynamicCache (SDPA fallback) and padded batches."""
    from transformers import DynamicCache

    ids = torch.randint(3, 90, (2, 30), generator=torch.Generator().manual_seed(4))
    pad = torch.ones(2, 30, dtype=torch.long)
    pad[1, 8:11] = 0  # masked tokens in the second row (every query still sees a real token: no NaN rows)

    def run(fused: bool, cache_kind: str, mask: torch.Tensor | None):
        gqa_llama.set_attn_implementation("sdpa")
        if fused:
            enable_fused_attention(gqa_llama)
        if cache_kind == "dynamic":
            cache = DynamicCache()
        else:
            cache = CompressedCache("int8", config=gqa_llama.config, fused=fused)
        outs = []
        with torch.inference_mode():
            for s, e in ((0, 17), (17, 26), (26, 30)):  # chunked prefill: the later chunks have q < kv
                kw = {} if mask is None else {"attention_mask": mask[:, :e]}
                outs.append(gqa_llama(input_ids=ids[:, s:e], cache=cache, **kw).logits)
        gqa_llama.set_attn_implementation("sdpa")
        return outs

    for cache_kind in ("dynamic", "compressed"):
        for mask in (None, pad):
            ref, got = run(False, cache_kind, mask), run(True, cache_kind, mask)
            for a, b in zip(ref, got, strict=True):
                assert torch.allclose(a, b, atol=2e-5), (cache_kind, float((a - b).abs().max()))


def test_fused_mask_skips_only_the_plain_causal_mask():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from walshkv.cache.fused import _fused_mask

    common = {"batch_size": 1, "q_length": 4, "kv_length": 10, "q_offset": 6, "device": "cpu"}
    no_padding = torch.ones(1, 10, dtype=torch.bool)
    assert _fused_mask(mask_function=causal_mask_function, attention_mask=no_padding, **common) is None
    padded = torch.ones(1, 10, dtype=torch.bool)
    padded[0, 0] = False
    mask = _fused_mask(mask_function=causal_mask_function, attention_mask=padded, **common)
    assert mask is not None and not bool(mask[0, 0, :, 0].any()) and bool(mask[0, 0, -1, -1])
    sliding = _fused_mask(mask_function=sliding_window_causal_mask_function(3), local_size=3, **common)
    assert sliding is not None and not bool(sliding[0, 0, -1, 0])


@pytest.mark.parametrize(
    "spec", ["sink:1:ropeblock:8+eqr:8+tq:3.5/tq:3", "ropeblock:16+eqr:16+tcq:3:norm=8:tables=2/tq:3"]
)
def test_block_frame_keys_fused_match_the_decoding_path(gqa_llama, spec):
    """K in the block frame: fused prefill and decode (a query per block, the mean's table) as the codecs decode."""
    stub = CalibrationStub(64, 2)
    ids = torch.randint(3, 90, (2, 41), generator=torch.Generator().manual_seed(2))
    splits = [23, 24, 25, 33, 41]
    ref, cache_ref = _run(gqa_llama, spec, 0, False, ids, splits, stub)
    got, cache = _run(gqa_llama, spec, 0, True, ids, splits, stub)
    for a, b in zip(ref, got, strict=True):
        assert torch.allclose(a, b, atol=5e-5), float((a - b).abs().max())
    assert cache.nbytes() == cache_ref.nbytes()
