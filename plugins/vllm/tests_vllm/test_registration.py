"""The vLLM glue (needs vLLM: run in the plugin's own environment, see docs/serving.md; not collected by the
main test run, whose testpaths do not include this folder)."""

from __future__ import annotations

import math
import os
from typing import get_args

import pytest
import torch

import walshkv_vllm
from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.paged import decode_paged
from walshkv_vllm.specs import KV_CACHE_DTYPES, resolve_spec

# on vLLM's CPU platform the plugin offers its cache dtypes only with the backend that reads them in place of vLLM's
os.environ.setdefault("WALSHKV_VLLM_CPU", "1")
walshkv_vllm.register()

from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config  # noqa: E402  (after the plugin widened the cache dtypes)
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from walshkv_vllm import vllm_backend  # noqa: E402


def test_register_is_idempotent() -> None:
    walshkv_vllm.register()
    import vllm.config.cache as cache_mod
    import vllm.v1.attention.selector as selector

    names = get_args(cache_mod.CacheDType)
    assert all(names.count(n) == 1 for n in KV_CACHE_DTYPES)
    assert selector.CacheDType is cache_mod.CacheDType


@pytest.mark.parametrize("name", ["walshkv_q4_0", "walshkv_tq3", "walshkv_rot_int4"])
def test_cache_dtype_accepted_everywhere(name: str) -> None:
    assert CacheConfig(cache_dtype=name).cache_dtype == name
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(["--kv-cache-dtype", name])
    assert args.kv_cache_dtype == name
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    assert STR_DTYPE_TO_TORCH_DTYPE[name] is torch.uint8


def test_unknown_dtype_still_refused() -> None:
    with pytest.raises(Exception, match="cache_dtype"):
        CacheConfig(cache_dtype="walshkv_nope")


def test_custom_backend_resolves() -> None:
    assert AttentionBackendEnum.CUSTOM.get_class() is vllm_backend.WalshKVAttentionBackend


def test_customize_spec_gives_the_slot_size() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=3, head_size=64, dtype=torch.uint8)
    vllm_backend._ACTIVE["cache_dtype"] = "walshkv_q8_0_q4_0"
    try:
        got = vllm_backend.WalshKVAttentionBackend.customize_spec(spec)
    finally:
        vllm_backend._ACTIVE.clear()
    cache = resolve_spec("walshkv_q8_0_q4_0")
    assert got.state_content_bytes == 68 + 36
    assert got.page_size_bytes == 16 * 3 * (cache.k.bits_per_element(64) + cache.v.bits_per_element(64)) * 64 / 8


class _Layer:
    layer_name = "model.layers.1.self_attn.attn"


def test_impl_update_and_forward_match_the_core() -> None:
    """do_kv_cache_update + forward on vLLM-shaped tensors: a decode request and a prefill request."""
    hq, hk, d, bs = 4, 2, 64, 4
    with set_current_vllm_config(VllmConfig()):  # what vLLM sets while it builds the model
        impl = vllm_backend.WalshKVAttentionImpl(hq, d, 1 / math.sqrt(d), hk, kv_cache_dtype="walshkv_rot_int4")
    layout = SlotLayout.of(impl.cache.k, impl.cache.v, d, hk)
    kv_cache = torch.zeros(8, hk, bs, layout.slot_bytes, dtype=torch.uint8)  # vLLM's logical [B, H, N, C] view
    kv_cache = kv_cache.transpose(1, 2).contiguous().transpose(1, 2)  # LBNHC: N, H contiguous
    table = torch.tensor([[5, 2, -1], [0, 7, 3]], dtype=torch.int32)
    # request 0 has 5 tokens cached, request 1 is a 9-token prompt
    k0, v0 = torch.randn(6, hk, d), torch.randn(6, hk, d)
    slots0 = torch.tensor([5 * bs + i if i < bs else 2 * bs + i - bs for i in range(6)])
    impl.do_kv_cache_update(_Layer(), k0[:5].reshape(5, -1), v0[:5].reshape(5, -1), kv_cache, slots0[:5])
    k1, v1 = torch.randn(9, hk, d), torch.randn(9, hk, d)
    slots1 = torch.tensor([int(table[1, i // bs]) * bs + i % bs for i in range(9)])
    key = torch.cat([k0[5:], k1]).reshape(10, -1)
    value = torch.cat([v0[5:], v1]).reshape(10, -1)
    slots = torch.cat([slots0[5:], slots1, torch.tensor([-1, -1])])
    key = torch.cat([key, torch.zeros(2, hk * d)])
    value = torch.cat([value, torch.zeros(2, hk * d)])
    impl.do_kv_cache_update(_Layer(), key, value, kv_cache, slots)
    query = torch.randn(12, hq * d)
    meta = vllm_backend.WalshKVMetadata(
        seq_lens=torch.tensor([6, 9]),
        slot_mapping=slots,
        block_table=table,
        query_start_loc=torch.tensor([0, 1, 10]),
        query_start_loc_cpu=torch.tensor([0, 1, 10]),
        seq_lens_cpu=torch.tensor([6, 9]),
        num_actual_tokens=10,
        num_decodes=1,
        num_decode_tokens=1,
    )
    out = impl.forward(_Layer(), query, key, value, kv_cache, meta, output=torch.zeros(12, hq * d))
    k_codec, v_codec = impl._codecs(_Layer())
    want = decode_paged(
        query[:1].view(1, hq, d), kv_cache.transpose(1, 2), layout, k_codec, v_codec, table[:1], [6], impl.scale
    )
    torch.testing.assert_close(out[:1].view(1, hq, d), want)
    q1 = query[1:10].view(9, hq, d).transpose(0, 1)[None]
    exact = torch.nn.functional.scaled_dot_product_attention(
        q1, k1.transpose(0, 1)[None], v1.transpose(0, 1)[None], is_causal=True, scale=impl.scale, enable_gqa=True
    )
    torch.testing.assert_close(out[1:10].view(9, hq, d), exact[0].transpose(0, 1), rtol=1e-4, atol=1e-5)
    assert not out[10:].any()
