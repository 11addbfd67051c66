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
from walshkv.ops.rope import rope_angles

__all__ = ["BlockFramePlan", "block_frame_decode_cpu", "block_frame_plan", "block_query_matrix"]


@dataclass(eq=False)
class BlockFramePlan:
    """What a decode step over a ``ropeblock:G+`` K cache needs besides the query.

    Attributes:
        codec: the bound K codec.
        plan: the kernel's plan for the storing codec (``eqr+`` peeled off) and V's codec.
        q_to_buffer: ``[kv_heads, head_dim, L]``: a query turned back to its block's start, to K's kernel buffer
            (RoPE's scaling, ``A⁻ᵀ``, the softmax scale and the storing codec's rotations in one matrix).
        table_buffer: ``A R(j) mu`` (the mean at each offset in the codes' space) in K's kernel buffer
            ``[kv_heads, G, L]``.
        angles: ``[cos, sin]`` rows ``[n, head_dim]`` of block starts ``0, G, 2G, ...``, grown as the cache grows
            (:meth:`block_angles`).
    """

    codec: RopeBlock
    plan: CpuPlan
    q_to_buffer: torch.Tensor
    table_buffer: torch.Tensor
    angles: torch.Tensor

    def block_angles(self, first: int, n: int) -> torch.Tensor:
        """``[cos, sin]`` ``[n, head_dim]`` (each half ``head_dim / 2`` wide, one column per rotary pair) of the
        starts of blocks ``first .. first + n - 1``: the model's float32 angles (:func:`walshkv.ops.rope.rope_angles`,
        what :func:`walshkv.ops.rope.turn` rotates by)."""
        if first + n > self.angles.shape[0]:
            rope, _ = self.codec.bound()
            have = max(64, 2 * (first + n))
            freqs = rope_angles(rope, self.codec.block * torch.arange(have))
            self.angles = torch.cat((freqs.cos(), freqs.sin()), dim=-1)
        return self.angles[first : first + n]


_TABLES: dict[int, tuple[RopeBlock, CpuPlan, BlockFramePlan]] = {}
_MAX_TABLES = 256


def block_frame_plan(k_codec: Codec, v_codec: Codec, head_dim: int, scale: float) -> BlockFramePlan | None:
    """The setup for :func:`block_frame_decode_cpu`, or ``None`` if ``k_codec`` is not a bound ``ropeblock:G+``
    codec whose storing codec (and ``v_codec``) the CPU kernel reads with an orthogonal K buffer as long as the
    head."""
    if not isinstance(k_codec, RopeBlock) or k_codec.rope is None or k_codec.mu is None:
        return None
    fold, inner = peel_equalizer(k_codec.inner)
    plan = cpu_plan(inner, v_codec, head_dim, scale)
    if plan is None or plan.prerope is not None or not plan.k_buffer_orthogonal or plan.k.length != head_dim:
        return None
    hit = _TABLES.get(id(k_codec))
    if hit is not None and hit[0] is k_codec and hit[1] is plan:
        return hit[2]
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    rope, _ = k_codec.bound()
    means = k_codec.offset_means("cpu")  # R(j) mu, [kv_heads, G, d]
    table = means
    eq = find_wrapper(k_codec.inner, Equalized)
    if fold is not None and eq is not None and eq.matrix is not None:  # A R(j) mu as rows: (R(j) mu) @ Aᵀ
        table = torch.matmul(means, eq.matrix.transpose(-1, -2))
    kv = table.shape[0]
    to_buffer = plan.q_map if plan.q_map is not None else torch.eye(head_dim) * plan.scale
    mapped = to_buffer.expand(kv, -1, -1) if fold is None else torch.matmul(fold, to_buffer)  # A⁻ᵀ first
    q_to_buffer = (rope.scaling * mapped).contiguous()
    table_buffer = table if plan.q_map is None else torch.matmul(table, plan.q_map / plan.scale)
    if not bool(torch.isfinite(table_buffer).all()):  # checked once here; the steps pass key_table_finite
        raise ValueError(
            "the block frame's mean table has NaN or Inf entries: the keys would be undefined (check the K mean of "
            "the calibration file)"
        )
    bp = BlockFramePlan(k_codec, plan, q_to_buffer, table_buffer.contiguous(), torch.empty(0, head_dim))
    _TABLES[id(k_codec)] = (k_codec, plan, bp)
    return bp


def block_query_matrix(q: torch.Tensor, bp: BlockFramePlan) -> torch.Tensor:
    """The per-step matrix ``W`` whose product with a block's ``[cos, sin]`` row is the query turned back to that
    block's start and mapped to K's buffer, ``F (R(p0)ᵀ q)``.

    With ``q = (q1, q2)``, ``F = (F1; F2)`` (halves) and the block's angles ``(c, s)``, ``R(p0)ᵀ q = (q1 c + q2 s,
    q2 c - q1 s)``, so ``F (R(p0)ᵀ q) = sum_k c_k (q1_k F1_k + q2_k F2_k) + s_k (q2_k F1_k - q1_k F2_k)``.

    Args:
        q: ``[batch, kv_heads, group, head_dim]``, unscaled, in the model's basis (after RoPE).
        bp: :func:`block_frame_plan` of the codecs.

    Returns:
        float32 ``[batch, kv_heads, head_dim, group * head_dim]``: ``[cos, sin] @ W`` gives every query of the group.
    """
    b, h, g, d = q.shape
    qf = q.to(torch.float32)
    half = d // 2
    q1, q2 = qf[..., :half, None], qf[..., half:, None]  # [b, h, g, d/2, 1]
    f1, f2 = bp.q_to_buffer[:, None, :half], bp.q_to_buffer[:, None, half:]  # [h, 1, d/2, L]
    w = torch.cat((q1 * f1 + q2 * f2, q2 * f1 - q1 * f2), dim=-2)  # [b, h, g, d, L]
    return w.permute(0, 1, 3, 2, 4).reshape(b, h, d, g * d)


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
    g_len = bp.codec.block
    b, h, g, d = q.shape
    off = start % g_len
    n_blocks = max(1, -(-(off + packed_k.seq_len) // g_len))
    cs = bp.block_angles((start - off) // g_len, n_blocks)  # [n_blocks, d]: c then s
    qb = torch.matmul(cs, block_query_matrix(q, bp)).reshape(b, h, n_blocks, g, d)
    return fused_decode_cpu(
        qb,
        bp.plan,
        packed_k,
        packed_v,
        query_block=g_len,
        key_table=bp.table_buffer,
        block_offset=off,
        in_buffer=True,
        key_table_finite=True,
    )
