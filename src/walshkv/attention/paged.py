"""Decode attention over a paged cache: many requests, one call, their tokens found through a block table.

A serving engine (vLLM) keeps every request's K/V in fixed-size blocks of one shared page tensor and hands the
attention a block table: request ``r``'s token ``t`` is row ``t % block_size`` of block ``block_table[r, t //
block_size]``, and the request has ``seq_lens[r]`` tokens. Here the packed fields are pages
``[num_blocks, num_kv_heads, block_size, ...]`` (the :class:`~walshkv.codecs.base.Packed` layout with the block as
the batch and the row in the block as the token: any strides, so views into an engine's slot tensor work), and
:func:`decode_attention_paged` attends one query per request over its own tokens:

- on the CPU, where the fused kernel reads both codecs, all requests and kv heads go through **one kernel call**
  that follows the block table itself (tiles stop at block ends; each request's softmax stops at its length;
  ``prerope+`` keys are rotated to their positions in the request). Nothing is gathered or copied.
- on CUDA (or ``backend="triton"``), where the Triton kernel reads both codecs, all requests go through **one
  launch** that follows the block table the same way (:func:`~walshkv.attention.triton_decode.fused_decode_triton`
  with ``paged``). Its checks (lengths, block ids, a finite query) are device-side asserts and the lengths are read
  on the device: nothing in the step reads a value back to the host, so a CUDA graph can capture it
  (``tests/attention/test_paged_triton.py`` checks that under a dispatch mode that fails on every read back).
  ``prerope+`` K is not read by it yet.
- elsewhere (other codecs, ``prerope+`` K on CUDA) each request's rows are gathered from the pages and read by
  :func:`~walshkv.attention.decode.decode_attention`, one call per request (correct; as slow as the loop it is).

A field whose codec stores a wider dtype (fp16 scales, norms) may be given as its raw bytes (``uint8`` with the
last dimension in bytes): a slot packs fields with no alignment, so a view of the page cannot always be typed.
"""

from __future__ import annotations

import math

import torch

from walshkv.attention.cpu import fused_decode_cpu
from walshkv.attention.cpu_formats import cpu_plan
from walshkv.attention.decode import BACKENDS, decode_attention
from walshkv.attention.peeling import peel, peel_equalizer
from walshkv.attention.reference import as_codec, rotate, unrotate
from walshkv.attention.triton_decode import fused_decode_triton, triton_available, triton_supports
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.prerope import PreRope
from walshkv.constants import Backend

__all__ = ["decode_attention_paged", "gather_pages"]


def _check(
    q: torch.Tensor, pages_k: Packed, pages_v: Packed, block_table: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[int, int, int]:
    """Shapes, dtypes and finiteness; returns ``(num_reqs, num_kv_heads, block_size)``."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.shape[2] != 1:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"q must be [num_reqs, num_q_heads, 1, head_dim] (one decode token per request), got {got}")
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    r, hq, _, d = q.shape
    for what, pages in (("K", pages_k), ("V", pages_v)):
        if not isinstance(pages, Packed) or any(t.dim() < 4 for t in pages.tensors.values()):
            raise ValueError(f"the {what} pages must be a Packed of fields [num_blocks, num_kv_heads, block_size, ...]")
        if pages.head_dim != d:
            raise ValueError(f"the {what} pages hold head_dim {pages.head_dim}, the query has {d}")
    kv, block_size = pages_k.num_heads, pages_k.seq_len
    if (pages_v.num_heads, pages_v.seq_len, pages_v.batch_size) != (kv, block_size, pages_k.batch_size):
        raise ValueError("the K and V pages differ in blocks, kv heads or block size; pass one layer's pages")
    if hq % kv:
        raise ValueError(f"num_q_heads ({hq}) must be a multiple of num_kv_heads ({kv})")
    if block_table.dim() != 2 or block_table.shape[0] < r or block_table.dtype.is_floating_point:
        raise ValueError(f"block_table must be integer [num_reqs >= {r}, max_blocks], got {tuple(block_table.shape)}")
    if seq_lens.shape != (r,) or seq_lens.dtype.is_floating_point:
        raise ValueError(f"seq_lens must be integer [{r}] (a length per request), got {tuple(seq_lens.shape)}")
    return r, kv, block_size


def _check_values(q: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """On the host (it waits for the values): every request has a token, the query is finite."""
    if q.shape[0] and int(seq_lens.min()) < 1:
        raise ValueError(f"every request attends to at least one token (its own), got seq_lens {seq_lens.tolist()}")
    if not bool(torch.isfinite(q).all()):
        raise ValueError("q contains NaN or Inf; check the model's activations before the attention")


def _assert_on_device(
    q: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int
) -> None:
    """The checks of :func:`_check_values` and the block ids' range, as device-side asserts: nothing waits for the
    GPU (CUDA-graph safe); a failure raises at once on the CPU and at the next synchronisation on CUDA."""
    r = q.shape[0]
    lens = seq_lens.to(torch.int64)
    need = (lens + block_size - 1) // block_size
    torch._assert_async(
        (lens >= 1).all(), "paged decode: every request attends to at least one token (its own); a seq_lens entry is 0"
    )
    torch._assert_async(
        (need <= block_table.shape[1]).all(),
        f"paged decode: a request needs more blocks than a block-table row has ({block_table.shape[1]})",
    )
    ids = block_table[:r].to(device=lens.device, dtype=torch.int64)
    used = torch.arange(block_table.shape[1], device=lens.device)[None, :] < need[:, None]
    torch._assert_async(
        (~used | ((ids >= 0) & (ids < num_blocks))).all(),
        f"paged decode: a request names a block outside the pages' blocks 0..{num_blocks - 1}: a block table from "
        "another cache, or one the engine did not fill; pass the layer's own pages and block table",
    )
    torch._assert_async(
        torch.isfinite(q).all(), "q contains NaN or Inf; check the model's activations before the attention"
    )


def gather_pages(pages: Packed, codec: Codec, block_row: torch.Tensor, stop: int) -> Packed:
    """Tokens ``0:stop`` of one request, gathered from ``pages`` through its block-table row.

    Args:
        pages: fields ``[num_blocks, kv_heads, block_size, ...]`` (typed, or as raw bytes).
        codec: the codec that wrote them (its layout types the byte fields).
        block_row: ``[max_blocks]`` the request's block ids.
        stop: its token count.

    Returns:
        A contiguous :class:`Packed` with fields ``[1, kv_heads, stop, ...]`` in the codec's dtypes.

    Raises:
        ValueError: the row has too few blocks, or names a block outside the pages.
    """
    block_size, num_blocks = pages.seq_len, pages.batch_size
    need = -(-stop // block_size)
    used = block_row[:need].to(dtype=torch.long)
    if used.shape[0] < need or (need and (int(used.min()) < 0 or int(used.max()) >= num_blocks)):
        raise ValueError(
            f"{stop} tokens need {need} blocks in 0..{num_blocks - 1}; the block-table row has "
            f"{block_row[:need].tolist()}: pass the layer's own pages and block table"
        )
    pos = torch.arange(stop, device=used.device)
    blocks, rows = used[pos // block_size], pos % block_size
    layout = codec.layout(pages.head_dim)
    out = {}
    for name, t in pages.tensors.items():
        g = t[blocks.to(t.device), :, rows.to(t.device)].transpose(0, 1).unsqueeze(0).contiguous()  # [1, kv, n, ...]
        field = layout.get(name)
        if field is not None and g.dtype == torch.uint8 and field.dtype != torch.uint8:
            g = g.view(field.dtype).reshape(*g.shape[:3], *field.shape)
        out[name] = g
    return Packed(out, pages.head_dim, pages.dtype)


def decode_attention_paged(
    q: torch.Tensor,
    pages_k: Packed,
    pages_v: Packed,
    k_codec: Codec | str,
    v_codec: Codec | str,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """One decode step for every request over its own tokens in a paged cache (see the module docstring).

    Args:
        q: ``[num_reqs, num_q_heads, 1, head_dim]``, float32, bfloat16 or float16, finite.
        pages_k, pages_v: the layer's K and V pages, fields ``[num_blocks, num_kv_heads, block_size, ...]``.
        k_codec, v_codec: the codecs that wrote them (or their specs).
        block_table: integer ``[num_reqs, max_blocks]``.
        seq_lens: integer ``[num_reqs]``, each request's token count (at least 1).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        backend: ``"auto"`` (the one-call CPU kernel, or on CUDA the one-launch Triton kernel, where it reads both
            codecs, else per request), ``"cpu"`` (the kernel, or an error naming the codec), ``"triton"`` (the
            one-launch kernel; CPU tensors under ``TRITON_INTERPRET=1``; per request where it does not read the
            codecs) or ``"reference"`` (per request).

    Returns:
        ``[num_reqs, num_q_heads, 1, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: mismatched shapes, a block outside the pages, an empty request, a NaN/Inf query, or
            ``backend="cpu"`` with a codec the kernel does not read.
        RuntimeError: on the Triton path, the same value problems as device-side asserts (at once on CPU tensors,
            at the next synchronisation on CUDA).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    k_codec, v_codec = as_codec(k_codec, "k_codec"), as_codec(v_codec, "v_codec")
    r, kv, _ = _check(q, pages_k, pages_v, block_table, seq_lens)
    d = q.shape[-1]
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    k_eq, k_core = peel_equalizer(k_codec)
    v_eq, v_core = peel_equalizer(v_codec)
    if _batched_triton(q, k_core, v_core, backend):
        _assert_on_device(q, block_table, seq_lens, pages_k.batch_size, pages_k.seq_len)
        return _paged_triton(q, pages_k, pages_v, k_core, v_core, k_eq, v_eq, block_table[:r], seq_lens, sm_scale)
    _check_values(q, seq_lens)
    plan = cpu_plan(k_core, v_core, d, sm_scale) if backend in ("auto", "cpu") and q.device.type == "cpu" else None
    state = None
    if plan is not None and r:
        g = q.shape[1] // kv
        q0 = q.reshape(r, kv, g, d).to(torch.float32)
        if k_eq is not None:
            q0 = torch.einsum("bhge,hed->bhgd", q0, k_eq.to(torch.float32))
        # the kernel checks every block it will read against the pages (ValueError naming the request)
        state = fused_decode_cpu(q0, plan, pages_k, pages_v, paged=(block_table[:r], seq_lens))
    if state is not None:
        _, l_sum, acc = state
        if v_eq is not None:
            acc = torch.einsum("hed,bhgd->bhge", v_eq.to(torch.float32), acc)
        return (acc / l_sum.unsqueeze(-1)).reshape(q.shape).to(q.dtype)
    if backend == "cpu" and plan is None:
        raise ValueError(
            f"backend='cpu' does not read {k_codec.spec!r}/{v_codec.spec!r} at head_dim {d} (or q is not on the "
            "CPU); use backend='auto' or 'reference'"
        )
    out = torch.empty_like(q)
    for i, n in enumerate(seq_lens.tolist()):
        pk = gather_pages(pages_k, k_codec, block_table[i], n)
        pv = gather_pages(pages_v, v_codec, block_table[i], n)
        out[i : i + 1] = decode_attention(q[i : i + 1], pk, pv, k_codec, v_codec, scale=sm_scale, backend=backend)
    return out


def _batched_triton(q: torch.Tensor, k_core: Codec, v_core: Codec, backend: Backend) -> bool:
    """Whether the paged Triton kernel takes this step: ``backend="triton"``, or ``"auto"`` on CUDA with triton
    importable; both codecs read by it (``prerope+`` K is not, yet: it goes request by request)."""
    if backend not in ("auto", "triton") or (backend == "auto" and q.device.type != "cuda") or not q.shape[0]:
        return False
    d = q.shape[-1]
    if isinstance(k_core, PreRope) or not (triton_supports(k_core, d) and triton_supports(v_core, d)):
        return False
    return triton_available()


def _paged_triton(
    q: torch.Tensor,
    pages_k: Packed,
    pages_v: Packed,
    k_core: Codec,
    v_core: Codec,
    k_eq: torch.Tensor | None,
    v_eq: torch.Tensor | None,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """Every request in one Triton launch (:func:`fused_decode_triton` with ``paged``): the query mapped into the K
    codec's basis once, the V sum out of V's once, as :func:`~walshkv.attention.decode.decode_attention` does."""
    r, hq, _, d = q.shape
    kv = pages_k.num_heads
    q0 = q.reshape(r, kv, hq // kv, d).to(torch.float32)
    if k_eq is not None:  # eq+ K: q . A⁻¹y = (A⁻ᵀq) . y
        q0 = torch.einsum("bhge,hed->bhgd", q0, k_eq.to(device=q.device, dtype=torch.float32))
    k_rots, k_store = peel(k_core)
    v_rots, v_store = peel(v_core)
    qk = rotate(q0 * sm_scale, k_rots)
    _, l_sum, acc = fused_decode_triton(qk, pages_k, pages_v, k_store, v_store, paged=(block_table, seq_lens))
    acc = unrotate(acc, v_rots)
    if v_eq is not None:  # eq+ V: sum p A⁻¹y = A⁻¹ sum p y
        acc = torch.einsum("hed,bhgd->bhge", v_eq.to(device=q.device, dtype=torch.float32), acc)
    return (acc / l_sum.unsqueeze(-1)).reshape(q.shape).to(q.dtype)
