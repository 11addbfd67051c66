"""The shipped presets' codecs in the fused decode kernels: every part of a preset spec against the reference.

The presets store K before RoPE behind a mean and an ``eq+`` transform (``prerope+center+eq+tq:B``), V as ``tq:B``,
and keep ``sink:1:`` tokens in fp16 (which join the full-precision window at decode); smollm2-135m's
``walshkv:4.5`` stores K as ``center+rot+iq4_nl``. Each K part alone and together, fp32 and bf16 queries, GQA
groups 1/3/6/7, batch 2, lengths that are no multiple of any block, packed tokens starting after a sink.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import decode as attn
from walshkv.attention import decode_attention
from walshkv.codecs.registry import parse_codec

KV, D = 2, 64
K_SPECS = (
    "prerope+tq:3.5",
    "prerope+center+tq:3.5",
    "prerope+eq+tq:3.5",
    "prerope+center+eq+tq:3.5",
    "prerope+center+eq+tq:3",
    "center+eq+tq:3",
    "center+rot+iq4_nl",
    "iq4_nl",
)
V_SPECS = ("tq:3", "tq:2.5", "tq:4", "eq+tq:3")

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler: the CPU kernel cannot be built",
)


def _bound(spec: str, kind: str):
    return parse_codec(spec).bind(1, kind, CalibrationStub(D, KV))


@pytest.mark.parametrize("kspec", K_SPECS)
@pytest.mark.parametrize("group", [1, 3, 6, 7])
def test_preset_parts_in_the_cpu_kernel(kspec, group, monkeypatch):
    vspec = V_SPECS[K_SPECS.index(kspec) % len(V_SPECS)]
    kc, vc = _bound(kspec, "k"), _bound(vspec, "v")
    gen = torch.Generator().manual_seed(group)
    n, start = 101, 1  # three whole tiles of 32 and a partial one, after one sink token
    k, v = torch.randn(2, KV, n, D, generator=gen), torch.randn(2, KV, n, D, generator=gen)
    pk, pv = kc.encode(k, start), vc.encode(v, start)
    sink_k, sink_v = torch.randn(2, KV, 1, D, generator=gen), torch.randn(2, KV, 1, D, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(2, KV * group, 1, D, generator=gen).to(dtype)
        kw = {"window_k": sink_k, "window_v": sink_v, "start": start}
        want = decode_attention(q, pk, pv, kc, vc, backend="reference", **kw)
        # the fused path must not fall back to the reference (it would be correct, and slow)
        with monkeypatch.context() as m:
            m.setattr(attn, "reference_partial", lambda *a, **k: pytest.fail("the CPU kernel fell back"))
            got = decode_attention(q, pk, pv, kc, vc, backend="cpu", **kw)
        assert got.dtype == dtype
        tol = 3e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


def test_positions_matter_to_prerope_keys():
    """Reading a prerope+ cache at the wrong start position gives another answer (the test above would notice)."""
    kc, vc = _bound("prerope+center+eq+tq:3.5", "k"), _bound("tq:3", "v")
    k = torch.randn(1, KV, 40, D)
    pk, pv = kc.encode(k, 5), vc.encode(k)
    q = torch.randn(1, KV, 1, D)
    right = decode_attention(q, pk, pv, kc, vc, start=5)
    wrong = decode_attention(q, pk, pv, kc, vc, start=6)
    assert (right - wrong).abs().max() > 1e-3
    with pytest.raises(ValueError, match="start must be a position"):
        decode_attention(q, pk, pv, kc, vc, start=-1)
