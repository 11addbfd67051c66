"""Decode attention over K stored in the block frame (``ropeblock:G+``), with the fused CPU kernel.

:class:`walshkv.codecs.blockrope.RopeBlock` stores a key at position ``p`` (block start ``p0``, offset ``j``) as
``X(A (R(p0)ᵀ k / s - R(j) mu))`` (``A``: the ``eqr:G+`` transform, ``X``: the storing codec, ``s``: the RoPE
table's scaling). The score of a query ``q`` is then::

    q · k = (s A⁻ᵀ R(p0)ᵀ q) · (X⁻¹(codes) + A R(j) mu)

so one step turns the query back to each block's first position and maps it by ``A⁻ᵀ`` once per block
(``[kv_heads, n_blocks, group, head_dim]``), and the kernel adds row ``j`` of the table ``A R(j) mu``
(``[kv_heads, G, head_dim]``) to each decoded key (``fused_decode_cpu``'s ``query_block`` and ``key_table``). No
matrix and no RoPE per key. The reference is the codec's own decode (keys turned to their positions) through
:func:`walshkv.attention.reference.reference_partial`, which the tests compare this with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from walshkv.attention.cpu import fused_decode_cpu
from walshkv.attention.cpu_formats import CpuPlan, cpu_plan
from walshkv.attention.peeling import peel_equalizer
from walshkv.codecs.base import Codec, Packed, find_wrapper
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.equalize import Equalized
from walshkv.ops.rope import turn

__all__ = ["BlockFramePlan", "block_frame_decode_cpu", "block_frame_plan"]


@dataclass(frozen=True)
class BlockFramePlan:
    """What a decode step over a ``ropeblock:G+`` K cache needs besides the query.

    Attributes:
        codec: the bound K codec.
        plan: the kernel's plan for the storing codec (``eqr+`` peeled off) and V's codec.
        fold: ``A⁻¹`` ``[kv_heads, head_dim, head_dim]`` (``q @ fold`` is ``A⁻ᵀ q``), or ``None`` without ``eqr+``.
        table: ``A R(j) mu`` ``[kv_heads, G, head_dim]``, the mean at each offset in the codes' space.
    """

    codec: RopeBlock
    plan: CpuPlan
    fold: torch.Tensor | None
    table: torch.Tensor


_TABLES: dict[int, tuple[RopeBlock, torch.Tensor | None, torch.Tensor]] = {}
_MAX_TABLES = 256


def block_frame_plan(k_codec: Codec, v_codec: Codec, head_dim: int, scale: float) -> BlockFramePlan | None:
    """The setup for :func:`block_frame_decode_cpu`, or ``None`` if ``k_codec`` is not a bound ``ropeblock:G+``
    codec whose storing codec (and ``v_codec``) the CPU kernel reads with an orthogonal K buffer."""
    if not isinstance(k_codec, RopeBlock) or k_codec.rope is None or k_codec.mu is None:
        return None
    fold, inner = peel_equalizer(k_codec.inner)
    plan = cpu_plan(inner, v_codec, head_dim, scale)
    if plan is None or plan.prerope is not None or not plan.k_buffer_orthogonal:
        return None
    hit = _TABLES.get(id(k_codec))
    if hit is None or hit[0] is not k_codec:
        if len(_TABLES) >= _MAX_TABLES:
            _TABLES.clear()
        means = k_codec.offset_means("cpu")  # R(j) mu, [kv_heads, G, d]
        table = means
        eq = find_wrapper(k_codec.inner, Equalized)
        if fold is not None and eq is not None and eq.matrix is not None:  # A R(j) mu as rows: (R(j) mu) @ Aᵀ
            table = torch.matmul(means, eq.matrix.transpose(-1, -2))
        hit = _TABLES[id(k_codec)] = (k_codec, None if fold is None else fold.contiguous(), table.contiguous())
    return BlockFramePlan(k_codec, plan, hit[1], hit[2])


def block_frame_decode_cpu(
    q: torch.Tensor, bp: BlockFramePlan, packed_k: Packed, packed_v: Packed, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Unnormalised attention of one query step over a ``ropeblock:G+`` K cache, with the C++ kernel.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, unscaled, in the model's basis (after RoPE).
        bp: :func:`block_frame_plan` of the codecs.
        packed_k, packed_v: CPU fields ``[batch, kv_heads, seq_len, ...]``; packed token ``t`` is at position
            ``start + t``.
        start: position of packed token 0.

    Returns:
        ``(m, l, acc)`` as :func:`walshkv.attention.cpu.fused_decode_cpu` returns them (``acc`` in the model's
        basis of V), or ``None`` if the kernel cannot be built.
    """
    codec = bp.codec
    rope, _ = codec.bound()
    g_len = codec.block
    b, h, g, d = q.shape
    off = start % g_len
    n_blocks = max(1, -(-(off + packed_k.seq_len) // g_len))
    starts = (start - off) + g_len * torch.arange(n_blocks)
    # the query turned back to each block's first position: [b, h, g, n_blocks, d] -> [b, h, n_blocks, g, d]
    qr = turn(q.to(torch.float32)[:, :, :, None, :].expand(b, h, g, n_blocks, d), rope, starts, inverse=True)
    qr = qr.transpose(2, 3)
    if rope.scaling != 1.0:
        qr = qr * rope.scaling
    if bp.fold is not None:  # A⁻ᵀ q, once per block and query head
        qr = torch.matmul(qr.reshape(b, h, n_blocks * g, d), bp.fold[None]).reshape(b, h, n_blocks, g, d)
    return fused_decode_cpu(
        qr.contiguous(),
        bp.plan,
        packed_k,
        packed_v,
        query_block=g_len,
        key_table=bp.table,
        block_offset=off,
    )
