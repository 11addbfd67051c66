"""Shared pieces of the plugin's core tests: sizes, the specs a page slot holds (bound as the backend binds them)."""

from __future__ import annotations

import torch
from walshkv.codecs import CacheSpec, Codec

from walshkv_vllm.specs import resolve_spec

HEAD_DIM = 64
KV_HEADS = 2
Q_HEADS = 4  # grouped-query attention: two query heads per kv head

#: The specs the tests run on (the brief's fixed-size codecs, a mixed K/V pair, center+ with a K mean).
SPECS = ["rot+int4", "q4_0", "q8_0", "tq:3", "tq:4", "q8_0/q4_0", "rot+int4/rot+int3", "center+rot+int4"]


class FakeKMean:
    """A K mean per (layer, kv head, channel) in walshkv's ``rot`` basis, as a calibration file holds it."""

    def __init__(self, layers: int = 2, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> None:
        gen = torch.Generator().manual_seed(7)
        self.bias = torch.randn(layers, kv_heads, head_dim, generator=gen) * 2.0

    def k_bias(self, layer: int, basis: str) -> torch.Tensor:
        assert basis == "rot"
        return self.bias[layer]


def bound(spec_text: str, layer: int = 1) -> tuple[CacheSpec, Codec, Codec]:
    """``(spec, k_codec, v_codec)``: the spec and its codecs bound to ``layer`` (with a K mean for center+)."""
    spec = resolve_spec(spec_text)
    calibration = FakeKMean() if "center+" in spec_text else None
    return spec, spec.k.bind(layer, "k", calibration), spec.v.bind(layer, "v", calibration)


def kv(tokens: int, scale: float = 1.0, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V rows ``[tokens, kv_heads, head_dim]`` (K with an outlier channel and a per-head offset)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) * scale
    k[..., 3] *= 8.0
    k += torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(tokens, KV_HEADS, HEAD_DIM, generator=gen) * scale
    return k, v
