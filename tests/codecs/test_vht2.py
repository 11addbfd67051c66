"""Tests for walshkv.codecs.vht2: banded Walsh-Hadamard (vht2), vzc and sqfree:B."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.codecs.spec import CacheSpec, available_codecs, codec_example, parse_cache_spec, parse_codec
from walshkv.codecs.vht2 import Band, SqfreeCodec, VHT2Codec, VZCCodec, allocate_bits, equal_bands
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.numtheory import squarefree_indices
from walshkv.ops.orders import coefficient_order, variance_order


def _from_wht(y: torch.Tensor) -> torch.Tensor:
    """The vector whose (orthonormal, self-inverse) WHT is ``y``, as a [1, 1, 1, d] float64 block."""
    return hadamard_transform(y.to(torch.float64)).reshape(1, 1, 1, -1)


def _roundtrip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x))


def _rel_mse(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float(((x - x_hat) ** 2).sum() / (x**2).sum())


def _cost_bits(bands: tuple[Band, ...]) -> int:
    """Bits a set of bands takes per vector: packed codes plus one fp16 scale each."""
    return sum(8 * b.nbytes + 16 for b in bands)


class FakeStats:
    """Stands in for KVStats: a fixed WHT-basis variance per (kind, layer), [kv_heads, head_dim]."""

    def __init__(self, variance: dict[tuple[str, int], torch.Tensor]) -> None:
        self._variance = variance

    def variance(self, kind: str, layer: int, basis: str = "wht") -> torch.Tensor:
        assert basis == "wht"
        return self._variance[(kind, layer)]


# ---- known bytes ---------------------------------------------------------------------------------


def test_known_vector_encodes_to_known_bytes() -> None:
    """head_dim 8, vht2:4,2 natural: band 0 = y[0:4] at 4 bits, band 1 = y[4:8] at 2 bits.

    Band 0: absmax 7 -> scale 7/7 = 1.0, codes y + 7 = [14, 4, 7, 12] -> bytes 0x4E, 0xC7 (low nibble first).
    Band 1: absmax 2 -> scale 2/1 = 2.0, codes round(y/2) + 1 = [2, 0, 1, 2] -> 2 | 0<<2 | 1<<4 | 2<<6 = 0x92.
    """
    y = torch.tensor([7.0, -3.0, 0.0, 5.0, 2.0, -2.0, 0.0, 1.5])
    codec = parse_codec("vht2:4,2")
    packed = codec.encode(_from_wht(y))
    assert set(packed.tensors) == {"codes", "scale"}
    codes, scale = packed.tensors["codes"], packed.tensors["scale"]
    assert codes.dtype == torch.uint8 and codes.shape == (1, 1, 1, 3)
    assert codes.flatten().tolist() == [0x4E, 0xC7, 0x92]
    assert scale.dtype == torch.float16 and scale.shape == (1, 1, 1, 2)
    assert scale.flatten().tolist() == [1.0, 2.0]
    assert packed.nbytes() == 3 + 4 == codec.bytes_per_vector(8)
    decoded = codec.decode(packed)
    assert decoded.dtype == torch.float64
    torch.testing.assert_close(
        hadamard_transform(decoded).flatten(),
        torch.tensor([7.0, -3.0, 0.0, 5.0, 2.0, -2.0, 0.0, 2.0], dtype=torch.float64),
        rtol=0,
        atol=1e-5,
    )


def test_known_vector_sequency_order() -> None:
    """The same codes as above, but the coefficients are first taken in sequency order."""
    perm = coefficient_order("sequency", 8)
    y_ordered = torch.tensor([7.0, -3.0, 0.0, 5.0, 2.0, -2.0, 0.0, 1.5])
    y = torch.zeros(8)
    y[perm] = y_ordered
    packed = parse_codec("vht2:4,2:order=sequency").encode(_from_wht(y))
    assert packed.tensors["codes"].flatten().tolist() == [0x4E, 0xC7, 0x92]
    assert packed.tensors["scale"].flatten().tolist() == [1.0, 2.0]


def test_single_band_natural_equals_rot_int() -> None:
    """vht2:B with one band in natural order is exactly WHT + one-scale RTN, i.e. rot+intB."""
    x = torch.randn(2, 2, 5, 64)
    for bits in (3, 4, 8):
        a, b = parse_codec(f"vht2:{bits}"), parse_codec(f"rot+int{bits}")
        pa, pb = a.encode(x), b.encode(x)
        assert torch.equal(pa.tensors["codes"], pb.tensors["codes"])
        assert torch.equal(pa.tensors["scale"], pb.tensors["scale"])
        torch.testing.assert_close(a.decode(pa), b.decode(pb), rtol=0, atol=1e-6)


# ---- sizes ---------------------------------------------------------------------------------------


def test_bits_per_element_equals_bytes_held_head_dim_64() -> None:
    codec = parse_codec("vht2:5,5,4,3")
    assert [(b.size, b.bits) for b in codec.bands(64)] == [(16, 5), (16, 5), (16, 4), (16, 3)]
    assert codec.bytes_per_vector(64) == 10 + 10 + 8 + 6 + 8 == 42
    assert codec.bits_per_element(64) == 336 / 64 == 5.25
    x = torch.randn(2, 3, 5, 64)
    packed = codec.encode(x)
    assert packed.tensors["codes"].shape == (2, 3, 5, 34)
    assert packed.tensors["scale"].shape == (2, 3, 5, 4)
    assert packed.nbytes() == 2 * 3 * 5 * 42


def test_bits_per_element_head_dim_128() -> None:
    codec = parse_codec("vht2:5,5,4,3")
    assert codec.bytes_per_vector(128) == (20 + 20 + 16 + 12) + 8 == 76
    assert codec.bits_per_element(128) == 4.75
    assert codec.encode(torch.randn(1, 2, 3, 128)).nbytes() == 6 * 76


def test_flat_v_is_one_band() -> None:
    codec = parse_codec("vht2:3")
    assert codec.bands(64) == (Band(64, 3),)
    assert codec.bytes_per_vector(64) == 24 + 2
    assert codec.bits_per_element(64) == 3.25


def test_band_remainder_goes_to_the_last_band() -> None:
    codec = parse_codec("vht2:4,4,3")
    assert [b.size for b in codec.bands(64)] == [21, 21, 22]
    assert codec.bytes_per_vector(64) == 11 + 11 + 9 + 6
    assert codec.encode(torch.randn(1, 1, 4, 64)).nbytes() == 4 * 37
    assert equal_bands((2, 2, 2), 3) == (Band(1, 2), Band(1, 2), Band(1, 2))


def test_skeleton_keeps_sk_coefficients() -> None:
    codec = parse_codec("vht2:4:sk=32")
    assert codec.bands(64) == (Band(32, 4),)
    assert codec.bytes_per_vector(64) == 16 + 2
    assert codec.bits_per_element(64) == 18 * 8 / 64
    x = torch.randn(2, 2, 6, 64)
    packed = codec.encode(x)
    assert packed.nbytes() == 24 * 18
    y = hadamard_transform(codec.decode(packed))
    assert y[..., 32:].abs().max() < 1e-5
    assert y[..., :32].abs().max() > 0.1


@pytest.mark.parametrize("order", ["sequency", "squarefree", "squarefree-dc"])
def test_skeleton_drops_the_tail_of_the_chosen_order(order: str) -> None:
    codec = parse_codec(f"vht2:5,3:order={order}:sk=20")
    assert [b.size for b in codec.bands(64)] == [10, 10]
    x = torch.randn(1, 2, 8, 64)
    y = hadamard_transform(_roundtrip(codec, x))
    perm = coefficient_order(order, 64)
    assert y[..., perm[20:]].abs().max() < 1e-5
    # the kept coefficients are quantized versions of the originals
    y_true = hadamard_transform(x)[..., perm[:20]]
    assert (y[..., perm[:20]] - y_true).abs().max() < 0.5 * y_true.abs().max()


def test_multiband_skeleton_sizes() -> None:
    codec = parse_codec("vht2:5,5,4,3:sk=32")
    assert [b.size for b in codec.bands(64)] == [8, 8, 8, 8]
    assert codec.bytes_per_vector(64) == 5 + 5 + 4 + 3 + 8


# ---- quality -------------------------------------------------------------------------------------


def test_roundtrip_error_decreases_with_bits() -> None:
    x = torch.randn(2, 4, 32, 64)
    err = {b: _rel_mse(x, _roundtrip(parse_codec(f"vht2:{b}"), x)) for b in (3, 5, 8)}
    assert err[8] < err[5] < err[3]
    assert err[8] < 1e-3
    banded = _rel_mse(x, _roundtrip(parse_codec("vht2:5,5,4,3"), x))
    assert err[5] < banded < err[3]


@pytest.mark.parametrize("order", ["natural", "sequency", "squarefree", "squarefree-dc"])
def test_every_order_roundtrips(order: str) -> None:
    x = torch.randn(1, 2, 16, 128)
    out = _roundtrip(parse_codec(f"vht2:8,8:order={order}"), x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert _rel_mse(x, out) < 1e-3


def test_dtype_is_kept() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        x = torch.randn(1, 1, 3, 32).to(dtype)
        assert _roundtrip(parse_codec("vht2:5,3"), x).dtype == dtype


def test_one_bit_band_decodes_as_sign_times_mean_abs() -> None:
    x = torch.randn(2, 2, 7, 64)
    codec = parse_codec("vht2:1")
    assert codec.bytes_per_vector(64) == 8 + 2
    packed = codec.encode(x)
    y = hadamard_transform(x)
    scale = y.abs().mean(dim=-1, keepdim=True).to(torch.float16)
    assert torch.equal(packed.tensors["scale"], scale)
    expected = torch.where(y >= 0, 1.0, -1.0) * scale.float()
    torch.testing.assert_close(hadamard_transform(codec.decode(packed)), expected, rtol=0, atol=1e-5)


def test_one_bit_band_next_to_a_wider_band() -> None:
    x = torch.randn(1, 2, 4, 16)
    codec = parse_codec("vht2:8,1")
    y = hadamard_transform(x)
    out = hadamard_transform(_roundtrip(codec, x))
    tail_scale = y[..., 8:].abs().mean(dim=-1, keepdim=True).to(torch.float16).float()
    torch.testing.assert_close(out[..., 8:], torch.sign(y[..., 8:]) * tail_scale, rtol=0, atol=1e-5)
    assert (out[..., :8] - y[..., :8]).abs().max() < 0.01 * y.abs().max()


def test_zero_vectors_decode_to_zero() -> None:
    for spec in ("vht2:5,5,4,3", "vht2:1", "vzc", "sqfree:4"):
        out = _roundtrip(parse_codec(spec), torch.zeros(1, 1, 2, 64))
        assert torch.equal(out, torch.zeros_like(out)), spec


# ---- bad specs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("vht2:9", "1..8"),
        ("vht2:0,4", "1..8"),
        ("vht2:4:foo=1", "unknown vht2 option 'foo=1'"),
        ("vht2:4:order", "unknown vht2 option"),
        ("vht2:4.5,3", "must be integers"),
        ("vht2:4,x", "must be integers"),
        ("vht2:4,,3", "must be integers"),
        ("vht2:", "needs band widths"),
        ("vht2", "needs band widths"),
        ("vht2:4:order=zigzag", "unknown vht2 order 'zigzag'"),
        ("vht2:4:sk=abc", "sk takes an integer"),
        ("vht2:4:sk=0", "sk"),
        ("vht2:auto@x", "takes a number"),
        ("vht2:auto@0.25", "between 0.5 and 16"),
        ("vht2:auto@17", "between 0.5 and 16"),
        ("vht2:auto@4:sk=8", "takes no options"),
    ],
)
def test_bad_specs_are_refused(spec: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_codec(spec)


def test_unknown_order_lists_the_valid_orders() -> None:
    with pytest.raises(ValueError, match="natural, sequency, squarefree, squarefree-dc, variance"):
        parse_codec("vht2:4:order=zigzag")


def test_more_bands_than_kept_coefficients() -> None:
    codec = parse_codec("vht2:4,4,4:sk=2")
    with pytest.raises(ValueError, match="3 bands need at least 3 kept coefficients"):
        codec.check_head_dim(64)
    with pytest.raises(ValueError, match="3 bands"):
        codec.encode(torch.randn(1, 1, 1, 64))
    with pytest.raises(ValueError, match="3 bands"):
        parse_codec("vht2:4,4,4").encode(torch.randn(1, 1, 1, 2))


def test_sk_larger_than_head_dim() -> None:
    codec = parse_codec("vht2:4:sk=128")
    codec.check_head_dim(128)
    with pytest.raises(ValueError, match="sk=128 exceeds head_dim 64"):
        codec.encode(torch.randn(1, 1, 1, 64))


@pytest.mark.parametrize("spec", ["vht2:5,5,4,3", "vht2:4:order=sequency", "vzc", "sqfree:4"])
@pytest.mark.parametrize("head_dim", [48, 96, 100])
def test_non_power_of_two_head_dim_is_refused(spec: str, head_dim: int) -> None:
    codec = parse_codec(spec)
    with pytest.raises(ValueError, match="power-of-two"):
        codec.check_head_dim(head_dim)
    with pytest.raises(ValueError, match="power-of-two"):
        codec.encode(torch.randn(1, 1, 2, head_dim))


def test_bad_input_is_refused() -> None:
    codec = parse_codec("vht2:4")
    x = torch.randn(1, 1, 2, 16)
    x[0, 0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(x)
    with pytest.raises(ValueError, match="shape"):
        codec.encode(torch.randn(2, 16))


# ---- parsing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "spec",
    [
        "vht2:3",
        "vht2:5,5,4,3",
        "vht2:5,5,4,3:order=squarefree",
        "vht2:5,5,4,3:order=squarefree:sk=32",
        "vht2:4:order=sequency",
        "vht2:4:order=squarefree-dc:sk=8",
        "vht2:4:sk=8",
        "vht2:4,3:order=variance",
        "vht2:auto@4",
        "vht2:auto@5.25",
        "vzc",
        "sqfree:4",
    ],
)
def test_canonical_specs_round_trip(spec: str) -> None:
    codec = parse_codec(spec)
    assert codec.spec == spec
    assert parse_codec(codec.spec).spec == spec


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("vht2:4:order=natural", "vht2:4"),
        ("vht2:4:sk=08:order=sequency", "vht2:4:order=sequency:sk=8"),
        ("VHT2:5,3", "vht2:5,3"),
        ("vht2:auto@4.0", "vht2:auto@4"),
        ("sqfree:04", "sqfree:4"),
    ],
)
def test_specs_are_canonicalised(text: str, canonical: str) -> None:
    assert parse_codec(text).spec == canonical


def test_parsed_fields() -> None:
    codec = parse_codec("vht2:5,5,4,3:order=squarefree:sk=32")
    assert isinstance(codec, VHT2Codec)
    assert codec.widths == (5, 5, 4, 3)
    assert codec.order == "squarefree"
    assert codec.sk == 32
    assert not codec.needs_calibration
    assert codec.bind(0, "k") is codec


def test_k_v_pair_spec() -> None:
    cache = parse_cache_spec("vht2:5,5,4,3:order=squarefree/vht2:3")
    assert cache.k.spec == "vht2:5,5,4,3:order=squarefree"
    assert cache.v.spec == "vht2:3"
    assert cache.spec == "vht2:5,5,4,3:order=squarefree/vht2:3"
    assert cache.bits_per_element(64) == (5.25 + 3.25) / 2
    assert not cache.needs_calibration
    assert cache.bind(3) is cache


def test_registered_and_examples_parse() -> None:
    codecs = available_codecs()
    for name in ("vht2", "vzc", "sqfree"):
        assert name in codecs
        parse_codec(codec_example(name)).check_head_dim(64)
    assert "order=" in codecs["vht2"] and "auto@BITS" in codecs["vht2"]


# ---- variance order and auto@BITS (calibrated) ---------------------------------------------------


def test_variance_order_needs_calibration() -> None:
    codec = parse_codec("vht2:5,3:order=variance")
    assert codec.needs_calibration
    with pytest.raises(ValueError, match="--calib-text"):
        codec.bind(0, "k")
    with pytest.raises(ValueError, match="--calib-text"):
        codec.encode(torch.randn(1, 1, 1, 16))
    with pytest.raises(ValueError, match="--calib-text"):
        CacheSpec(codec, parse_codec("vht2:3")).bind(0)


def test_variance_order_binds_per_layer() -> None:
    d = 16
    var_k0 = torch.stack([torch.arange(d, dtype=torch.float64), torch.arange(d, dtype=torch.float64)])  # rising
    var_k1 = torch.stack([torch.arange(d, 0, -1, dtype=torch.float64), torch.ones(d, dtype=torch.float64)])
    stats = FakeStats({("k", 0): var_k0, ("k", 1): var_k1})
    codec = parse_codec("vht2:8,2:order=variance:sk=8")
    b0, b1 = codec.bind(0, "k", stats), codec.bind(1, "k", stats)
    assert b0 is not codec and b1 is not codec
    assert not b0.needs_calibration and b0.bind(0, "k", stats) is b0
    assert b0.spec == "vht2:8,2:order=variance:sk=8[k0]" and b1.spec.endswith("[k1]")
    assert codec.spec == "vht2:8,2:order=variance:sk=8"  # the unbound codec is unchanged
    assert b0.perm(d).tolist() == list(range(d - 1, -1, -1))
    assert torch.equal(b1.perm(d), variance_order(var_k1.mean(dim=0)))
    assert b0.bytes_per_vector(d) == 4 + 1 + 4
    # decoding keeps the 8 highest-variance coefficients only: natural indices 15..8 for layer 0
    x = torch.randn(1, 2, 5, d)
    y = hadamard_transform(_roundtrip(b0, x))
    assert y[..., :8].abs().max() < 1e-5
    assert y[..., 8:].abs().max() > 0.1
    with pytest.raises(ValueError, match="calibrated for head_dim 16"):
        b0.check_head_dim(32)


def test_auto_needs_calibration() -> None:
    codec = parse_codec("vht2:auto@4")
    assert isinstance(codec, VHT2Codec)
    assert codec.needs_calibration and codec.order == "variance"
    with pytest.raises(ValueError, match="--calib-text"):
        codec.bind(0, "k")
    with pytest.raises(ValueError, match="--calib-text"):
        parse_cache_spec("vht2:auto@4/vht2:3").bind(0)
    with pytest.raises(ValueError, match="bind"):
        codec.bands(64)
    with pytest.raises(ValueError, match="bind"):
        codec.bits_per_element(64)


def test_auto_binds_to_a_budgeted_layout() -> None:
    d = 64
    profile = 2.0 ** (-torch.arange(d, dtype=torch.float64) / 4)
    shuffled = torch.randperm(d)
    var = torch.empty(d, dtype=torch.float64)
    var[shuffled] = profile  # coefficient shuffled[j] has the j-th largest variance
    stats = FakeStats({("v", 2): torch.stack([var, var])})
    bound = parse_codec("vht2:auto@4").bind(2, "v", stats)
    assert bound.spec == "vht2:auto@4[v2]"
    assert torch.equal(bound.perm(d), shuffled)
    bands = bound.bands(d)
    assert bands == allocate_bits(profile, 4)
    assert bound.bits_per_element(d) <= 4
    assert bound.bytes_per_vector(d) * 8 == _cost_bits(bands)
    x = torch.randn(1, 2, 8, d) * var.sqrt().float()
    packed = bound.encode(hadamard_transform(x))
    assert packed.nbytes() == 16 * bound.bytes_per_vector(d)
    out = bound.decode(packed)
    assert out.shape == x.shape
    kept = sum(b.size for b in bands)
    y_out = hadamard_transform(out)
    assert y_out[..., shuffled[kept:]].abs().max() < 1e-5
    assert _rel_mse(x, y_out) < 0.1


# ---- allocate_bits -------------------------------------------------------------------------------


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("budget", [1.5, 2, 3, 4, 4.75, 5.25, 6])
def test_allocate_bits_decaying_profile(d: int, budget: float) -> None:
    var = 2.0 ** (-torch.arange(d, dtype=torch.float64) / 4)
    bands = allocate_bits(var, budget)
    widths = [b.bits for b in bands]
    assert widths == sorted(widths, reverse=True)
    assert len(set(widths)) == len(widths)  # equal neighbours are merged into one band
    assert all(1 <= w <= 8 for w in widths)
    assert all(b.size >= 1 for b in bands)
    assert sum(b.size for b in bands) <= d
    cost = _cost_bits(bands)
    assert cost <= budget * d
    assert cost > budget * d - (16 + 8)  # within one band scale and one code byte of the budget


def test_allocate_bits_gives_more_bits_to_more_variance() -> None:
    var = 2.0 ** (-torch.arange(64, dtype=torch.float64) / 4)
    low, high = allocate_bits(var, 2), allocate_bits(var, 6)
    assert high[0].bits > low[0].bits
    assert sum(b.size for b in high) >= sum(b.size for b in low)
    assert allocate_bits(var, 16) == (Band(64, 8),)
    assert allocate_bits(var, 16, max_bits=4) == (Band(64, 4),)


def test_allocate_bits_flat_profile_uses_the_budget() -> None:
    # Ties are broken by index, so a flat profile splits into two neighbouring widths.
    bands = allocate_bits(torch.ones(64), 4)
    widths = [b.bits for b in bands]
    assert max(widths) - min(widths) <= 1 and sum(b.size for b in bands) == 64
    assert 64 * 4 - 24 < _cost_bits(bands) <= 64 * 4
    assert allocate_bits(torch.ones(64), 5.25) == (Band(64, 5),)
    assert allocate_bits(torch.ones(128), 8.125) == (Band(128, 8),)
    assert sum(b.size for b in allocate_bits(torch.ones(64), 1)) >= 48


def test_allocate_bits_nearly_flat_profile_gives_nearly_equal_widths() -> None:
    var = (1 + 1e-3 * torch.rand(64, dtype=torch.float64)).sort(descending=True).values
    for budget in (2, 3, 4):
        bands = allocate_bits(var, budget)
        widths = [b.bits for b in bands]
        assert max(widths) - min(widths) <= 1
        assert budget - 1 <= min(widths) and max(widths) <= budget
        assert budget * 64 - 24 < _cost_bits(bands) <= budget * 64


def test_allocate_bits_impossible_budget_raises() -> None:
    # 16 coefficients at 0.5 bits: 8 bits, less than one fp16 scale
    with pytest.raises(ValueError, match="cannot hold even one band"):
        allocate_bits(2.0 ** (-torch.arange(16, dtype=torch.float64)), 0.5)
    with pytest.raises(ValueError, match="cannot hold"):
        allocate_bits(torch.ones(16), 1)


# ---- vzc -----------------------------------------------------------------------------------------


def test_vzc_sizes() -> None:
    codec = parse_codec("vzc")
    assert isinstance(codec, VZCCodec)
    assert codec.bytes_per_vector(128) == 16 + 6 == 22
    assert codec.bytes_per_vector(64) == 8 + 6 == 14
    assert codec.bits_per_element(128) == 22 * 8 / 128
    packed = codec.encode(torch.randn(2, 2, 3, 128))
    assert packed.tensors["signs"].shape == (2, 2, 3, 16) and packed.tensors["signs"].dtype == torch.uint8
    assert packed.tensors["scale"].shape == (2, 2, 3, 3) and packed.tensors["scale"].dtype == torch.float16
    assert packed.nbytes() == 12 * 22


@pytest.mark.parametrize("d", [4, 64, 128])
def test_vzc_decodes_sign_times_class_mean(d: int) -> None:
    codec = parse_codec("vzc")
    x = torch.randn(2, 2, 5, d)
    packed = codec.encode(x)
    y = hadamard_transform(x)
    cls = torch.arange(d) % 3
    scale = torch.stack([y[..., cls == r].abs().mean(dim=-1) for r in range(3)], dim=-1).to(torch.float16)
    assert torch.equal(packed.tensors["scale"], scale)
    expected = torch.where(y >= 0, 1.0, -1.0) * scale.float()[..., cls]
    torch.testing.assert_close(hadamard_transform(codec.decode(packed)), expected, rtol=0, atol=1e-5)


def test_vzc_refuses_tiny_heads_and_args() -> None:
    with pytest.raises(ValueError, match="head_dim >= 3"):
        VZCCodec().check_head_dim(2)
    with pytest.raises(ValueError, match="takes no arguments"):
        parse_codec("vzc:3")


# ---- sqfree:B ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", range(1, 9))
def test_sqfree_sizes(bits: int) -> None:
    codec = parse_codec(f"sqfree:{bits}")
    assert isinstance(codec, SqfreeCodec)
    assert len(squarefree_indices(128)) == 78
    assert codec.bytes_per_vector(128) == math.ceil(78 * bits / 8) + 2
    assert codec.bytes_per_vector(64) == math.ceil(39 * bits / 8) + 2
    assert codec.encode(torch.randn(1, 2, 3, 128)).nbytes() == 6 * codec.bytes_per_vector(128)


@pytest.mark.parametrize("bits", [1, 4, 8])
def test_sqfree_zeroes_non_squarefree_coefficients(bits: int) -> None:
    codec = parse_codec(f"sqfree:{bits}")
    x = torch.randn(2, 2, 4, 128)
    y = hadamard_transform(x)
    out = hadamard_transform(_roundtrip(codec, x))
    sf = squarefree_indices(128)
    rest = [i for i in range(128) if i not in sf]
    assert len(rest) == 50 and rest[0] == 0
    assert out[..., rest].abs().max() < 1e-5
    if bits == 8:
        assert (out[..., sf] - y[..., sf]).abs().max() < 0.01 * y.abs().max()
    if bits == 1:
        scale = y[..., sf].abs().mean(dim=-1, keepdim=True).to(torch.float16).float()
        torch.testing.assert_close(out[..., sf], torch.where(y[..., sf] >= 0, 1.0, -1.0) * scale, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ["sqfree:9", "sqfree:0", "sqfree:x", "sqfree", "sqfree:"])
def test_sqfree_bad_bits(spec: str) -> None:
    with pytest.raises(ValueError, match=r"sqfree takes a bit width 1\.\.8"):
        parse_codec(spec)


# ---- known bugs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["vht2:1", "vht2:8,1", "sqfree:1", "vzc"])
def test_mean_abs_scale_overflow_is_refused(spec: str) -> None:
    x = torch.randn(1, 1, 1, 64) * 1e6  # int8 and rot+int8 still encode this (scale about 3e4)
    parse_codec("rot+int8").encode(x)
    with pytest.raises(ValueError, match="fp16"):
        parse_codec(spec).encode(x)


def test_auto_budget_survives_the_canonical_spec() -> None:
    codec = parse_codec("vht2:auto@4.123456789")
    assert codec.auto_bits == 4.123456789
    assert parse_codec(codec.spec).auto_bits == codec.auto_bits


def test_coefficient_basis_gives_the_stored_coefficients() -> None:
    from walshkv.codecs.spec import parse_codec
    from walshkv.ops.hadamard import hadamard_transform

    codec = parse_codec("vht2:8,8:order=sequency:sk=40")
    x = torch.randn(5, 64)
    basis = codec.coefficient_basis(64)
    assert basis.shape == (64, 40)
    torch.testing.assert_close(x @ basis, hadamard_transform(x)[:, codec.perm(64)[:40]], atol=1e-5, rtol=0)
    torch.testing.assert_close(basis.T @ basis, torch.eye(40), atol=1e-5, rtol=0)  # orthonormal columns
