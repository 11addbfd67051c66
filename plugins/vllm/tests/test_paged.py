"""Paged K/V: slot writes through a slot mapping, reads through a block table, decode and prefill attention."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from walshkv.attention import decode_attention, decode_attention_reference
from walshkv.codecs import accelerated, find_wrapper
from walshkv.codecs.center import Centered

from vllm_helpers import HEAD_DIM, KV_HEADS, Q_HEADS, SPECS, bound, kv
from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.paged import decode_paged, prefill_paged, read_sequence, write_slots

BLOCK = 4
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _tables(lens: list[int], num_blocks: int, seed: int = 0) -> torch.Tensor:
    """A block table giving each request its own blocks, scattered at random over ``num_blocks``."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // BLOCK) for n in lens]
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    at = 0
    for r, m in enumerate(need):
        table[r, :m] = perm[at : at + m].to(torch.int32)
        at += m
    return table


def _slots(table: torch.Tensor, r: int, positions: torch.Tensor) -> torch.Tensor:
    return table[r, positions // BLOCK].long() * BLOCK + positions % BLOCK


def _fill(spec_text: str, lens: list[int], num_blocks: int = 16, seed: int = 0):
    """Write every request's K/V in one call, interleaved at random with padding rows (slot -1, NaN values)."""
    _, k_codec, v_codec = bound(spec_text)
    layout = SlotLayout.of(k_codec, v_codec, HEAD_DIM, KV_HEADS)
    pages = layout.empty_pages(num_blocks, BLOCK)
    table = _tables(lens, num_blocks, seed)
    seqs = [kv(n, seed=seed + r) for r, n in enumerate(lens)]
    rows_k, rows_v, rows_s = [], [], []
    for r, (k, v) in enumerate(seqs):
        rows_k.append(k)
        rows_v.append(v)
        rows_s.append(_slots(table, r, torch.arange(len(k))))
    pad = 5
    rows_k.append(torch.full((pad, KV_HEADS, HEAD_DIM), float("nan")))
    rows_v.append(torch.full((pad, KV_HEADS, HEAD_DIM), float("nan")))
    rows_s.append(torch.full((pad,), -1, dtype=torch.long))
    order = torch.randperm(sum(lens) + pad, generator=torch.Generator().manual_seed(seed + 99))
    key, value, slots = torch.cat(rows_k)[order], torch.cat(rows_v)[order], torch.cat(rows_s)[order]
    write_slots(pages, layout, k_codec, v_codec, key, value, slots)
    return layout, k_codec, v_codec, pages, table, seqs, (key, value, slots)


@pytest.mark.parametrize("spec_text", SPECS)
def test_write_then_read_round_trips(spec_text: str) -> None:
    lens = [7, 1, 12]
    layout, k_codec, v_codec, pages, table, seqs, (key, value, slots) = _fill(spec_text, lens)
    keep = slots >= 0
    # what the write stored: the one encode of the real rows, in write order
    pk = k_codec.encode(key[keep].transpose(0, 1).unsqueeze(0))
    pv = v_codec.encode(value[keep].transpose(0, 1).unsqueeze(0))
    want = layout.to_bytes(pk, pv)[0].transpose(0, 1)  # [n, kv_heads, slot_bytes]
    flat = pages.reshape(-1, KV_HEADS, layout.slot_bytes)
    assert torch.equal(flat[slots[keep]], want)
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[keep]] = False
    assert not flat[untouched].any(), "padding rows (slot -1) must not be written"
    for r, n in enumerate(lens):
        rk, rv = read_sequence(pages, layout, table[r], n, torch.float32)
        assert rk.seq_len == n and rk.num_heads == KV_HEADS
        sel = [int(i) for i in torch.nonzero(keep).flatten() if int(slots[i]) >= 0 and _owner(table, slots[i]) == r]
        assert len(sel) == n
        # tokens come back in position order: decoding them gives the codec's round trip of the sequence
        k_seq, v_seq = seqs[r]
        torch.testing.assert_close(
            k_codec.decode(rk)[0].transpose(0, 1), _round_trip(k_codec, k_seq), rtol=0, atol=1e-5
        )
        torch.testing.assert_close(
            v_codec.decode(rv)[0].transpose(0, 1), _round_trip(v_codec, v_seq), rtol=0, atol=1e-5
        )


def _owner(table: torch.Tensor, slot: torch.Tensor) -> int:
    hits = torch.nonzero(table == int(slot) // BLOCK)
    return int(hits[0, 0]) if len(hits) else -1


def _round_trip(codec, x: torch.Tensor) -> torch.Tensor:
    return codec.decode(codec.encode(x.transpose(0, 1).unsqueeze(0)))[0].transpose(0, 1)


@pytest.mark.parametrize("first", ["padding", "real"])
@pytest.mark.parametrize("spec_text", [*SPECS, "q8_0/int4", "rot+int8/q5_1"])
def test_device_write_stores_the_host_writes_bytes(spec_text: str, first: str, no_host_reads) -> None:
    """The write CUDA uses (nothing read back to the host, padding written as copies of a real row) stores the same
    pages as the host write, and reads no value back (checked on CPU tensors by a dispatch mode)."""
    layout, k_codec, v_codec, want, _, _, (key, value, slots) = _fill(spec_text, [7, 1, 12])
    order = torch.argsort((slots >= 0).to(torch.int8), stable=True, descending=first == "real")
    key, value, slots = key[order], value[order], slots[order]
    pages = torch.zeros_like(want)
    with accelerated.reference_only(), no_host_reads():  # the torch encoders, as on CUDA (not the C++ kernel's)
        write_slots(pages, layout, k_codec, v_codec, key, value, slots, on_device=True)
    assert torch.equal(pages, want)
    before = pages.clone()
    write_slots(pages, layout, k_codec, v_codec, key, value, torch.full_like(slots, -1), on_device=True)
    assert torch.equal(pages, before)  # padding alone changes nothing


def test_device_write_checks_on_the_device() -> None:
    layout, k_codec, v_codec, pages, *_ = _fill("rot+int4", [3])
    k, v = kv(2)
    with pytest.raises(RuntimeError, match="past the pages"):
        write_slots(pages, layout, k_codec, v_codec, k, v, torch.tensor([0, pages.shape[0] * BLOCK]), on_device=True)
    k[1, 0, 3] = float("inf")
    with pytest.raises(RuntimeError, match="NaN or Inf"):
        write_slots(pages, layout, k_codec, v_codec, k, v, torch.tensor([0, 1]), on_device=True)
    write_slots(pages, layout, k_codec, v_codec, k, v, torch.tensor([0, -1]), on_device=True)  # Inf in padding: fine


def test_write_refuses_bad_input() -> None:
    layout, k_codec, v_codec, pages, *_ = _fill("q8_0", [3])
    k, v = kv(2)
    with pytest.raises(ValueError, match="past the pages"):
        write_slots(pages, layout, k_codec, v_codec, k, v, torch.tensor([0, pages.shape[0] * BLOCK]))
    with pytest.raises(ValueError, match="2 tokens"):
        write_slots(pages, layout, k_codec, v_codec, k, v, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="do not fit"):
        write_slots(pages[..., :-1], layout, k_codec, v_codec, k, v, torch.tensor([0, 1]))


@pytest.mark.parametrize("spec_text", SPECS)
@pytest.mark.parametrize("backend", ["reference", "auto"])
def test_decode_from_pages_matches_walshkv_decode(spec_text: str, backend: str) -> None:
    lens = [9, 1, 14]
    layout, k_codec, v_codec, pages, table, seqs, _ = _fill(spec_text, lens)
    q = torch.randn(len(lens), Q_HEADS, HEAD_DIM)
    got = decode_paged(q, pages, layout, k_codec, v_codec, table, torch.tensor(lens), SCALE, backend=backend)
    assert got.shape == q.shape
    for r, (k, v) in enumerate(seqs):
        pk = k_codec.encode(k.transpose(0, 1).unsqueeze(0))
        pv = v_codec.encode(v.transpose(0, 1).unsqueeze(0))
        q_r = q[r][None, :, None, :]
        want = decode_attention_reference(q_r, pk, pv, k_codec, v_codec, scale=SCALE)[0, :, 0]
        torch.testing.assert_close(got[r], want, rtol=1e-4, atol=1e-5)
        if backend == "auto":  # the dispatcher on the same packed K/V picks the same kernel
            same = decode_attention(q_r, pk, pv, k_codec, v_codec, scale=SCALE)[0, :, 0]
            torch.testing.assert_close(got[r], same, rtol=1e-5, atol=1e-6)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """Causal attention of ``q [L, hq, d]`` at positions ``ctx..`` over ``k/v [ctx + L, hk, d]``."""
    n, length = k.shape[0], q.shape[0]
    mask = torch.arange(n)[None, :] <= (ctx + torch.arange(length))[:, None]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        scale=SCALE,
        enable_gqa=True,
    )
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("spec_text", SPECS)
def test_prefill_exact_and_quantized(spec_text: str) -> None:
    """Two requests: a whole prompt (nothing cached) and a second chunk (8 tokens cached before its 5)."""
    lens, q_lens = [6, 13], [6, 5]
    layout, k_codec, v_codec, pages, table, seqs, _ = _fill(spec_text, lens)
    key = torch.cat([seqs[0][0], seqs[1][0][8:]])
    value = torch.cat([seqs[0][1], seqs[1][1][8:]])
    query = torch.randn(sum(q_lens), Q_HEADS, HEAD_DIM)
    loc = torch.tensor([0, 6, 11])
    args = (pages, layout, k_codec, v_codec, table, loc, torch.tensor(lens), SCALE)
    exact = prefill_paged(query, key, value, *args, mode="exact")
    quant = prefill_paged(query, key, value, *args, mode="quantized")
    k0, v0 = seqs[0]
    k1, v1 = seqs[1]
    # a whole prompt in exact mode is plain causal attention over its full-precision K/V
    torch.testing.assert_close(exact[:6], _sdpa(query[:6], k0, v0, 0), rtol=1e-4, atol=1e-5)
    # a later chunk: the cached 8 tokens as stored, the chunk's own exact (centered like the stored keys)
    k_ctx, v_ctx = _round_trip(k_codec, k1[:8]), _round_trip(v_codec, v1[:8])
    k_new = k1[8:]
    centered = find_wrapper(k_codec, Centered)
    if centered is not None:
        k_new = k_new - centered.plain_offset()
    want = _sdpa(query[6:], torch.cat([k_ctx, k_new]), torch.cat([v_ctx, v1[8:]]), 8)
    torch.testing.assert_close(exact[6:], want, rtol=1e-4, atol=1e-5)
    # quantize-on-write: every key and value as stored
    torch.testing.assert_close(
        quant[:6], _sdpa(query[:6], _round_trip(k_codec, k0), _round_trip(v_codec, v0), 0), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        quant[6:], _sdpa(query[6:], _round_trip(k_codec, k1), _round_trip(v_codec, v1), 8), rtol=1e-4, atol=1e-5
    )
    # the modes differ (the codecs are lossy) and the last quantized row is what a decode step at that position sees
    assert not torch.allclose(exact, quant)
    last = decode_paged(query[[5, 10]], pages, layout, k_codec, v_codec, table, torch.tensor(lens), SCALE, "reference")
    torch.testing.assert_close(last, quant[[5, 10]], rtol=1e-4, atol=1e-5)


def test_center_exact_prefill_is_shift_invariant() -> None:
    """center+ leaves K shifted by its mean; exact prefill shifts the chunk's keys alike, so softmax is unchanged."""
    lens = [10]
    layout, k_codec, v_codec, pages, table, seqs, _ = _fill("center+rot+int4", lens)
    k, v = seqs[0]
    query = torch.randn(10, Q_HEADS, HEAD_DIM)
    out = prefill_paged(
        query, k, v, pages, layout, k_codec, v_codec, table, torch.tensor([0, 10]), torch.tensor(lens), SCALE
    )
    torch.testing.assert_close(out, _sdpa(query, k, v, 0), rtol=1e-4, atol=1e-5)


def test_prefill_refuses_bad_input() -> None:
    layout, k_codec, v_codec, pages, table, seqs, _ = _fill("q4_0", [4])
    k, v = seqs[0]
    q = torch.randn(4, Q_HEADS, HEAD_DIM)
    args = (pages, layout, k_codec, v_codec, table)
    with pytest.raises(ValueError, match="prefill mode"):
        prefill_paged(q, k, v, *args, torch.tensor([0, 4]), torch.tensor([4]), SCALE, mode="fp8")
    with pytest.raises(ValueError, match="one more"):
        prefill_paged(q, k, v, *args, torch.tensor([0, 4]), torch.tensor([4, 4]), SCALE)
    with pytest.raises(ValueError, match="sequence of only"):
        prefill_paged(q, k, v, *args, torch.tensor([0, 4]), torch.tensor([3]), SCALE)


def test_decode_refuses_block_tables_that_do_not_fit_the_pages() -> None:
    """Fault matrix: a block id past the pages (or negative: torch would wrap it silently), fewer block-table rows
    than requests, a negative length; each refused by name before anything is read."""
    lens = [9, 5]
    layout, k_codec, v_codec, pages, table, _, _ = _fill("q8_0", lens)
    q = torch.randn(len(lens), Q_HEADS, HEAD_DIM)
    args = (pages, layout, k_codec, v_codec)
    for bad in (pages.shape[0], -1):
        broken = table.clone()
        broken[1, 0] = bad
        with pytest.raises(ValueError, match=rf"names block {bad} .* hold blocks 0\.\.{pages.shape[0] - 1}"):
            decode_paged(q, *args, broken, torch.tensor(lens), SCALE)
        with pytest.raises(ValueError, match=rf"names block {bad}"):
            read_sequence(pages, layout, broken[1], lens[1], q.dtype)
    with pytest.raises(ValueError, match="a row per request"):
        decode_paged(q, *args, table[:1], torch.tensor(lens), SCALE)
    with pytest.raises(ValueError, match="lengths are >= 0"):
        decode_paged(q, *args, table, torch.tensor([9, -1]), SCALE)
    # a block id past the ones a length needs is never read: vLLM leaves stale ids there
    stale = table.clone()
    stale[1, -1] = 10_000
    decode_paged(q, *args, stale, torch.tensor([9, 4]), SCALE)


def test_prefill_refuses_row_offsets_past_the_queries() -> None:
    layout, k_codec, v_codec, pages, table, seqs, _ = _fill("q4_0", [4])
    k, v = seqs[0]
    q = torch.randn(4, Q_HEADS, HEAD_DIM)
    args = (pages, layout, k_codec, v_codec, table)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_paged(q, k, v, *args, torch.tensor([0, 9]), torch.tensor([9]), SCALE)
    with pytest.raises(ValueError, match="query_start_loc"):
        prefill_paged(q, k, v, *args, torch.tensor([3, 1]), torch.tensor([4]), SCALE)
