"""Paged decode (walshkv.attention.paged): many requests through a block table, one kernel call, against each
request decoded on its own by the reference.

Pages are filled as an engine would (blocks shuffled, requests of odd lengths, stale block ids past a request's
length), and fields are given typed or as raw bytes (a slot's unaligned view).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import cpu as cpu_mod
from walshkv.attention import decode_attention, decode_attention_paged, gather_pages
from walshkv.attention import paged as paged_mod
from walshkv.codecs.base import Packed
from walshkv.codecs.registry import parse_codec

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler: the CPU kernel cannot be built",
)

PAIRS = (
    ("rot+int4", "rot+int4"),  # K by byte dot products
    ("q4_0", "q8_0"),
    ("tq:3.5", "tq:3"),
    ("tcq:3", "tcq:2.5"),
    ("center+rot+int4", "rot+int3"),
    ("prerope+center+eq+tcq:3", "tcq:2.5"),  # keys rotated to their positions in the request
    ("prerope+center+eqd+tq:3.5", "eq+tq:3"),
)


def _bound(spec: str, kind: str, d: int, kv: int):
    return parse_codec(spec).bind(1, kind, CalibrationStub(d, kv))


def _pages(codec, rows: list[torch.Tensor], table: torch.Tensor, blocks: int, block_size: int, as_bytes: bool):
    """Each request's rows ``[1, kv, n, d]`` encoded and scattered into pages ``[blocks, kv, block_size, ...]``."""
    fields: dict[str, torch.Tensor] = {}
    for r, x in enumerate(rows):
        p = codec.encode(x)
        for name, t in p.tensors.items():
            if as_bytes and t.dtype != torch.uint8:
                t = t.contiguous().view(torch.uint8).reshape(*t.shape[:3], -1)
            page = fields.setdefault(name, torch.full((blocks, t.shape[1], block_size, *t.shape[3:]), 7, dtype=t.dtype))
            pos = torch.arange(x.shape[2])
            page[table[r, pos // block_size], :, pos % block_size] = t[0].transpose(0, 1)
    return Packed(fields, rows[0].shape[-1], torch.float32)


def _case(kspec, vspec, d, kv, group, block_size, lens, as_bytes, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kc, vc = _bound(kspec, "k", d, kv), _bound(vspec, "v", d, kv)
    per = -(-max(lens) // block_size) + 1  # a stale block id past every request's length
    blocks = len(lens) * per + 3
    table = torch.randperm(blocks, generator=gen)[: len(lens) * per].reshape(len(lens), per).to(torch.int32)
    ks = [torch.randn(1, kv, n, d, generator=gen) for n in lens]
    vs = [torch.randn(1, kv, n, d, generator=gen) for n in lens]
    pk = _pages(kc, ks, table, blocks, block_size, as_bytes)
    pv = _pages(vc, vs, table, blocks, block_size, as_bytes)
    return kc, vc, ks, vs, pk, pv, table, gen


@pytest.mark.parametrize(("kspec", "vspec"), PAIRS)
@pytest.mark.parametrize(("d", "kv", "group", "block_size"), [(64, 2, 3, 16), (128, 1, 7, 32), (64, 3, 1, 48)])
def test_one_call_matches_each_request_alone(kspec, vspec, d, kv, group, block_size, monkeypatch):
    lens = [37, 130, 1, 64]
    kc, vc, ks, vs, pk, pv, table, gen = _case(kspec, vspec, d, kv, group, block_size, lens, as_bytes=d != 128)
    calls = []
    run = cpu_mod.fused_decode_cpu
    monkeypatch.setattr(paged_mod, "fused_decode_cpu", lambda *a, **k: calls.append(1) or run(*a, **k))
    monkeypatch.setattr(paged_mod, "decode_attention", lambda *a, **k: pytest.fail("a per-request fallback ran"))
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(len(lens), kv * group, 1, d, generator=gen).to(dtype)
        got = decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(lens), backend="cpu")
        want = torch.cat(
            [
                decode_attention(q[i : i + 1], kc.encode(ks[i]), vc.encode(vs[i]), kc, vc, backend="reference")
                for i in range(len(lens))
            ]
        )
        assert got.dtype == dtype and got.shape == q.shape
        tol = 3e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)
    assert len(calls) == 2  # one kernel call per step, whatever the number of requests


def test_codecs_the_kernel_does_not_read_go_request_by_request():
    """fp16 and kivi-free per-token codecs outside the kernel: gathered per request, read by the reference."""
    lens = [5, 19]
    kc, vc, ks, vs, pk, pv, table, gen = _case("fp16", "int2", 64, 2, 2, 16, lens, as_bytes=True)
    q = torch.randn(2, 4, 1, 64, generator=gen)
    got = decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(lens))
    for i in range(2):
        want = decode_attention(q[i : i + 1], kc.encode(ks[i]), vc.encode(vs[i]), kc, vc, backend="reference")
        torch.testing.assert_close(got[i : i + 1], want, atol=3e-5, rtol=0)
    with pytest.raises(ValueError, match="backend='cpu' does not read 'fp16'"):
        decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(lens), backend="cpu")


def test_gather_pages_types_byte_fields():
    lens = [21]
    kc, _, ks, _, pk, _, table, _ = _case("tq:3", "tq:3", 64, 2, 1, 16, lens, as_bytes=True)
    got = gather_pages(pk, kc, table[0], lens[0])
    want = kc.encode(ks[0])
    assert got.tensors.keys() == want.tensors.keys()
    for name, t in want.tensors.items():
        assert got.tensors[name].dtype == t.dtype
        assert torch.equal(got.tensors[name], t)


def test_bad_tables_and_inputs_are_refused_by_name():
    lens = [9, 40]
    kc, vc, _, _, pk, pv, table, gen = _case("rot+int4", "rot+int4", 64, 2, 1, 16, lens, as_bytes=False)
    q = torch.randn(2, 2, 1, 64, generator=gen)
    blocks = pk.batch_size
    for bad in (blocks, -1):
        broken = table.clone()
        broken[1, 2] = bad
        msg = rf"request 1 names block {bad} but the pages hold blocks 0\.\.{blocks - 1}"
        with pytest.raises(ValueError, match=msg):
            decode_attention_paged(q, pk, pv, kc, vc, broken, torch.tensor(lens))
    stale = table.clone()
    stale[0, 1:] = blocks + 5  # past request 0's one block: never read
    decode_attention_paged(q, pk, pv, kc, vc, stale, torch.tensor(lens))
    with pytest.raises(ValueError, match="more blocks than a block-table row"):
        decode_attention_paged(q, pk, pv, kc, vc, table[:, :2], torch.tensor(lens))
    with pytest.raises(ValueError, match="at least one token"):
        decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor([9, 0]))
    with pytest.raises(ValueError, match=r"seq_lens must be integer \[2\]"):
        decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor([9]))
    with pytest.raises(ValueError, match="block_table must be integer"):
        decode_attention_paged(q, pk, pv, kc, vc, table[:1], torch.tensor(lens))
    with pytest.raises(ValueError, match="NaN or Inf"):
        decode_attention_paged(q * float("nan"), pk, pv, kc, vc, table, torch.tensor(lens))
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        decode_attention_paged(q[:, :1], pk, pv, kc, vc, table, torch.tensor(lens))
    with pytest.raises(ValueError, match="unknown backend 'gpu'; choose one of"):
        decode_attention_paged(q, pk, pv, kc, vc, table, torch.tensor(lens), backend="gpu")  # type: ignore[arg-type]
