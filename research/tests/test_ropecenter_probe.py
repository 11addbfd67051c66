"""The frame probe's ``ropecenter+`` wrapper (research/scripts/ropecenter_probe.py): exact round trip, and its
residual is ``prerope+center+``'s turned by RoPE."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.rotation import Rotated
from walshkv.ops.rope import RopeTable, apply_rope, rope_averaged, undo_rope

PROBE = Path(__file__).resolve().parents[1] / "scripts" / "ropecenter_probe.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("ropecenter_probe", PROBE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["ropecenter_probe"] = module
    spec.loader.exec_module(module)
    return module


def _table(d: int) -> RopeTable:
    return RopeTable(inv_freq=1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)))


def _bound(probe, inner, mu, d, pairs=None):
    return probe.RopeCentered(inner, _table(d), mu=mu, pairs=pairs)


def test_round_trip_is_exact_with_a_lossless_inner_codec(probe):
    torch.manual_seed(0)
    d, start = 16, 37
    mu = torch.randn(2, d)
    codec = _bound(probe, FloatCodec("fp32"), mu, d)
    x = torch.randn(1, 2, 5, d)
    out = codec.decode(codec.encode(x, start), start)
    torch.testing.assert_close(out, x, rtol=0, atol=1e-5)


def test_residual_is_the_pre_rope_residual_turned_to_its_position(probe):
    torch.manual_seed(1)
    d, start = 16, 100
    table = _table(d)
    mu = torch.randn(3, d)
    codec = _bound(probe, Rotated(FloatCodec("fp32")), mu, d)
    k_pre = torch.randn(2, 3, 4, d)
    k_post = apply_rope(k_pre, table, start)
    inner, y = codec._transform(k_post, start)
    expected = apply_rope(k_pre - mu[None, :, None, :], table, start)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-5)
    assert inner is codec.inner
    # the same residual before RoPE is prerope+center+'s
    torch.testing.assert_close(undo_rope(y, table, start), k_pre - mu[None, :, None, :], rtol=0, atol=1e-5)


def test_parser_reads_the_wrapper_and_keeps_the_prerope_slot(probe, monkeypatch):
    from walshkv.codecs import registry
    from walshkv.codecs.registry import parse_codec

    # as main() registers it, but only for this test (the package's registry stays as shipped)
    monkeypatch.setitem(registry._WRAPPERS, "ropecenter", (probe._factory, "probe"))
    codec = parse_codec("ropecenter:4+rot+iq4_nl")
    assert isinstance(codec, probe.RopeCentered)
    assert codec.pairs == 4 and codec.spec == "ropecenter:4+rot+iq4_nl"
    with pytest.raises(ValueError):
        parse_codec("rot+ropecenter+iq4_nl")  # outermost on K, as prerope+


def test_bad_pair_counts_and_kernel_commands_are_refused(probe, monkeypatch):
    from walshkv.codecs import registry
    from walshkv.codecs.registry import parse_codec

    monkeypatch.setitem(registry._WRAPPERS, "ropecenter", (probe._factory, "probe"))
    for bad in ("ropecenter:0+rot+iq4_nl", "ropecenter:x+rot+iq4_nl"):
        with pytest.raises(ValueError, match="channel pairs >= 1"):
            parse_codec(bad)
    for argv in (["bench", "--codec", "ropecenter+rot+iq4_nl"], ["needle", "--fused"]):
        with pytest.raises(SystemExit, match="eval` only"):
            probe.main(argv)


def _brute_rope_average(m: torch.Tensor, table: RopeTable, length: int) -> torch.Tensor:
    d = m.shape[-1]
    eye = torch.eye(d)[:, None, None, :]  # each basis vector a sequence of one token
    total = torch.zeros(d, d, dtype=torch.float64)
    for p in range(length):
        r = apply_rope(eye, table, p)[:, 0, 0].to(torch.float64).T  # column i: RoPE(e_i) at position p
        total += r @ m @ r.T
    return total / length


def test_rope_averaged_moments_match_the_mean_over_positions(probe):
    torch.manual_seed(2)
    d = 16
    table = _table(d)
    a = torch.randn(d, 3 * d, dtype=torch.float64)
    m = a @ a.T / (3 * d)
    for length in (1, 5, 37):
        got = rope_averaged(m, table.inv_freq, length)
        torch.testing.assert_close(got, _brute_rope_average(m, table, length), rtol=0, atol=1e-6)
    # the limit keeps only each channel pair's isotropic part: it commutes with RoPE at every position
    lim = rope_averaged(m, table.inv_freq, None)
    h = d // 2
    pair = torch.diagonal(m)[:h] + torch.diagonal(m)[h:]
    torch.testing.assert_close(lim, torch.diag(torch.cat([pair, pair]) / 2), rtol=0, atol=1e-12)


def test_eqr_transform_after_rope_is_fixed_and_refuses_v(probe):
    from walshkv.codecs.floats import FloatCodec

    codec = probe._eqr_factory("4096", FloatCodec("fp32"))
    assert codec.spec == "eqr:4096+fp32" and codec.needs_calibration
    with pytest.raises(ValueError, match="eqr"):
        probe._eqr_factory("0", FloatCodec("fp32"))
    with pytest.raises(ValueError, match="is for K"):
        codec.bind(0, "v", None)
    # the query moment averaged over its own number of positions (inf: the limit)
    assert probe._eqr_factory("64:inf", FloatCodec("fp32")).spec == "eqr:64:inf+fp32"
    split = probe._eqr_factory("64:512", FloatCodec("fp32"))
    assert (split.length, split.q_length, split.spec) == (64, 512, "eqr:64:512+fp32")
    for bad in ("64:0", "64:x", "x:inf"):
        with pytest.raises(ValueError, match="then optionally the query's"):
            probe._eqr_factory(bad, FloatCodec("fp32"))


@pytest.mark.parametrize("block", [1, 4, 64])
def test_blockrope_round_trip_is_exact_with_a_lossless_inner_codec(probe, block):
    torch.manual_seed(2)
    d, start = 16, 37
    codec = probe.BlockRoped(FloatCodec("fp32"), _table(d), block=block, mu=torch.randn(2, d))
    x = torch.randn(1, 2, 9, d)
    torch.testing.assert_close(codec.decode(codec.encode(x, start), start), x, rtol=0, atol=1e-5)


def test_blockrope_turns_keys_back_by_their_blocks_first_position(probe):
    torch.manual_seed(3)
    d, block, start = 16, 4, 6
    table = _table(d)
    mu = torch.zeros(2, d)
    codec = probe.BlockRoped(FloatCodec("fp32"), table, block=block, mu=mu)
    k_pre = torch.randn(1, 2, 5, d)  # positions 6..10: blocks start at 4 (6, 7) and 8 (8, 9, 10)
    _, u = codec._transform(apply_rope(k_pre, table, start), start)
    offsets = [2, 3, 0, 1, 2]
    for i, j in enumerate(offsets):
        torch.testing.assert_close(u[:, :, i], apply_rope(k_pre[:, :, i : i + 1], table, j)[:, :, 0], atol=1e-5, rtol=0)
    # block 1 is prerope+: the key before RoPE
    one = probe.BlockRoped(FloatCodec("fp32"), table, block=1, mu=mu)
    torch.testing.assert_close(one._transform(apply_rope(k_pre, table, start), start)[1], k_pre, atol=1e-5, rtol=0)


def test_blockropec_centres_each_key_exactly(probe):
    torch.manual_seed(4)
    d, block, start = 16, 8, 13
    table = _table(d)
    mu = torch.randn(2, d)
    codec = probe.BlockRoped(FloatCodec("fp32"), table, block=block, mu=mu, exact=True)
    k_pre = mu[None, :, None, :] + 0.01 * torch.randn(1, 2, 6, d)
    _, u = codec._transform(apply_rope(k_pre, table, start), start)
    assert u.abs().max() < 0.05  # the keys' own mean is gone at every offset
    torch.testing.assert_close(
        codec.decode(codec.encode(apply_rope(k_pre, table, start), start), start),
        apply_rope(k_pre, table, start),
        atol=1e-5,
        rtol=0,
    )
