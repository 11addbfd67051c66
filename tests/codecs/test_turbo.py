"""TurboQuant-class codecs ``tq:B`` and ``tqprod:B``: layouts, distortion, unbiased inner products, edges."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.cache import CompressedCache
from walshkv.codecs import available_codecs, parse_cache_spec, parse_codec
from walshkv.codecs.spec import codec_example
from walshkv.codecs.turbo import TQ_BITS, TQPROD_BITS, TurboQuant, TurboQuantProd
from walshkv.ops.lloyd_max import lloyd_max
from walshkv.ops.packing import unpack_bits

SPECS = ["tq:1", "tq:2", "tq:2.5", "tq:3", "tq:3.5", "tq:4", "tq:8", "tq:3:codebook=beta", "tqprod:1", "tqprod:3"]
SPECS += ["tqprod:3.5", "tqprod:8"]


def _rel_mse(spec: str, x: torch.Tensor) -> float:
    codec = parse_codec(spec)
    x_hat = codec.decode(codec.encode(x))
    return float((x_hat.double() - x.double()).square().sum() / x.double().square().sum())


# --- specs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "canon"),
    [
        ("tq:3", "tq:3"),
        ("TQ:3.0", "tq:3"),
        ("tq:3.50", "tq:3.5"),
        ("tq:2.5:seed=0", "tq:2.5"),
        ("tq:4:seed=7:codebook=BETA", "tq:4:codebook=beta:seed=7"),
        ("tqprod:3", "tqprod:3"),
        ("tqprod:3.0:codebook=gauss", "tqprod:3"),
        ("rrot+tq:3", "rrot+tq:3"),
    ],
)
def test_specs_canonicalise_and_round_trip(raw, canon):
    assert parse_codec(raw).spec == canon
    assert parse_codec(canon).spec == canon


def test_registered_with_examples():
    codecs = available_codecs()
    for name in ("tq", "tqprod"):
        assert name in codecs
        parse_codec(codec_example(name)).check_head_dim(64)
    assert parse_cache_spec("tq:4/tqprod:3").spec == "tq:4/tqprod:3"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("tq", "without a bit width"),
        ("tq:9", "1, 1.5, 2, 2.5"),
        ("tq:0", "1, 1.5, 2, 2.5"),
        ("tq:2.25", "1, 1.5, 2, 2.5"),
        ("tq:abc", "bit width"),
        ("tqprod:1.5", "1, 2, 2.5, 3"),
        ("tqprod:9", "1, 2, 2.5, 3"),
        ("tq:3:foo=1", "unknown option"),
        ("tq:3:seed", "unknown option"),
        ("tq:3:seed=x", "seed must be an integer"),
        ("tq:3:seed=-1", "0 .. 2"),
        ("tq:3:codebook=laplace", "gauss, beta"),
    ],
)
def test_bad_specs_raise_with_the_valid_values(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_codec(spec)


def test_valid_bit_lists():
    assert TQ_BITS[0] == 1 and TQ_BITS[-1] == 8 and 2.5 in TQ_BITS and 3.5 in TQ_BITS
    assert TQPROD_BITS[:3] == (1.0, 2.0, 2.5) and TQPROD_BITS[-1] == 8


# --- layout ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("spec", SPECS)
def test_bits_per_element_is_the_bytes_held(spec, head_dim):
    codec = parse_codec(spec)
    x = torch.randn(2, 3, 5, head_dim)
    packed = codec.encode(x)
    assert packed.nbytes() == codec.bytes_per_vector(head_dim) * 2 * 3 * 5
    assert codec.bits_per_element(head_dim) == 8 * packed.nbytes() / x.numel()
    for name, f in codec.layout(head_dim).items():
        assert packed.tensors[name].shape == (2, 3, 5, *f.shape) and packed.tensors[name].dtype == f.dtype
    assert set(packed.tensors) == set(codec.layout(head_dim))


def test_layouts_at_head_dim_64():
    # integer widths: codes + fp16 norm
    assert parse_codec("tq:3").bytes_per_vector(64) == 24 + 2
    assert parse_codec("tq:3").bits_per_element(64) == 3.25
    # half widths: 32 coordinates at 3 bits + 32 at 2 bits + the norm
    assert {k: f.shape for k, f in parse_codec("tq:2.5").layout(64).items()} == {
        "codes_hi": (12,),
        "codes_lo": (8,),
        "norm": (1,),
    }
    # tqprod:3 = tq:2 (16 + 2 bytes) + 64 sign bits (8 bytes) + fp16 residual norm
    layout = parse_codec("tqprod:3").layout(64)
    assert {k: f.shape for k, f in layout.items()} == {
        "mse_codes": (16,),
        "mse_norm": (1,),
        "qjl_signs": (8,),
        "qjl_norm": (1,),
    }
    assert parse_codec("tqprod:3").bits_per_element(64) == 3.5
    assert set(parse_codec("tqprod:1").layout(64)) == {"qjl_signs", "qjl_norm"}


def test_codes_are_the_nearest_lloyd_max_levels():
    codec = TurboQuant(3)
    x = torch.randn(1, 1, 7, 32)
    packed = codec.encode(x)
    norm = packed.tensors["norm"].float()
    t = codec.rotate(x) / (norm / math.sqrt(32))
    levels = lloyd_max(3).levels.float()
    nearest = (t.unsqueeze(-1) - levels).abs().argmin(-1)
    assert torch.equal(unpack_bits(packed.tensors["codes"], 3, 32).long(), nearest)
    # decode is exactly levels * norm / sqrt(d), rotated back
    want = codec.unrotate(levels[nearest] * norm / math.sqrt(32))
    assert torch.allclose(codec.decode(packed), want, atol=1e-5)


# --- distortion --------------------------------------------------------------------------------------


def test_tq4_mse_on_gaussian_vectors_is_the_lloyd_max_value():
    x = torch.randn(1, 4, 1000, 128)
    assert _rel_mse("tq:4", x) == pytest.approx(0.009497, rel=0.25)


def test_distortion_falls_with_bits_and_half_widths_sit_between():
    x = torch.randn(1, 2, 500, 64)
    mse = {b: _rel_mse(f"tq:{b:g}", x) for b in (1, 2, 2.5, 3, 3.5, 4)}
    assert mse[1] > mse[2] > mse[2.5] > mse[3] > mse[3.5] > mse[4]
    for b in (1, 2, 3):
        assert mse[b] == pytest.approx(lloyd_max(b).mse, rel=0.25)
    beta = _rel_mse("tq:3:codebook=beta", x)
    assert beta == pytest.approx(mse[3], rel=0.1)


def test_rotation_makes_tq_indifferent_to_outlier_channels():
    x = torch.randn(1, 2, 400, 64)
    x[..., 5] *= 30.0  # one huge channel, as K has after RoPE
    assert _rel_mse("tq:3", x) == pytest.approx(lloyd_max(3).mse, rel=0.3)
    assert _rel_mse("tq:3", x) < _rel_mse("int3", x)


def test_tqprod_mse_is_pi_over_2_times_its_mse_stage():
    # E||r_hat - r||^2 = (pi/2 - 1/d) ||r||^2 for the QJL estimate with the sqrt(pi/2)/d constant
    d = 64
    x = torch.randn(1, 4, 500, d)
    stage = _rel_mse("tq:2", x)
    assert _rel_mse("tqprod:3", x) == pytest.approx((math.pi / 2 - 1 / d) * stage, rel=0.08)
    assert _rel_mse("tqprod:1", x) == pytest.approx(math.pi / 2 - 1 / d, rel=0.08)


# --- unbiased inner products ---------------------------------------------------------------------------


def _ip_bias(spec: str, x: torch.Tensor, q: torch.Tensor, seeds: range) -> tuple[float, float]:
    """Mean and standard error over seeds and vectors of (<q, x_hat> - <q, x>) / (|q| |x|)."""
    errs = []
    for seed in seeds:
        codec = parse_codec(f"{spec}:seed={seed}")
        x_hat = codec.decode(codec.encode(x)).double()
        errs.append(((q * (x_hat - x)).sum(-1) / (q.norm(dim=-1) * x.norm(dim=-1))).flatten())
    e = torch.cat(errs)
    return float(e.mean()), float(e.std() / math.sqrt(e.numel()))


def test_tqprod_inner_products_are_unbiased_and_tq_shrinks():
    gen = torch.Generator().manual_seed(5)
    d = 64
    x = torch.randn(1, 2, 64, d, generator=gen, dtype=torch.float64)
    # queries aligned with the keys (as attention's are), where an MSE quantizer's shrinkage shows most
    q = x + 0.5 * torch.randn(x.shape, generator=gen, dtype=torch.float64)
    mean, se = _ip_bias("tqprod:3", x, q, range(20))
    assert abs(mean) < 4 * se + 1e-3, (mean, se)
    mean, se = _ip_bias("tqprod:1", x, q, range(20))
    assert abs(mean) < 4 * se + 2e-3, (mean, se)
    shrink, se_tq = _ip_bias("tq:2", x, q, range(5))
    assert shrink < -0.05 and abs(shrink) > 20 * se_tq  # biased towards zero by about the MSE


def test_seeds_change_the_random_parts_only():
    x = torch.randn(1, 1, 4, 32)
    a, b = TurboQuantProd(3, seed=1), TurboQuantProd(3, seed=1)
    assert all(torch.equal(a.encode(x).tensors[k], b.encode(x).tensors[k]) for k in a.layout(32))
    c = TurboQuantProd(3, seed=2)
    assert not torch.equal(a.encode(x).tensors["qjl_signs"], c.encode(x).tensors["qjl_signs"])
    assert not torch.equal(a.projection(32), c.projection(32))


# --- edges -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["tq:3", "tq:2.5", "tqprod:3", "tqprod:1", "tq:1:codebook=beta"])
def test_zero_vectors_decode_to_zeros(spec):
    codec = parse_codec(spec)
    x = torch.randn(1, 2, 3, 16)
    x[0, 1, 1] = 0.0
    out = codec.decode(codec.encode(x))
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, 1, 1], torch.zeros(16))
    z = codec.decode(codec.encode(torch.zeros(1, 1, 2, 16)))
    assert torch.equal(z, torch.zeros(1, 1, 2, 16))


@pytest.mark.parametrize("spec", ["tq:3", "tqprod:3", "tqprod:1"])
def test_norm_beyond_fp16_raises(spec):
    x = torch.full((1, 1, 2, 64), 9000.0)  # every value fits fp16, the norm (72000) does not
    with pytest.raises(ValueError, match=r"fp16.*65504"):
        parse_codec(spec).encode(x)


def test_head_dim_must_be_a_power_of_two():
    for spec in ("tq:3", "tqprod:3", "tq:2.5"):
        with pytest.raises(ValueError, match="power-of-two"):
            parse_codec(spec).encode(torch.randn(1, 1, 2, 48))
    with pytest.raises(ValueError, match="two halves"):
        parse_codec("tq:2.5").check_head_dim(1)


def test_non_finite_input_is_refused():
    x = torch.randn(1, 1, 2, 16)
    x[0, 0, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        parse_codec("tq:3").encode(x)


def test_dtypes_round_trip():
    x = torch.randn(1, 1, 3, 32)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        codec = parse_codec("tqprod:3")
        assert codec.decode(codec.encode(x.to(dtype))).dtype == dtype


def test_in_a_compressed_cache(tiny_llama):
    ids = torch.randint(3, 96, (2, 9))
    for spec in ("tq:3", "tq:2.5/tqprod:3"):
        cache = CompressedCache(spec, config=tiny_llama.config)
        with torch.inference_mode():
            out = tiny_llama(ids, cache=cache).logits
        assert torch.isfinite(out).all()
        assert cache.nbytes() == cache.layout_nbytes() > 0
        cs = parse_cache_spec(spec)
        assert cache.bits_per_element() == pytest.approx((cs.k.bits_per_element(16) + cs.v.bits_per_element(16)) / 2)


@pytest.mark.parametrize("spec", ["tq:3", "tcq:3"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_norm_past_fp16_names_a_float_codec_not_a_wider_input(spec, dtype):
    """The norm is fp16 in every input dtype: the error says so and names a float codec, not a float32 input."""
    x = torch.full((1, 1, 4, 64), 60000.0, dtype=dtype)  # finite, but the L2 norm is 4.8e5
    with pytest.raises(ValueError, match="whatever the input's dtype") as info:
        parse_codec(spec).encode(x)
    assert "spec fp32 or bf16" in str(info.value) and "480000" in str(info.value)
