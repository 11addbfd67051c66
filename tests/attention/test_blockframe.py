"""K in the block frame (``ropeblock:G+``): the fused CPU kernel's decode against the codec's own decode."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from walshkv.attention import blockframe, cpu
from walshkv.attention.cpu import kernel_available
from walshkv.attention.cpu_formats import cpu_plan
from walshkv.attention.decode import decode_attention, decode_attention_reference
from walshkv.codecs import parse_codec
from walshkv.ops.rope import apply_rope

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))

from matrix import CalibrationStub

pytestmark = pytest.mark.skipif(not kernel_available(), reason="the fused CPU kernel cannot be built here")

KV = 2


def _bound(spec: str, kind: str, head_dim: int = 64):
    return parse_codec(spec).bind(0, kind, CalibrationStub(head_dim, KV))


def _case(kspec: str, vspec: str, batch: int, group: int, n: int, start: int, dtype: torch.dtype, head_dim: int = 64):
    """Keys after RoPE at positions ``start ..`` with the stub's mean before RoPE, encoded at their positions."""
    gen = torch.Generator().manual_seed(n * 31 + start)
    kc, vc = _bound(kspec, "k", head_dim), _bound(vspec, "v", head_dim)
    stub = CalibrationStub(head_dim, KV)
    pre = torch.randn(batch, KV, n, head_dim, generator=gen) + 2 * stub.k_bias(0, "plain")[None, :, None, :]
    k = apply_rope(pre, stub.rope_table(0), start)
    v = torch.randn(batch, KV, n, head_dim, generator=gen)
    q = torch.randn(batch, KV * group, 1, head_dim, generator=gen).to(dtype)
    return q, kc.encode(k, start), vc.encode(v), kc, vc


@pytest.mark.parametrize(
    ("kspec", "batch", "group", "n", "start", "dtype"),
    [
        ("ropeblock:64+eqr:64+tq:3.5", 1, 1, 300, 0, torch.float32),
        ("ropeblock:64+eqr:64+tq:3.5", 2, 3, 131, 1, torch.bfloat16),  # a sink token before the packed ones
        ("ropeblock:16+eqr:16+tcq:3:norm=8:tables=2", 2, 6, 77, 13, torch.float32),
        ("ropeblock:16+eqr:16:inf+rot+int4", 1, 7, 40, 5, torch.float32),
        ("ropeblock:1+eqr:1+rrot:3+q4_0", 2, 3, 19, 2, torch.float32),  # a block per key
        ("ropeblock:64+tcq:3.5", 1, 3, 65, 40_000, torch.float32),  # far past any calibration window
        ("ropeblock:256+eqr:256+iq4_nl", 1, 1, 1, 255, torch.float16),  # one key, last of its block
    ],
)
def test_the_kernel_reads_the_block_frame_as_the_codec_decodes_it(kspec, batch, group, n, start, dtype):
    q, pk, pv, kc, vc = _case(kspec, "tq:3", batch, group, n, start, dtype)
    assert blockframe.block_frame_plan(kc, vc, 64, 0.125) is not None
    ref = decode_attention_reference(q, pk, pv, kc, vc, start=start)
    got = decode_attention(q, pk, pv, kc, vc, start=start, backend="cpu")
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


def test_a_full_precision_window_and_left_padding_positions_join_the_packed_keys():
    q, pk, pv, kc, vc = _case("ropeblock:16+eqr:16+tq:4", "tq:4", 2, 3, 50, 3, torch.float32)
    wk, wv = torch.randn(2, KV, 5, 64), torch.randn(2, KV, 5, 64)
    ref = decode_attention_reference(q, pk, pv, kc, vc, start=3, window_k=wk, window_v=wv)
    got = decode_attention(q, pk, pv, kc, vc, start=3, window_k=wk, window_v=wv)
    torch.testing.assert_close(got, ref, atol=2e-6, rtol=2e-6)


def test_a_wrong_start_gives_another_answer():
    q, pk, pv, kc, vc = _case("ropeblock:16+eqr:16+tq:4", "tq:4", 1, 3, 90, 7, torch.float32)
    right = decode_attention(q, pk, pv, kc, vc, start=7)
    wrong = decode_attention(q, pk, pv, kc, vc, start=8)
    assert float((right - wrong).abs().max()) > 1e-3


def test_no_per_key_map_on_the_decode_path(monkeypatch):
    """The block frame's decode step gives the kernel a query per block and the mean table, never a prerope+ key
    map (a matrix or RoPE per key): the K plan is the storing codec's, as for a cache stored after RoPE."""
    q, pk, pv, kc, vc = _case("ropeblock:64+eqr:64+tcq:3.5", "tq:3", 1, 3, 200, 1, torch.float32)
    assert cpu.prerope_key_map(kc, vc, 64, KV) is None
    assert cpu.cpu_supports(kc, 64) and not cpu.cpu_supports(parse_codec(kc.spec), 64)  # bound: read by the kernel
    calls = []
    real = cpu.fused_decode_cpu

    def spy(q, plan, *args, **kwargs):
        calls.append((plan, kwargs))
        return real(q, plan, *args, **kwargs)

    monkeypatch.setattr(blockframe, "fused_decode_cpu", spy)
    decode_attention(q, pk, pv, kc, vc, start=1, backend="cpu")
    (plan, kwargs), *rest = calls
    assert not rest and plan.prerope is None
    assert kwargs["query_block"] == 64 and kwargs["block_offset"] == 1
    assert tuple(kwargs["key_table"].shape) == (KV, 64, 64)


def test_the_kernel_refuses_a_block_offset_out_of_range():
    _, pk, pv, kc, vc = _case("ropeblock:16+tq:4", "tq:4", 1, 1, 20, 0, torch.float32)
    plan = cpu_plan(kc.inner, vc, 64, 0.125)
    assert plan is not None
    qb = torch.randn(1, KV, 2, 1, 64)
    for bad in (-1, 16, 17):
        with pytest.raises(ValueError, match=r"block_offset must be in 0 \.\. query_block - 1"):
            cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, block_offset=bad)
    with pytest.raises(ValueError, match="need 3"):  # 20 keys from offset 15: 1 + 16 + 3
        cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, block_offset=15)


def test_an_unbound_codec_names_the_fix():
    kc = parse_codec("ropeblock:64+eqr:64+tq:3")
    with pytest.raises(ValueError, match="not bound"):
        kc.encode(torch.randn(1, KV, 4, 64))
    with pytest.raises(ValueError, match="before RoPE"):
        kc.bind(0, "k", None)
    with pytest.raises(ValueError, match="ropeblock\\+ is for K"):
        kc.bind(0, "v", CalibrationStub(64, KV))


def test_a_query_already_in_k_buffer_gives_the_same_attention():
    """``in_buffer=True``: the caller folded the plan's query map (the block frame does, into its own per-block map);
    the kernel then takes the query and the key table as they are, and refuses a buffer shorter than the head."""
    _, pk, pv, kc, vc = _case("ropeblock:16+tcq:3:norm=8:tables=2", "tq:4", 1, 3, 40, 0, torch.float32)
    plan = cpu_plan(kc.inner, vc, 64, 0.125)
    assert plan is not None and plan.q_map is not None
    gen = torch.Generator().manual_seed(5)
    qb, table = torch.randn(1, KV, 3, 3, 64, generator=gen), torch.randn(KV, 16, 64, generator=gen)
    want = cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, key_table=table)
    got = cpu.fused_decode_cpu(
        qb @ plan.q_map, plan, pk, pv, query_block=16, key_table=table @ (plan.q_map / plan.scale), in_buffer=True
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_key_table_with_nan_is_refused_unless_the_caller_checked_it():
    """The kernel scans a key table for NaN/Inf unless its caller says it checked it (a block frame's plan checks its
    table once, when it builds it, and its steps pass ``key_table_finite``)."""
    _, pk, pv, kc, vc = _case("ropeblock:16+tq:3", "tq:4", 1, 3, 40, 0, torch.float32)
    plan = cpu_plan(kc.inner, vc, 64, 0.125)
    gen = torch.Generator().manual_seed(6)
    qb, table = torch.randn(1, KV, 3, 3, 64, generator=gen), torch.randn(KV, 16, 64, generator=gen)
    want = cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, key_table=table)
    got = cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, key_table=table, key_table_finite=True)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    table[1, 3, 7] = float("nan")
    with pytest.raises(ValueError, match="key_table has NaN or Inf"):
        cpu.fused_decode_cpu(qb, plan, pk, pv, query_block=16, key_table=table)


def test_a_block_frame_plan_refuses_a_mean_with_nan():
    """The plan checks its mean table once, when it builds it (the steps then skip the scan)."""
    _, _, _, kc, vc = _case("ropeblock:16+tq:3", "tq:4", 1, 3, 40, 0, torch.float32)
    kc.mu[0, 0] = float("nan")  # past bind's own check of the calibration
    kc._table.clear()
    with pytest.raises(ValueError, match="mean table has NaN or Inf"):
        blockframe.block_frame_plan(kc, vc, 64, 0.125)


def test_the_block_angles_grow_with_the_cache_and_match_the_model_rope():
    """The per-block cos/sin rows a plan keeps are the model's float32 angles at each block start, at any reach."""
    _, _, _, kc, vc = _case("ropeblock:16+tq:4", "tq:4", 1, 1, 20, 0, torch.float32)
    bp = blockframe.block_frame_plan(kc, vc, 64, 0.125)
    assert bp is not None
    rope, _ = kc.bound()
    for first, n in ((0, 3), (5000, 7), (2, 1)):
        cs = bp.block_angles(first, n)
        freqs = (16 * torch.arange(first, first + n, dtype=torch.float32))[:, None] * rope.inv_freq[None, :].float()
        torch.testing.assert_close(cs, torch.cat((freqs.cos(), freqs.sin()), dim=-1), atol=0, rtol=0)
