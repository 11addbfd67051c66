"""Finite fp16 K/V near the fp16 maximum: every codec decodes it finite or refuses it on encode (never ±Inf)."""

from __future__ import annotations

import re

import pytest
import torch
from matrix import MATRIX, CalibrationStub, Entry

from walshkv.codecs.base import FP16_TRIAL_ABOVE, Codec
from walshkv.codecs.registry import parse_codec

# from a healthy size up to the fp16 maximum, through the values where codecs used to overflow
MAGNITUDES = (1000.0, 20000.0, 41000.0, 53760.0, 62656.0, 65472.0, 65504.0)


def _codec(entry: Entry) -> Codec:
    return parse_codec(entry.spec).bind(1, entry.kind, CalibrationStub(entry.head_dim, 2))


def _blocks(entry: Entry, magnitude: float) -> dict[str, torch.Tensor]:
    shape = (2, 2, entry.tokens, entry.head_dim)
    gauss = torch.randn(shape, generator=torch.Generator().manual_seed(11))
    spike = torch.zeros(shape)
    spike[..., 5] = magnitude
    flat = torch.full(shape, magnitude)
    flat[..., ::2] *= -1
    blocks = {"gaussian": gauss * (magnitude / gauss.abs().amax()), "spike": spike, "flat": flat}
    return {name: x.half() for name, x in blocks.items()} | {"constant": torch.full(shape, -magnitude).half()}


_CASES = [(m, torch.float16) for m in MAGNITUDES] + [(m, torch.float32) for m in MAGNITUDES[-3:]]


@pytest.mark.parametrize(("magnitude", "dtype"), _CASES, ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.id)
def test_input_up_to_the_fp16_maximum_decodes_finite_or_is_refused(
    entry: Entry, magnitude: float, dtype: torch.dtype
) -> None:
    codec = _codec(entry)
    for name, x in _blocks(entry, magnitude).items():
        x = x.to(dtype)
        assert bool(torch.isfinite(x).all())
        try:
            packed = codec.encode(x, 3)
        except ValueError as err:  # names the limit and a wider dtype or codec
            assert "65504" in str(err) and re.search("fp32|float32", str(err)), f"{name}: {err}"
            continue
        got = codec.decode(packed, 3)
        assert got.dtype == dtype
        assert bool(torch.isfinite(got).all()), f"{entry.spec} decodes {name} |x| = {magnitude} to ±Inf"


def test_below_the_trial_bound_decoded_values_stay_far_from_the_limit() -> None:
    """Why float16 blocks up to FP16_TRIAL_ABOVE need no trial decode: no codec decodes past 32x the input."""
    for entry in MATRIX:
        codec = _codec(entry)
        for name, x in _blocks(entry, 1000.0).items():
            got = codec.decode(codec.encode(x.float(), 3), 3)
            ratio = float(got.abs().amax()) / float(x.float().abs().amax())
            assert ratio * FP16_TRIAL_ABOVE < 65504, (entry.spec, name, ratio)
            assert bool(torch.isfinite(codec.decode(codec.encode(x, 3), 3)).all()), (entry.spec, name)
