"""Tests for walshkv.ops.packing: dense LSB-first bit packing of unsigned codes."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.ops.packing import pack_bits, packed_nbytes, unpack_bits

BITS = list(range(1, 9))
SIZES = [1, 3, 7, 8, 13, 64, 100, 128, 256]


def reference_pack(codes: list[int], bits: int) -> list[int]:
    """Naive packer: code i fills stream bits [i*bits, (i+1)*bits); stream bit j is bit j%8 of byte j//8."""
    out = [0] * math.ceil(len(codes) * bits / 8)
    for i, code in enumerate(codes):
        assert 0 <= code < 2**bits
        for b in range(bits):
            if (code >> b) & 1:
                j = i * bits + b
                out[j // 8] |= 1 << (j % 8)
    return out


def random_codes(shape: tuple[int, ...], bits: int) -> torch.Tensor:
    return torch.randint(0, 2**bits, shape, dtype=torch.uint8)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_roundtrip_exact(bits: int, n: int) -> None:
    codes = random_codes((3, 2, n), bits)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (3, 2, packed_nbytes(n, bits))
    out = unpack_bits(packed, bits, n)
    assert out.dtype == torch.uint8
    assert torch.equal(out, codes)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits", BITS)
def test_packed_size(bits: int, n: int) -> None:
    expected = math.ceil(n * bits / 8)
    assert packed_nbytes(n, bits) == expected
    assert pack_bits(random_codes((n,), bits), bits).shape == (expected,)


@pytest.mark.parametrize(("n", "bits", "nbytes"), [(64, 4, 32), (64, 3, 24), (64, 2, 16), (64, 8, 64), (64, 5, 40)])
def test_packed_nbytes_known(n: int, bits: int, nbytes: int) -> None:
    assert packed_nbytes(n, bits) == nbytes


@pytest.mark.parametrize("bits", BITS)
def test_matches_reference_packer(bits: int) -> None:
    for n in (1, 5, 13, 64, 100):
        codes = random_codes((4, n), bits)
        packed = pack_bits(codes, bits)
        for row in range(codes.shape[0]):
            assert packed[row].tolist() == reference_pack(codes[row].tolist(), bits)


@pytest.mark.parametrize("bits", BITS)
def test_all_ones_codes_pad_with_zero_bits(bits: int) -> None:
    n = 13  # 13 * bits is not a multiple of 8 for any odd bits
    codes = torch.full((n,), 2**bits - 1, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.tolist() == reference_pack(codes.tolist(), bits)
    used = n * bits
    if used % 8:
        assert packed[-1].item() == (1 << (used % 8)) - 1


@pytest.mark.parametrize(
    ("bits", "codes", "expected"),
    [
        (4, [1, 2, 3, 4], [0x21, 0x43]),  # low nibble first
        (4, [15, 0, 0], [0x0F, 0x00]),
        (2, [0, 1, 2, 3], [0xE4]),
        (2, [3], [0x03]),
        (1, [1, 0, 1, 1, 0, 0, 0, 1, 1], [0x8D, 0x01]),
        (3, [7, 0, 0, 0, 0, 0, 0, 0], [0x07, 0x00, 0x00]),
        (3, [0, 0, 7, 0, 0, 0, 0, 0], [0xC0, 0x01, 0x00]),  # code 2 straddles bytes 0 and 1
        (3, [5, 3], [0x1D]),
        (3, [0, 0, 0, 0, 0, 0, 0, 7], [0x00, 0x00, 0xE0]),
        (5, [31, 1], [0x3F, 0x00]),
        (5, [31], [0x1F]),
        (6, [1, 2, 3, 4], [0x81, 0x30, 0x10]),
        (7, [0x7F, 0x7F], [0xFF, 0x3F]),
        (8, [0, 255, 17], [0, 255, 17]),
    ],
)
def test_known_bytes(bits: int, codes: list[int], expected: list[int]) -> None:
    packed = pack_bits(torch.tensor(codes, dtype=torch.uint8), bits)
    assert packed.tolist() == expected
    assert unpack_bits(packed, bits, len(codes)).tolist() == codes


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_accepts_wider_integer_codes(bits: int) -> None:
    codes = random_codes((5, 24), bits)
    for dtype in (torch.int32, torch.int64):
        assert torch.equal(pack_bits(codes.to(dtype), bits), pack_bits(codes, bits))


@pytest.mark.parametrize("bits", [3, 4])
def test_pack_does_not_modify_input(bits: int) -> None:
    codes = random_codes((2, 16), bits)
    before = codes.clone()
    pack_bits(codes, bits)
    assert torch.equal(codes, before)


def test_rows_are_independent() -> None:
    codes = random_codes((6, 13), 3)
    packed = pack_bits(codes, 3)
    for row in range(6):
        assert torch.equal(packed[row], pack_bits(codes[row], 3))


@pytest.mark.parametrize("bits", [0, 9, -1, 16])
def test_bad_bits_raise(bits: int) -> None:
    codes = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits"):
        pack_bits(codes, bits)
    with pytest.raises(ValueError, match="bits"):
        unpack_bits(torch.zeros(8, dtype=torch.uint8), bits, 8)


def test_non_integer_bits_raise() -> None:
    with pytest.raises(ValueError, match="bits"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 4.0)  # type: ignore[arg-type]


@pytest.mark.parametrize(("bits", "n", "nbytes"), [(4, 64, 31), (4, 64, 33), (3, 64, 32), (8, 10, 9), (1, 9, 1)])
def test_unpack_wrong_byte_count_raises(bits: int, n: int, nbytes: int) -> None:
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(2, nbytes, dtype=torch.uint8), bits, n)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.float32])
def test_unpack_non_uint8_raises(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(2, 32, dtype=dtype), 4, 64)


def test_empty_leading_dim_bits8() -> None:
    codes = torch.zeros(2, 0, 64, dtype=torch.uint8)
    packed = pack_bits(codes, 8)
    assert packed.shape == (2, 0, 64)
    assert unpack_bits(packed, 8, 64).shape == (2, 0, 64)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_empty_leading_dim_roundtrip(bits: int) -> None:
    codes = torch.zeros(2, 0, 64, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.shape == (2, 0, packed_nbytes(64, bits))
    assert unpack_bits(packed, bits, 64).shape == (2, 0, 64)
