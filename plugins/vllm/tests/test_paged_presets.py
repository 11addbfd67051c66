"""smollm2-135m's shipped presets in vLLM pages: the bytes CompressedCache holds, and attention that reads them alike.

Every preset of the model (``sink:1:`` with ``prerope+`` or ``ropeblock:64+`` K, ``eq+``/``eqr:64+``, trellis codes)
is resolved as the backend resolves it (``$WALSHKV_VLLM_SPEC`` and ``$WALSHKV_VLLM_MODEL``, the calibration the
package ships for it), bound to one layer, and written through :func:`walshkv_vllm.paged.write_slots` step by step as
vLLM writes (two requests interleaved, a prompt in two chunks, then decode steps), against walshkv's own
``CompressedLayer`` fed the same K/V: the pages must hold its packed bytes for every position past the sink and its
fp16 sink rows, and decode and prefill attention must match attention over the keys ``CompressedLayer`` returns.
"""

from __future__ import annotations

import math
from functools import cache

import pytest
import torch
from walshkv.cache.layers import CompressedLayer
from walshkv.codecs import CacheSpec
from walshkv.export import read_kv_mean_center
from walshkv.presets import model_presets

from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.paged import Places, SinkRows, decode_paged, is_positional, prefill_paged, write_slots
from walshkv_vllm.specs import MODEL_ENV, SPEC_ENV, calibration_path, resolve_spec

MODEL = "smollm2-135m"
PRESETS = sorted(model_presets()[MODEL]["presets"])
LAYER = 3
KV_HEADS, Q_HEADS, HEAD_DIM = 3, 9, 64
BLOCK = 16
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def _env(preset: str) -> dict[str, str]:
    return {SPEC_ENV: preset, MODEL_ENV: MODEL}


@cache
def _calibration(path: str) -> object:
    return read_kv_mean_center(path)


def _bound(preset: str) -> tuple[CacheSpec, CacheSpec]:
    """``(spec, bound)``: the preset as the backend resolves it, bound to ``LAYER`` with its shipped calibration."""
    env = _env(preset)
    spec = resolve_spec("walshkv_spec", env)
    path = calibration_path("walshkv_spec", env)
    assert path, f"{preset}: no shipped calibration found"
    return spec, spec.bind(LAYER, _calibration(path))


def _kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V rows ``[n, kv_heads, head_dim]`` with a mean and an outlier channel, as real K has."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)
    k[..., 5] *= 6.0
    k += 2.0 * torch.randn(1, KV_HEADS, HEAD_DIM, generator=gen)
    return k, torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """Dense causal attention: ``q [q_heads, t, d]`` at positions ``offset ..`` over ``k, v [kv_heads, n, d]``."""
    g = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
    s = torch.einsum("htd,hnd->htn", q.double(), k.double()) * SCALE
    t, n = q.shape[1], k.shape[1]
    visible = torch.arange(n)[None, :] <= (offset + torch.arange(t))[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    return torch.einsum("htn,hnd->htd", s.softmax(-1), v.double())


class _Run:
    """Two requests written through the pages step by step, and two ``CompressedLayer`` fed the same rows."""

    def __init__(self, preset: str, lens: tuple[int, int] = (90, 20), exact: bool = False) -> None:
        self.spec, self.bound = _bound(preset)
        self.layout = SlotLayout.of(self.bound.k, self.bound.v, HEAD_DIM, KV_HEADS)
        self.pages = self.layout.empty_pages(24, BLOCK)
        perm = torch.randperm(24, generator=torch.Generator().manual_seed(5)).to(torch.int32)
        self.table = torch.stack([perm[:12], perm[12:]])
        self.sinks = SinkRows(self.spec.sink) if self.spec.sink else None
        self.layers = [CompressedLayer(self.bound, 0, self.spec.sink) for _ in lens]
        for layer in self.layers:
            layer.exact_prefill = exact
        self.lens = [0, 0]
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = [(torch.zeros(0), torch.zeros(0))] * 2
        self.seed = 0

    def step(self, counts: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Write ``counts[r]`` new rows of each request in one call (rows interleaved as vLLM batches them:
        request 0's then request 1's); returns the rows ``(key, value)`` and ``query_start_loc``."""
        ks, vs, slots, starts = [], [], [], [0]
        for r, c in enumerate(counts):
            self.seed += 1
            k, v = _kv(c, self.seed)
            pos = torch.arange(self.lens[r], self.lens[r] + c)
            ks.append(k)
            vs.append(v)
            slots.append(self.table[r, pos // BLOCK].long() * BLOCK + pos % BLOCK)
            starts.append(starts[-1] + c)
            if c:
                self.keys[r] = self.layers[r].update(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
            self.lens[r] += c
        key, value = torch.cat(ks), torch.cat(vs)
        pad = torch.full((2,), -1, dtype=torch.long)  # padding rows, as vLLM pads a batch
        slot_mapping = torch.cat([*slots, pad])
        key = torch.cat([key, torch.full((2, KV_HEADS, HEAD_DIM), float("nan"))])
        value = torch.cat([value, torch.zeros(2, KV_HEADS, HEAD_DIM)])
        places = Places.of(starts, self.lens, self.table, num_rows=slot_mapping.shape[0])
        write_slots(
            self.pages,
            self.layout,
            self.bound.k,
            self.bound.v,
            key,
            value,
            slot_mapping,
            places=places,
            sinks=self.sinks,
        )
        return key, value, starts

    def slots_of(self, r: int) -> torch.Tensor:
        pos = torch.arange(self.lens[r])
        return self.pages[self.table[r, pos // BLOCK].long(), pos % BLOCK]  # [n, kv_heads, slot_bytes]


@pytest.mark.parametrize("preset", PRESETS)
def test_pages_hold_compressed_caches_bytes_and_decode_reads_them_alike(preset: str) -> None:
    run = _Run(preset)
    assert run.spec.sink == 1 and is_positional(run.bound.k), "the shipped presets keep a sink and turn K by position"
    run.step((50, 20))  # the prompts (request 0 in two chunks)
    run.step((40, 0))
    for _ in range(3):  # decode steps
        run.step((1, 1))
    for r, layer in enumerate(run.layers):
        held = run.slots_of(r)
        sink = layer.sink
        want = run.layout.to_bytes(layer.packed_k, layer.packed_v)[0].transpose(0, 1)  # positions sink..
        assert torch.equal(held[sink:], want), f"request {r}: the pages do not hold CompressedCache's bytes"
        hk, hv = run.sinks.head(run.pages, int(run.table[r, 0]), sink)
        assert torch.equal(hk, layer.sink_k) and torch.equal(hv, layer.sink_v)
    # bits from the layout, as the slot holds them
    assert run.layout.slot_bytes * 8 == pytest.approx(run.bound.bits_per_element(HEAD_DIM) * HEAD_DIM * 2, abs=1e-9)
    q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(11))
    for backend in ("auto", "reference"):
        out = decode_paged(
            q, run.pages, run.layout, run.bound.k, run.bound.v, run.table, run.lens, SCALE, backend, sinks=run.sinks
        )
        for r in range(2):
            k, v = (t[0].double() for t in run.keys[r])
            want = _attend(q[r][:, None], k, v, run.lens[r] - 1)[:, 0]
            err = (out[r].double() - want).abs().max().item()
            assert err < 2e-4, f"{preset} request {r} backend {backend}: decode differs by {err:.2e}"


@pytest.mark.parametrize("mode", ["quantized", "exact"])
@pytest.mark.parametrize("preset", ["walshkv:3.5", "walshkv:3.5-fast"])
def test_prefill_reads_what_compressed_cache_attends_to(preset: str, mode: str) -> None:
    run = _Run(preset, exact=mode == "exact")
    gen = torch.Generator().manual_seed(3)
    for counts in ((30, 12), (37, 0)):  # a whole prompt, then a later chunk of request 0 (context 30)
        key, value, starts = run.step(counts)
        q = torch.randn(key.shape[0], Q_HEADS, HEAD_DIM, generator=gen)
        out = prefill_paged(
            q,
            key,
            value,
            run.pages,
            run.layout,
            run.bound.k,
            run.bound.v,
            run.table,
            starts,
            run.lens,
            SCALE,
            mode=mode,
            sinks=run.sinks,
        )
        for r, c in enumerate(counts):
            if not c:
                continue
            k, v = (t[0].double() for t in run.keys[r])
            qr = q[starts[r] : starts[r + 1]].transpose(0, 1)
            want = _attend(qr, k, v, run.lens[r] - c).transpose(0, 1)
            err = (out[starts[r] : starts[r + 1]].double() - want).abs().max().item()
            assert err < 2e-4, f"{preset} {mode} request {r}: prefill differs by {err:.2e}"


def test_places_follow_the_metadata() -> None:
    table = torch.tensor([[7, 2], [5, 1]], dtype=torch.int32)
    places = Places.of([0, 3, 4], [10, 1], table, num_rows=6)
    assert places.positions.tolist() == [7, 8, 9, 0, 0, 0]
    assert places.first_blocks.tolist()[:4] == [7, 7, 7, 5]  # padding rows: anything (never written)
    with pytest.raises(ValueError, match="request 0 has 3 rows but a sequence of only 2 tokens"):
        Places.of([0, 3], [2], table)


def test_a_positional_write_needs_places_and_cpu_pages() -> None:
    _, bound = _bound("walshkv:3.5-fast")
    layout = SlotLayout.of(bound.k, bound.v, HEAD_DIM, KV_HEADS)
    pages = layout.empty_pages(4, BLOCK)
    k, v = _kv(3, 0)
    with pytest.raises(ValueError, match=r"turns K by position.*pass places"):
        write_slots(pages, layout, bound.k, bound.v, k, v, torch.arange(3))
    places = Places.of([0, 3], [3], torch.zeros(1, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="runs on CPU pages only"):
        write_slots(pages, layout, bound.k, bound.v, k, v, torch.arange(3), places=places, on_device=True)


def test_sink_rows_refuse_a_block_they_did_not_write() -> None:
    """A block filled by something else (a KV connector) has no sink rows: refused by name, never read."""
    run = _Run("walshkv:3.5-fast")
    run.step((5, 5))
    block = int(run.table[0, 0])
    run.pages[block, 0] ^= 1  # the slot of position 0 rewritten behind the backend's back
    q = torch.randn(2, Q_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match=r"sink:1: position 0 .* has no full-precision row written with its slot"):
        decode_paged(q, run.pages, run.layout, run.bound.k, run.bound.v, run.table, run.lens, SCALE, sinks=run.sinks)
