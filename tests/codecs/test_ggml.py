"""Tests for llama.cpp's KV-cache block types (q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl).

The encoders must write ggml's block bytes exactly: q4_0/q4_1/q5_0/q5_1/q8_0 are compared with the
numpy reference ports in the ``gguf`` package, iq4_nl (which ``gguf`` can only dequantize) with a
line-by-line scalar port of ggml's ``quantize_row_iq4_nl_ref`` below. Decoding must equal
``gguf.quants.dequantize`` bit for bit.
"""

from __future__ import annotations

import itertools
import warnings

import gguf
import gguf.quants
import numpy as np
import pytest
import torch

from walshkv import CompressedCache
from walshkv.codecs import GGMLCodec, Packed, available_codecs, parse_codec
from walshkv.codecs.ggml import (
    GGML_BLOCK_BYTES,
    GGML_TYPES,
    KVALUES_IQ4NL,
    ggml_dequantize,
    ggml_quantize,
)
from walshkv.codecs.rotation import Rotated

GGUF_QUANTIZED = ["q8_0", "q5_1", "q5_0", "q4_1", "q4_0"]  # types with a numpy quantizer in gguf
HEAD_DIMS = [32, 64, 128, 256]
BITS = {"q8_0": 8.5, "q5_1": 6.0, "q5_0": 5.5, "q4_1": 5.0, "q4_0": 4.5, "iq4_nl": 4.5}
INPUT_KINDS = ["gauss", "heavy", "zeros", "spike", "negative", "ties", "grid", "constant", "tiny"]


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name.upper()]


def make_input(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """float32 K/V-shaped test data; adversarial kinds stress ggml's rounding and max/min rules."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if kind == "gauss":
        x = rng.standard_normal(n)
    elif kind == "heavy":  # Student-t: occasional large outliers, as in real K
        x = rng.standard_t(2, n) * 3
    elif kind == "zeros":  # all zero, plus some all-zero blocks inside non-zero vectors
        x = np.zeros(n)
    elif kind == "spike":  # one huge value per block
        x = rng.standard_normal(n).reshape(-1, 32)
        x[:, 5] = 1e4
        x[::2, 17] = -2e4
    elif kind == "negative":  # negative-dominant blocks: the signed max is negative
        x = -np.abs(rng.standard_normal(n)) * 2
        x.reshape(-1, 32)[:, 3] += 0.5
    elif kind == "ties":  # q4_0/q5_0 with max 8 / 16: x*id lands on .5 exactly; q8_0 with max 127
        x = rng.integers(-16, 17, n) * 0.5
        blocks = x.reshape(-1, 32)
        blocks[0::3, 0] = 8.0
        blocks[1::3, 0] = -16.0
        blocks[2::3, 0] = 127.0
    elif kind == "grid":  # values on a coarse grid: many equal magnitudes of both signs
        x = rng.integers(-127, 128, n) / 8
        x.reshape(-1, 32)[::2, :2] = [[-15.875, 15.875]]
    elif kind == "constant":  # every block constant: d = 0 for the _1 types, m carries the value
        x = np.repeat(rng.standard_normal(n // 32), 32)
    elif kind == "tiny":  # values around 1e-6: fp16 scale is subnormal
        x = rng.standard_normal(n) * 1e-6
    else:
        raise ValueError(kind)
    return np.ascontiguousarray(x.reshape(shape), dtype=np.float32)


def gguf_blocks(x: np.ndarray, name: str) -> np.ndarray:
    """Reference bytes from the gguf package, shape ``[..., head_dim / 32 * block_bytes]``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return gguf.quants.quantize(x, qtype(name))


def blocks_of(codec, x: np.ndarray) -> np.ndarray:
    return codec.encode(torch.from_numpy(x)).tensors["blocks"].numpy()


def same_floats(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality of float32 arrays (distinguishes -0.0 and +0.0)."""
    return a.shape == b.shape and np.array_equal(a.astype(np.float32).view(np.uint32), b.view(np.uint32))


# --- byte-exactness against the gguf reference -----------------------------------------------------------


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_blocks_match_gguf_quantize(name: str, head_dim: int, kind: str) -> None:
    x = make_input(kind, (2, 3, 5, head_dim), seed=head_dim)
    mine = blocks_of(GGMLCodec(name), x)
    assert mine.dtype == np.uint8
    assert np.array_equal(mine, gguf_blocks(x, name))


@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_blocks_match_gguf_many_random_vectors(name: str) -> None:
    x = np.concatenate([make_input("gauss", (1, 4, 300, 128), 1), make_input("heavy", (1, 4, 300, 128), 2)])
    assert np.array_equal(blocks_of(GGMLCodec(name), x), gguf_blocks(x, name))


@pytest.mark.parametrize("kind", INPUT_KINDS)
@pytest.mark.parametrize("name", GGML_TYPES)
def test_decode_matches_gguf_dequantize(name: str, kind: str) -> None:
    codec = GGMLCodec(name)
    x = make_input(kind, (2, 2, 7, 128), seed=3)
    packed = codec.encode(torch.from_numpy(x))
    y = codec.decode(packed).numpy()
    assert y.dtype == np.float32
    ref = gguf.quants.dequantize(packed.tensors["blocks"].numpy(), qtype(name))
    assert same_floats(y, ref)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("name", GGML_TYPES)
def test_decode_of_arbitrary_bytes_matches_gguf(name: str) -> None:
    """Every bit pattern decodes as ggml does (random bytes, finite fp16 d and m)."""
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (40, 4 * GGML_BLOCK_BYTES[name]), dtype=np.uint8)
    blocks = raw.reshape(-1, GGML_BLOCK_BYTES[name])
    n_f16 = 2 if name in ("q4_1", "q5_1") else 1
    f16 = rng.standard_normal((blocks.shape[0], n_f16)).astype(np.float16)
    blocks[:, : 2 * n_f16] = f16.view(np.uint8)
    y = ggml_dequantize(torch.from_numpy(raw), name).numpy()
    assert same_floats(y, gguf.quants.dequantize(raw, qtype(name)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("name", GGUF_QUANTIZED)
def test_other_input_dtypes_quantize_their_float32_value(name: str, dtype: torch.dtype) -> None:
    x = torch.randn(1, 2, 3, 64).to(dtype)
    codec = GGMLCodec(name)
    packed = codec.encode(x)
    assert np.array_equal(packed.tensors["blocks"].numpy(), gguf_blocks(x.to(torch.float32).numpy(), name))
    y = codec.decode(packed)
    assert y.dtype == dtype and y.shape == x.shape


# --- iq4_nl: a scalar port of ggml's quantize_row_iq4_nl_ref ----------------------------------------------


def _best_index_int8(values: tuple[int, ...], x: np.float32) -> int:
    """ggml's original best_index_int8 (binary search, float32 distances)."""
    if x <= values[0]:
        return 0
    if x >= values[-1]:
        return len(values) - 1
    ml, mu = 0, len(values) - 1
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < values[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - np.float32(values[mu - 1]) < np.float32(values[mu]) - x else mu


def iq4_nl_reference_block(xb: np.ndarray) -> bytes:
    """quantize_row_iq4_nl_impl(32, 32, 16, x, ..., quant_weights=NULL, ntry=-1), scalar float32.

    With ntry = -1 the scale search loop runs zero times and the final re-indexing is skipped.
    """
    f32 = np.float32
    values = KVALUES_IQ4NL
    x = [f32(v) for v in xb]
    weight = [xj * xj for xj in x]
    amax, mx = f32(0), f32(0)
    for xj in x:
        if abs(xj) > amax:
            amax, mx = abs(xj), xj
    if amax < f32(1e-15):  # GROUP_MAX_EPS
        d, L = f32(0), [0] * 32
    else:
        d = mx / f32(values[0])
        inv = f32(1) / d
        sumqx, sumq2 = f32(0), f32(0)
        L = []
        for j in range(32):
            lj = _best_index_int8(values, inv * x[j])
            L.append(lj)
            q = f32(values[lj])
            sumqx = sumqx + weight[j] * q * x[j]
            sumq2 = sumq2 + weight[j] * q * q
        d = sumqx / sumq2 if sumq2 > 0 else f32(0)
    qs = bytes(L[j] | (L[j + 16] << 4) for j in range(16))
    return np.float16(d).tobytes() + qs


def iq4_adversarial_blocks(rng: np.random.Generator) -> np.ndarray:
    """Blocks whose scaled values hit the grid midpoints exactly (max = 127 gives id = -1)."""
    mids = [(a + b) / 2 for a, b in itertools.pairwise(KVALUES_IQ4NL)]
    rows = []
    for sign in (1.0, -1.0):
        for _ in range(6):
            row = rng.choice(mids, 32) * rng.choice([1.0, -1.0], 32)
            row = np.clip(row, -126.0, 126.0)
            row[rng.integers(32)] = 127.0 * sign
            rows.append(row)
    near = np.array(mids, dtype=np.float32)
    for direction in (np.inf, -np.inf):  # one float32 step either side of each midpoint
        row = np.zeros(32, np.float32)
        row[:15] = np.nextafter(-near, np.float32(direction))
        row[15] = -127.0
        row[16:31] = np.nextafter(near, np.float32(direction))
        rows.append(row)
    return np.array(rows, dtype=np.float32)


def test_iq4_nl_matches_scalar_reference() -> None:
    rng = np.random.default_rng(5)
    parts = [make_input(kind, (1, 1, 6, 128), seed=i) for i, kind in enumerate(INPUT_KINDS)]
    blocks = np.concatenate([p.reshape(-1, 32) for p in parts] + [iq4_adversarial_blocks(rng)])
    edge = np.zeros((3, 32), np.float32)
    edge[1, 4] = 5e-16  # below GROUP_MAX_EPS: stored as zeros
    edge[2, 4] = 2e-15  # just above it
    blocks = np.concatenate([blocks, edge])
    mine = ggml_quantize(torch.from_numpy(blocks), "iq4_nl").numpy()
    ref = np.frombuffer(b"".join(iq4_nl_reference_block(b) for b in blocks), np.uint8).reshape(mine.shape)
    mismatch = np.nonzero((mine != ref).any(axis=1))[0]
    assert mismatch.size == 0, f"blocks {mismatch[:5]} differ, e.g. {blocks[mismatch[0]]}"


def test_iq4_nl_zero_block_bytes() -> None:
    """ggml stores d = 0 and all-zero indices for blocks with max |x| < 1e-15; they decode to +0."""
    x = torch.zeros(1, 1, 2, 64)
    x[0, 0, 1, 40] = 1.0
    blocks = ggml_quantize(x, "iq4_nl")
    assert blocks[0, 0, 0].tolist() == [0] * 36
    assert blocks[0, 0, 1, :18].tolist() == [0] * 18
    y = ggml_dequantize(blocks, "iq4_nl")
    assert torch.equal(y[0, 0, 0], torch.zeros(64)) and bool((y[0, 0, 0].sign() >= 0).all())


def test_iq4_nl_uses_the_nonlinear_grid() -> None:
    x = torch.randn(1, 2, 9, 64)
    codec = GGMLCodec("iq4_nl")
    packed = codec.encode(x)
    b = packed.tensors["blocks"].reshape(-1, 18)
    d = torch.from_numpy(b[:, :2].contiguous().numpy().view(np.float16).astype(np.float32))
    ratios = codec.decode(packed).reshape(-1, 32) / d
    assert set(torch.unique(ratios).tolist()) <= set(float(v) for v in KVALUES_IQ4NL)


# --- ggml's C semantics where gguf's numpy port differs ------------------------------------------------------


@pytest.mark.parametrize(("name", "d_bytes"), [("q4_0", [0x00, 0x80]), ("q5_0", [0x00, 0x80])])
def test_zero_block_scale_is_negative_zero_as_in_c(name: str, d_bytes: list[int]) -> None:
    """ggml's loop keeps max = +0.0 for an all-zero block, so d = 0/-8 = -0.0 (fp16 0x8000) even when
    the block starts with -0.0; gguf's numpy port picks that -0.0 and stores +0.0 (its only divergence)."""
    x = torch.zeros(1, 1, 2, 32)
    x[0, 0, 1, 0] = -0.0
    blocks = ggml_quantize(x, name)
    assert blocks[0, 0, 0, :2].tolist() == d_bytes
    assert blocks[0, 0, 1, :2].tolist() == d_bytes
    assert np.array_equal(blocks[0, 0, 0].numpy(), gguf_blocks(x[0, 0, :1].numpy(), name)[0])
    assert torch.equal(ggml_dequantize(blocks, name), torch.zeros(1, 1, 2, 32))


# --- layout, sizes, head sizes ------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [*HEAD_DIMS, 96, 160])
@pytest.mark.parametrize("name", GGML_TYPES)
def test_bits_per_element(name: str, head_dim: int) -> None:
    codec = GGMLCodec(name)
    assert codec.bits_per_element(head_dim) == BITS[name]
    assert codec.bytes_per_vector(head_dim) == head_dim // 32 * GGML_BLOCK_BYTES[name]
    assert GGML_BLOCK_BYTES[name] * 8 == BITS[name] * 32


@pytest.mark.parametrize("name", GGML_TYPES)
def test_packed_holds_exactly_the_blocks(name: str) -> None:
    codec = parse_codec(name)
    shape = (2, 3, 11, 128)
    packed = codec.encode(torch.randn(shape))
    assert set(packed.tensors) == {"blocks"} == set(codec.layout(128))
    t = packed.tensors["blocks"]
    assert t.dtype == torch.uint8 and t.shape == (2, 3, 11, 4 * GGML_BLOCK_BYTES[name])
    assert packed.nbytes() == 2 * 3 * 11 * codec.bytes_per_vector(128)
    assert (packed.batch_size, packed.num_heads, packed.seq_len, packed.head_dim) == shape


@pytest.mark.parametrize("head_dim", [48, 16, 100, 1])
@pytest.mark.parametrize("name", GGML_TYPES)
def test_head_dim_not_multiple_of_32_refused(name: str, head_dim: int) -> None:
    codec = GGMLCodec(name)
    with pytest.raises(ValueError, match=r"multiple of 32 for .*\(32, 64, 96, 128"):
        codec.encode(torch.randn(1, 1, 2, head_dim))
    with pytest.raises(ValueError, match=f"got {head_dim}"):
        codec.bits_per_element(head_dim)
    with pytest.raises(ValueError, match="multiple of 32"):
        ggml_quantize(torch.randn(2, head_dim), name)


def test_head_dim_48_message_names_neighbours() -> None:
    with pytest.raises(ValueError, match=r"multiple of 32 for q4_0.*got 48, nearest allowed: 32 or 64"):
        GGMLCodec("q4_0").check_head_dim(48)


def test_unknown_type_refused() -> None:
    with pytest.raises(ValueError, match="q4_0"):
        GGMLCodec("q3_0")
    with pytest.raises(ValueError, match="whole number"):
        ggml_dequantize(torch.zeros(1, 17, dtype=torch.uint8), "q4_0")


# --- spec strings and the rot+ wrapper ---------------------------------------------------------------------


@pytest.mark.parametrize("name", GGML_TYPES)
def test_registered_and_parsed(name: str) -> None:
    assert name in available_codecs()
    codec = parse_codec(name.upper())
    assert isinstance(codec, GGMLCodec) and codec.spec == name
    assert repr(codec) == f"GGMLCodec({name!r})"
    with pytest.raises(ValueError, match="takes no arguments"):
        parse_codec(f"{name}:3")


@pytest.mark.parametrize("wrapper", ["rot", "rrot", "rrot:5"])
@pytest.mark.parametrize("name", GGML_TYPES)
def test_rotated_variants_roundtrip(name: str, wrapper: str) -> None:
    spec = f"{wrapper}+{name}"
    codec = parse_codec(spec)
    assert isinstance(codec, Rotated) and codec.spec == spec
    assert codec.bits_per_element(128) == BITS[name]
    x = torch.randn(2, 3, 9, 128)
    packed = codec.encode(x)
    assert packed.nbytes() == 2 * 3 * 9 * codec.bytes_per_vector(128)
    # The stored bytes are the inner type's blocks of the rotated vectors.
    rotated = codec.rotate(x)
    assert torch.equal(packed.tensors["blocks"], ggml_quantize(rotated, name))
    y = codec.decode(packed)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.allclose(y, codec.unrotate(ggml_dequantize(packed.tensors["blocks"], name)))
    rel = float(((y - x) ** 2).mean() / (x**2).mean())
    assert rel < (1e-4 if name == "q8_0" else 0.02)


def test_rotated_needs_power_of_two_and_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="power-of-two"):
        parse_codec("rot+q4_0").encode(torch.randn(1, 1, 2, 96))
    with pytest.raises(ValueError, match="multiple of 32"):
        parse_codec("rot+q4_0").encode(torch.randn(1, 1, 2, 16))
    GGMLCodec("q4_0").encode(torch.randn(1, 1, 2, 96))  # plain q4_0 takes 96


def test_rotation_helps_q4_0_on_outlier_channels() -> None:
    x = torch.randn(2, 4, 64, 128)
    x[..., 7] *= 20.0  # one outlier channel, as in real K
    err = {s: float(((parse_codec(s).decode(parse_codec(s).encode(x)) - x) ** 2).mean()) for s in ("q4_0", "rot+q4_0")}
    assert err["rot+q4_0"] < err["q4_0"]


# --- edge cases ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [*GGML_TYPES, *(f"rot+{n}" for n in GGML_TYPES)])
def test_zero_vectors_decode_to_zeros(spec: str) -> None:
    codec = parse_codec(spec)
    x = torch.randn(2, 2, 4, 64)
    x[0, 1] = 0.0
    x[1, :, 2] = 0.0
    x[1, 0, 3, 32:] = 0.0  # one zero block inside a non-zero vector
    y = codec.decode(codec.encode(x))
    assert bool(torch.isfinite(y).all())
    assert torch.equal(y[0, 1], torch.zeros(4, 64))
    assert torch.equal(y[1, :, 2], torch.zeros(2, 64))
    if not spec.startswith("rot+"):
        assert torch.equal(y[1, 0, 3, 32:], torch.zeros(32))
    assert torch.equal(codec.decode(codec.encode(torch.zeros(1, 1, 3, 64))), torch.zeros(1, 1, 3, 64))


@pytest.mark.parametrize(
    ("name", "value", "what"),
    [
        ("q8_0", 1e7, "scale d"),
        ("q5_0", 2e6, "scale d"),
        ("q4_0", 6e5, "scale d"),
        ("q5_1", 3e6, "scale d"),
        ("q4_1", 1e6, "scale d"),
        ("iq4_nl", 1e7, "scale d"),
        ("iq4_nl", 1e30, "scale d"),  # float32 overflow inside the weighted fit (NaN) is refused too
    ],
)
def test_fp16_scale_overflow_raises(name: str, value: float, what: str) -> None:
    x = torch.randn(1, 2, 3, 64)
    x[0, 1, 2, 40] = value
    with pytest.raises(ValueError, match=f"{name}: .*{what}.*fp16 range"):
        GGMLCodec(name).encode(x)


@pytest.mark.parametrize("name", ["q4_1", "q5_1"])
def test_fp16_min_overflow_raises(name: str) -> None:
    x = torch.randn(1, 1, 2, 64)
    x[0, 0, 1, :32] = -1e5  # constant block: d = 0 but the minimum m overflows fp16
    with pytest.raises(ValueError, match=r"block minimum m.*fp16 range"):
        GGMLCodec(name).encode(x)


@pytest.mark.parametrize("name", GGML_TYPES)
def test_largest_accepted_values_store_finite_scales(name: str) -> None:
    limit = {"q8_0": 8e6, "q5_0": 1e6, "q4_0": 5e5, "q5_1": 1e6, "q4_1": 4.5e5, "iq4_nl": 8e6}[name]
    x = torch.randn(1, 1, 2, 64)
    x[0, 0, 0, 3] = limit
    x[0, 0, 1, 33] = -6e4 if name.endswith("_1") else -limit  # the _1 types store the minimum as fp16
    y = GGMLCodec(name).decode(GGMLCodec(name).encode(x))
    assert bool(torch.isfinite(y).all())
    assert float(y[0, 0, 0, 3]) == pytest.approx(limit, rel=0.1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("spec", ["q4_0", "iq4_nl", "rot+q8_0"])
def test_non_finite_input_raises(spec: str, bad: float) -> None:
    x = torch.randn(1, 2, 3, 64)
    x[0, 1, 2, 5] = bad
    with pytest.raises(ValueError, match="NaN"):
        parse_codec(spec).encode(x)


def test_encode_does_not_modify_input_and_empty_sequence() -> None:
    for name in GGML_TYPES:
        codec = GGMLCodec(name)
        x = torch.randn(1, 2, 3, 64)
        before = x.clone()
        codec.encode(x)
        assert torch.equal(x, before)
        packed = codec.encode(torch.randn(2, 3, 0, 64))
        assert packed.seq_len == 0 and codec.decode(packed).shape == (2, 3, 0, 64)


def test_packed_slice_and_cat_keep_blocks() -> None:
    codec = GGMLCodec("q5_1")
    a, b = torch.randn(2, 3, 5, 64), torch.randn(2, 3, 4, 64)
    pa, pb = codec.encode(a), codec.encode(b)
    joined = Packed.cat([pa, pb])
    assert torch.equal(codec.decode(joined), torch.cat([codec.decode(pa), codec.decode(pb)], dim=2))
    assert torch.equal(joined.slice_seq(5).tensors["blocks"], pb.tensors["blocks"])


def test_compressed_cache_holds_ggml_blocks() -> None:
    """Through CompressedCache: stored bytes are the ggml blocks, attention sees their decoding."""
    cache = CompressedCache("q8_0/iq4_nl")
    k, v = torch.randn(1, 2, 6, 64), torch.randn(1, 2, 6, 64)
    k_seen, v_seen = cache.update(k, v, 0)
    assert torch.equal(k_seen, ggml_dequantize(ggml_quantize(k, "q8_0"), "q8_0"))
    assert torch.equal(v_seen, ggml_dequantize(ggml_quantize(v, "iq4_nl"), "iq4_nl"))
    assert cache.nbytes() == 2 * 6 * (2 * 34 + 2 * 18)
    assert cache.bits_per_element() == (8.5 + 4.5) / 2


# --- error ordering ------------------------------------------------------------------------------------------


def test_roundtrip_error_ordering_on_gaussian_data() -> None:
    x = torch.randn(2, 4, 64, 128)
    err = {}
    for name in GGML_TYPES:
        codec = GGMLCodec(name)
        err[name] = float(((codec.decode(codec.encode(x)) - x) ** 2).mean() / (x**2).mean())
    assert err["q8_0"] < err["q5_1"] < err["q5_0"] < err["q4_1"] < err["q4_0"], err
    assert err["iq4_nl"] < err["q4_0"], err
    assert err["q8_0"] < 1e-4 and err["q4_0"] < 0.01, err
