"""Attention of a block of queries over a packed cache, in chunks: prefill with bounded extra memory.

For a block of ``T`` new queries at positions ``offset .. offset+T-1`` over ``n`` keys (the packed
tokens, then an optional full-precision window), the queries are processed ``q_block`` at a time and
the keys ``kv_chunk`` at a time: each key chunk is decoded from its packed codes, scored, masked
(causal: key ``j`` is visible to query ``i`` when ``j <= offset + i``; plus the model's own mask, if
given), and folded into an online softmax; a query that sees no key at all (a padding position) gets zeros,
as torch SDPA gives. Extra memory is about
``batch * num_q_heads * q_block * kv_chunk`` scores plus one decoded chunk, whatever the cache length:
never a float copy of the whole cache.
"""

from __future__ import annotations

import math

import torch

from walshkv.codecs.base import Codec, Packed

__all__ = ["chunked_attention"]


def _slice_mask(mask: torch.Tensor | None, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor | None:
    if mask is None:
        return None
    return mask[..., q0:q1, k0:k1]


def chunked_attention(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec,
    v_codec: Codec,
    *,
    offset: int,
    scale: float | None = None,
    window_k: torch.Tensor | None = None,
    window_v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    q_block: int = 512,
    kv_chunk: int = 1024,
) -> torch.Tensor:
    """Causal attention of ``T`` queries over a packed cache plus a full-precision window.

    Args:
        q: ``[batch, num_q_heads, T, head_dim]``; ``num_q_heads`` a multiple of the cache's kv heads.
        packed_k, packed_v: packed tokens ``[batch, num_kv_heads, n_packed, ...]`` (or ``None``).
        k_codec, v_codec: the codecs that encoded them.
        offset: position of the first query; keys are at positions ``0 .. n - 1`` and query ``i`` sees
            keys ``j <= offset + i``.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        window_k, window_v: full-precision tokens ``[batch, num_kv_heads, r, head_dim]`` after the packed ones.
        mask: the model's mask over ``[..., T, n]``, boolean (True = visible) or additive float; applied
            on top of the causal rule.
        q_block, kv_chunk: tile sizes.

    Returns:
        ``[batch, num_q_heads, T, head_dim]`` in ``q``'s dtype (computed in float32).
    """
    b, hq, t, d = q.shape
    n_packed = 0 if packed_k is None else packed_k.seq_len
    n_win = 0 if window_k is None else window_k.shape[-2]
    n = n_packed + n_win
    if n == 0:
        raise ValueError("attention over an empty cache: write at least one token first")
    hk = packed_k.num_heads if packed_k is not None else window_k.shape[1]  # type: ignore[union-attr]
    if hq % hk:
        raise ValueError(f"{hq} query heads cannot share {hk} kv heads: need a multiple")
    group = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf = q.to(torch.float32).reshape(b, hk, group, t, d) * scale
    out = torch.empty(b, hk, group, t, d, dtype=torch.float32, device=q.device)

    def keys_values(k0: int, k1: int) -> tuple[torch.Tensor, torch.Tensor]:
        parts_k, parts_v = [], []
        if k0 < n_packed:
            a, z = k0, min(k1, n_packed)
            parts_k.append(k_codec.decode(packed_k.slice_seq(a, z)).to(torch.float32))  # type: ignore[union-attr]
            parts_v.append(v_codec.decode(packed_v.slice_seq(a, z)).to(torch.float32))  # type: ignore[union-attr]
        if k1 > n_packed:
            a, z = max(k0, n_packed) - n_packed, k1 - n_packed
            parts_k.append(window_k[:, :, a:z].to(torch.float32))  # type: ignore[index]
            parts_v.append(window_v[:, :, a:z].to(torch.float32))  # type: ignore[index]
        k = parts_k[0] if len(parts_k) == 1 else torch.cat(parts_k, dim=-2)
        v = parts_v[0] if len(parts_v) == 1 else torch.cat(parts_v, dim=-2)
        return k, v

    for q0 in range(0, t, q_block):
        q1 = min(t, q0 + q_block)
        qb = qf[:, :, :, q0:q1]  # [b, hk, g, tq, d]
        last_visible = offset + q1 - 1  # no key after this position is visible to the block
        m = torch.full((b, hk, group, q1 - q0, 1), -math.inf, device=q.device)
        den = torch.zeros_like(m)
        acc = torch.zeros(b, hk, group, q1 - q0, d, device=q.device)
        qpos = torch.arange(offset + q0, offset + q1, device=q.device).view(-1, 1)
        for k0 in range(0, min(n, last_visible + 1), kv_chunk):
            k1 = min(n, k0 + kv_chunk, last_visible + 1)
            k, v = keys_values(k0, k1)
            s = torch.einsum("bhgtd,bhkd->bhgtk", qb, k)
            visible = torch.arange(k0, k1, device=q.device).view(1, -1) <= qpos
            extra = _slice_mask(mask, q0, q1, k0, k1)
            if extra is not None:
                if extra.dim() == 4:  # [b or 1, 1 or num_q_heads, tq, kc] -> the grouped score layout
                    heads = extra.shape[1]
                    extra = extra.reshape(
                        extra.shape[0], hk if heads == hq else 1, group if heads == hq else 1, *extra.shape[-2:]
                    )
                if extra.dtype == torch.bool:
                    visible = visible & extra
                else:
                    s.add_(extra.to(torch.float32))
            # in place: one tile of scores at a time (fewer and smaller allocations, lower peak memory)
            s.masked_fill_(~visible, -math.inf)
            m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
            safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
            p = s.sub_(safe).exp_()
            corr = torch.exp(torch.where(torch.isinf(m), torch.full_like(m, -math.inf), m - safe))
            den = den * corr + p.sum(dim=-1, keepdim=True)
            acc = acc * corr + torch.einsum("bhgtk,bhkd->bhgtd", p, v)
            m = m_new
        # a row that sees no key (a left-padding query) has den = acc = 0: zeros, as torch SDPA gives, not NaN
        out[:, :, :, q0:q1] = acc / torch.where(den > 0, den, torch.ones_like(den))
    return out.reshape(b, hq, t, d).to(q.dtype)
