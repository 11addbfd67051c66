"""The per-token fast paths of walshkv.ops give the same bits as the plain computations they replace.

Each fast path (cached tables, fewer ops) must change no stored byte and no decoded value: the checks here
compare bit patterns (``view`` as integers, so that ``-0.0`` and ``0.0`` differ) and strides.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from walshkv.ops.hadamard import hadamard_transform, signed_hadamard, signs_for
from walshkv.ops.packing import pack_bits, pack_bits_span, pack_float_codes, unpack_bits
from walshkv.ops.quant import (
    FP16_MAX,
    check_finite,
    divide_by_scale,
    finite_absmax,
    fp16_scale_up,
    quantize_symmetric,
    symmetric_qmax,
)
from walshkv.ops.rope import RopeRows, RopeTable, undo_rope


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape, strides (of the dimensions longer than 1) and bit patterns."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if [s for s, n in zip(a.stride(), a.shape, strict=True) if n > 1] != [
        s for s, n in zip(b.stride(), b.shape, strict=True) if n > 1
    ]:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)) if a.numel() else True


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- packing ------------------------------------------------------------------------------------------


def _reference_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The shift-and-OR packer (uint8 arithmetic), as pack_bits computed it before its matmul form."""
    n = codes.shape[-1]
    lead = codes.shape[:-1]
    c = codes.to(torch.uint8)
    if bits == 8:
        return c.contiguous()
    if 8 % bits == 0:
        per_byte = 8 // bits
        pad = (-n) % per_byte
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        c = c.reshape(*lead, (n + pad) // per_byte, per_byte)
        out = c[..., 0].clone()
        for i in range(1, per_byte):
            out |= c[..., i] << (i * bits)
        return out
    shifts = torch.arange(bits, dtype=torch.uint8)
    stream = ((c.unsqueeze(-1) >> shifts) & 1).reshape(*lead, n * bits)
    pad = (-(n * bits)) % 8
    if pad:
        stream = torch.nn.functional.pad(stream, (0, pad))
    stream = stream.reshape(*lead, (n * bits + pad) // 8, 8)
    weights = (1 << torch.arange(8, dtype=torch.int32)).to(torch.uint8)
    return (stream * weights).sum(dim=-1, dtype=torch.int32).to(torch.uint8)


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_matches_the_shift_and_or_packer(bits: int) -> None:
    gen = _gen(bits)
    for n, lead in itertools.product((1, 3, 8, 13, 32, 64, 100), ((), (3,), (1, 3, 1), (2, 3, 7))):
        codes = torch.randint(0, 2**bits, (*lead, n), generator=gen)
        codes.view(-1)[-1] = 2**bits - 1
        variants = [codes, codes.to(torch.uint8), codes.float(), codes.expand(2, *codes.shape)]
        if codes.dim() > 1:
            variants.append(codes.transpose(0, -1))  # non-contiguous: the layout follows the input
        for c in variants:
            assert _same(pack_bits(c, bits), _reference_pack(c, bits)), (bits, n, lead, c.dtype, c.stride())
            if c.is_floating_point():
                assert _same(pack_float_codes(c, bits), _reference_pack(c, bits)), (bits, n, lead)
            packed = pack_bits(c, bits)
            assert torch.equal(unpack_bits(packed, bits, c.shape[-1]), c.to(torch.uint8))


@pytest.mark.parametrize("bits", range(1, 9))
def test_pack_bits_span_is_pack_bits_of_the_span(bits: int) -> None:
    gen = _gen(10 + bits)
    for n, lead in itertools.product((2, 8, 16, 24, 64, 128), ((), (1, 3, 1), (2, 3, 5))):
        codes = torch.randint(0, 2**bits, (*lead, n), generator=gen)
        for start, stop in {(0, n), (0, n // 2), (n // 2, n), (1, n), (0, n - 1), (n // 4, 3 * n // 4)}:
            if start < stop:
                expected = _reference_pack(codes[..., start:stop], bits)
                assert _same(pack_bits_span(codes, start, stop, bits), expected), (bits, n, lead, start, stop)


# --- quantization ---------------------------------------------------------------------------------------


def _reference_quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_symmetric as it was written before its fast path: nextafter round-up, where() divisions."""
    qmax = symmetric_qmax(bits)
    xf = x.to(torch.float32)
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale32 = absmax / qmax
    scale16 = scale32.to(torch.float16)
    rounded_down = scale16.to(torch.float32) < scale32
    scale16 = torch.where(rounded_down, torch.nextafter(scale16, torch.full_like(scale16, math.inf)), scale16)
    s = scale16.to(torch.float32)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(xf / safe), torch.zeros_like(xf)).clamp_(-qmax, qmax) + qmax
    return q.to(torch.uint8), scale16


@pytest.mark.parametrize("bits", range(2, 9))
def test_quantize_symmetric_matches_the_reference(bits: int) -> None:
    gen = _gen(20 + bits)
    for scale in (1.0, 1e-3, 3e-39, 1e-44, 1e3, 4e4):
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            x = (torch.randn(2, 3, 9, 64, generator=gen, dtype=torch.float64) * scale).to(dtype)
            x[0, 0, 0] = 0  # an all-zero vector (scale 0)
            x[1, 2, 3, :7] = 0
            if not torch.isfinite(x).all() or float(x.abs().max()) / symmetric_qmax(bits) > FP16_MAX:
                continue
            codes, scale16 = quantize_symmetric(x, bits)
            ref_codes, ref_scale = _reference_quantize(x, bits)
            assert _same(codes, ref_codes) and _same(scale16, ref_scale), (bits, scale, dtype)
    x = torch.randn(2, 3, 4, 64, generator=gen)
    x[1, 1, 2, 5] = math.nan  # the public function does not refuse NaN: it keeps its old codes there
    codes, scale16 = quantize_symmetric(x, bits)
    ref_codes, ref_scale = _reference_quantize(x, bits)
    assert _same(codes, ref_codes) and _same(scale16, ref_scale)


def test_fp16_scale_up_and_divide_by_scale_match_the_reference() -> None:
    gen = _gen(3)
    scale32 = torch.rand(4, 100, 1, generator=gen) * torch.logspace(-30, 4, 100).view(1, 100, 1)
    scale32[0, :5] = 0
    ref = scale32.to(torch.float16)
    ref = torch.where(ref.to(torch.float32) < scale32, torch.nextafter(ref, torch.full_like(ref, math.inf)), ref)
    assert _same(fp16_scale_up(scale32), ref)
    x = torch.randn(4, 100, 8, generator=gen)
    s = ref.to(torch.float32)
    expected = torch.where(s > 0, torch.round(x / torch.where(s > 0, s, torch.ones_like(s))), torch.zeros_like(x))
    assert _same(divide_by_scale(x, ref), expected)


def test_finite_absmax_measures_and_refuses() -> None:
    gen = _gen(4)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        x = torch.randn(2, 3, 5, 16, generator=gen).to(dtype)
        assert finite_absmax(x) == float(x.abs().amax())
        assert finite_absmax(x[:, :, :0]) == 0.0
        for value, counts in ((math.nan, "1 NaN and 0 Inf"), (math.inf, "0 NaN and 1 Inf"), (-math.inf, "0 NaN and 1")):
            y = x.clone()
            y[1, 2, 3, 4] = value
            with pytest.raises(ValueError, match=counts):
                finite_absmax(y, "K")
            with pytest.raises(ValueError, match=counts):
                check_finite(y, "K")
    check_finite(torch.arange(5))  # integer tensors are finite


# --- rotations, RoPE ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 16, 64, 128, 256])
def test_signed_hadamard_is_the_signed_transform(n: int) -> None:
    gen = _gen(n)
    for shape in ((1, 3, 1, n), (2, 2, 7, n), (300, n)):
        x = torch.randn(*shape, generator=gen)
        x.view(-1)[::5] = 0.0
        x.view(-1)[1::7] = -0.0
        m = signed_hadamard(x, 3)
        assert m is not None
        assert _same(x @ m, hadamard_transform(x * signs_for(n, 3)))
    big = torch.randn(3, n + 1, generator=gen)[:, 1:]  # a view at an odd offset: refused
    assert signed_hadamard(big, 3) is None
    assert signed_hadamard(torch.randn(3, n, dtype=torch.float64), 3) is None


@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_cached_rope_rows_give_the_same_keys(scaling: float) -> None:
    gen = _gen(5)
    table = RopeTable(10000.0 ** (-torch.arange(0, 64, 2, dtype=torch.float32) / 64), scaling)
    rows = RopeRows(table, window=64)
    for start, n in [(0, 1), (1, 1), (63, 1), (64, 1), (70, 7), (100, 64), (100, 65), (5000, 3), (2**24 - 10, 1)]:
        for dtype in (torch.float32, torch.float16):
            x = (torch.randn(2, 3, n, 64, generator=gen) * 10).to(dtype)
            assert _same(undo_rope(x, table, start, rows), undo_rope(x, table, start)), (start, n, dtype)
