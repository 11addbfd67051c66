"""Attention of a block of queries over a packed cache, tile by tile: prefill with bounded extra memory.

For a block of ``T`` new queries at positions ``offset .. offset+T-1`` over ``n`` stored keys (optional
full-precision *head* tokens, e.g. ``sink:N:``, then the packed tokens, then an optional full-precision
window, at positions ``0 .. n-1`` in that order), the keys are decoded ``kv_chunk`` at a time (each chunk
once) and every block of ``q_block`` queries that can see the chunk attends over it with an efficient
attention kernel that also returns the log-sum-exp of its scores: torch's CPU flash attention
(``aten::_scaled_dot_product_flash_attention_for_cpu``) on the CPU, a plain softmax tile elsewhere. The
tiles' results are merged exactly with their log-sum-exps (``o = Σ_i o_i exp(lse_i - lse)``, ``lse =
log Σ_i exp(lse_i)``). Causal rule: key ``j`` is visible to query ``i`` when ``j <= offset + i``; the
model's own mask (padding), if given, applies on top. A query that sees no key at all (a padding position)
gets zeros, as torch SDPA gives. Grouped-query attention reads each kv head's chunk once for its whole
group: the group's queries are stacked along the query axis of one call.

Extra memory: one decoded chunk (``batch * kv_heads * kv_chunk * head_dim`` floats, K and V) plus the
running output and log-sum-exp of the ``T`` queries (the size of the output): never a float copy of the
whole cache. Quantize-on-write is the caller's (the cache's) business: the packed tokens are read as
stored, the current block's included.
"""

from __future__ import annotations

import math

import torch

from walshkv.attention.cpu import decode_chunk_cpu
from walshkv.codecs.base import Codec, Packed

__all__ = ["KV_CHUNK", "chunked_attention"]

#: Packed keys decoded per tile by default (``chunked_attention``'s ``kv_chunk``).
KV_CHUNK = 2048

_NEG_INF = -math.inf


def _flash_tile(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool = False
):
    """``(out, lse)`` of ``q [b, h, tq, d]`` over ``k, v [b, h, tk, d]`` (float32; ``mask`` additive
    ``[tq, tk]`` or ``[b, 1, tq, tk]``, ``None`` = all visible; ``causal``: query ``i`` sees keys ``j <= i``, top-left
    aligned, no mask). A row with every key masked gets ``lse = -inf``."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=mask, scale=scale
        )
    else:
        s = (q @ k.transpose(-1, -2)) * scale
        if causal:
            hidden = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
            s = s.masked_fill(hidden, _NEG_INF)
        if mask is not None:
            s = s + mask
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse).unsqueeze(-1))
        out = p @ v
    if mask is not None:  # flash attention reports lse 0 (and zeros) for a row that sees nothing
        seen = (mask > _NEG_INF).any(dim=-1)
        lse = torch.where(seen, lse, torch.full_like(lse, _NEG_INF))
        out = torch.where(seen.unsqueeze(-1), out, torch.zeros_like(out))
    return out, lse


def _merge(out: torch.Tensor, lse: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> None:
    """Fold a tile's ``(o2, l2)`` into the running ``(out, lse)`` in place (exact softmax merge)."""
    mx = torch.maximum(lse, l2)
    safe = torch.where(torch.isinf(mx), torch.zeros_like(mx), mx)
    w1, w2 = torch.exp(lse - safe), torch.exp(l2 - safe)  # -inf rows weigh 0
    den = w1 + w2
    out.mul_(w1.unsqueeze(-1)).add_(o2 * w2.unsqueeze(-1)).div_(torch.where(den > 0, den, 1.0).unsqueeze(-1))
    lse.copy_(torch.where(den > 0, safe + torch.log(torch.where(den > 0, den, 1.0)), torch.full_like(den, _NEG_INF)))


def chunked_attention(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec,
    v_codec: Codec,
    *,
    offset: int,
    scale: float | None = None,
    head_k: torch.Tensor | None = None,
    head_v: torch.Tensor | None = None,
    window_k: torch.Tensor | None = None,
    window_v: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    start: int | None = None,
    q_block: int = 1024,
    kv_chunk: int = KV_CHUNK,
) -> torch.Tensor:
    """Causal attention of ``T`` queries over head tokens, a packed cache and a full-precision window.

    Args:
        q: ``[batch, num_q_heads, T, head_dim]``; ``num_q_heads`` a multiple of the cache's kv heads.
        packed_k, packed_v: packed tokens ``[batch, num_kv_heads, n_packed, ...]`` (or ``None``).
        k_codec, v_codec: the codecs that encoded them.
        offset: position of the first query; keys are at positions ``0 .. n - 1`` (head, packed, window in
            order) and query ``i`` sees keys ``j <= offset + i``.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        head_k, head_v: full-precision tokens ``[batch, num_kv_heads, s, head_dim]`` before the packed ones
            (``sink:N:`` tokens), as attention reads them.
        window_k, window_v: full-precision tokens ``[batch, num_kv_heads, r, head_dim]`` after the packed ones.
        mask: the model's mask over ``[..., T, n]``, boolean (True = visible) or additive float; applied
            on top of the causal rule.
        start: the position ``encode`` was given for packed token 0 (``prerope+`` keys); default: right after
            the head tokens.
        q_block, kv_chunk: tile sizes (queries per attention call, keys decoded at a time).

    Returns:
        ``[batch, num_q_heads, T, head_dim]`` in ``q``'s dtype (computed in float32).
    """
    b, hq, t, d = q.shape
    n_head = 0 if head_k is None else head_k.shape[-2]
    n_packed = 0 if packed_k is None else packed_k.seq_len
    n_win = 0 if window_k is None else window_k.shape[-2]
    n = n_head + n_packed + n_win
    if n == 0:
        raise ValueError("attention over an empty cache: write at least one token first")
    some = packed_k if packed_k is not None else None
    hk = some.num_heads if some is not None else (head_k if head_k is not None else window_k).shape[1]  # type: ignore[union-attr]
    if hq % hk:
        raise ValueError(f"{hq} query heads cannot share {hk} kv heads: need a multiple")
    if not isinstance(q_block, int) or not isinstance(kv_chunk, int) or q_block < 1 or kv_chunk < 1:
        raise ValueError(f"q_block and kv_chunk must be positive token counts, got {q_block!r}, {kv_chunk!r}")
    group = hq // hk
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    start = n_head if start is None else int(start)
    qf = q.to(torch.float32).reshape(b, hk, group, t, d)
    out = torch.zeros(b, hk, group, t, d, dtype=torch.float32, device=q.device)
    lse = torch.full((b, hk, group, t), _NEG_INF, dtype=torch.float32, device=q.device)
    extra = None if mask is None else _additive(mask, b, hk, group, t, n)

    def part(a: int, z: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``a .. z`` (float32), decoded or taken from the head/window tokens."""
        ks, vs = [], []
        for lo, hi, kind in ((0, n_head, "head"), (n_head, n_head + n_packed, "packed"), (n_head + n_packed, n, "win")):
            x0, x1 = max(a, lo), min(z, hi)
            if x0 >= x1:
                continue
            if kind == "packed":
                i0, i1 = x0 - n_head, x1 - n_head
                fast = decode_chunk_cpu(packed_k, packed_v, k_codec, v_codec, start, i0, i1)  # type: ignore[arg-type]
                if fast is not None:  # the C++ kernel's decode (None: a pair it does not read)
                    ks.append(fast[0])
                    vs.append(fast[1])
                    continue
                ks.append(k_codec.decode(packed_k.slice_seq(i0, i1), start + i0).to(torch.float32))  # type: ignore[union-attr]
                vs.append(v_codec.decode(packed_v.slice_seq(i0, i1), start + i0).to(torch.float32))  # type: ignore[union-attr]
            else:
                src_k, src_v = (head_k, head_v) if kind == "head" else (window_k, window_v)
                ks.append(src_k[:, :, x0 - lo : x1 - lo].to(torch.float32))  # type: ignore[index]
                vs.append(src_v[:, :, x0 - lo : x1 - lo].to(torch.float32))  # type: ignore[index]
        return (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks, dim=-2), torch.cat(vs, dim=-2))

    last_query = offset + t - 1

    def fold(q0: int, q1: int, o2: torch.Tensor, l2: torch.Tensor) -> None:
        tq = q1 - q0
        _merge(out[:, :, :, q0:q1], lse[:, :, :, q0:q1], o2.reshape(b, hk, group, tq, d), l2.reshape(b, hk, group, tq))

    for k0 in range(0, min(n, last_query + 1), kv_chunk):
        k1 = min(n, k0 + kv_chunk, last_query + 1)
        kc, vc = part(k0, k1)
        first_q = max(0, k0 - offset)  # queries before it see none of this chunk
        for q0 in range(first_q - first_q % q_block, t, q_block):
            q1 = min(t, q0 + q_block)
            if k0 > offset + q1 - 1:
                continue
            if extra is None:
                # causal rule only: keys k0 .. p-1 are seen by every query of the block (p: the position of its
                # first query that sees this chunk), keys p .. k1-1 by query p+i up to p+i: torch's top-left causal
                # flag, one query per head with the chunk's kv heads repeated, no mask to build or read
                qs = max(q0, k0 - offset)
                p = offset + qs
                if p > k0:
                    qt = qf[:, :, :, qs:q1].reshape(b, hk, group * (q1 - qs), d)
                    o2, l2 = _flash_tile(qt, kc[:, :, : p - k0], vc[:, :, : p - k0], None, scale)
                    fold(qs, q1, o2, l2)
                if k1 > p:
                    qt = qf[:, :, :, qs:q1].reshape(b, hk * group, q1 - qs, d)
                    kd, vd = kc[:, :, p - k0 :], vc[:, :, p - k0 :]
                    if group > 1:
                        kd, vd = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
                    o2, l2 = _flash_tile(qt, kd, vd, None, scale, causal=True)
                    fold(qs, q1, o2, l2)
                continue
            tq = q1 - q0
            tile_mask = None
            if k1 - 1 > offset + q0:  # the causal edge crosses this tile
                qpos = torch.arange(offset + q0, offset + q1, device=q.device).view(-1, 1)
                vis = torch.arange(k0, k1, device=q.device).view(1, -1) <= qpos
                tile_mask = torch.zeros(tq, k1 - k0, device=q.device).masked_fill_(~vis, _NEG_INF)
            e = extra[:, :, :, q0:q1, k0:k1]  # [b, hk|1, g|1, tq, kc]
            e = e.expand(b, hk, group, tq, k1 - k0)
            tile_mask = e if tile_mask is None else e + tile_mask
            tile_mask = tile_mask.reshape(b, hk, group * tq, k1 - k0)
            qt = qf[:, :, :, q0:q1].reshape(b, hk, group * tq, d)
            o2, l2 = _flash_tile(qt, kc, vc, tile_mask, scale)
            fold(q0, q1, o2, l2)
    return out.reshape(b, hq, t, d).to(q.dtype)


def _additive(mask: torch.Tensor, b: int, hk: int, group: int, t: int, n: int) -> torch.Tensor:
    """The model's mask as additive float32 ``[b|1, hk|1, group|1, T, n]`` (0 visible, -inf hidden)."""
    m = mask[..., -t:, :n]
    m = torch.zeros(m.shape, device=m.device).masked_fill_(~m, _NEG_INF) if m.dtype == torch.bool else m.float()
    if m.dim() == 2:
        return m.view(1, 1, 1, t, n)
    if m.dim() != 4:
        raise ValueError(f"the attention mask must be [T, n] or [batch, heads, T, n], got {tuple(mask.shape)}")
    heads = m.shape[1]
    if heads == 1:
        return m.unsqueeze(2)
    if heads != hk * group:
        raise ValueError(f"the attention mask has {heads} heads, the queries {hk * group}")
    return m.reshape(m.shape[0], hk, group, t, n)
