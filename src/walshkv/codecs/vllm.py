"""vLLM 0.32's and LMCache 0.5.6's own quantized KV caches, emulated as walshkv codecs so the harness can judge
them as peers.

vLLM ships ``--kv-cache-dtype turboquant_k8v4 | turboquant_4bit_nc | turboquant_k3v4_nc | turboquant_3bit_nc``
(TurboQuant) and ``int4_per_token_head``. Each side of each is one codec here, written from the vLLM 0.32.0 source
(``model_executor/layers/quantization/turboquant/``, ``v1/attention/ops/triton_turboquant_store.py`` and
``triton_turboquant_decode.py``, ``v1/attention/ops/int4_per_token_head.py``) and checked against that source in
vLLM's own environment (``plugins/vllm/tests_vllm/test_vllm_peers.py``: vLLM's Triton store kernels run under
Triton's interpreter on the CPU, byte for byte):

* ``vllm-tq:B[:nc]`` (TurboQuant keys, B in 3, 4): the vector's L2 norm as fp16; the unit vector times the plain
  orthonormal Sylvester Hadamard matrix (no random signs); each coordinate's index among ``2**B`` Lloyd-Max
  centroids for N(0, 1/head_dim) (vLLM's own solver: trapezoid sums, :func:`vllm_centroids`), packed LSB-first.
  Decoding reads the centroids, with ``:nc`` (norm correction) rescales them to a unit vector, rotates back and
  multiplies by the norm. ``head_dim * B + 16`` bits per vector.
* ``vllm-uq:B`` (TurboQuant values, B in 3, 4): asymmetric min-max over the vector, ``2**B`` levels, scale and
  minimum stored as fp16 (codes made with their float32 values, read back with the fp16 ones, as vLLM does).
  ``head_dim * B + 32`` bits per vector.
* ``vllm-fp8`` (``turboquant_k8v4``'s keys): a plain cast to float8 e4m3 (the ``e4nv`` format of Hopper and later,
  saturating at +-448), no scale. 8 bits per element. (On Ampere/Ada vLLM casts to ``e4b15`` instead.)
* ``vllm-int4`` (``int4_per_token_head``, K and V alike): a randomized Hadamard transform (vLLM's fixed signs,
  unnormalized, block-diagonal on the largest power-of-two divisor of head_dim) rounded to the input's dtype, then
  asymmetric 4-bit codes with a float32 scale whose low 4 mantissa bits hold the zero point. ``head_dim * 4 + 32``
  bits per vector.

TurboQuant also keeps the model's first two and last two attention layers at the model's own dtype (vLLM's
``get_boundary_skip_layers``): the peer specs (:data:`VLLM_PEERS`) write that as ``layers:bf16@0,1,-2,-1;...``.
vLLM prefills TurboQuant layers from the exact K/V (walshkv's ``--prefill exact``); decode steps read the codes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING

import torch

from walshkv.codecs.base import Codec, Field, Packed
from walshkv.codecs.turbo import _check_fp16
from walshkv.constants import Kind
from walshkv.ops.hadamard import is_power_of_two
from walshkv.ops.packing import pack_bits, packed_nbytes, unpack_bits

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = [
    "LMCACHE_PEERS",
    "LMCACHE_VERSION",
    "VLLM_PEERS",
    "VLLM_VERSION",
    "LmcacheTurboKey",
    "VllmFp8",
    "VllmInt4",
    "VllmTurboKey",
    "VllmUniformValue",
    "engine_peer_spec",
    "is_engine_peer",
    "lmcache_signs",
    "parse_lmcache_tq_args",
    "parse_vllm_tq_args",
    "parse_vllm_uq_args",
    "rht_signs",
    "vllm_centroids",
    "vllm_peer_spec",
]

#: The vLLM release these codecs follow (its source is what the tests compare with).
VLLM_VERSION = "0.32.0"

#: The layers TurboQuant keeps at the model's dtype: the first two and the last two (vLLM's n = 2).
_BOUNDARY = "bf16@0,1,-2,-1"

#: ``vllm:NAME`` (NAME as vLLM's ``--kv-cache-dtype``) -> the walshkv spec that stores what vLLM stores.
VLLM_PEERS: dict[str, str] = {
    "vllm:turboquant_k8v4": f"layers:{_BOUNDARY};vllm-fp8/vllm-uq:4",
    "vllm:turboquant_4bit_nc": f"layers:{_BOUNDARY};vllm-tq:4:nc/vllm-uq:4",
    "vllm:turboquant_k3v4_nc": f"layers:{_BOUNDARY};vllm-tq:3:nc/vllm-uq:4",
    "vllm:turboquant_3bit_nc": f"layers:{_BOUNDARY};vllm-tq:3:nc/vllm-uq:3",
    "vllm:int4_per_token_head": "vllm-int4",
}

#: The LMCache release whose serdes :data:`LMCACHE_PEERS` follow.
LMCACHE_VERSION = "0.5.6"

#: ``lmcache:NAME`` (LMCache's serde, and its preset for ``turboquant``) -> the walshkv spec of what it stores.
LMCACHE_PEERS: dict[str, str] = {
    "lmcache:fp8": "vllm-fp8",
    "lmcache:turboquant_k8v4": f"layers:{_BOUNDARY};vllm-fp8/vllm-uq:4",
    "lmcache:turboquant_4bit_nc": f"layers:{_BOUNDARY};lmcache-tq:4:nc/vllm-uq:4",
    "lmcache:turboquant_k3v4_nc": f"layers:{_BOUNDARY};lmcache-tq:3:nc/vllm-uq:4",
    "lmcache:turboquant_3bit_nc": f"layers:{_BOUNDARY};lmcache-tq:3:nc/vllm-uq:3",
}

_WIDTHS = (3, 4)
FP8_MAX = 448.0  # float8 e4m3fn's largest finite value


def is_engine_peer(name: str) -> bool:
    """Whether ``name`` is written ``vllm:NAME`` or ``lmcache:NAME`` (an engine's own cache, known or not)."""
    return isinstance(name, str) and name.strip().lower().startswith(("vllm:", "lmcache:"))


def vllm_peer_spec(name: str) -> str:
    """The walshkv spec of vLLM's cache dtype ``vllm:NAME`` (:data:`VLLM_PEERS`).

    Raises:
        ValueError: a name vLLM 0.32 does not ship as a quantized KV cache; the message lists those it does.
    """
    key = name.strip().lower()
    if key not in VLLM_PEERS:
        raise ValueError(
            f"unknown vLLM cache {name!r}; walshkv emulates vLLM {VLLM_VERSION}'s {', '.join(VLLM_PEERS)} "
            "(fp8 is a plain cast: the float codecs and hf-fp8 cover it)"
        )
    return VLLM_PEERS[key]


def engine_peer_spec(name: str) -> str:
    """The walshkv spec of ``vllm:NAME`` (:data:`VLLM_PEERS`) or ``lmcache:NAME`` (:data:`LMCACHE_PEERS`).

    Raises:
        ValueError: a name neither engine ships; the message lists the names of the engine it names.
    """
    key = name.strip().lower()
    if key.startswith("lmcache:"):
        if key not in LMCACHE_PEERS:
            raise ValueError(
                f"unknown LMCache serde {name!r}; walshkv emulates LMCache {LMCACHE_VERSION}'s "
                f"{', '.join(LMCACHE_PEERS)} (LMCache's naive serde stores the cache unchanged: spec bf16)"
            )
        return LMCACHE_PEERS[key]
    return vllm_peer_spec(name)


def _check_width(bits: object, name: str) -> None:
    if isinstance(bits, bool) or bits not in _WIDTHS:
        raise ValueError(f"{name} takes 3 or 4 bits, as vLLM's kernels do ({name}:3, {name}:4), got {bits!r}")


def _check_d(head_dim: int, spec: str, multiple: int) -> None:
    if head_dim % multiple:
        raise ValueError(
            f"'{spec}' packs codes in groups of {multiple}: head_dim must be a multiple of {multiple}, got {head_dim}"
        )


# ---- TurboQuant: keys -------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def _lloyd_max(d: int, bits: int) -> tuple[float, ...]:
    """vLLM's Lloyd-Max centroids for N(0, 1/d) as Python floats, by the same numerical procedure: centroids
    started evenly over +-3.5 sigma, cells cut at the midpoints (outer edges at +-10.5 sigma), each centroid moved
    to its cell's mean by trapezoid sums of 200 steps, until no centroid would move by 1e-10 (at most 200 rounds)."""
    levels, var = 2**bits, 1.0 / d
    sigma = math.sqrt(var)
    norm = 1.0 / math.sqrt(2 * math.pi * var)

    def pdf(x: float) -> float:
        return norm * math.exp(-x * x / (2 * var))

    def trapezoid(f: Callable[[float], float], a: float, b: float, steps: int = 200) -> float:
        h = (b - a) / steps
        total = 0.5 * (f(a) + f(b))
        for i in range(1, steps):
            total += f(a + i * h)
        return total * h

    lo, hi = -3.5 * sigma, 3.5 * sigma
    c = [lo + (hi - lo) * (i + 0.5) / levels for i in range(levels)]
    for _ in range(200):
        edges = [lo * 3, *((c[i] + c[i + 1]) / 2.0 for i in range(levels - 1)), hi * 3]
        moved = []
        for i in range(levels):
            a, b = edges[i], edges[i + 1]
            mass = trapezoid(pdf, a, b)
            moved.append(trapezoid(lambda x: x * pdf(x), a, b) / mass if mass > 1e-15 else c[i])
        if max(abs(m - old) for m, old in zip(moved, c, strict=True)) < 1e-10:
            break  # converged: vLLM keeps the levels it tested, not the round's update
        c = moved
    return tuple(c)


@lru_cache(maxsize=32)
def vllm_centroids(head_dim: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(centroids, midpoints)`` as vLLM's TurboQuant uses them: float32 ``[2**bits]`` and ``[2**bits - 1]`` (cached:
    every encode and decode reads them; treat them as read-only)."""
    c = torch.tensor(_lloyd_max(head_dim, bits), dtype=torch.float32).sort().values
    return c, (c[:-1] + c[1:]) / 2


@lru_cache(maxsize=8)
def _sylvester(d: int) -> torch.Tensor:
    """vLLM's TurboQuant rotation: the Sylvester Hadamard matrix over ``sqrt(d)``, float32 ``[d, d]`` (symmetric)."""
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


@dataclass(frozen=True, repr=False)
class VllmTurboKey(Codec):
    """``vllm-tq:B[:nc]``: vLLM TurboQuant's keys (fp16 norm, Hadamard rotation, Lloyd-Max codes).

    Attributes:
        bits: code width per coordinate, 3 or 4.
        norm_correction: rescale the decoded centroid vector to unit norm before rotating back (vLLM's ``_nc``).
    """

    bits: int
    norm_correction: bool = False

    def __post_init__(self) -> None:
        _check_width(self.bits, "vllm-tq")
        if not isinstance(self.norm_correction, bool):
            raise ValueError(f"norm_correction is True or False, got {self.norm_correction!r}")
        super().__post_init__()

    def _spec(self) -> str:
        return f"vllm-tq:{self.bits}" + (":nc" if self.norm_correction else "")

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {"codes": Field((packed_nbytes(head_dim, self.bits),), torch.uint8), "norm": Field((1,), torch.float16)}

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        if not is_power_of_two(head_dim):
            raise ValueError(
                f"'{self.spec}' rotates by a Sylvester Hadamard matrix: head_dim must be a power of two, got {head_dim}"
            )
        _check_d(head_dim, self.spec, 8)

    refuses_nonfinite = True

    def _encode(self, x: torch.Tensor) -> Packed:
        k = x.float()
        norm = k.norm(dim=-1, keepdim=True)
        norm16 = _check_fp16(norm, "L2 norm", self.spec)
        y = self._rotate(k / (norm + 1e-8))
        mid = self._midpoints(x.shape[-1])
        codes = torch.bucketize(y, mid.to(x.device), right=True)  # the number of midpoints <= y, as vLLM's search
        return Packed({"codes": pack_bits(codes.to(torch.uint8), self.bits), "norm": norm16}, x.shape[-1], x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        codes = unpack_bits(packed.tensors["codes"], self.bits, d).long()
        c, _ = vllm_centroids(d, self.bits)
        y = c.to(codes.device)[codes]
        if self.norm_correction:
            y = y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-16)
        return packed.tensors["norm"].float() * self._unrotate(y)

    def _midpoints(self, d: int) -> torch.Tensor:
        """The cell boundaries, float32 ``[2**bits - 1]``: vLLM halves the sum of float32 centroids."""
        return vllm_centroids(d, self.bits)[1]

    def _rotate(self, u: torch.Tensor) -> torch.Tensor:
        """``u Pi^T``: the unit vectors ``[..., d]`` in the frame the codes quantize (here the plain Hadamard)."""
        return u @ _sylvester(u.shape[-1]).to(u.device)

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of :meth:`_rotate` (the plain Hadamard matrix is its own inverse)."""
        return y @ _sylvester(y.shape[-1]).to(y.device)


def parse_vllm_tq_args(args: str | None) -> Codec:
    """``vllm-tq:B`` or ``vllm-tq:B:nc``."""
    parts = (args or "").split(":")
    try:
        bits = int(parts[0])
    except ValueError:
        bits = -1
    if bits not in _WIDTHS or len(parts) > 2 or (len(parts) == 2 and parts[1].strip().lower() != "nc"):
        raise ValueError(f"vllm-tq takes 3 or 4 bits and an optional ':nc' (vllm-tq:3:nc), got {args!r}")
    return VllmTurboKey(bits, len(parts) == 2)


def lmcache_signs(head_dim: int, layer: int) -> torch.Tensor:
    """LMCache's TurboQuant signs for ``layer``: float32 ``[head_dim]`` of +-1 from seed ``42 + 1337 * layer``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(42 + 1337 * layer)
    return torch.randint(0, 2, (head_dim,), generator=gen).float() * 2 - 1


@lru_cache(maxsize=32)
def _lmcache_midpoints(d: int, bits: int) -> torch.Tensor:
    """LMCache's TurboQuant cell boundaries: float32 of the float64 midpoints of :func:`_lloyd_max`'s levels."""
    return torch.tensor([(a + b) / 2.0 for a, b in itertools.pairwise(_lloyd_max(d, bits))], dtype=torch.float32)


@dataclass(frozen=True, repr=False)
class LmcacheTurboKey(VllmTurboKey):
    """``lmcache-tq:B[:nc]``: LMCache's TurboQuant keys, vLLM's with a rotation ``H diag(s)`` per layer.

    Attributes:
        layer: the layer whose signs rotate the keys, set by :meth:`bind` (a cache binds each layer's codec); an
            unbound codec refuses to encode.
    """

    layer: int | None = field(default=None, compare=False)

    def _spec(self) -> str:
        return "lmcache" + super()._spec()[len("vllm") :]

    def bind(self, layer_idx: int, kind: Kind, calibration: CalibrationLike | None = None) -> Codec:
        """This codec with ``layer_idx``'s signs (LMCache's rotation of that layer; no calibration is read)."""
        return self if self.layer == layer_idx else replace(self, layer=layer_idx)

    def _signs(self, d: int, device: torch.device) -> torch.Tensor:
        if self.layer is None:
            raise ValueError(
                f"'{self.spec}' rotates each layer with its own signs: bind it to a layer first "
                "(codec.bind(layer_idx, 'k'); a CompressedCache does this for every layer)"
            )
        return lmcache_signs(d, self.layer).to(device)

    def _midpoints(self, d: int) -> torch.Tensor:
        """LMCache rounds the float64 midpoints of the float64 levels to float32 (vLLM's differ in the last bit)."""
        return _lmcache_midpoints(d, self.bits)

    def _rotate(self, u: torch.Tensor) -> torch.Tensor:
        return (u * self._signs(u.shape[-1], u.device)) @ _sylvester(u.shape[-1]).to(u.device)

    def _unrotate(self, y: torch.Tensor) -> torch.Tensor:
        return (y @ _sylvester(y.shape[-1]).to(y.device)) * self._signs(y.shape[-1], y.device)


def parse_lmcache_tq_args(args: str | None) -> Codec:
    """``lmcache-tq:B`` or ``lmcache-tq:B:nc``."""
    try:
        key = parse_vllm_tq_args(args)
    except ValueError:
        raise ValueError(
            f"lmcache-tq takes 3 or 4 bits and an optional ':nc' (lmcache-tq:3:nc), got {args!r}"
        ) from None
    assert isinstance(key, VllmTurboKey)
    return LmcacheTurboKey(key.bits, key.norm_correction)


# ---- TurboQuant: values -----------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class VllmUniformValue(Codec):
    """``vllm-uq:B``: vLLM TurboQuant's values, asymmetric min-max codes with fp16 scale and minimum.

    Attributes:
        bits: code width, 3 or 4.
    """

    bits: int

    def __post_init__(self) -> None:
        _check_width(self.bits, "vllm-uq")
        super().__post_init__()

    def _spec(self) -> str:
        return f"vllm-uq:{self.bits}"

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {
            "codes": Field((packed_nbytes(head_dim, self.bits),), torch.uint8),
            "scale": Field((1,), torch.float16),
            "zero": Field((1,), torch.float16),
        }

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        _check_d(head_dim, self.spec, 8)

    refuses_nonfinite = True

    def _encode(self, x: torch.Tensor) -> Packed:
        v = x.float()
        lo = v.amin(-1, keepdim=True)
        top = 2**self.bits - 1
        scale = (v.amax(-1, keepdim=True) - lo) / top
        scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
        codes = torch.floor((v - lo) / scale + 0.5).clamp(0, top)  # vLLM: int(x + 0.5) of a value >= 0.5
        zero16 = lo.to(torch.float16)
        _check_fp16(lo.abs(), "minimum", self.spec)
        scale16 = _check_fp16(scale, "scale (max - min) / levels", self.spec)
        return Packed(
            {"codes": pack_bits(codes.to(torch.uint8), self.bits), "scale": scale16, "zero": zero16},
            x.shape[-1],
            x.dtype,
        )

    def _decode(self, packed: Packed) -> torch.Tensor:
        codes = unpack_bits(packed.tensors["codes"], self.bits, packed.head_dim).float()
        return codes * packed.tensors["scale"].float() + packed.tensors["zero"].float()


def parse_vllm_uq_args(args: str | None) -> Codec:
    """``vllm-uq:B``."""
    try:
        bits = int(args or "")
    except ValueError:
        bits = -1
    if bits not in _WIDTHS:
        raise ValueError(f"vllm-uq takes 3 or 4 bits (vllm-uq:4), got {args!r}")
    return VllmUniformValue(bits)


# ---- turboquant_k8v4's keys --------------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class VllmFp8(Codec):
    """``vllm-fp8``: float8 e4m3 (saturating at +-448), no scale: ``turboquant_k8v4``'s keys."""

    def _spec(self) -> str:
        return "vllm-fp8"

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {"values": Field((head_dim,), torch.uint8)}

    def _encode(self, x: torch.Tensor) -> Packed:
        e4m3 = x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Packed({"values": e4m3.view(torch.uint8)}, x.shape[-1], x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return packed.tensors["values"].view(torch.float8_e4m3fn).float()


# ---- int4_per_token_head -----------------------------------------------------------------------------------


def _power_of_two_block(d: int) -> int:
    return d & -d  # the largest power of two dividing d


@lru_cache(maxsize=8)
def rht_signs(block: int) -> torch.Tensor:
    """vLLM's fixed +-1 signs of ``int4_per_token_head``'s Hadamard transform, float32 ``[block]``."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9)
    return 2.0 * torch.bernoulli(torch.full((block,), 0.5), generator=gen) - 1.0


def _wht(x: torch.Tensor) -> torch.Tensor:
    """The unnormalized Walsh-Hadamard transform over the last dimension (a power of two), butterflies in vLLM's
    order. Not :func:`walshkv.ops.hadamard.fwht`: that one scales by ``n ** -0.5``, and undoing the scale rounds
    differently from vLLM's unscaled sums, which the int4 codes must match byte for byte."""
    d, h = x.shape[-1], 1
    while h < d:
        pairs = x.reshape(*x.shape[:-1], d // (2 * h), 2, h)
        x = torch.stack([pairs[..., 0, :] + pairs[..., 1, :], pairs[..., 0, :] - pairs[..., 1, :]], dim=-2)
        x = x.reshape(*pairs.shape[:-3], d)
        h *= 2
    return x


def _rht(x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """vLLM's ``single_rht``: ``H (s * x)`` per block of the largest power-of-two divisor (``inverse``: ``s * H x``)."""
    d = x.shape[-1]
    b = _power_of_two_block(d)
    blocks = x.reshape(*x.shape[:-1], d // b, b)
    s = rht_signs(b).to(x.device)
    out = _wht(blocks) * s if inverse else _wht(blocks * s)
    return out.reshape(x.shape)


def _round_away(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero (vLLM's ``int(x + 0.5)`` / ``int(x - 0.5)`` by sign)."""
    return torch.where(x >= 0, torch.trunc(x + 0.5), torch.trunc(x - 0.5))


@dataclass(frozen=True, repr=False)
class VllmInt4(Codec):
    """``vllm-int4``: vLLM's ``int4_per_token_head`` for one side (it treats K and V alike)."""

    def _spec(self) -> str:
        return "vllm-int4"

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {"codes": Field((packed_nbytes(head_dim, 4),), torch.uint8), "scale": Field((1,), torch.float32)}

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        _check_d(head_dim, self.spec, 2)

    refuses_nonfinite = True

    def _encode(self, x: torch.Tensor) -> Packed:
        y = _rht(x.float()).to(x.dtype)  # vLLM rounds the transform to the model's dtype before quantizing
        if not bool(torch.isfinite(y).all()):
            raise ValueError(
                f"'{self.spec}': the unnormalized Hadamard transform (values grow up to sqrt(head_dim) times) "
                f"passes {torch.finfo(x.dtype).max:g}, the maximum of {x.dtype}, for this input, although the input is "
                "finite (vLLM rounds the transform to the model's dtype); give the K/V as float32 or bf16"
            )
        y = y.float()
        lo, hi = y.amin(-1, keepdim=True), y.amax(-1, keepdim=True)
        scale = torch.clamp((hi - lo) / 15.0, min=1e-6)
        zp = _round_away(-lo / scale).clamp(0, 15)
        codes = _round_away(y * (1.0 / scale) + zp).clamp(0, 15)
        bits = (scale.view(torch.int32) & -16) | zp.to(torch.int32)
        return Packed(
            {"codes": pack_bits(codes.to(torch.uint8), 4), "scale": bits.view(torch.float32)}, x.shape[-1], x.dtype
        )

    def _decode(self, packed: Packed) -> torch.Tensor:
        d = packed.head_dim
        codes = unpack_bits(packed.tensors["codes"], 4, d).float()
        bits = packed.tensors["scale"].view(torch.int32)
        y = (codes - (bits & 0xF).float()) * (bits & -16).view(torch.float32)
        return _rht(y, inverse=True) / _power_of_two_block(d)
