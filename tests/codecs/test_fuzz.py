"""A CI-sized hypothesis fuzz of every codec entry of the shared matrix (tests/codecs/matrix.py).

Each example is a random finite block ``[batch 1-2, kv_heads 1-3, seq 1-17, entry.head_dim]`` (KIVI's K: ``seq``
rounded up to whole groups) in float16, bfloat16 or float32, with per-vector magnitudes from 1e-3 to 1e3
(Gaussian, uniform, heavy-tailed or spike vectors, some of them replaced by zero vectors or constant vectors),
encoded at a random start position. Checked: ``encode`` never raises; ``decode`` is finite, of the input's dtype
and shape; ``Packed.nbytes()`` equals the layout's bytes times the vectors stored; and every vector's error is
within its family's bound.

The bounds are worst cases derived from each codec's bits, per vector, on ``z``, the vector the storing codec
sees (the input after the wrappers' transforms: ``prerope+`` undoes RoPE, ``center+`` subtracts the mean,
``eq+`` applies ``A``, ``rot+`` rotates). ``s = absmax / qmax`` is a symmetric quantizer's step
(``qmax = 2^(B-1) - 1``, its fp16 scale rounded up: at most ``s (1 + 2^-10) + 2^-24``):

============  ==========================================================================================
family        ``||decode(z) - z||`` at most
============  ==========================================================================================
fp16/bf16/32  ``u ||z||`` with the storage dtype's unit roundoff ``u`` = 2^-11, 2^-8, 2^-24 (+ fp16 subnormals)
intB          ``||min(|z_i|, s/2)||``: round to nearest, and a value under half a step rounds to 0
vht2, sqfree  the same per band of Walsh-Hadamard coefficients (1-bit bands, sign x mean: the band's norm;
              coefficients not kept: their norm)
vzc           ``||z||``: sign x mean|y| per residue class leaves at most the class's norm
q8_0          per block of 32 with ``a`` its absmax: ``|e_i| <= a/254 + 127 Δd`` (half a step, and the fp16
              rounding Δd of the scale the codes were computed with)
q4_0, q5_0    ``|e_i| <= a/2^(B-1) + 2^(B-1) Δd``: a whole step, where the value opposite the signed maximum clips
q4_1, q5_1    ``|e_i| <= a/(2^B - 1) + (2^B - 1) Δd + Δm`` (half a step of the block's range ``<= 2a``)
iq4_nl        ``|e_i| <= 14 |d0| + 127 |d - d0|``: the grid's largest half gap is 12 and its top clips by 14 steps of
              ``d0 = max/-127``, and the refitted scale ``d`` (read from the block) moves each level by ``|q| <= 127``
tq:B          per rotated, normalised coordinate ``t``: half the largest gap of the B-bit Lloyd-Max levels, or
              ``|t| - level_max`` beyond the outer level; times ``norm/sqrt(d)``
tqprod:B      ``||r|| (1 + sqrt(pi/2) σ_max(S)/sqrt(d))`` with ``r`` the tq:(B-1) residual (bounded as tq) and
              ``S`` the QJL matrix: the 1-bit sketch is unbiased for inner products, not small in norm
kivi          ``range/(2 (2^B-1))`` per (channel, K group) or (token, V channel group), + the fp16 zero's rounding
vllm-tq:B     as tq on the unit vector ``u`` (plain Hadamard, vLLM's levels) giving ``E``; the result is
              ``n16 c`` (``:nc``: ``c/||c||``, at most ``2E`` from ``u``) with ``n16`` the fp16 norm
vllm-uq:B     half a step of the vector's range, plus the fp16 rounding of the step (times the top code) and of the
              minimum
vllm-fp8      ``2^-4 |z_i|`` (e4m3's 3 mantissa bits), ``2^-10`` under its subnormals, and ``|z_i| - 448`` clipped
vllm-int4     in the transformed vector ``y`` (norm ``sqrt(b) ||z||``): one step ``s`` per value when ``y`` has values
              of both signs, else ``|y_i| + 15 s`` (the zero point clamps); over ``sqrt(b)``; plus ``y``'s rounding
              to the input's dtype (bf16's ``2^-8`` taken for all)
============  ==========================================================================================

The outer error is at most the storing codec's times ``||A⁻¹||`` for each ``eq+``; float32 rounding of the
transforms and the cast to the input's dtype are added (``2^-16 ||x||`` and the output dtype's roundoff).
Examples per entry: ``WALSHKV_FUZZ_EXAMPLES`` (default 16, derandomized); the run prints the examples tried.
"""

from __future__ import annotations

import functools
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from matrix import MATRIX, CalibrationStub, Entry

from walshkv.codecs.base import Codec, Packed, unwrap, wrappers
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.floats import FloatCodec
from walshkv.codecs.ggml import KVALUES_IQ4NL, QK, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.registry import parse_codec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.trellis import TrellisQuant
from walshkv.codecs.turbo import TurboQuant, TurboQuantProd
from walshkv.codecs.vht2 import SqfreeCodec, VHT2Codec, VZCCodec
from walshkv.codecs.vllm import FP8_MAX, VllmFp8, VllmInt4, VllmTurboKey, VllmUniformValue, vllm_centroids
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.numtheory import squarefree_indices
from walshkv.ops.quant import symmetric_qmax
from walshkv.ops.rope import turn, undo_rope

EXAMPLES = int(os.environ.get("WALSHKV_FUZZ_EXAMPLES", "16"))
FUZZED: Counter[str] = Counter()  # examples passed per entry id
TIGHTNESS: dict[str, float] = {}  # per entry id: the largest error / bound seen
_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
_SUB16 = 2.0**-25  # half the spacing of fp16 subnormals: the absolute rounding of a tiny fp16 number
_F32_SLACK = 2.0**-16  # float32 rounding of the wrappers' transforms and the codecs' own rotations


@dataclass(frozen=True)
class Case:
    """One fuzzed block: its shape, dtype, values (from ``seed``) and start position."""

    batch: int
    heads: int
    seq: int
    dtype: torch.dtype
    log_magnitude: float  # log10 of the typical |x|
    spread: float  # per-vector magnitudes vary by up to 10^spread either way (within 1e-3 .. 1e3)
    shape: str
    zero_share: float
    constant_share: float
    seed: int
    start: int


CASES = st.builds(
    Case,
    batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    seq=st.integers(1, 17),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    log_magnitude=st.floats(-3.0, 3.0),
    spread=st.sampled_from([0.0, 1.0, 3.0]),
    shape=st.sampled_from(["gauss", "uniform", "heavy", "spike"]),
    zero_share=st.sampled_from([0.0, 0.25, 1.0]),
    constant_share=st.sampled_from([0.0, 0.25, 1.0]),
    seed=st.integers(0, 2**31 - 1),
    start=st.integers(0, 4096),
)


def _block(case: Case, seq: int, d: int) -> torch.Tensor:
    """``[batch, heads, seq, d]`` in ``case.dtype``, every vector's magnitude within 1e-3 .. 1e3 (zeros aside)."""
    gen = torch.Generator().manual_seed(case.seed)
    shape = (case.batch, case.heads, seq, d)
    x = {
        "gauss": lambda: torch.randn(shape, generator=gen),
        "uniform": lambda: torch.rand(shape, generator=gen) * 2 - 1,
        "heavy": lambda: torch.randn(shape, generator=gen) ** 3 / 3,
        "spike": lambda: torch.zeros(shape).index_fill_(3, torch.randint(0, d, (1,), generator=gen), 4.0),
    }[case.shape]()
    vectors = shape[:3]
    log_m = case.log_magnitude + case.spread * (2 * torch.rand(vectors, generator=gen) - 1)
    x = x * 10 ** log_m.clamp(-3, 3)[..., None]
    constant = torch.rand(vectors, generator=gen) < case.constant_share
    value = 10 ** log_m.clamp(-3, 3) * torch.where(torch.rand(vectors, generator=gen) < 0.5, -1.0, 1.0)
    x = torch.where(constant[..., None], value[..., None].expand(shape), x)
    x = torch.where((torch.rand(vectors, generator=gen) < case.zero_share)[..., None], 0.0, x)
    return x.to(case.dtype)


@functools.cache
def _codec(entry: Entry, heads: int) -> Codec:
    return parse_codec(entry.spec).bind(1, entry.kind, CalibrationStub(entry.head_dim, heads))


# ---- the storing codec's input, and its bound ------------------------------------------------------------


def _storing_input(
    codec: Codec, x: torch.Tensor, start: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(z, gain, offset, carried)``: what the storing codec encodes ``[b, h, s, d]``, the factor ``[h]`` by which
    the wrappers can grow its error (``||A⁻¹||`` per ``eq+``), the mean ``[h, d]`` decoding leaves subtracted, and
    the norm ``[h]`` of a mean subtracted and added back (float32 rounding scales with it too)."""
    z, heads = x.float(), x.shape[1]
    gain, offset, carried = torch.ones(heads), torch.zeros(heads, x.shape[-1]), torch.zeros(heads)
    for i, w in enumerate(wrappers(codec)):
        if isinstance(w, RopeBlock):  # turned back by each block's first position, minus the mean at its offset
            assert w.rope is not None and w.mu is not None
            n = z.shape[-2]
            z = turn(z, w.rope, w.block_starts(start, n), inverse=True)
            z = z - w.offset_means()[:, (torch.arange(start, start + n) % w.block)][None]
            carried = torch.linalg.vector_norm(w.mu, dim=-1)
        elif isinstance(w, PreRope):
            assert w.rope is not None
            z = undo_rope(z, w.rope, start)
        elif isinstance(w, Centered):
            mean = w.plain_offset()  # in the plain basis: rotating after it is rotating then subtracting the bias
            z = z - mean[None, :, None, :]
            offset = mean if i == 0 else offset  # prerope+ adds it back
        elif isinstance(w, Equalized):
            assert w.matrix is not None and w.inverse is not None
            z = torch.einsum("hed,bhnd->bhne", w.matrix, z)
            gain = gain * torch.linalg.matrix_norm(w.inverse.double(), ord=2).float()
        elif isinstance(w, Rotated):
            z = w.rotate(z)
        else:
            raise AssertionError(f"{type(w).__name__}: teach tests/codecs/test_fuzz.py its transform and bound")
    return z, gain, offset, carried


def _step(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """The stored step of a symmetric quantizer: ``absmax / qmax`` as fp16, rounded up."""
    return absmax / qmax * (1 + 2.0**-10) + 2.0**-24


def _symmetric(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Squared error bound per vector of one band ``[..., n]`` at ``bits`` (sign x mean for 1 bit)."""
    if bits == 1:
        return (y**2).sum(-1) * (1 + 2.0**-9)
    s = _step(y.abs().amax(-1, keepdim=True), symmetric_qmax(bits))
    return (torch.minimum(y.abs(), s / 2) ** 2).sum(-1)


def _coefficients(y: torch.Tensor, kept: torch.Tensor, bands: list[tuple[int, int]]) -> torch.Tensor:
    """Bound of Walsh-Hadamard coefficient codecs: the bands ``(size, bits)`` over ``y[..., kept]``, the rest 0."""
    dropped = torch.ones(y.shape[-1], dtype=torch.bool)
    dropped[kept] = False
    total, at = (y[..., dropped] ** 2).sum(-1), 0
    for size, bits in bands:
        total = total + _symmetric(y[..., kept[at : at + size]], bits)
        at += size
    return total.sqrt()


def _ggml(codec: GGMLCodec, z: torch.Tensor, packed: Packed) -> torch.Tensor:
    blocks = z.reshape(*z.shape[:-1], -1, QK)
    a = blocks.abs().amax(-1, keepdim=True)
    name = codec.spec
    bits = int(name[1]) if name[0] == "q" else 4
    if name == "q8_0":
        e = a / 254 + 127 * (a / 127 * 2.0**-11 + _SUB16)
    elif name in ("q4_0", "q5_0"):
        half = 1 << (bits - 1)
        e = a / half + half * (a / half * 2.0**-11 + _SUB16)
    elif name in ("q4_1", "q5_1"):
        levels = (1 << bits) - 1
        e = a / levels + levels * (2 * a / levels * 2.0**-11 + _SUB16) + a * 2.0**-11 + _SUB16
    else:  # iq4_nl: the scale d0 the codes were chosen with, and the refitted d the block stores
        signed = blocks.gather(-1, blocks.abs().argmax(-1, keepdim=True))
        d0 = signed / KVALUES_IQ4NL[0]
        raw = packed.tensors["blocks"].reshape(*z.shape[:-1], -1, codec.block_bytes)[..., :2].contiguous()
        d = raw.view(torch.float16).float()
        e = 14 * d0.abs() + 127 * (d - d0).abs() + a * 2.0**-20
    return (e.expand_as(blocks) ** 2).sum((-1, -2)).sqrt()


def _tq(codec: TurboQuant, z: torch.Tensor) -> torch.Tensor:
    d = z.shape[-1]
    scale = torch.linalg.vector_norm(z.double(), dim=-1, keepdim=True).to(torch.float16).float() / math.sqrt(d)
    t = codec.rotate(z) / torch.where(scale > 0, scale, torch.ones_like(scale))
    parts = []
    for _, begin, end, bits in codec.segments(d):
        levels = codec.quantizer(bits, d).levels.float()
        top, half_gap = float(levels[-1]), float(levels.diff().max()) / 2 if levels.numel() > 1 else 0.0
        u = t[..., begin:end].abs()
        parts.append(torch.where(u > top, u - top, torch.full_like(u, half_gap)))
    return scale.squeeze(-1) * torch.linalg.vector_norm(torch.cat(parts, -1), dim=-1)


def _tcq(codec: TrellisQuant, z: torch.Tensor) -> torch.Tensor:
    # the trellis decodes every value to an entry of its table: |t_i - table[s_i]| <= |t_i| + max |table|
    d = z.shape[-1]
    scale = torch.linalg.vector_norm(z.double(), dim=-1, keepdim=True).to(torch.float16).float() / math.sqrt(d)
    t = codec.rotation.rotate(z) / torch.where(scale > 0, scale, torch.ones_like(scale))
    top = float(codec.table().abs().max())
    return scale.squeeze(-1) * torch.linalg.vector_norm(t.abs() + top, dim=-1) * (1 + 2.0**-10)


def _kivi(codec: KiviCodec, z: torch.Tensor) -> torch.Tensor:
    b, h, t, d = z.shape
    levels = (1 << codec.bits) - 1
    if codec.kind == "k":  # per channel over each group of G tokens
        groups, dim = z.reshape(b, h, t // codec.group, codec.group, d), 3
    else:  # per token over groups of channels
        gv = codec.v_group(d)
        groups, dim = z.reshape(b, h, t, d // gv, gv), 4
    lo, hi = groups.amin(dim, keepdim=True), groups.amax(dim, keepdim=True)
    e = (hi - lo) / levels * (1 + 2.0**-10) / 2 + 2.0**-24 + lo.abs() * 2.0**-11 + _SUB16
    return (e.expand_as(groups) ** 2).reshape(b, h, t, d).sum(-1).sqrt()


def _vllm_tq(codec: VllmTurboKey, z: torch.Tensor) -> torch.Tensor:
    d = z.shape[-1]
    n = torch.linalg.vector_norm(z.double(), dim=-1).float()
    n16 = n.to(torch.float16).float()
    u = hadamard_transform(z.float()) / torch.where(n > 0, n, torch.ones_like(n))[..., None]
    levels, _ = vllm_centroids(d, codec.bits)
    top, half_gap = float(levels[-1]), float(levels.diff().max()) / 2
    e = torch.linalg.vector_norm(torch.where(u.abs() > top, u.abs() - top, torch.full_like(u, half_gap)), dim=-1)
    e = 2 * e if codec.norm_correction else e
    return n16 * e + (n - n16).abs() * (1 + e) + 1e-7 + n * 2.0**-20


def _vllm_uq(codec: VllmUniformValue, z: torch.Tensor) -> torch.Tensor:
    lo, hi = z.amin(-1, keepdim=True), z.amax(-1, keepdim=True)
    top = (1 << codec.bits) - 1
    s = torch.clamp((hi - lo) / top, min=1e-8)
    e = s / 2 * (1 + 2.0**-18) + top * (s * 2.0**-11 + _SUB16) + lo.abs() * 2.0**-11 + _SUB16
    return e.squeeze(-1) * math.sqrt(z.shape[-1])


def _vllm_int4(z: torch.Tensor) -> torch.Tensor:
    d = z.shape[-1]
    b = d & -d
    y = hadamard_transform(z.float().reshape(*z.shape[:-1], d // b, b)).reshape(z.shape) * math.sqrt(b)
    lo, hi = y.amin(-1), y.amax(-1)
    s = torch.clamp((hi - lo) / 15, min=1e-6) * (1 + 2.0**-18)
    norm = torch.linalg.vector_norm(y, dim=-1)
    rot = torch.where((lo <= 0) & (hi >= 0), s * math.sqrt(d), norm + 15 * s * math.sqrt(d))
    return (rot + 2.0**-8 * norm) / math.sqrt(b)


def _store_bound(codec: Codec, z: torch.Tensor, packed: Packed) -> torch.Tensor:
    """The bound on ``||decode(z) - z||`` per vector ``[b, h, s]`` for the storing codec (module docstring)."""
    d = z.shape[-1]
    norm = torch.linalg.vector_norm(z, dim=-1)
    if isinstance(codec, FloatCodec):
        return _ROUNDOFF[codec.storage_dtype] * norm + math.sqrt(d) * _SUB16
    if isinstance(codec, IntCodec):
        return _symmetric(z, codec.bits).sqrt()
    if isinstance(codec, VHT2Codec):
        sizes = [(band.size, band.bits) for band in codec.bands(d)]
        perm = codec.perm(d)
        return _coefficients(hadamard_transform(z), perm[: sum(n for n, _ in sizes)], sizes)
    if isinstance(codec, SqfreeCodec):
        kept = torch.tensor(squarefree_indices(d))
        return _coefficients(hadamard_transform(z), kept, [(kept.numel(), codec.bits)])
    if isinstance(codec, VZCCodec):
        return norm * (1 + 2.0**-9)
    if isinstance(codec, GGMLCodec):
        return _ggml(codec, z, packed)
    if isinstance(codec, TurboQuant):
        return _tq(codec, z)
    if isinstance(codec, TrellisQuant):
        return _tcq(codec, z)
    if isinstance(codec, TurboQuantProd):
        residual = norm if codec.stage is None else _tq(codec.stage, z)
        sigma = float(torch.linalg.matrix_norm(codec.projection(d).double(), ord=2))
        return residual * (1 + math.sqrt(math.pi / 2) * sigma / math.sqrt(d) * (1 + 2.0**-10))
    if isinstance(codec, KiviCodec):
        return _kivi(codec, z)
    if isinstance(codec, VllmTurboKey):
        return _vllm_tq(codec, z)
    if isinstance(codec, VllmUniformValue):
        return _vllm_uq(codec, z)
    if isinstance(codec, VllmFp8):
        a = z.float().abs()
        e = (a - FP8_MAX).clamp(min=0) + 2.0**-4 * a.clamp(max=FP8_MAX) + 2.0**-10
        return torch.linalg.vector_norm(e, dim=-1)
    if isinstance(codec, VllmInt4):
        return _vllm_int4(z)
    raise AssertionError(f"{type(codec).__name__}: state its family's bound in tests/codecs/test_fuzz.py")


# ---- the fuzz ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not FUZZED:
        return
    loosest = min(TIGHTNESS, key=TIGHTNESS.__getitem__)
    with capture.global_and_fixture_disabled():
        reporter.write_line(
            f"\ncodec fuzz: {sum(FUZZED.values())} examples passed over {len(FUZZED)} matrix entries; largest "
            f"error/bound per entry from {TIGHTNESS[loosest]:.2f} ({loosest}) to {max(TIGHTNESS.values()):.2f}"
        )
        if os.environ.get("WALSHKV_FUZZ_REPORT"):
            for name, ratio in sorted(TIGHTNESS.items(), key=lambda kv: kv[1]):
                reporter.write_line(f"  {name}: {FUZZED[name]} examples, largest error/bound {ratio:.3f}")


@pytest.mark.parametrize("entry", MATRIX, ids=lambda e: e.id)
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(case=CASES)
def test_valid_input_encodes_and_decodes_within_the_bound(entry: Entry, case: Case) -> None:
    codec = _codec(entry, case.heads)
    store = unwrap(codec)
    group = store.group if isinstance(store, KiviCodec) and store.kind == "k" else 1
    seq = -(-case.seq // group) * group
    x = _block(case, seq, entry.head_dim)
    assert bool(torch.isfinite(x).all())

    packed = codec.encode(x, case.start)  # valid finite input never raises
    got = codec.decode(packed, case.start)
    assert got.dtype == x.dtype and got.shape == x.shape
    assert bool(torch.isfinite(got).all()), f"{entry.id}: decoded NaN/Inf"

    vectors = case.batch * case.heads * packed.seq_len
    assert packed.seq_len == seq // group
    assert packed.nbytes() == sum(f.nbytes for f in codec.layout(entry.head_dim).values()) * vectors

    z, gain, offset, carried = _storing_input(codec, x, case.start)
    bound = gain[None, :, None] * _store_bound(store, z, packed)
    size = torch.linalg.vector_norm(x.float(), dim=-1) + torch.linalg.vector_norm(offset, dim=-1)[None, :, None]
    size = size + carried[None, :, None]
    out = torch.linalg.vector_norm(got.float(), dim=-1)
    bound = bound + _F32_SLACK * gain[None, :, None] * size + _ROUNDOFF[x.dtype] * out + 64 * _SUB16
    error = torch.linalg.vector_norm(got.float() - (x.float() - offset[None, :, None, :]), dim=-1)
    worst = int((error - bound).argmax())
    assert bool((error <= bound).all()), (
        f"{entry.id}: a vector's error {float(error.flatten()[worst]):.4g} exceeds its bound "
        f"{float(bound.flatten()[worst]):.4g} (|x| {float(size.flatten()[worst]):.4g}) for {case}"
    )
    FUZZED[entry.id] += 1
    TIGHTNESS[entry.id] = max(TIGHTNESS.get(entry.id, 0.0), float((error / bound).max()))
