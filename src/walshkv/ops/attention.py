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
(:func:`walshkv.ops.attention_cpu.peel_equalizer`).

What is not covered yet: ``kivi``, ``vzc``, ``sqfree``, ``tqprod``,
ggml types other than q4_0/q8_0 and float codecs go through the reference (correct, but it decodes
each chunk to float, so it is no faster than decoding the cache); only one query token per call.

Backends (:func:`decode_attention`): ``"reference"`` (pure torch, any codec, decodes chunks of at
most ``chunk`` tokens), ``"cpu"`` (the fused C++ kernel of :mod:`walshkv.ops.attention_cpu`, for
int2..int8, ggml q4_0/q8_0, vht2 and tq, also under rot+/rrot+/center+/eq+) and ``"triton"`` (the fused GPU kernel of
:mod:`walshkv.ops.attention_triton`, same codecs, CUDA tensors; on CPU tensors only under the Triton
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

import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.rotation import Rotated
from walshkv.ops.attention_cpu import (
    CPU_SUPPORTED,
    CpuPlan,
    cpu_plan,
    cpu_supports,
    fused_decode_cpu,
    peel,
    peel_equalizer,
)
from walshkv.ops.attention_triton import (
    TRITON_SUPPORTED,
    fused_decode_triton,
    triton_available,
    triton_interpret,
    triton_supports,
)

__all__ = ["BACKENDS", "decode_attention", "decode_attention_reference"]

#: Accepted values of ``backend``.
BACKENDS = ("auto", "reference", "cpu", "triton")

_Q_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _codec(codec: Codec | str, what: str) -> Codec:
    if isinstance(codec, str):
        from walshkv.codecs.spec import parse_codec

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


def _validate(
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
    """Check shapes, dtypes, devices and finiteness; return the softmax scale."""
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
            if check_fields:  # (the fused kernel checks the fields it reads itself)
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


def _rotate(x: torch.Tensor, rots: list[Rotated]) -> torch.Tensor:
    """Apply the transposed decode rotations: ``Uᵀ x`` for ``U`` = outermost ... innermost unrotations."""
    for r in rots:
        x = r.rotate(x)
    return x


def _unrotate(x: torch.Tensor, rots: list[Rotated]) -> torch.Tensor:
    """``U x``: the codec's decode rotations, innermost first."""
    for r in reversed(rots):
        x = r.unrotate(x)
    return x


def _decode_f32(core: Codec, packed: Packed) -> torch.Tensor:
    return core._decode(packed).to(torch.float32)


def _merge_block(
    state: tuple[torch.Tensor, torch.Tensor, torch.Tensor], s: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online-softmax update of ``(m, l, acc)`` with scores ``s [b, kv, g, c]`` and values ``v [b, kv, c, d]``."""
    m, l_sum, acc = state
    m_new = torch.maximum(m, s.amax(dim=-1))
    alpha = torch.exp(m - m_new)  # 0 while m is -inf (nothing seen yet)
    p = torch.exp(s - m_new.unsqueeze(-1))
    l_sum = l_sum * alpha + p.sum(dim=-1)
    acc = acc * alpha.unsqueeze(-1) + p @ v
    return m_new, l_sum, acc


def _reference_partial(
    q: torch.Tensor, packed_k: Packed, packed_v: Packed, k_core: Codec, v_core: Codec, chunk: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Online softmax over the packed tokens, ``chunk`` at a time, in the cores' (rotated) bases.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, scaled and rotated into ``k_core``'s basis.

    Returns:
        ``(m, l, acc)``: running max and denominator ``[batch, kv_heads, group]`` and the unnormalised V
        sum ``[batch, kv_heads, group, head_dim]`` in ``v_core``'s basis.
    """
    b, kv, g, d = q.shape
    m = torch.full((b, kv, g), float("-inf"), dtype=torch.float32, device=q.device)
    state = (m, torch.zeros_like(m), torch.zeros(b, kv, g, d, dtype=torch.float32, device=q.device))
    for start in range(0, packed_k.seq_len, chunk):
        stop = min(start + chunk, packed_k.seq_len)
        k = _decode_f32(k_core, packed_k.slice_seq(start, stop))
        v = _decode_f32(v_core, packed_v.slice_seq(start, stop))
        state = _merge_block(state, q @ k.transpose(-1, -2), v)
    return state


def _attend(
    q: torch.Tensor,
    packed_k: Packed | None,
    packed_v: Packed | None,
    k_codec: Codec | str,
    v_codec: Codec | str,
    scale: float | None,
    window_k: torch.Tensor | None,
    window_v: torch.Tensor | None,
    chunk: int,
    plan: CpuPlan | None,
    use_triton: bool = False,
    k_eq: torch.Tensor | None = None,
    v_eq: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shared body of the backends; ``plan`` selects the fused CPU kernel, ``use_triton`` the Triton one
    (neither: the reference). ``k_eq``/``v_eq``: the ``eq+`` inverses ``[kv_heads, d, d]`` that
    :func:`peel_equalizer` took off the codecs (the query is mapped once before the packed tokens, their
    V sum once after)."""
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive number of tokens, got {chunk!r}")
    sm_scale = _validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale, plan is None)
    batch, hq, _, d = q.shape
    kv = packed_k.num_heads if packed_k is not None else window_k.shape[1]  # type: ignore[union-attr]
    g = hq // kv
    q0 = q.reshape(batch, kv, g, d).to(torch.float32)  # unscaled, model basis
    state = None
    if packed_k is not None and packed_v is not None and packed_k.seq_len > 0:
        # eq+ K: q . A⁻¹y = (A⁻ᵀq) . y, so the packed tokens are read as the inner codec's with A⁻ᵀq
        qp = q0 if k_eq is None else torch.einsum("bhge,hed->bhgd", q0, _per_head(k_eq, kv, "K", q.device))
        if plan is not None:
            state = fused_decode_cpu(qp, plan, packed_k, packed_v)  # None: no compiler (warned once)
        if state is None:
            k_rots, k_core = peel(k_codec)
            v_rots, v_core = peel(v_codec)
            qk = _rotate(qp * sm_scale, k_rots)
            if use_triton:
                m, l_sum, acc = fused_decode_triton(qk, packed_k, packed_v, k_core, v_core)
            else:
                m, l_sum, acc = _reference_partial(qk, packed_k, packed_v, k_core, v_core, chunk)
            state = (m, l_sum, _unrotate(acc, v_rots))  # the V sum, unrotated once
        if v_eq is not None:  # eq+ V: sum p A⁻¹y = A⁻¹ sum p y
            m, l_sum, acc = state
            state = (m, l_sum, torch.einsum("hed,bhgd->bhge", _per_head(v_eq, kv, "V", q.device), acc))
    if window_k is not None and window_v is not None and window_k.shape[2] > 0:
        if state is None:
            m = torch.full((batch, kv, g), float("-inf"), dtype=torch.float32, device=q.device)
            state = (m, torch.zeros_like(m), torch.zeros(batch, kv, g, d, dtype=torch.float32, device=q.device))
        scores = (q0 * sm_scale) @ window_k.to(torch.float32).transpose(-1, -2)
        state = _merge_block(state, scores, window_v.to(torch.float32))
    assert state is not None  # _validate refused an empty cache
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

    Returns:
        ``[batch, num_q_heads, 1, head_dim]`` in ``q``'s dtype (computed in float32).

    Raises:
        ValueError: wrong shapes, head_dim/batch/head-count mismatches, a packed cache that does not fit
            its codec, an empty cache, or a NaN/Inf query.
    """
    k_codec, v_codec = _codec(k_codec, "k_codec"), _codec(v_codec, "v_codec")
    k_eq, k_codec = peel_equalizer(k_codec)
    v_eq, v_codec = peel_equalizer(v_codec)
    return _attend(q, packed_k, packed_v, k_codec, v_codec, scale, window_k, window_v, chunk, None, False, k_eq, v_eq)


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
    backend: str = "auto",
    chunk: int = 1024,
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

    Returns:
        ``[batch, num_q_heads, 1, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: an unknown backend, ``backend="cpu"`` or ``"triton"`` with a codec or device it does not
            handle (or ``"triton"`` without the triton package), or
            any of the input errors of :func:`decode_attention_reference`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    k_codec, v_codec = _codec(k_codec, "k_codec"), _codec(v_codec, "v_codec")
    k_eq, k_codec = peel_equalizer(k_codec)
    v_eq, v_codec = peel_equalizer(v_codec)
    plan = None
    on_cpu = isinstance(q, torch.Tensor) and q.dim() == 4 and q.device.type == "cpu"
    if backend != "reference" and on_cpu:
        d = q.shape[-1]
        plan = cpu_plan(k_codec, v_codec, d, 1.0 / math.sqrt(d) if scale is None else float(scale))
    if backend == "cpu" and plan is None:
        _validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale)  # input errors first
        if not on_cpu:
            raise ValueError(f"backend='cpu' needs CPU tensors, q is on {q.device}; use backend='reference'")
        d = q.shape[-1]
        bad = [c.spec for c in (k_codec, v_codec) if not cpu_supports(c, d)]
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
        _validate(q, packed_k, packed_v, k_codec, v_codec, window_k, window_v, scale)  # input errors first
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
        bad = [c.spec for c in (k_codec, v_codec) if not triton_supports(c, d)]
        if bad:
            raise ValueError(
                f"backend='triton' does not read {', '.join(repr(s) for s in bad)} (at head_dim {d}); it reads "
                f"{TRITON_SUPPORTED}. Use backend='reference' (or 'auto') for other codecs"
            )
        use_triton = True
    return _attend(
        q, packed_k, packed_v, k_codec, v_codec, scale, window_k, window_v, chunk, plan, use_triton, k_eq, v_eq
    )
