"""The bitshift trellis of ``tcq`` (walshkv.ops.trellis): states, wrapping, optimality, shipped tables."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from walshkv.ops import trellis
from walshkv.ops.lloyd_max import lloyd_max


@pytest.mark.parametrize(("bits", "state_bits"), [(3, 8), (2.5, 8), (1, 8), (1.5, 8), (4, 8)])
def test_codes_give_back_the_viterbi_states(bits: float, state_bits: int) -> None:
    widths = trellis.step_widths(bits, 32)
    tab = trellis.table(bits, state_bits)
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    states = trellis.viterbi(x, tab, widths, state_bits)
    codes = trellis.encode(x, tab, widths, state_bits)
    assert codes.dtype == torch.int32
    assert all(int(codes[:, i].max()) < 1 << k for i, k in enumerate(widths))
    assert torch.equal(trellis.codes_to_states(codes, widths, state_bits), states)


def test_the_stream_wraps() -> None:
    # value 0's state holds the last codes of the stream in its high bits
    widths = (3,) * 8
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    states = trellis.codes_to_states(codes, widths, 8)
    assert int(states[0, 0]) == (1 | (0 << 3) | (7 << 6)) & 255
    assert int(states[0, 3]) == (4 | (3 << 3) | (2 << 6)) & 255


def _cost(x: torch.Tensor, tab: torch.Tensor, codes: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> float:
    states = trellis.codes_to_states(codes, widths, state_bits)
    return float(((x - tab[states]) ** 2).sum())


def test_the_search_finds_the_best_wrapped_stream() -> None:
    # every stream of 8 values x 2 bits with a 4-bit state (65,536), against the two-pass search
    widths, state_bits = (2,) * 8, 4
    tab = trellis.gaussian_table(state_bits)
    streams = torch.tensor(list(itertools.product(range(4), repeat=8)))
    values = tab[trellis.codes_to_states(streams, widths, state_bits)]
    gen = torch.Generator().manual_seed(1)
    for _ in range(30):
        x = torch.randn(1, 8, generator=gen)
        best = float(((values - x) ** 2).sum(1).min())
        got = _cost(x, tab, trellis.encode(x, tab, widths, state_bits), widths, state_bits)
        assert best - 1e-5 <= got <= best + 1e-5


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_beats_lloyd_max_on_a_gaussian(bits: int) -> None:
    widths = trellis.step_widths(bits, 64)
    tab = trellis.table(bits, 8)
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(2))
    mse = float(((x - tab[trellis.viterbi(x, tab, widths, 8)]) ** 2).mean())
    scalar = lloyd_max(bits, "gaussian").mse
    assert mse < 0.8 * scalar  # about 1.8 dB better at 3 bits (docs/trellis.md)
    assert mse > 2 ** (-2 * bits)  # never below D(R)


def test_every_table_ships() -> None:
    for bits in trellis.TRELLIS_BITS:
        for state_bits in trellis.STATE_BITS:
            tab = trellis.table(bits, state_bits)
            assert tab.shape == (1 << state_bits,)
            assert bool(torch.isfinite(tab).all())
            assert abs(float(tab.mean())) < 0.1
            assert 0.7 < float(tab.std()) < 1.2


def test_a_missing_table_names_the_ones_that_ship() -> None:
    with pytest.raises(ValueError, match=r"tables ship for bits 1, 1\.5, 2.* and L in 8"):
        trellis.table(6, 8)


def test_half_widths_put_the_wider_half_first() -> None:
    assert trellis.step_widths(2.5, 6) == (3, 3, 3, 2, 2, 2)
    assert trellis.step_widths(3, 3) == (3, 3, 3)
    assert math.isclose(sum(trellis.step_widths(3.5, 64)) / 64, 3.5)


def test_training_lowers_the_error() -> None:
    tab, history = trellis.train_table(2, 6, n=16, samples=256, iterations=3)
    assert tab.shape == (64,)
    assert history[-1] < history[0]
