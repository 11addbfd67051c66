"""The bitshift trellis of ``tcq`` (walshkv.ops.trellis): states, wrapping, optimality, shipped tables."""

from __future__ import annotations

import hashlib
import itertools
import math
from importlib import resources

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


@pytest.mark.parametrize("tables", trellis.TABLE_SETS)
def test_every_table_ships(tables: int) -> None:
    for bits in trellis.TRELLIS_BITS:
        for state_bits in trellis.STATE_BITS:
            tab = trellis.table(bits, state_bits, tables)
            assert tab.shape == (1 << state_bits,)
            assert bool(torch.isfinite(tab).all())
            assert abs(float(tab.mean())) < 0.1
            # entries, not codes: set 2 spreads to 1.22 at 4.5 bits; set 3's split parts to 1.34 at 5 bits
            assert 0.7 < float(tab.std()) < (1.35 if tables in trellis.SPLIT_SETS else 1.3)


def test_a_missing_table_names_the_ones_that_ship() -> None:
    with pytest.raises(ValueError, match=r"tables ship for bits 1, 1\.5, 2.* and L in 8"):
        trellis.table(6, 8)


#: A shipped set never changes: its codes in saved caches and every KLD row measured with it would decode to other
#: values. Better tables ship as a new set (scripts/train_trellis_tables.py --set N, a new TABLE_SETS entry).
SHIPPED_SHA256 = {
    1: "9598f8757721ce6f0533933df8098e7eabb4cde3a795e75eeb7cf2802191c891",
    2: "91e084790d1a29221d26420f704a0c5c953f40da5f2b98482f467102d2b7dfa1",
    3: "b1f9728381e55775476f397fe6e9268f53fa044c03ee5a9d6d7fb41f76b034d8",
    4: "40511c171b6284edf5f573fa6566cf673a9c6e8483ea9e9abdd23de6036e7241",
}


@pytest.mark.parametrize("tables", sorted(trellis.ROUNDED_SETS))
def test_a_rounded_set_is_its_source_rounded_to_bfloat16(tables: int) -> None:
    source = trellis.ROUNDED_SETS[tables]
    for bits in trellis.TRELLIS_BITS:
        tab = trellis.table(bits, 8, tables)
        assert torch.equal(tab, trellis.round_bf16(trellis.table(bits, 8, source)))
        assert not (tab.view(torch.int32) & 0xFFFF).any()  # what the VBMI decoder's two-plane lookup needs
        assert (tab - trellis.table(bits, 8, source)).abs().max() <= 2**-8 * tab.abs().max()


@pytest.mark.parametrize("tables", trellis.TABLE_SETS)
def test_a_shipped_table_set_never_changes(tables: int) -> None:
    data = resources.files("walshkv.ops").joinpath(trellis.table_file(tables)).read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHIPPED_SHA256[tables]


def test_the_longer_trained_set_codes_closer_to_the_bound() -> None:
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(7))
    for bits in (2, 3, 4):
        widths = trellis.step_widths(bits, 64)
        mse = []
        for tables in (1, 2):
            tab = trellis.table(bits, 8, tables)
            mse.append(float(((x - tab[trellis.viterbi(x, tab, widths, 8)]) ** 2).mean()))
        assert mse[1] < mse[0]  # 0.2-0.3 dB at these widths (docs/trellis.md)


def test_an_unknown_table_set_names_the_ones_that_ship() -> None:
    with pytest.raises(ValueError, match=r"table set is one of 1, 2, 3, 4; got 5"):
        trellis.table(3, 8, 5)


@pytest.mark.parametrize("tables", sorted(trellis.SPLIT_SETS))
def test_a_split_set_is_the_float32_sum_of_its_parts(tables: int) -> None:
    """Every reader but the AVX2 decoder reads the 256 values; that one sums the parts: they must agree bit for bit."""
    for bits in trellis.TRELLIS_BITS:
        parts = trellis.table_parts(bits, 8, tables)
        assert parts is not None and parts.shape == (32,)
        tab = trellis.table(bits, 8, tables)
        s = torch.arange(256)
        assert torch.equal(tab, parts[s & 15] + parts[16 + (s >> 4)])
    assert trellis.table_parts(3, 8, 2) is None  # 256 free values


def test_a_split_table_codes_close_to_the_free_table() -> None:
    """The split costs a little of the trellis's gain, not most of it (docs/trellis.md: about 0.3 dB at 3 bits)."""
    x = torch.randn(2048, 64, generator=torch.Generator().manual_seed(8))
    for bits in (2, 3, 4):
        widths = trellis.step_widths(bits, 64)
        mse = {}
        for tables in (2, 3):
            tab = trellis.table(bits, 8, tables)
            mse[tables] = float(((x - tab[trellis.viterbi(x, tab, widths, 8)]) ** 2).mean())
        assert mse[3] < 0.85 * lloyd_max(bits, "gaussian").mse  # still well below the scalar quantizer
        assert mse[3] < 1.15 * mse[2]


def test_split_training_keeps_the_structure() -> None:
    parts, history = trellis.train_table_parts(3, 8, n=16, samples=256, iterations=3)
    assert parts.shape == (32,) and len(history) == 3
    again, _ = trellis.train_table_parts(3, 8, n=16, samples=256, iterations=3)
    assert torch.equal(parts, again)  # the same seed: the same parts
    with pytest.raises(ValueError, match=r"44 split covers L=8 tables only"):
        trellis.train_table_parts(3, 6, n=16, samples=16, iterations=1)


def test_training_takes_another_search() -> None:
    calls = []

    def coder(x: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor | None:
        calls.append(x.shape)
        return None if len(calls) == 1 else trellis.encode(x, tab, widths, state_bits)

    ours = trellis.train_table(2, 6, n=16, samples=128, iterations=3, coder=coder)
    plain = trellis.train_table(2, 6, n=16, samples=128, iterations=3)
    assert len(calls) == 3  # a coder that declines (None) leaves that round to the torch search
    assert torch.equal(ours[0], plain[0]) and ours[1] == plain[1]


def test_half_widths_put_the_wider_half_first() -> None:
    assert trellis.step_widths(2.5, 6) == (3, 3, 3, 2, 2, 2)
    assert trellis.step_widths(3, 3) == (3, 3, 3)
    assert math.isclose(sum(trellis.step_widths(3.5, 64)) / 64, 3.5)


def test_training_lowers_the_error() -> None:
    tab, history = trellis.train_table(2, 6, n=16, samples=256, iterations=3)
    assert tab.shape == (64,)
    assert history[-1] < history[0]
