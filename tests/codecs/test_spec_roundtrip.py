"""Codecs are frozen dataclasses whose ``spec`` derives from their fields, in one canonical form.

``parse_codec(codec.spec)`` rebuilds an equal codec for every entry of the shared matrix and every registered
codec's example; what a bound codec took from calibration is left out of equality; the codec cannot be changed
after it is built.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from matrix import MATRIX, CalibrationStub, Entry

from walshkv.codecs.base import Codec, rewrap, unwrap
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.registry import codec_example, parse_codec, registered_codecs
from walshkv.codecs.turbo import TurboQuant

SPECS = sorted({e.spec for e in MATRIX} | {codec_example(name) for name in registered_codecs()})


def _compared(codec: Codec) -> dict[str, object]:
    """The fields that make up ``codec``'s identity (a wrapper's ``inner`` by its own fields, recursively)."""
    out: dict[str, object] = {"type": type(codec)}
    for f in dataclasses.fields(codec):
        if f.compare:
            value = getattr(codec, f.name)
            out[f.name] = _compared(value) if isinstance(value, Codec) else value
    return out


@pytest.mark.parametrize("spec", SPECS)
def test_spec_round_trips_to_an_equal_codec(spec: str) -> None:
    codec = parse_codec(spec)
    again = parse_codec(codec.spec)
    assert again.spec == codec.spec
    assert _compared(again) == _compared(codec)
    assert again == codec and hash(again) == hash(codec)
    assert dataclasses.replace(codec).spec == codec.spec  # derived from the fields, not carried along


@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.id)
def test_a_bound_codec_keeps_its_spec_and_equals_its_unbound_codec(entry: Entry) -> None:
    codec = parse_codec(entry.spec)
    bound = codec.bind(1, entry.kind, CalibrationStub(entry.head_dim))
    if entry.spec.startswith("vht2") and entry.calibrated:  # its calibrated order is the layer's: the spec says so
        assert bound.spec == f"{codec.spec}[{entry.kind}1]" and bound != codec
        return
    assert parse_codec(bound.spec).spec == bound.spec
    if bound.spec == codec.spec and not isinstance(codec, KiviCodec):  # KIVI binds to a side (a field)
        assert bound == codec and hash(bound) == hash(codec)  # K means, transforms, RoPE tables left out


@pytest.mark.parametrize(
    ("written", "canonical"),
    [
        ("tq:3.0", "tq:3"),
        ("tq:3:seed=0:codebook=gauss", "tq:3"),
        ("TQ:2.5:codebook=beta", "tq:2.5:codebook=beta"),
        ("vht2:5,5:order=natural", "vht2:5,5"),
        ("vht2:auto@4.0", "vht2:auto@4"),
        ("rrot:0+int4", "rrot+int4"),
        ("kivi2:g=32:r=32", "kivi2"),
        ("tqprod:3:seed=0", "tqprod:3"),
    ],
)
def test_every_spelling_of_a_codec_gives_one_canonical_spec(written: str, canonical: str) -> None:
    assert parse_codec(written).spec == canonical
    assert parse_codec(written) == parse_codec(canonical)


def test_codecs_are_frozen() -> None:
    codec = parse_codec("center+rot+tq:3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.inner = parse_codec("int4")  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        unwrap(codec).bits = 4.0  # type: ignore[misc]


def test_bound_tensors_are_left_out_of_equality() -> None:
    stub = CalibrationStub(64)
    codec = parse_codec("prerope+center+eq+tq:3.5")
    a, b = codec.bind(0, "k", stub), codec.bind(5, "k", stub)
    assert a == b == codec and len({a, b, codec}) == 1
    assert a.spec == codec.spec
    assert a.rope is not None and codec.rope is None  # type: ignore[attr-defined]


def test_rewrap_rebuilds_the_chain_around_another_storing_codec() -> None:
    codec = parse_codec("center+rrot:7+tq:4:codebook=beta:seed=3")
    moved = rewrap(codec, dataclasses.replace(unwrap(codec), bits=4.5))
    assert moved.spec == "center+rrot:7+tq:4.5:codebook=beta:seed=3"
    assert moved == parse_codec(moved.spec)
    assert rewrap(parse_codec("int4"), TurboQuant(3)) == TurboQuant(3)
    bound = codec.bind(0, "k", CalibrationStub(64))
    kept = rewrap(bound, TurboQuant(2))
    assert torch.equal(kept.bias, bound.bias)  # type: ignore[attr-defined]  # a wrapper keeps its own fields
