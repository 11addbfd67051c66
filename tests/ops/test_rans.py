"""walshkv.ops.rans: the bits-at-rest coder round-trips every byte, comes near the order-0 bound, refuses damage."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from walshkv.ops.rans import RansError, decode, decode_rows, encode, encode_rows, order0_bits

SKEW = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])


def _skewed(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).choice(8, n, p=SKEW).astype(np.uint8)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 8191, 8192, 8193, 50_000])
def test_round_trip_at_stream_boundaries(n):
    s = _skewed(n, seed=n)
    assert np.array_equal(decode(encode(s)), s)
    assert np.array_equal(decode(encode(s, stream_symbols=3)), s)  # many short streams, a padded last one


@pytest.mark.parametrize(
    "make",
    [
        lambda r: np.full(20_000, 200, np.uint8),  # one symbol: its frequency is the whole range
        lambda r: r.integers(0, 256, 20_000).astype(np.uint8),  # every byte value
        lambda r: np.array([0, 255] * 5_000, np.uint8),
        lambda r: (r.random(20_000) < 0.0005).astype(np.uint8),  # a rare symbol: frequency 1 of 2**PROB_BITS or so
    ],
)
def test_round_trip_of_extreme_histograms(make):
    s = make(np.random.default_rng(3))
    assert np.array_equal(decode(encode(s)), s)


def test_close_to_the_order0_bound_and_never_far_above_8_bits():
    s = _skewed(400_000)
    bound = order0_bits(s) / s.size
    coded = 8 * len(encode(s)) / s.size
    assert bound < coded < bound * 1.01  # within 1%, table and states counted
    uniform = np.random.default_rng(1).integers(0, 256, 400_000).astype(np.uint8)
    assert 8 * len(encode(uniform)) / uniform.size < 8.05


def test_order0_bits_known_values():
    assert order0_bits(np.zeros(10, np.uint8)) == 0.0
    assert order0_bits(np.array([0, 1] * 8, np.uint8)) == pytest.approx(16.0)
    assert order0_bits(np.arange(256, dtype=np.uint8)) == pytest.approx(256 * 8)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="uint8"):
        encode(np.zeros(4, np.int16))
    with pytest.raises(ValueError, match="prob_bits"):
        encode(np.zeros(4, np.uint8), prob_bits=16)
    with pytest.raises(ValueError, match="2-D uint8"):
        encode_rows(np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match="period"):
        encode_rows(np.zeros((4, 4), np.uint8), period=0)


def test_damaged_blobs_are_refused_not_decoded_to_garbage():
    s = _skewed(30_000)
    blob = encode(s)
    with pytest.raises(RansError, match="truncated"):
        decode(blob[:10])
    with pytest.raises(RansError, match="truncated"):
        decode(blob[:-1])
    with pytest.raises(RansError, match="after the last word"):
        decode(blob + b"\0")
    with pytest.raises(RansError, match="not a walshkv rANS blob"):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(RansError, match="version"):
        decode(blob[:4] + b"\x09" + blob[5:])
    table = 24  # header bytes
    freq = bytearray(blob)
    freq[table : table + 2] = struct.pack("<H", struct.unpack("<H", freq[table : table + 2])[0] + 1)
    with pytest.raises(RansError, match="frequency table"):
        decode(bytes(freq))
    rng = np.random.default_rng(5)
    for _ in range(20):  # a changed word: the streams no longer end on RANS_L, where they all began
        hit = bytearray(blob)
        hit[len(hit) - 2 * int(rng.integers(1, 2000))] ^= 0x5A
        with pytest.raises(RansError, match="damaged words"):
            decode(bytes(hit))


@pytest.mark.parametrize("period", [None, 1, 2, 3, 8])
def test_rows_round_trip_with_each_period(period):
    rows = np.random.default_rng(2).choice(8, (3_000, 24), p=SKEW).astype(np.uint8)
    rows[:, 1::3] = 7  # a column class with one value: a period of 3 catches it
    blob = encode_rows(rows, period=period)
    assert np.array_equal(decode_rows(blob), rows)
    if period is None:
        assert blob[5] == 3 and len(blob) < len(encode_rows(rows, period=1))


def test_rows_that_do_not_code_shorter_are_stored():
    rows = np.random.default_rng(4).integers(0, 256, (50, 24)).astype(np.uint8)
    blob = encode_rows(rows)
    assert blob[5] == 0 and len(blob) == rows.size + 20
    assert np.array_equal(decode_rows(blob), rows)
    with pytest.raises(RansError, match="truncated"):
        decode_rows(blob[:-1])
    with pytest.raises(RansError, match="not a walshkv row blob"):
        decode_rows(b"WKVR" + blob[4:])
    empty = np.zeros((0, 8), np.uint8)
    assert decode_rows(encode_rows(empty)).shape == (0, 8)
