"""Small inputs that used to cost unbounded work or end in a traceback: each refused by name, at once.

Fault matrix (docs/reliability.md, "spec limits"): layer ranges past any model (``0-99999999999`` built the
whole range before any check), wrapper chains past what the grammar allows (2,500 ``rot+`` parsed and then
died in ``RecursionError``), ``sink:``/``layers:`` nested in themselves, a spec programmatically wrapped
thousands of times, and a transform that overflows finite K/V (the error blamed the input).
"""

from __future__ import annotations

import time

import pytest
import torch

from walshkv.codecs import parse_codec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import parse_cache_spec
from walshkv.constants import MAX_LAYERS, MAX_WRAPPERS


def _refused_fast(spec: str, match: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        parse_cache_spec(spec)
    assert time.perf_counter() - t0 < 5.0  # refused before building anything (a generous bound, not a benchmark)


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("layers:int4@0-99999999999;int3", r"layer 99999999999 .* past any model \(.*indices 0\.\.4095"),
        (f"layers:int4@{MAX_LAYERS};int3", rf"layer {MAX_LAYERS} .* past any model"),
        ("layers:int4@5,99999999999999999999999;int3", "past any model"),
        ("rot+" * 2500 + "int4", r"chains 2500 wrappers; a codec takes at most 6"),
        ("rrot:1+" * 2500 + "int4/int3", "chains 2500 wrappers"),
        ("sink:1:" * 2500 + "int4", "sink:N: appears twice"),
        ("layers:" * 2500 + "int4", "layers: appears twice"),
        ("layers:int4@0;layers:int3", "layers: appears twice"),
        ("layers:int4@0;sink:1:int3", "write it before layers:"),
    ],
)
def test_specs_that_would_grow_without_bound_are_refused(spec: str, match: str) -> None:
    _refused_fast(spec, match)


def test_the_limits_leave_every_meaningful_spec() -> None:
    assert parse_cache_spec(f"layers:int4@0-{MAX_LAYERS - 1};int3").for_layer(MAX_LAYERS - 1).spec == "int4"
    assert parse_cache_spec("sink:1:prerope+center+eq+rot+rot+int4/int3").spec.startswith("sink:1:prerope+")
    assert parse_codec("rot+rot+fp32").spec == "rot+rot+fp32"


def test_a_codec_wrapped_in_code_is_bounded_too() -> None:
    codec = parse_codec("int4")
    with pytest.raises(ValueError, match=rf"{MAX_WRAPPERS + 1} wrappers around int4; a codec takes at most"):
        for _ in range(3000):
            codec = Rotated(codec)


@pytest.mark.parametrize("spec", ["rot+int4", "rot+fp32", "rrot:3+q8_0"])
def test_a_transform_that_overflows_finite_input_says_so(spec: str) -> None:
    x = torch.full((1, 1, 2, 64), 3e38)  # finite float32; the Hadamard rotation sums 64 of them
    with pytest.raises(ValueError, match=r"transform overflowed torch\.float32: finite K/V \(\|x\| up to 3e\+38\)"):
        parse_codec(spec).encode(x)


def test_values_grown_past_fp16_by_a_rotation_name_the_rotation() -> None:
    x = torch.full((1, 1, 2, 64), 2e4, dtype=torch.float16)  # fine for fp16; 8x that after the rotation
    with pytest.raises(ValueError, match=r"come from rot\+: the K/V handed to rot\+fp16 reach only \|x\| up to 2e\+04"):
        parse_codec("rot+fp16").encode(x)
    with pytest.raises(ValueError, match=r"NaN and 1 Inf"):  # Inf in the input is still the input's
        bad = x.clone()
        bad[0, 0, 0, 0] = float("inf")
        parse_codec("rot+fp16").encode(bad)
