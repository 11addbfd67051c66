"""The paged Triton kernel (walshkv.attention.paged on CUDA, here under Triton's interpreter): every request in one
launch through the block table, against each request read alone by the reference; its checks run on the device, and
nothing in the step waits for the device (no value read back to the host), so a CUDA graph can capture it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (the backend also reads it at each call)

import pytest
import torch

pytest.importorskip("triton")

from test_paged_decode import _case  # pages filled as an engine would (shuffled blocks, stale ids, byte fields)

from walshkv.attention import decode_attention, decode_attention_paged
from walshkv.attention import paged as paged_mod

PAIRS = (
    ("rot+int4", "rot+int4"),
    ("q4_0", "q8_0"),
    ("tq:3.5", "tq:3"),
    ("tcq:3", "tcq:2.5"),
    ("center+rot+int4", "int3"),
    ("center+eq+int4", "eq+tq:3"),
    ("vht2:5,5,4,3", "int8"),
)
LENS = [37, 1, 20]


def _want(q, kc, vc, ks, vs):
    return torch.cat(
        [
            decode_attention(q[i : i + 1], kc.encode(ks[i]), vc.encode(vs[i]), kc, vc, backend="reference")
            for i in range(len(ks))
        ]
    )


@pytest.mark.parametrize(("kspec", "vspec"), PAIRS)
@pytest.mark.parametrize("as_bytes", [True, False])
def test_one_launch_matches_each_request_alone(kspec, vspec, as_bytes, monkeypatch):
    kc, vc, ks, vs, pk, pv, table, gen = _case(kspec, vspec, 64, 2, 2, 16, LENS, as_bytes=as_bytes)
    launches = []
    run = paged_mod.fused_decode_triton
    monkeypatch.setattr(paged_mod, "fused_decode_triton", lambda *a, **k: launches.append(1) or run(*a, **k))
    monkeypatch.setattr(paged_mod, "decode_attention", lambda *a, **k: pytest.fail("a per-request fallback ran"))
    q = torch.randn(len(LENS), 4, 1, 64, generator=gen)
    got = decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(LENS), backend="triton")
    torch.testing.assert_close(got, _want(q, kc, vc, ks, vs), atol=3e-5, rtol=0)
    assert launches == [1]


def test_prerope_keys_go_request_by_request():
    kc, vc, ks, vs, pk, pv, table, gen = _case("prerope+center+eq+int4", "int4", 64, 2, 2, 16, [19, 3], as_bytes=False)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    got = decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor([19, 3]), backend="triton")
    torch.testing.assert_close(got, _want(q, kc, vc, ks, vs), atol=3e-5, rtol=0)


@pytest.mark.parametrize(("kspec", "vspec"), [("rot+int4", "rot+int4"), ("center+eq+int4", "eq+tq:3")])
def test_the_step_reads_nothing_back_to_the_host(kspec, vspec, no_host_reads):
    kc, vc, ks, vs, pk, pv, table, gen = _case(kspec, vspec, 64, 2, 2, 16, LENS, as_bytes=True)
    q = torch.randn(len(LENS), 4, 1, 64, generator=gen)
    decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(LENS), backend="triton")  # warm: tables cached
    with no_host_reads():
        got = decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(LENS), backend="triton")
    torch.testing.assert_close(got, _want(q, kc, vc, ks, vs), atol=3e-5, rtol=0)
    with pytest.raises(AssertionError, match="host read"), no_host_reads():  # the mode does catch one
        bool(torch.isfinite(q).all())


def test_device_checks_name_the_problem():
    kc, vc, _, _, pk, pv, table, gen = _case("rot+int4", "rot+int4", 64, 2, 1, 16, [9, 40], as_bytes=False)
    q = torch.randn(2, 2, 1, 64, generator=gen)
    lens = torch.tensor([9, 40])
    blocks = pk.batch_size
    for bad in (blocks, -1):
        broken = table.clone()
        broken[1, 2] = bad
        with pytest.raises(RuntimeError, match=rf"block outside the pages' blocks 0\.\.{blocks - 1}"):
            decode_attention_paged(q, pk, pv, kc, vc, broken, lens, backend="triton")
    stale = table.clone()
    stale[0, 1:] = blocks + 5  # past request 0's one block: never read
    decode_attention_paged(q, pk, pv, kc, vc, stale, lens, backend="triton")
    with pytest.raises(RuntimeError, match="more blocks than a block-table row"):
        decode_attention_paged(q, pk, pv, kc, vc, table[:, :2], lens, backend="triton")
    with pytest.raises(RuntimeError, match="at least one token"):
        decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor([9, 0]), backend="triton")
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        decode_attention_paged(q * float("nan"), pk, pv, kc, vc, table, lens, backend="triton")
