"""A wrapper chain's encode (checks once, at the outermost call) gives what validating at every level gives.

``Wrapper._encode_at`` is the reference path: each transformed block goes through the next codec's public
``encode``, which checks it again. ``encode`` takes the fast path (``Codec._encode_inner``); both must store the
same bytes (bit for bit, strides included) and refuse the same blocks with the same error, also where a
transform itself overflows (the wrapper's output is then no longer finite).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from matrix import MATRIX, CalibrationStub, Entry

from walshkv.codecs.base import Codec, Packed, Wrapper
from walshkv.codecs.equalize import _apply_per_head
from walshkv.codecs.registry import parse_codec

HEADS, START = 2, 5


def _codec(entry: Entry) -> Codec:
    return parse_codec(entry.spec).bind(1, entry.kind, CalibrationStub(entry.head_dim, HEADS))


#: The entries whose bound codec is a wrapper chain (``center+`` on V binds to its inner codec).
WRAPPED = [e for e in MATRIX if isinstance(_codec(e), Wrapper)]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def _outcome(fn: Callable[[torch.Tensor, int], Packed], x: torch.Tensor, start: int) -> Packed | tuple[str, str]:
    try:
        return fn(x, start)
    except (ValueError, TypeError) as e:
        return type(e).__name__, str(e)


def _check_same(fast: Packed | tuple[str, str], ref: Packed | tuple[str, str], what: str) -> None:
    if isinstance(ref, tuple) or isinstance(fast, tuple):
        assert fast == ref, what
        return
    assert list(fast.tensors) == list(ref.tensors), what
    for name in ref.tensors:
        assert _same(fast.tensors[name], ref.tensors[name]), (what, name)


@pytest.mark.parametrize("entry", WRAPPED, ids=lambda e: e.id)
def test_fast_path_stores_what_the_reference_path_stores(entry: Entry) -> None:
    codec = _codec(entry)
    assert isinstance(codec, Wrapper)
    gen = torch.Generator().manual_seed(11)
    for batch, tokens, dtype in itertools.product((1, 2), (1, 7), (torch.float32, torch.float16, torch.bfloat16)):
        x = (torch.randn(batch, HEADS, tokens, entry.head_dim, generator=gen) * 2).to(dtype)
        x[0, 0, 0] = 0  # an all-zero vector
        fast = codec.encode(x, START)
        ref = codec._encode_at(x, START)
        _check_same(fast, ref, f"{entry.id} {tuple(x.shape)} {dtype}")


@pytest.mark.parametrize("entry", WRAPPED, ids=lambda e: e.id)
def test_fast_path_refuses_overflow_as_the_reference_path_does(entry: Entry) -> None:
    codec = _codec(entry)
    gen = torch.Generator().manual_seed(12)
    for scale, dtype in ((1e38, torch.float32), (3e37, torch.float32), (1e39, torch.float64), (1e300, torch.float64)):
        x = (torch.randn(1, HEADS, 3, entry.head_dim, generator=gen, dtype=torch.float64) * scale).to(dtype)
        fast = _outcome(codec.encode, x, START)
        ref = _outcome(codec._encode_at, x, START)
        _check_same(fast, ref, f"{entry.id} {scale:g} {dtype}")


def test_apply_per_head_is_einsum() -> None:
    gen = torch.Generator().manual_seed(6)
    for b, h, n, d in itertools.product((1, 2), (1, 3), (1, 7, 50), (32, 64)):
        m = torch.randn(h, d, d, generator=gen)
        for x in (
            torch.randn(b, h, n, d, generator=gen),
            torch.randn(b, n, h, d, generator=gen).transpose(1, 2),
            torch.randn(b, h, n + 2, d, generator=gen)[:, :, 1 : n + 1],
        ):
            assert _same(_apply_per_head(m, x), torch.einsum("hed,bhnd->bhne", m, x)), (b, h, n, d, x.stride())
