"""Fused prefill (:func:`walshkv.attention.chunked.chunked_attention`) against attention over decoded K/V."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import chunked
from walshkv.attention.chunked import chunked_attention
from walshkv.codecs.base import Codec
from walshkv.codecs.registry import parse_codec

KV = 2
D = 64


def _bind(spec: str, kind: str) -> Codec:
    return parse_codec(spec).bind(1, kind, CalibrationStub(D, KV))


def _reference(q, keys, values, offset, mask):
    """float64 causal attention over every key (GQA by repeating), the model's mask on top."""
    _, hq, t, d = q.shape
    g = hq // keys.shape[1]
    k = keys.double().repeat_interleave(g, dim=1)
    v = values.double().repeat_interleave(g, dim=1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(d)
    n = k.shape[-2]
    vis = torch.arange(n).view(1, -1) <= torch.arange(offset, offset + t).view(-1, 1)
    if mask is not None:
        vis = vis & mask
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return p @ v


@pytest.mark.parametrize("kspec", ["tq:3", "center+eq+tq:3.5", "prerope+center+eq+tq:3.5", "rot+iq4_nl"])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_prefill_matches_attention_over_decoded_keys(kspec, group, dtype, monkeypatch):
    kc, vc = _bind(kspec, "k"), _bind("tq:3", "v")
    gen = torch.Generator().manual_seed(7)
    b, n_head, n_packed, n_win, t = 2, 1, 70, 5, 23
    start = n_head
    k = torch.randn(b, KV, n_packed, D, generator=gen)
    v = torch.randn(b, KV, n_packed, D, generator=gen)
    pk, pv = kc.encode(k, start), vc.encode(v, start)
    head_k, head_v = (torch.randn(b, KV, n_head, D, generator=gen) for _ in range(2))
    win_k, win_v = (torch.randn(b, KV, n_win, D, generator=gen) for _ in range(2))
    q = torch.randn(b, KV * group, t, D, generator=gen).to(dtype)
    n = n_head + n_packed + n_win
    offset = n - t
    keys = torch.cat([head_k, kc.decode(pk, start), win_k], dim=-2)
    values = torch.cat([head_v, vc.decode(pv, start), win_v], dim=-2)
    pad = torch.ones(b, 1, t, n, dtype=torch.bool)
    pad[1, :, :, :3] = False  # row 1 is left-padded by 3 tokens
    biggest: list[int] = []
    for cls in {type(kc), type(vc)}:  # codecs are frozen: spy on the class, counting these two codecs' calls

        def spy(self, p, s=0, _d=cls.decode):
            if self is kc or self is vc:
                biggest.append(p.seq_len)
            return _d(self, p, s)

        monkeypatch.setattr(cls, "decode", spy)
    kernel_rows: list[int] = []  # the C++ kernel's decode of a tile (the pairs it reads)
    fast = chunked.decode_chunk_cpu

    def counted(pk, pv, k_codec, v_codec, start, i0, i1):
        got = fast(pk, pv, k_codec, v_codec, start, i0, i1)
        if got is not None:
            kernel_rows.append(i1 - i0)
        return got

    monkeypatch.setattr(chunked, "decode_chunk_cpu", counted)
    for mask in (None, pad):
        got = chunked_attention(
            q,
            pk,
            pv,
            kc,
            vc,
            offset=offset,
            head_k=head_k,
            head_v=head_v,
            window_k=win_k,
            window_v=win_v,
            mask=mask,
            start=start,
            q_block=8,
            kv_chunk=16,
        )
        assert got.dtype == dtype and got.shape == q.shape
        want = _reference(q.float(), keys, values, offset, None if mask is None else mask[:, :, :, :])
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)
    assert max(biggest + kernel_rows) <= 16  # one chunk of keys decoded at a time, never the layer
    # eq+ outside prerope+ has no kernel decode (the codecs decode it); every other pair here is read by the kernel
    assert bool(kernel_rows) == (kspec != "center+eq+tq:3.5") and not (kernel_rows and biggest), (kernel_rows, biggest)


def test_a_query_that_sees_nothing_gets_zeros():
    kc = vc = _bind("tq:4", "v")
    k = torch.randn(1, KV, 10, D)
    pk, pv = kc.encode(k), vc.encode(k)
    q = torch.randn(1, KV, 4, D)
    mask = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    mask[:, :, 0] = False
    out = chunked_attention(q, pk, pv, kc, vc, offset=6, mask=mask, kv_chunk=4, q_block=2)
    assert torch.equal(out[:, :, 0], torch.zeros_like(out[:, :, 0]))
    assert torch.isfinite(out).all()


def test_tile_sizes_are_checked():
    kc = _bind("tq:4", "v")
    pk = kc.encode(torch.randn(1, KV, 4, D))
    with pytest.raises(ValueError, match="positive token counts"):
        chunked_attention(torch.randn(1, KV, 1, D), pk, pk, kc, kc, offset=3, kv_chunk=0)


@pytest.mark.parametrize(
    ("n", "t", "q_block", "kv_chunk", "group"),
    [
        (40, 40, 8, 16, 1),
        (40, 40, 16, 8, 3),
        (57, 13, 5, 7, 3),
        (30, 1, 4, 8, 2),
        (64, 64, 64, 64, 3),
        (33, 20, 7, 64, 1),
    ],
)
def test_causal_tiles_split_into_seen_and_diagonal_parts(n, t, q_block, kv_chunk, group):
    """Without the model's mask, each tile is cut where the causal edge starts: keys every query of the block sees
    (one call, the group's queries stacked) and the diagonal part under torch's top-left causal flag; chunk and
    block boundaries that fall anywhere, a single query, pure prefill (offset 0)."""
    gen = torch.Generator().manual_seed(n * 100 + t)
    k, v = torch.randn(2, KV, n, D, generator=gen), torch.randn(2, KV, n, D, generator=gen)
    q = torch.randn(2, KV * group, t, D, generator=gen)
    kc = _bind("tq:3", "k")
    got = chunked_attention(q, None, None, kc, kc, offset=n - t, head_k=k, head_v=v, q_block=q_block, kv_chunk=kv_chunk)
    torch.testing.assert_close(got.double(), _reference(q, k, v, n - t, None), atol=2e-5, rtol=0)
