"""walshkv.ops.lognorm: 8-bit logarithmic norms, and what ``:norm=8`` does to tq and tcq."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.codecs.registry import parse_codec
from walshkv.ops.lognorm import LOG_NORM_MAX, LOG_NORM_STEPS, decode_log_norms, encode_log_norms, log_norm_table


def test_the_table_is_eight_steps_per_octave_with_zero_first() -> None:
    tab = log_norm_table()
    assert tab.dtype == torch.float32 and tab.shape == (256,)
    assert tab[0] == 0.0 and tab[128] == 1.0 and tab[136] == 2.0 and tab[120] == 0.5
    assert float(tab[255]) == pytest.approx(LOG_NORM_MAX, rel=1e-6)
    ratios = tab[2:] / tab[1:-1]
    assert torch.allclose(ratios, torch.full_like(ratios, 2 ** (1 / LOG_NORM_STEPS)), rtol=1e-6)


def test_codes_round_to_the_nearest_step_in_the_log_domain() -> None:
    norm = torch.logspace(-4, 4.7, 5000, dtype=torch.float64)
    back = decode_log_norms(encode_log_norms(norm, "t")).to(torch.float64)
    ratio = back / norm
    half_step = 2 ** (1 / (2 * LOG_NORM_STEPS))
    assert float(ratio.max()) <= half_step * (1 + 1e-6) and float(ratio.min()) >= 1 / half_step * (1 - 1e-6)


def test_zero_and_tiny_norms_decode_to_zero() -> None:
    norm = torch.tensor([0.0, 1e-30, 2.0 ** (-128.6 / LOG_NORM_STEPS)], dtype=torch.float64)
    assert encode_log_norms(norm, "t").tolist() == [0, 0, 0]
    assert decode_log_norms(torch.zeros(3, dtype=torch.uint8)).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("bad", [1e5, math.inf, math.nan])
def test_a_norm_past_the_top_code_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match=r"tcq:3:norm=8.*8 bits.*fp32 or bf16"):
        encode_log_norms(torch.tensor([1.0, bad], dtype=torch.float64), "tcq:3:norm=8")


@pytest.mark.parametrize("spec", ["tq:3", "tcq:3", "tcq:2.5", "tq:4"])
def test_norm8_saves_a_byte_per_vector_at_nearly_the_same_error(spec: str) -> None:
    """The codes absorb the norm's rounding: the error stays within 1% of the fp16 norm's; 8 bits per row saved."""
    x = torch.randn(2, 3, 400, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-2, 2, 400)[:, None]
    errs = {}
    for s in (spec, f"{spec}:norm=8"):
        codec = parse_codec(s)
        packed = codec.encode(x)
        got = codec.decode(packed)
        errs[s] = float(((got - x) ** 2).sum(-1).div((x**2).sum(-1)).mean())
    plain, byte = parse_codec(spec), parse_codec(f"{spec}:norm=8")
    assert byte.bits_per_element(64) == pytest.approx(plain.bits_per_element(64) - 8 / 64)
    assert errs[f"{spec}:norm=8"] <= 1.01 * errs[spec]
    assert byte.encode(x).tensors["norm"].dtype == torch.uint8


def test_the_option_round_trips_and_bad_values_are_refused() -> None:
    assert parse_codec("tcq:3:norm=8").spec == "tcq:3:norm=8"
    assert parse_codec("tq:3:norm=16").spec == "tq:3"
    assert parse_codec("tq:3:seed=2:norm=8").spec == "tq:3:seed=2:norm=8"
    with pytest.raises(ValueError, match="16, 8"):
        parse_codec("tcq:3:norm=4")
    with pytest.raises(ValueError, match="unknown option"):
        parse_codec("tqprod:3:norm=8")


def test_a_zero_vector_decodes_to_zeros() -> None:
    x = torch.zeros(1, 1, 3, 64)
    x[0, 0, 1] = torch.randn(64)
    for spec in ("tq:3:norm=8", "tcq:3:norm=8"):
        codec = parse_codec(spec)
        got = codec.decode(codec.encode(x))
        assert torch.equal(got[0, 0, 0], torch.zeros(64)) and torch.equal(got[0, 0, 2], torch.zeros(64))
