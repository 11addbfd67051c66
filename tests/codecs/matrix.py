"""The shared codec matrix: one entry per registered codec and per wrapper combination worth testing.

``tests/codecs/test_contract.py`` runs every entry through the codec contract (round trip, bytes, dtypes,
refusals, positions), and fails if a registered codec or wrapper has no entry here: adding a codec means
adding its line below (docs/architecture.md, "Adding a codec"). Other tests may import :data:`MATRIX` too.

The tolerance is the largest relative RMS error ``||decode(encode(x)) - x|| / ||x||`` accepted on
``CalibrationStub``-bound codecs for Gaussian input ``[2, 2, tokens, head_dim]`` (measured, with margin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from walshkv.constants import Kind
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.rope import RopeTable

__all__ = ["MATRIX", "CalibrationStub", "Entry"]


@dataclass(frozen=True)
class Entry:
    """One codec spec to run through the contract.

    Attributes:
        spec: a codec spec (``parse_codec``).
        tol: the largest relative RMS round-trip error accepted.
        head_dim: the vectors' length.
        kind: the side the codec is bound to (``k`` or ``v``).
        calibrated: ``bind`` needs calibration (``needs_calibration`` is true before binding).
        positional: the stored codes depend on the block's start position (``prerope+``).
        tokens: tokens per encoded block (a multiple of KIVI's K group).
        bad_head_dim: a head size the codec must refuse (``None``: every positive size is allowed).
    """

    spec: str
    tol: float
    head_dim: int = 64
    kind: Kind = "k"
    calibrated: bool = False
    positional: bool = False
    tokens: int = 8
    bad_head_dim: int | None = None

    @property
    def id(self) -> str:
        return f"{self.spec}[{self.kind}]"


# A head size that is not a power of two (the rotations and the Walsh-Hadamard codecs refuse it) and not a
# multiple of 32 (llama.cpp's blocks).
_ODD = 48
_NOT32 = 16

MATRIX: tuple[Entry, ...] = (
    # float storage
    Entry("fp16", 5e-4),
    Entry("bf16", 3e-3),
    Entry("fp32", 1e-6),
    # symmetric integers
    Entry("int2", 0.8),
    Entry("int3", 0.3),
    Entry("int4", 0.14),
    Entry("int5", 0.065),
    Entry("int6", 0.03),
    Entry("int7", 0.015),
    Entry("int8", 0.008),
    # banded Walsh-Hadamard family
    Entry("vht2:5,5,4,3", 0.14, bad_head_dim=_ODD),
    Entry("vht2:4,3:order=variance", 0.22, calibrated=True, bad_head_dim=_ODD),
    Entry("vht2:auto@4", 0.4, kind="v", calibrated=True, bad_head_dim=_ODD),
    Entry("vzc", 0.7, bad_head_dim=_ODD),
    Entry("sqfree:4", 0.8, bad_head_dim=_ODD),
    # llama.cpp blocks
    Entry("q8_0", 0.007, bad_head_dim=_NOT32),
    Entry("q5_1", 0.05, bad_head_dim=_NOT32),
    Entry("q5_0", 0.055, bad_head_dim=_NOT32),
    Entry("q4_1", 0.1, bad_head_dim=_NOT32),
    Entry("q4_0", 0.11, bad_head_dim=_NOT32),
    Entry("iq4_nl", 0.1, bad_head_dim=_NOT32),
    # TurboQuant class
    Entry("tq:3", 0.23, bad_head_dim=_ODD),
    Entry("tq:2.5", 0.34, bad_head_dim=_ODD),
    Entry("tq:4:codebook=beta", 0.12, bad_head_dim=_ODD),
    Entry("tqprod:3", 0.53, bad_head_dim=_ODD),
    Entry("tqprod:1", 1.6),  # the QJL sketch alone takes any head size
    # trellis codes
    Entry("tcq:3", 0.2, bad_head_dim=_ODD),
    Entry("tcq:2.5", 0.28, bad_head_dim=_ODD),
    Entry("tcq:4", 0.1, kind="v", bad_head_dim=_ODD),
    Entry("tq:3:norm=8", 0.23, bad_head_dim=_ODD),  # the norm as a log byte (walshkv.ops.lognorm)
    Entry("tcq:3:norm=8", 0.2, bad_head_dim=_ODD),
    Entry("tcq:2.5:norm=8", 0.28, kind="v", bad_head_dim=_ODD),
    Entry("tcq:3:norm=8:tables=2", 0.2, bad_head_dim=_ODD),  # the longer-trained table set
    Entry("tcq:2.5:norm=8:tables=2", 0.28, kind="v", bad_head_dim=_ODD),
    Entry("tcq:3:norm=8:tables=3", 0.2, bad_head_dim=_ODD),  # split tables (AVX2: register permutes, no gather)
    Entry("tcq:3:norm=8:tables=4", 0.2, bad_head_dim=_ODD),  # set 2 rounded to bfloat16 (VBMI: two byte planes)
    # vLLM 0.32's own caches (emulated): TurboQuant keys and values, turboquant_k8v4's fp8 keys, int4_per_token_head;
    Entry("vllm-tq:3:nc", 0.2, bad_head_dim=_ODD),
    Entry("vllm-tq:4", 0.11, bad_head_dim=_ODD),
    Entry("vllm-uq:4", 0.1, kind="v", bad_head_dim=12),
    Entry("vllm-uq:3", 0.21, kind="v", bad_head_dim=12),
    Entry("vllm-fp8", 0.04),
    Entry("vllm-int4", 0.1, bad_head_dim=9),
    Entry("lmcache-tq:4:nc", 0.11, bad_head_dim=_ODD),  # LMCache's TurboQuant keys: vllm-tq with per-layer signs
    # KIVI: K in groups of g tokens, V per token
    Entry("kivi2:g=4:r=4", 0.19, tokens=8),
    Entry("kivi2:g=4:r=4", 0.19, kind="v", tokens=6),
    Entry("kivi4", 0.1, tokens=32),
    Entry("kivi4", 0.1, kind="v", tokens=5),
    # wrappers
    Entry("rot+int4", 0.14, bad_head_dim=_ODD),
    Entry("rrot:3+int3", 0.3, bad_head_dim=_ODD),
    Entry("rot+rot+fp32", 1e-6, bad_head_dim=_ODD),
    Entry("center+int4", 0.14, calibrated=True),
    Entry("center+int4", 0.14, kind="v", calibrated=True),  # skipped on V: plain int4
    Entry("center+rot+int4", 0.13, calibrated=True, bad_head_dim=_ODD),
    Entry("center+rrot:3+q4_0", 0.11, calibrated=True, bad_head_dim=_ODD),
    Entry("eq+tq:4", 0.12, calibrated=True, bad_head_dim=_ODD),
    Entry("eq+tq:3", 0.23, kind="v", calibrated=True, bad_head_dim=_ODD),
    Entry("center+eq+tq:3.5", 0.18, calibrated=True, bad_head_dim=_ODD),
    Entry("eq+rot+int4", 0.13, calibrated=True, bad_head_dim=_ODD),
    Entry("prerope+fp32", 1e-6, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("prerope+tq:4", 0.12, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("prerope+center+eq+tq:3.5", 0.21, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("center+eqd+tq:3.5", 0.18, calibrated=True, bad_head_dim=_ODD),
    Entry("eqd+tq:3", 0.23, kind="v", calibrated=True, bad_head_dim=_ODD),
    Entry("prerope+center+eqd+rot+iq4_nl", 0.15, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("prerope+center+eqd+tcq:3.5", 0.17, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("prerope+center+eq+tcq:3:norm=8", 0.2, calibrated=True, positional=True, bad_head_dim=_ODD),
    # K in the block frame (no per-key map at decode)
    Entry("ropeblock:4+fp32", 1e-6, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("ropeblock:4+eqr:4+tq:4", 0.15, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("ropeblock:3+eqr:3:inf+rot+int4", 0.15, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("ropeblock:2+tcq:3.5", 0.15, calibrated=True, positional=True, bad_head_dim=_ODD),
    Entry("eqr:16+tq:4", 0.15, calibrated=True, bad_head_dim=_ODD),
    Entry("eqr+tq:3", 0.25, calibrated=True, bad_head_dim=_ODD),
)


class CalibrationStub:
    """Deterministic calibration with every part of :class:`walshkv.codecs.calibration.Statistics`.

    Shapes follow the protocols: means and variances ``[kv_heads, head_dim]``, transforms
    ``[kv_heads, head_dim, head_dim]``. Built for one ``head_dim`` and ``kv_heads``; every layer is the same.
    """

    k_basis = "post-rope"

    def __init__(self, head_dim: int, kv_heads: int = 2) -> None:
        gen = torch.Generator().manual_seed(1234)
        d = head_dim
        self._mean = 0.5 * torch.randn(kv_heads, d, generator=gen)
        self._var = torch.linspace(2.0, 0.05, d).expand(kv_heads, d).clone()
        eye = torch.eye(d).expand(kv_heads, d, d)
        self._keq = eye + 0.1 * torch.randn(kv_heads, d, d, generator=gen) / d**0.5
        self._veq = eye + 0.1 * torch.randn(kv_heads, d, d, generator=gen) / d**0.5
        self._rope = RopeTable(10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float32) / d))

    def mean(self, kind: Kind, layer: int, basis: str = "plain") -> torch.Tensor:
        return hadamard_transform(self._mean) if basis == "wht" else self._mean

    def k_bias(self, layer: int, basis: str) -> torch.Tensor:
        return self.mean("k", layer, "wht" if basis == "rot" else "plain")

    def variance(self, kind: Kind, layer: int, basis: str = "wht") -> torch.Tensor:
        return self._var

    def k_equalizer(self, layer: int) -> torch.Tensor:
        return self._keq

    def v_equalizer(self, layer: int) -> torch.Tensor:
        return self._veq

    def k_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        return torch.diag_embed(torch.diagonal(self._keq, dim1=-2, dim2=-1))

    def v_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        return torch.diag_embed(torch.diagonal(self._veq, dim1=-2, dim2=-1))

    def k_covariance(self, layer: int) -> torch.Tensor:
        return torch.diag_embed(self._var).to(torch.float64) + 0.01 * (self._keq @ self._keq.mT).to(torch.float64)

    def query_moment(self, layer: int) -> torch.Tensor:
        return (self._veq @ self._veq.mT).to(torch.float64)

    def rope_table(self, layer: int) -> RopeTable:
        return self._rope

    def pre_rope(self) -> CalibrationStub:
        return self

    def check_matches(
        self, num_layers: int, num_kv_heads: int, head_dim: int, model: str | None = None, **_: object
    ) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"kind": "test stub"}
