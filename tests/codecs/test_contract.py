"""The codec contract, checked on every entry of the shared matrix (tests/codecs/matrix.py).

For each entry: the round trip stays within its tolerance; the bytes held equal the layout's; bits per
element follow from the layout; NaN/Inf and impossible head sizes are refused before any work; decode
returns the input's dtype; ``start`` positions are honoured (and ignored by codecs blind to them).
Every registered codec and wrapper must have an entry, and the wrapper order is checked pair by pair.
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from matrix import MATRIX, CalibrationStub, Entry

from walshkv.codecs.base import REPEATABLE_WRAPPERS, WRAPPER_ORDER, Codec, Packed, Wrapper, wrappers
from walshkv.codecs.calibration import Calibration, Statistics
from walshkv.codecs.center import Centered
from walshkv.codecs.registry import parse_codec, registered_codecs, registered_wrappers

BATCH, HEADS, START = 2, 2, 5


def _codec(entry: Entry, head_dim: int | None = None) -> Codec:
    return parse_codec(entry.spec).bind(1, entry.kind, CalibrationStub(head_dim or entry.head_dim, HEADS))


def _x(entry: Entry, dtype: torch.dtype = torch.float32, head_dim: int | None = None) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randn(BATCH, HEADS, entry.tokens, head_dim or entry.head_dim, generator=gen).to(dtype)


def _expected(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """What decoding gives back: ``x``, less the K mean where ``center+`` is outermost (softmax ignores it)."""
    if isinstance(codec, Centered):
        return x.float() - codec.plain_offset()[None, :, None, :]
    return x.float()


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.fixture(params=MATRIX, ids=lambda e: e.id)
def entry(request: pytest.FixtureRequest) -> Entry:
    return request.param


def test_the_round_trip_stays_within_tolerance(entry: Entry) -> None:
    codec = _codec(entry)
    x = _x(entry)
    got = codec.decode(codec.encode(x, START), START)
    assert got.shape == x.shape
    assert _relative_error(got, _expected(codec, x)) <= entry.tol


def test_the_bytes_held_are_the_layouts(entry: Entry) -> None:
    codec = _codec(entry)
    d = entry.head_dim
    packed = codec.encode(_x(entry), START)
    layout = codec.layout(d)
    assert set(packed.tensors) == set(layout)
    vectors = BATCH * HEADS * packed.seq_len  # KIVI's K: packed.seq_len counts token groups, its layout one group
    for name, field in layout.items():
        t = packed.tensors[name]
        assert t.shape == (BATCH, HEADS, packed.seq_len, *field.shape) and t.dtype == field.dtype, name
    assert sum(f.nbytes for f in layout.values()) * vectors == packed.nbytes()
    assert codec.bits_per_element(d) == 8 * codec.bytes_per_vector(d) / d
    assert codec.bits_per_element(d) * d * BATCH * HEADS * entry.tokens == pytest.approx(8 * packed.nbytes())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused_before_any_work(entry: Entry, bad: float) -> None:
    codec = _codec(entry)
    x = _x(entry)
    x[1, 0, entry.tokens - 1, 3] = bad
    before = x.clone()
    with pytest.raises(ValueError, match="NaN"):
        codec.encode(x, START)
    assert torch.equal(x.isnan(), before.isnan()) and torch.equal(x.nan_to_num(), before.nan_to_num())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_decode_returns_the_input_dtype(entry: Entry, dtype: torch.dtype) -> None:
    codec = _codec(entry)
    packed = codec.encode(_x(entry, dtype), START)
    assert packed.dtype == dtype
    assert codec.decode(packed, START).dtype == dtype


def test_an_impossible_head_size_is_refused(entry: Entry) -> None:
    codec = _codec(entry)
    with pytest.raises(ValueError, match="head_dim"):
        codec.check_head_dim(0)
    if entry.bad_head_dim is None:
        return
    with pytest.raises(ValueError, match="head_dim"):
        codec.encode(_x(entry, head_dim=entry.bad_head_dim), START)


def test_start_positions_are_honoured(entry: Entry) -> None:
    codec = _codec(entry)
    x = _x(entry)
    whole = codec.decode(codec.encode(x, START), START)
    with pytest.raises(ValueError, match="start"):
        codec.encode(x, -1)
    with pytest.raises(ValueError, match="start"):
        codec.decode(codec.encode(x), -1)
    if not entry.positional:  # blind to positions: start changes nothing
        assert torch.equal(codec.decode(codec.encode(x, 0), 0), whole)
        return
    # two blocks at their own positions decode as the whole block does; a wrong start does not
    cut = entry.tokens // 2
    parts = Packed.cat([codec.encode(x[:, :, :cut], START), codec.encode(x[:, :, cut:], START + cut)])
    torch.testing.assert_close(codec.decode(parts, START), whole, atol=1e-5, rtol=1e-5)
    assert _relative_error(codec.decode(codec.encode(x, START), START + 3), x) > 2 * entry.tol + 0.1


def test_calibration_is_needed_where_the_entry_says(entry: Entry) -> None:
    unbound = parse_codec(entry.spec)
    assert unbound.needs_calibration == entry.calibrated
    assert not _codec(entry).needs_calibration
    if not entry.calibrated:
        return
    # without calibration: a K-only wrapper on V is skipped down to a codec that needs none; anything else is
    # refused with the fix (every calibrated codec can be calibrated from a text)
    if isinstance(unbound, Wrapper) and entry.kind not in unbound.kinds:
        assert not unbound.bind(0, entry.kind, None).needs_calibration
        return
    with pytest.raises(ValueError, match=r"needs .*--calib-text TEXT"):
        unbound.bind(0, entry.kind, None)


# ---- the matrix itself ----------------------------------------------------------------------------------


def _base_name(spec: str) -> str:
    return spec.split("+")[-1].split(":")[0].lower()


def _wrapper_names(spec: str) -> set[str]:
    return {token.split(":")[0].lower() for token in spec.split("+")[:-1]}


def test_every_registered_codec_and_wrapper_has_a_matrix_entry() -> None:
    covered = {_base_name(e.spec) for e in MATRIX}
    missing = [name for name in registered_codecs() if name not in covered]
    assert not missing, f"add an entry to tests/codecs/matrix.py for {missing}"
    wrapped = set().union(*(_wrapper_names(e.spec) for e in MATRIX))
    missing = [name for name in registered_wrappers() if name not in wrapped]
    assert not missing, f"add an entry to tests/codecs/matrix.py for the wrappers {missing}"


def test_the_stub_is_a_full_calibration() -> None:
    stub = CalibrationStub(64)
    assert isinstance(stub, Statistics) and isinstance(stub, Calibration)


# ---- wrappers: their order and sides, as data -------------------------------------------------------------


#: how a spec writes the wrappers that need an argument
_WRITTEN = {"ropeblock": "ropeblock:4"}


#: pairs in WRAPPER_ORDER that the outer wrapper refuses: the block frame centres K itself and needs eqr+, which is
#: fitted after RoPE (center+, eq+ and eqd+ work on K before RoPE)
_REFUSED_INSIDE = {("ropeblock", "center"), ("ropeblock", "eq"), ("ropeblock", "eqd")}


def _written(name: str) -> str:
    return _WRITTEN.get(name, name)


def _wrapper_of(name: str) -> Wrapper:
    codec = parse_codec(f"{_written(name)}+fp32")
    assert isinstance(codec, Wrapper)
    return codec


@pytest.mark.parametrize("name", registered_wrappers())
def test_every_wrapper_has_a_slot_and_says_which_sides_it_serves(name: str) -> None:
    w = _wrapper_of(name)
    assert w.name in WRAPPER_ORDER and w.prefix.split(":")[0] == name
    assert w.kinds and set(w.kinds) <= {"k", "v"} and w.other_kind in ("skip", "refuse")
    stub = CalibrationStub(64)
    for kind in ("k", "v"):
        if kind in w.kinds:
            assert isinstance(w.bind(0, kind, stub), type(w))
        elif w.other_kind == "skip":
            assert not wrappers(w.bind(0, kind, stub))
        else:
            with pytest.raises(ValueError, match=f"{name}\\+"):
                w.bind(0, kind, stub)


@pytest.mark.parametrize(("outer", "inner"), list(itertools.product(registered_wrappers(), repeat=2)))
def test_wrappers_out_of_order_name_the_spec_written_in_order(outer: str, inner: str) -> None:
    a, b = _wrapper_of(outer), _wrapper_of(inner)
    spec = f"{_written(outer)}+{_written(inner)}+int4"
    rank_a, rank_b = WRAPPER_ORDER.index(a.name), WRAPPER_ORDER.index(b.name)
    if (outer, inner) in _REFUSED_INSIDE:  # in order, but a pair that does not make sense: refused by name
        with pytest.raises(ValueError, match=f"not {inner}\\+ inside it"):
            parse_codec(spec)
        return
    if (inner, outer) in _REFUSED_INSIDE:  # out of order, and no order makes the pair valid
        with pytest.raises(ValueError):
            parse_codec(spec)
        return
    if rank_a < rank_b or (a.name == b.name and a.name in REPEATABLE_WRAPPERS):
        assert parse_codec(spec).spec == spec
        return
    with pytest.raises(ValueError) as info:
        parse_codec(spec)
    fixed = re.search(r"[\w:.+]+\+int4", str(info.value).partition("write")[2])  # the first spec after "write"
    assert fixed is not None, str(info.value)
    assert parse_codec(fixed[0]).spec == fixed[0]


# ---- every method refuses the head sizes encode refuses; encoding ignores the memory layout ---------------


def test_every_method_refuses_the_head_sizes_encode_refuses(entry: Entry) -> None:
    codec = _codec(entry)
    for bad in (0, -4, entry.bad_head_dim):
        if bad is None:
            continue
        with pytest.raises(ValueError, match="head_dim") as refused:
            codec.check_head_dim(bad)
        for method in (codec.layout, codec.bytes_per_vector, codec.bits_per_element):
            with pytest.raises(ValueError, match="head_dim") as got:
                method(bad)
            assert str(got.value) == str(refused.value), method.__name__
        if bad > 0:
            with pytest.raises(ValueError, match="head_dim") as got:
                codec.encode(_x(entry, head_dim=bad), START)
            assert str(got.value) == str(refused.value)


def _ties(entry: Entry) -> torch.Tensor:
    """Values on a coarse grid (many exact ties in rounding and in sorts), laid out [b, h, head_dim, tokens]."""
    gen = torch.Generator().manual_seed(3)
    return torch.randint(-4, 5, (BATCH, HEADS, entry.head_dim, entry.tokens), generator=gen).float() / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_view_encodes_to_the_same_bytes_as_its_contiguous_copy(entry: Entry, dtype: torch.dtype) -> None:
    codec = _codec(entry)
    one = _ties(entry)[:, :, :, :1].transpose(-1, -2)
    views = [x.to(dtype).transpose(-1, -2) for x in (_ties(entry), torch.randn_like(_ties(entry)))]
    views.append(one.to(dtype).expand(BATCH, HEADS, entry.tokens, entry.head_dim))  # one vector, stride 0
    for view in views:  # [b, h, tokens, head_dim], none of them contiguous
        assert not view.is_contiguous()
        a, b = codec.encode(view, START), codec.encode(view.contiguous(), START)
        assert a.tensors.keys() == b.tensors.keys()
        for name in a.tensors:
            assert torch.equal(a.tensors[name], b.tensors[name]), name
