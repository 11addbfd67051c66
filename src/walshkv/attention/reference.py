"""The pure-torch pieces of decode attention: input checks, the online softmax and the chunked reference.

Every backend of :func:`walshkv.attention.decode_attention` validates its inputs here and merges the
full-precision window with :func:`merge_block`; the reference backend also reads the packed tokens
here (:func:`reference_partial`), decoding ``chunk`` tokens at a time in the core codecs' (rotated) bases.
Layout everywhere: ``[batch, num_kv_heads, seq_len, head_dim]``; queries ``[batch, num_q_heads, 1, head_dim]``.
"""

from __future__ import annotations

import math

import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import parse_codec

__all__ = ["as_codec", "merge_block", "reference_partial", "rotate", "unrotate", "validate"]

_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: Online-softmax state: running max and denominator ``[batch, kv_heads, group]``, unnormalised V sum
#: ``[batch, kv_heads, group, head_dim]``, all float32.
State = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def as_codec(codec: Codec | str, what: str) -> Codec:
    """``codec`` itself, or the codec its spec string names (``"rot+int4"``)."""
    if isinstance(codec, str):
        return parse_codec(codec)
    if not isinstance(codec, Codec):
        raise TypeError(f"{what} must be a walshkv Codec (or a codec spec string), got {type(codec).__name__}")
    return codec


def _check_fields(packed: Packed, codec: Codec, head_dim: int, what: str) -> None:
    """The packed fields must be the ones ``codec`` writes (a wrong codec would decode garbage)."""
    for name, field in codec.layout(head_dim).items():
        t = packed.tensors.get(name)
        if t is None or tuple(t.shape[3:]) != field.shape or t.dtype != field.dtype:
            got = "missing" if t is None else f"{t.dtype} {tuple(t.shape[3:])}"
            raise ValueError(
                f"packed {what} does not match codec {codec.spec!r}: field {name!r} should be {field.dtype} "
                f"{field.shape} per vector at head_dim {head_dim}, got {got}; pass the codec that encoded it"
            )


def validate(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec,
    v_codec: Codec,
    window_k: torch.Tensor | None,
    window_v: torch.Tensor | None,
    scale: float | None,
    check_fields: bool = True,
) -> float:
    """Check shapes, dtypes, devices and finiteness; return the softmax scale.

    Args:
        q: ``[batch, num_q_heads, 1, head_dim]``.
        packed_k, packed_v: ``[batch, num_kv_heads, seq_len, ...]`` (or both ``None``).
        k_codec, v_codec: the codecs that wrote them.
        window_k, window_v: ``[batch, num_kv_heads, r, head_dim]`` (or both ``None``).
        scale: the caller's softmax scale, ``None`` for ``1 / sqrt(head_dim)``.
        check_fields: check the packed fields against the codecs' layouts (the fused kernels check the
            fields they read themselves).

    Raises:
        ValueError: any mismatch, an empty cache or a NaN/Inf query (the message names it and the fix).
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(
            f"q must have shape [batch, num_q_heads, 1, head_dim] (one decode step), got {tuple(q.shape)}; "
            "for several query tokens call once per token or use scaled_dot_product_attention on decoded K/V"
        )
    if q.dtype not in _Q_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}; cast it with q.float()")
    batch, hq, _, d = q.shape
    if (packed_k is None) != (packed_v is None):
        raise ValueError("pass both packed_k and packed_v, or neither (everything in the window)")
    if (window_k is None) != (window_v is None):
        raise ValueError("pass both window_k and window_v, or neither")
    parts: list[tuple[str, int, int, int, int, torch.device]] = []
    if packed_k is not None and packed_v is not None:
        for what, p, c in (("K", packed_k, k_codec), ("V", packed_v, v_codec)):
            if not isinstance(p, Packed):
                raise TypeError(f"packed_{what.lower()} must be a walshkv Packed, got {type(p).__name__}")
            first = p._first()
            pb, ph, pt = first.shape[:3]
            parts.append((f"packed {what}", pb, ph, p.head_dim, pt, first.device))
            if p.head_dim != d:
                raise ValueError(
                    f"head_dim mismatch: q has {d}, packed {what} was encoded at head_dim {p.head_dim}; "
                    "use the query of the layer whose cache this is"
                )
            if check_fields:
                _check_fields(p, c, d, what)
        if parts[0][4] != parts[1][4]:
            raise ValueError(f"packed K holds {parts[0][4]} tokens but packed V {parts[1][4]}; they must match")
    if window_k is not None and window_v is not None:
        for what, w in (("window_k", window_k), ("window_v", window_v)):
            if not isinstance(w, torch.Tensor) or w.dim() != 4 or not w.dtype.is_floating_point:
                raise ValueError(f"{what} must be a float tensor [batch, num_kv_heads, r, head_dim]")
            if w.shape[-1] != d:
                raise ValueError(f"head_dim mismatch: q has {d}, {what} has {w.shape[-1]}")
            parts.append((what, w.shape[0], w.shape[1], w.shape[3], w.shape[2], w.device))
        if window_k.shape != window_v.shape:
            raise ValueError(f"window_k {tuple(window_k.shape)} and window_v {tuple(window_v.shape)} must match")
    if not parts:
        raise ValueError("nothing to attend to: pass packed_k/packed_v and/or window_k/window_v")
    kv = parts[0][2]
    for name, b, h, _, _, dev in parts:
        if b != batch:
            raise ValueError(f"batch mismatch: q has batch {batch}, {name} has {b}; pass the matching cache rows")
        if h != kv:
            raise ValueError(f"kv head mismatch: {parts[0][0]} has {kv} heads, {name} has {h}")
        if dev != q.device:
            raise ValueError(f"device mismatch: q is on {q.device}, {name} on {dev}; move them to one device")
    if hq % kv:
        raise ValueError(
            f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({kv}) for grouped-query attention; "
            "check that q and the cache come from the same layer"
        )
    if sum(p[4] for p in parts) == 0:
        raise ValueError("nothing to attend to: the cache holds 0 tokens")
    # one reduction instead of isfinite().all(); a NaN/Inf anywhere makes the sum non-finite (and an
    # overflowing sum of finite values is caught by the exact check that follows)
    if not math.isfinite(float(q.sum(dtype=torch.float32))) and not bool(torch.isfinite(q).all()):
        n_nan, n_inf = int(torch.isnan(q).sum()), int(torch.isinf(q).sum())
        raise ValueError(
            f"q contains {n_nan} NaN and {n_inf} Inf values; attention would spread them to every output. "
            "Find where the model overflows (e.g. run it in float32) and pass a finite query."
        )
    if scale is None:
        return 1.0 / math.sqrt(d)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def rotate(x: torch.Tensor, rots: list[Rotated]) -> torch.Tensor:
    """Apply the transposed decode rotations: ``Uᵀ x`` for ``U`` = outermost ... innermost unrotations."""
    for r in rots:
        x = r.rotate(x)
    return x


def unrotate(x: torch.Tensor, rots: list[Rotated]) -> torch.Tensor:
    """``U x``: the codec's decode rotations, innermost first."""
    for r in reversed(rots):
        x = r.unrotate(x)
    return x


def empty_state(b: int, kv: int, g: int, d: int, device: torch.device) -> State:
    """The online-softmax state before any token: ``m = -inf``, ``l = 0``, ``acc = 0``."""
    m = torch.full((b, kv, g), float("-inf"), dtype=torch.float32, device=device)
    return m, torch.zeros_like(m), torch.zeros(b, kv, g, d, dtype=torch.float32, device=device)


def merge_block(state: State, s: torch.Tensor, v: torch.Tensor) -> State:
    """Online-softmax update of ``(m, l, acc)`` with scores ``s [b, kv, g, c]`` and values ``v [b, kv, c, d]``."""
    m, l_sum, acc = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    alpha = torch.exp(m - m_new)  # 0 while m is -inf (nothing seen yet)
    p = torch.exp(s - m_new.unsqueeze(-1))
    l_sum = l_sum * alpha + p.sum(dim=-1)
    acc = acc * alpha.unsqueeze(-1) + p @ v
    return m_new, l_sum, acc


def reference_partial(
    q: torch.Tensor, packed_k: Packed, packed_v: Packed, k_core: Codec, v_core: Codec, chunk: int, k_start: int = 0
) -> State:
    """Online softmax over the packed tokens, ``chunk`` at a time, in the cores' (rotated) bases.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, scaled and rotated into ``k_core``'s basis.
        packed_k, packed_v: ``[batch, kv_heads, seq_len, ...]`` written by ``k_core`` / ``v_core``.
        k_core, v_core: the storing codecs (wrappers peeled; a ``prerope+`` K codec is read whole, in the
            model's basis, at positions ``k_start, ...``).
        k_start: position of packed token 0.
        chunk: tokens decoded at a time.

    Returns:
        ``(m, l, acc)``: running max and denominator ``[batch, kv_heads, group]`` and the unnormalised V
        sum ``[batch, kv_heads, group, head_dim]`` in ``v_core``'s basis.
    """
    b, kv, g, d = q.shape
    state = empty_state(b, kv, g, d, q.device)
    for start in range(0, packed_k.seq_len, chunk):
        stop = min(start + chunk, packed_k.seq_len)
        k = k_core._decode_at(packed_k.slice_seq(start, stop), k_start + start).to(torch.float32)
        v = v_core._decode(packed_v.slice_seq(start, stop)).to(torch.float32)
        state = merge_block(state, q @ k.transpose(-1, -2), v)
    return state
