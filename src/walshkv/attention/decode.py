"""Decode attention straight from a packed K/V cache, without a float copy of the whole cache.

One decode step: a query ``q [batch, num_q_heads, 1, head_dim]`` attends over ``seq_len`` cached
tokens stored as :class:`walshkv.codecs.base.Packed` K and V (``[batch, num_kv_heads, seq_len, ...]``),
optionally followed by a full-precision window of the most recent tokens (what
:class:`walshkv.cache.CompressedCache` keeps when ``residual > 0``). Grouped-query attention: query
head ``h`` reads kv head ``h // (num_q_heads // num_kv_heads)`` (the ``repeat_interleave`` /
``enable_gqa`` convention).

Rotation trick: for ``rot+X`` / ``rrot[:SEED]+X`` the cached vectors are ``k = U c`` with ``U`` the
orthonormal inverse rotation and ``c`` what ``X`` decodes. Since ``q·k = (Uᵀq)·c`` the query is
rotated once (``Uᵀ`` is the codec's forward rotation, random signs included) instead of unrotating
every key; and since ``Σ p_t v_t = U Σ p_t c_t`` the weighted sum of V is accumulated in the rotated
basis and unrotated once (unrotating the unnormalised sum is exact: the map is linear). ``center+``
needs nothing: its decode adds no bias back. The full-precision window is in the model's basis: it
joins after the packed part, with the unrotated query, into the already unrotated sum.

Softmax is online (streaming): a running max ``m``, denominator ``l`` and unnormalised sum ``acc``
are updated chunk by chunk, so the extra memory is one chunk of decoded tokens. All arithmetic is
float32 whatever the query dtype; the result is cast to the query's dtype at the end.

``vht2`` works the same way: its codes are WHT coefficients in the codec's order, so the query is
transformed once into that basis (WHT, then the order; calibrated orders and bands are per layer) and
the V sum is transformed back once.

``eq+`` (a calibrated matrix ``A`` per kv head before the codec) is the same trick without
orthogonality: ``q·A⁻¹y = (A⁻ᵀq)·y`` and ``Σ p_t A⁻¹y_t = A⁻¹ Σ p_t y_t``, so every backend reads the
inner codec's cache with the query mapped once and the V sum mapped back once
(:func:`walshkv.attention.peeling.peel_equalizer`).

What is not covered yet: ``kivi``, ``vzc``, ``sqfree``, ``tqprod``,
ggml types other than q4_0/q8_0 and float codecs go through the reference (correct, but it decodes
each chunk to float, so it is no faster than decoding the cache); only one query token per call.

Backends (:func:`decode_attention`): ``"reference"`` (pure torch, any codec, decodes chunks of at
most ``chunk`` tokens), ``"cpu"`` (the fused C++ kernel of :mod:`walshkv.attention.cpu`, for
int2..int8, ggml q4_0/q8_0, vht2 and tq, also under rot+/rrot+/center+/eq+) and ``"triton"`` (the fused GPU kernel of
:mod:`walshkv.attention.triton_decode`, same codecs, CUDA tensors; on CPU tensors only under the Triton
interpreter, ``TRITON_INTERPRET=1``, which is how the tests run it). The CPU and Triton kernels return
the partial softmax state of the packed tokens; the rotations and the window are applied here, as for
the reference. ``"auto"`` picks ``"cpu"`` when it reads both codecs and the tensors are on the CPU,
``"triton"`` when they are on a CUDA device, triton is importable and it reads both codecs, else the
reference.

Example::

    spec = parse_cache_spec("rot+int4/int3")
    pk, pv = spec.k.encode(k), spec.v.encode(v)            # [batch, kv_heads, seq, ...]
    out = decode_attention(q, pk, pv, spec.k, spec.v)      # q, out: [batch, q_heads, 1, head_dim]
"""

from __future__ import annotations

import math
from typing import get_args

import torch

from walshkv.attention.blockframe import BlockFramePlan, block_frame_decode_cpu, block_frame_plan
from walshkv.attention.cpu import fused_decode_cpu
from walshkv.attention.cpu_formats import CPU_SUPPORTED, CpuPlan, cpu_plan, cpu_supports
from walshkv.attention.peeling import peel, peel_equalizer
from walshkv.attention.reference import (
    as_codec,
    empty_state,
    merge_block,
    reference_partial,
    rotate,
    unrotate,
    validate,
)
from walshkv.attention.triton_decode import (
    TRITON_SUPPORTED,
    fused_decode_triton,
    fused_decode_triton_prerope,
    triton_available,
    triton_interpret,
    triton_supports,
)
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.prerope import PreRope
from walshkv.constants import Backend

__all__ = ["BACKENDS", "decode_attention", "decode_attention_reference"]

#: Accepted values of ``backend``.
BACKENDS: tuple[Backend, ...] = get_args(Backend)


def _attend(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec,
    v_codec: Codec,
    scale: float | None,
    window_k: torch.Tensor | None,
    window_v: torch.Tensor | None,
    chunk: int,
    plan: CpuPlan | None,
    use_triton: bool = False,
    k_eq: torch.Tensor | None = None,
    v_eq: torch.Tensor | None = None,
    start: int = 0,
    block: BlockFramePlan | None = None,
) -> torch.Tensor:
    """Shared body of the backends; ``plan`` (or ``block``, a ``ropeblock:G+`` K) selects the fused CPU kernel,
    ``use_triton`` the Triton one (neither: the reference). ``k_eq``/``v_eq``: the ``eq+`` inverses
    ``[kv_heads, d, d]`` that :func:`peel_equalizer` took off the codecs (the query is mapped once before the packed
    tokens, their V sum once after). ``start``: position of packed token 0 (``prerope+`` and ``ropeblock:G+`` keys)."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    if not isinstance(start, int) or start < 0:
        raise ValueError(f"start must be a position >= 0 (of the first packed token), got {start!r}")
    fields = plan is None and block is None  # the kernel checks the fields it reads
    sm_scale = validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale, fields)
    batch, hq, _, d = q.shape
    kv = packed_k.num_heads if packed_k is not None else window_k.shape[1]  # type: ignore[union-attr]
    g = hq // kv
    q0 = q.reshape(batch, kv, g, d).to(torch.float32)  # unscaled, model basis
    state = None
    if packed_k is not None and packed_v is not None and packed_k.seq_len > 0:
        # eq+ K: q . A⁻¹y = (A⁻ᵀq) . y, so the packed tokens are read as the inner codec's with A⁻ᵀq
        qp = q0 if k_eq is None else torch.einsum("bhge,hed->bhgd", q0, _per_head(k_eq, kv, "K", q.device))
        if block is not None:  # K in the block frame: the query turned and mapped once per block
            state = block_frame_decode_cpu(qp, block, packed_k, packed_v, start)  # None: no compiler
        elif plan is not None:
            state = fused_decode_cpu(qp, plan, packed_k, packed_v, start)  # None: no compiler (warned once)
        if state is None:
            k_rots, k_core = peel(k_codec)
            v_rots, v_core = peel(v_codec)
            qk = rotate(qp * sm_scale, k_rots)
            if use_triton and isinstance(k_codec, PreRope):  # keys rotated to their positions in the kernel
                m, l_sum, acc = fused_decode_triton_prerope(qk, packed_k, packed_v, k_codec, v_core, start)
            elif use_triton:
                m, l_sum, acc = fused_decode_triton(qk, packed_k, packed_v, k_core, v_core)
            else:
                m, l_sum, acc = reference_partial(qk, packed_k, packed_v, k_core, v_core, chunk, start)
            state = (m, l_sum, unrotate(acc, v_rots))  # the V sum, unrotated once
        if v_eq is not None:  # eq+ V: sum p A⁻¹y = A⁻¹ sum p y
            m, l_sum, acc = state
            state = (m, l_sum, torch.einsum("hed,bhgd->bhge", _per_head(v_eq, kv, "V", q.device), acc))
    if window_k is not None and window_v is not None and window_k.shape[2] > 0:
        if state is None:
            state = empty_state(batch, kv, g, d, q.device)
        scores = (q0 * sm_scale) @ window_k.to(torch.float32).transpose(-1, -2)
        state = merge_block(state, scores, window_v.to(torch.float32))
    assert state is not None  # validate refused an empty cache
    _, l_sum, acc = state
    return (acc / l_sum.unsqueeze(-1)).reshape(batch, hq, 1, d).to(q.dtype)


def _per_head(inverse: torch.Tensor, kv: int, what: str, device: torch.device) -> torch.Tensor:
    if inverse.shape[0] != kv:
        raise ValueError(
            f"the {what} codec's eq+ transform has {inverse.shape[0]} kv heads, the cache {kv}: pass the codec of "
            "the layer whose cache this is"
        )
    return inverse.to(device=device, dtype=torch.float32)


def decode_attention_reference(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec | str,
    v_codec: Codec | str,
    *,
    scale: float | None = None,
    window_k: torch.Tensor | None = None,
    window_v: torch.Tensor | None = None,
    chunk: int = 1024,
    start: int = 0,
) -> torch.Tensor:
    """Attention of one decode step over a packed cache, pure torch, any codec.

    The cache is decoded ``chunk`` tokens at a time (rotation wrappers are not undone: the query is
    rotated instead, see the module docstring) and folded into an online softmax, so the extra memory
    is about ``batch * num_kv_heads * chunk * head_dim`` float32 values, whatever the cache length.

    Args:
        q: ``[batch, num_q_heads, 1, head_dim]``, float32, bfloat16 or float16, finite; ``num_q_heads``
            a multiple of ``num_kv_heads``.
        packed_k, packed_v: what ``k_codec.encode`` / ``v_codec.encode`` returned, fields
            ``[batch, num_kv_heads, seq_len, ...]``; both ``None`` if every token is in the window.
        k_codec, v_codec: the codecs that encoded them (or their spec strings, e.g. ``"rot+int4"``).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_k, window_v: optional full-precision recent tokens ``[batch, num_kv_heads, r, head_dim]``,
            attended after the packed ones.
        chunk: tokens decoded at a time.
        start: position of the first packed token (what ``encode`` was given; it matters to ``prerope+`` keys
            only: sink tokens before it).

    Returns:
        ``[batch, num_q_heads, 1, head_dim]`` in ``q``'s dtype (computed in float32).

    Raises:
        ValueError: wrong shapes, head_dim/batch/head-count mismatches, a packed cache that does not fit
            its codec, an empty cache, or a NaN/Inf query.
    """
    k_codec, v_codec = as_codec(k_codec, "k_codec"), as_codec(v_codec, "v_codec")
    k_eq, k_codec = peel_equalizer(k_codec)
    v_eq, v_codec = peel_equalizer(v_codec)
    return _attend(
        q, packed_k, packed_v, k_codec, v_codec, scale, window_k, window_v, chunk, None, False, k_eq, v_eq, start
    )


def decode_attention(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec | str,
    v_codec: Codec | str,
    *,
    scale: float | None = None,
    window_k: torch.Tensor | None = None,
    window_v: torch.Tensor | None = None,
    backend: Backend = "auto",
    chunk: int = 1024,
    start: int = 0,
) -> torch.Tensor:
    """Attention of one decode step over a packed cache, on the fastest backend for the codecs.

    Args:
        q: ``[batch, num_q_heads, 1, head_dim]``, float32, bfloat16 or float16, finite.
        packed_k, packed_v: packed cache fields ``[batch, num_kv_heads, seq_len, ...]`` (or both ``None``).
        k_codec, v_codec: the codecs that encoded them (or spec strings).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        window_k, window_v: optional full-precision recent tokens ``[batch, num_kv_heads, r, head_dim]``.
        backend: ``"auto"`` (``"cpu"`` when the fused kernel reads both codecs and ``q`` is on the CPU,
            ``"triton"`` when ``q`` is on a CUDA device, triton is importable and its kernel reads both
            codecs, else ``"reference"``), ``"reference"``, ``"cpu"`` or ``"triton"`` (CUDA tensors; CPU
            tensors only with ``TRITON_INTERPRET=1`` set, which runs Triton's slow interpreter).
        chunk: tokens per chunk of the reference backend.
        start: position of the first packed token (``prerope+`` keys; see :func:`decode_attention_reference`).

    Returns:
        ``[batch, num_q_heads, 1, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: an unknown backend, ``backend="cpu"`` or ``"triton"`` with a codec or device it does not
            handle (or ``"triton"`` without the triton package), or
            any of the input errors of :func:`decode_attention_reference`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    k_codec, v_codec = as_codec(k_codec, "k_codec"), as_codec(v_codec, "v_codec")
    k_eq, k_codec = peel_equalizer(k_codec)
    v_eq, v_codec = peel_equalizer(v_codec)
    plan = block = None
    on_cpu = isinstance(q, torch.Tensor) and q.dim() == 4 and q.device.type == "cpu"
    if backend in ("auto", "cpu") and on_cpu:  # backend="triton" on CPU tensors runs Triton's interpreter
        d = q.shape[-1]
        sm = 1.0 / math.sqrt(d) if scale is None else float(scale)
        block = block_frame_plan(k_codec, v_codec, d, sm)
        plan = cpu_plan(k_codec, v_codec, d, sm) if block is None else None
    if backend == "cpu" and plan is None and block is None:
        validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale)  # input errors first
        if not on_cpu:
            raise ValueError(f"backend='cpu' needs CPU tensors, q is on {q.device}; use backend='reference'")
        d = q.shape[-1]
        bad = [c.spec for c in (k_codec, v_codec) if not cpu_supports(c, d)] or [f"{k_codec.spec}/{v_codec.spec}"]
        raise ValueError(
            f"backend='cpu' does not read {', '.join(repr(s) for s in bad)} (at head_dim {d}); it reads "
            f"{CPU_SUPPORTED}. Use backend='reference' (or 'auto') for other codecs"
        )
    use_triton = False
    on_cuda = isinstance(q, torch.Tensor) and q.dim() == 4 and q.device.type == "cuda"
    if backend == "auto" and on_cuda:
        d = q.shape[-1]
        use_triton = triton_supports(k_codec, d) and triton_supports(v_codec, d) and triton_available()
    elif backend == "triton":
        validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale)  # input errors first
        if not triton_available():
            raise ValueError(
                "backend='triton' needs the triton package, which cannot be imported (pip install triton); "
                "use backend='auto' or 'reference'"
            )
        if not on_cuda and not triton_interpret():
            raise ValueError(
                f"backend='triton' needs CUDA tensors, q is on {q.device}; CPU tensors run only under Triton's "
                "interpreter (set TRITON_INTERPRET=1 in the environment; slow, meant for tests). Use "
                "backend='cpu' or 'auto' on the CPU"
            )
        d = q.shape[-1]
        bad = [
            c.spec
            for c, ok in ((k_codec, triton_supports(k_codec, d)), (v_codec, triton_supports(v_codec, d)))
            if not ok
        ]
        if bad:
            raise ValueError(
                f"backend='triton' does not read {', '.join(repr(s) for s in bad)} (at head_dim {d}); it reads "
                f"{TRITON_SUPPORTED}. Use backend='reference' (or 'auto') for other codecs"
            )
        use_triton = True
    return _attend(
        q,
        packed_k,
        packed_v,
        k_codec,
        v_codec,
        scale,
        window_k,
        window_v,
        chunk,
        plan,
        use_triton,
        k_eq,
        v_eq,
        start,
        block,
    )
