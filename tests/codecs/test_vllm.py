"""vLLM's and LMCache's own caches as codecs (``walshkv.codecs.vllm``): layouts, grammar, refusals, the peer specs,
and LMCache's serdes (LMCache is installed by README's test command; its TurboQuant kernels need CUDA, so its
rotations, levels, layer ranges and sizes are compared here, and its fp8 serde's bytes).

The byte-for-byte comparison with vLLM's kernels runs in vLLM's environment (plugins/vllm/tests_vllm/
test_vllm_peers.py); these tests hold what walshkv promises without vLLM installed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from walshkv.codecs import parse_cache_spec, parse_codec
from walshkv.codecs.spec import LayeredCacheSpec
from walshkv.codecs.vllm import (
    VLLM_PEERS,
    LmcacheTurboKey,
    VllmTurboKey,
    lmcache_signs,
    vllm_centroids,
    vllm_peer_spec,
)
from walshkv.ops.lloyd_max import lloyd_max


@pytest.mark.parametrize(
    ("spec", "bytes_64"),
    [
        ("vllm-tq:3:nc", 24 + 2),
        ("vllm-tq:4", 32 + 2),
        ("vllm-uq:3", 24 + 4),
        ("vllm-uq:4", 32 + 4),
        ("vllm-fp8", 64),
        ("vllm-int4", 32 + 4),
    ],
)
def test_layout_is_vllms_slot(spec: str, bytes_64: int) -> None:
    """The bytes per vector are vLLM's ``key_packed_size`` / ``value_packed_size`` (and int4's codes + fp32 scale)."""
    codec = parse_codec(spec)
    assert codec.bytes_per_vector(64) == bytes_64
    packed = codec.encode(torch.randn(1, 2, 5, 64))
    assert packed.nbytes() == 2 * 5 * bytes_64


def test_peer_bits_count_the_boundary_layers() -> None:
    """vllm:turboquant_k3v4_nc on a 30-layer model: 26 layers at (3.25 + 4.5) / 2 bits, 4 at bf16's 16."""
    spec = parse_cache_spec("vllm:turboquant_k3v4_nc")
    assert isinstance(spec, LayeredCacheSpec)
    assert spec.bits_per_element(64, 30) == pytest.approx((26 * (3.25 + 4.5) / 2 + 4 * 16) / 30)
    resolved = spec.resolve(30)
    assert resolved.spec == "layers:bf16@0-1,28-29;vllm-tq:3:nc/vllm-uq:4"
    assert [resolved.for_layer(i).k.spec for i in (0, 1, 2, 27, 28, 29)] == [
        "bf16",
        "bf16",
        *["vllm-tq:3:nc"] * 2,
        "bf16",
        "bf16",
    ]
    assert parse_cache_spec("vllm:int4_per_token_head").spec == "vllm-int4"
    assert set(VLLM_PEERS) == {
        "vllm:turboquant_k8v4",
        "vllm:turboquant_4bit_nc",
        "vllm:turboquant_k3v4_nc",
        "vllm:turboquant_3bit_nc",
        "vllm:int4_per_token_head",
    }


def test_unknown_peer_and_bad_arguments_name_the_choices() -> None:
    with pytest.raises(ValueError, match=r"turboquant_k3v4_nc.*int4_per_token_head"):
        vllm_peer_spec("vllm:turboquant_2bit")
    with pytest.raises(ValueError, match="unknown vLLM cache"):
        parse_cache_spec("vllm:fp8_e5m2")
    for bad in ("vllm-tq:5", "vllm-tq:3:nd", "vllm-tq", "vllm-uq:2", "vllm-fp8:1", "vllm-int4:4"):
        with pytest.raises(ValueError):
            parse_codec(bad)


@pytest.mark.parametrize("bits", [3, 4])
def test_centroids_near_the_gaussian_lloyd_max(bits: int) -> None:
    """vLLM's trapezoid solver lands within 1e-3 (relative) of walshkv's exact Gaussian Lloyd-Max table."""
    ours, mid = vllm_centroids(64, bits)
    exact = lloyd_max(bits).levels.float() / 8  # N(0, 1/64): sigma 1/8
    assert torch.allclose(ours, exact, rtol=1e-3, atol=1e-5)
    assert torch.equal(ours, -ours.flip(0))
    assert torch.all(mid[1:] > mid[:-1])


def test_norm_correction_decodes_the_norm() -> None:
    """With ``:nc`` the decoded vector's norm is the stored fp16 norm; without it, the centroids' own."""
    x = torch.randn(1, 1, 50, 64)
    nc, plain = VllmTurboKey(3, True), VllmTurboKey(3)
    norm16 = x.norm(dim=-1).half().float()
    assert torch.allclose(nc.decode(nc.encode(x)).norm(dim=-1), norm16, rtol=1e-5)
    assert not torch.allclose(plain.decode(plain.encode(x)).norm(dim=-1), norm16, rtol=1e-3)


def test_fp8_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -1000.0, 1.99, 0.0, 17.0]).reshape(1, 1, 1, 5)
    out = parse_codec("vllm-fp8").decode(parse_codec("vllm-fp8").encode(x)).flatten().tolist()
    assert out == [448.0, -448.0, 2.0, 0.0, 16.0]


def test_int4_zero_point_and_its_clamp() -> None:
    """The scale's low mantissa bits hold the zero point and are masked off when read, as vLLM's attention kernel
    does; a vector decodes to within int4's error. As in vLLM, the zero point is clamped to 0..15, so a vector whose
    transformed coordinates all share one sign (here a basis vector: all +1 after the transform) loses its values."""
    codec = parse_codec("vllm-int4")
    x = torch.randn(1, 2, 40, 64)
    packed = codec.encode(x)
    bits = packed.tensors["scale"].view(torch.int32)
    assert bool(((bits & 0xF) <= 15).all()) and bool(((bits & 0xF) > 0).any())
    y = codec.decode(packed)
    assert float((y - x).norm() / x.norm()) < 0.1
    basis = torch.zeros(1, 1, 1, 64)
    basis[..., 0] = 1.0
    assert float(codec.decode(codec.encode(basis)).abs().max()) < 1e-3
    with pytest.raises(ValueError, match=r"passes 65504, the maximum of torch\.float16"):
        codec.encode(torch.full((1, 1, 1, 64), 60000.0, dtype=torch.float16))


def test_negative_layer_indices() -> None:
    """``layers:`` counts from the end with negative indices; a cache resolves them with the model's depth."""
    spec = parse_cache_spec("layers:int8@0,-1;int4")
    assert isinstance(spec, LayeredCacheSpec)
    assert spec.counts_from_end
    assert parse_cache_spec(spec.spec).spec == spec.spec == "layers:int8@0,-1;int4"
    assert spec.resolve(4).spec == "layers:int8@0,3;int4"
    with pytest.raises(ValueError, match="resolve it for the model first"):
        spec.bind(0)
    with pytest.raises(ValueError, match="two specs"):
        parse_cache_spec("layers:int8@0;int6@-2;int4").resolve(2)
    with pytest.raises(ValueError, match="names layer -5"):
        spec_5 = parse_cache_spec("layers:int8@-5;int4")
        assert isinstance(spec_5, LayeredCacheSpec)
        spec_5.resolve(4)
    for bad in ("layers:int8@-0;int4", "layers:int8@-2-1;int4", "layers:int8@-99999999999;int4"):
        with pytest.raises(ValueError):
            parse_cache_spec(bad)


def test_cache_without_config_refuses_layers_from_the_end() -> None:
    from walshkv.cache import CompressedCache

    with pytest.raises(ValueError, match=r"config=model\.config"):
        CompressedCache("vllm:turboquant_k3v4_nc")


@pytest.mark.parametrize("layer", [0, 2, 17, 27])
@pytest.mark.parametrize("preset", ["turboquant_4bit_nc", "turboquant_k3v4_nc"])
def test_lmcache_turboquant_rotation_levels_and_layers(layer: int, preset: str) -> None:
    """``lmcache-tq`` rotates by LMCache's own per-layer ``PiT`` with its levels, skips its layers, and its layout is
    LMCache's slot (codes and norm; values as vLLM's)."""
    from lmcache.v1.distributed.serde.turboquant.turboquant import (
        TurboQuantSerdeConfig,
        _generate_wht_signs,
        _layer_ranges,
        _make_tq_tensors_for_layer,
    )

    d = 64
    cfg = TurboQuantSerdeConfig(preset=preset, head_dim=d)
    pi_t, midpoints, centroids = _make_tq_tensors_for_layer(cfg, layer, torch.device("cpu"))
    spec = parse_cache_spec(f"lmcache:{preset}")
    assert isinstance(spec, LayeredCacheSpec)
    key = spec.default.k.bind(layer, "k")
    assert isinstance(key, LmcacheTurboKey)
    assert torch.allclose(key._rotate(torch.eye(d)), pi_t, atol=1e-7)
    assert torch.allclose(key._unrotate(key._rotate(torch.eye(d))), torch.eye(d), atol=1e-6)
    assert torch.equal(vllm_centroids(d, key.bits)[0], centroids)
    assert torch.equal(key._midpoints(d), midpoints)
    start, end = _layer_ranges(30, cfg)
    resolved = spec.resolve(30)
    assert [i for i in range(30) if resolved.for_layer(i).k.spec != "bf16"] == list(range(start, end))
    assert key.bytes_per_vector(d) == cfg.key_packed_size
    assert spec.default.v.bytes_per_vector(d) == cfg.value_packed_size
    assert torch.equal(lmcache_signs(d, layer), _generate_wht_signs(d, 42 + 1337 * layer, torch.device("cpu")))


def test_lmcache_fp8_serde_bytes() -> None:
    """LMCache's fp8 serde, run on a K/V chunk, stores the bytes of walshkv's ``vllm-fp8`` (a saturating e4m3 cast)."""
    from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationSerializer

    chunk = torch.randn(2, 3, 16, 2 * 64) * 40  # [K/V, layers, tokens, kv_heads * head_dim], values past 448 too
    dst = torch.zeros(chunk.numel(), dtype=torch.uint8)
    n = Fp8QuantizationSerializer().serialize(SimpleNamespace(tensor=chunk), SimpleNamespace(tensor=dst), None)
    assert n == chunk.numel()
    x = chunk.reshape(2, 3, 16, 2, 64).permute(0, 1, 3, 2, 4).reshape(6, 2, 16, 64)  # [K/V x layer, heads, tokens, d]
    ours = parse_codec("vllm-fp8").encode(x).tensors["values"]
    theirs = dst.reshape(2, 3, 16, 2, 64).permute(0, 1, 3, 2, 4).reshape(6, 2, 16, 64)
    assert torch.equal(ours, theirs)
    assert parse_cache_spec("lmcache:fp8").spec == "vllm-fp8"
    with pytest.raises(ValueError, match="unknown LMCache serde"):
        parse_cache_spec("lmcache:cachegen")
