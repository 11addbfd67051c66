"""Attention straight from the packed cache (``CompressedCache(..., fused=True)``).

:func:`enable_fused_attention` registers :func:`fused_attention` with transformers under
:data:`FUSED_ATTENTION`. A fused layer's ``update`` returns :func:`marker` tensors instead of decoded
K/V; the attention function finds the layer through them and reads its packed codes with
:func:`walshkv.attention.decode.decode_attention` (one query token) or
:func:`walshkv.attention.chunked.chunked_attention` (prefill, padding: tile by tile with torch's flash attention
and log-sum-exp merging, sink tokens first). Neither decodes the whole layer. Anything else goes to torch SDPA.
Any other reader of a marker (SDPA or eager attention after ``model.set_attn_implementation(...)``, another
model) fails on its first tensor operation with :data:`MISREAD`, and the cache undoes the step, instead of
attending over no tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from walshkv.attention.chunked import chunked_attention
from walshkv.attention.cpu import load_kernel
from walshkv.attention.decode import decode_attention

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from walshkv.cache.layers import CompressedLayer

__all__ = ["FUSED_ATTENTION", "MISREAD", "Marker", "enable_fused_attention", "fused_attention", "marker"]

#: The attention implementation name :func:`enable_fused_attention` registers with transformers.
FUSED_ATTENTION = "walshkv_fused"

#: The error of any attention but :func:`fused_attention` that reads a fused layer's K/V.
MISREAD = (
    "this CompressedCache was built with fused=True: its layers hand attention no K/V, the fused attention reads "
    "the packed codes itself, but the model now runs another attention (e.g. after "
    "model.set_attn_implementation('sdpa'), or the cache was passed to another model). Call "
    "walshkv.cache.enable_fused_attention(model) on the model that uses this cache, or build the cache with "
    "fused=False; the step was not stored"
)


class Marker(torch.Tensor):
    """What a fused layer's ``update`` returns for K and V: an empty ``[batch, heads, 0, head_dim]`` tensor that
    names the layer (``walshkv_layer``) for :func:`fused_attention`. Any tensor operation on it but reading its
    shape, dtype or device raises ``RuntimeError(MISREAD)`` after calling ``walshkv_misread`` (the cache's
    rollback of the step), so no other attention can read it as an empty cache."""

    walshkv_layer: CompressedLayer
    walshkv_misread: Callable[[], None] | None = None
    _METADATA: ClassVar[frozenset[Any]] = frozenset(
        {
            torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
            torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
            torch.Tensor.device.__get__,  # type: ignore[attr-defined]
            torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
            torch.Tensor.dim,
            torch.Tensor.size,
        }
    )

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in cls._METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        for a in (*args, *(kwargs or {}).values()):
            if isinstance(a, Marker) and a.walshkv_misread is not None:
                a.walshkv_misread()
                break
        raise RuntimeError(MISREAD)

    def __repr__(self) -> str:  # torch's repr would run tensor operations
        return f"Marker(fused layer, shape={tuple(self.shape)})"


def marker(layer: CompressedLayer, like: torch.Tensor) -> Marker:
    """An empty ``[batch, heads, 0, head_dim]`` :class:`Marker` that tells :func:`fused_attention` which layer to
    read."""
    out = like.new_empty((*like.shape[:2], 0, like.shape[-1])).as_subclass(Marker)
    out.walshkv_layer = layer
    return out


def _all_visible(mask: torch.Tensor | None) -> bool:
    if mask is None:
        return True
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function that reads a fused :class:`CompressedLayer`'s packed codes.

    ``key``/``value`` are the markers the layer's ``update`` returned; anything else (sliding-window
    layers, other caches) goes to torch SDPA unchanged. One query token with nothing masked uses
    :func:`walshkv.attention.decode.decode_attention`; otherwise (prefill, padding)
    :func:`walshkv.attention.chunked.chunked_attention` with the model's mask.

    Args:
        query: ``[batch, num_q_heads, T, head_dim]``.

    Returns:
        ``([batch, T, num_q_heads, head_dim], None)``, as transformers' attention functions return.
    """
    if not isinstance(key, Marker):
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    layer = key.walshkv_layer
    if kwargs.get("softcap") is not None:
        if key.walshkv_misread is not None:
            key.walshkv_misread()  # the step is stored in no layer
        raise ValueError("fused attention does not apply logit soft-capping; use CompressedCache(..., fused=False)")
    t = query.shape[2]
    visible = _all_visible(attention_mask)
    head_k, head_v = layer.sink_tokens(layer.keys.dtype)
    start = layer.packed_start()  # position of packed token 0 (prerope+ keys are rotated to their positions)
    window_k = layer.keys if layer.keys.shape[-2] else None
    window_v = layer.values if layer.values.shape[-2] else None
    if t == 1 and visible:
        # one visible query token: order does not matter to softmax, so the sink joins the full-precision window
        if head_k:
            window_k = torch.cat([*head_k, layer.keys], dim=-2)
            window_v = torch.cat([*head_v, layer.values], dim=-2)
        out = decode_attention(
            query,
            layer.packed_k,
            layer.packed_v,
            layer.spec.k,
            layer.spec.v,
            scale=scaling,
            window_k=window_k,
            window_v=window_v,
            start=start,
        )
    else:  # prefill (or a masked step): sink tokens first, then the packed tokens, then the window
        packed_k, packed_v = layer.packed_k, layer.packed_v
        if layer._exact is not None:  # prefill="exact": the block's own tokens as computed, after the old ones
            n_old, old_k, old_v, new_k, new_v = layer._exact
            layer._exact = None
            packed_k = packed_k.slice_seq(0, n_old) if n_old and packed_k is not None else None
            packed_v = packed_v.slice_seq(0, n_old) if n_old and packed_v is not None else None
            window_k, window_v = torch.cat([old_k, new_k], dim=-2), torch.cat([old_v, new_v], dim=-2)
        out = chunked_attention(
            query,
            packed_k,
            packed_v,
            layer.spec.k,
            layer.spec.v,
            offset=layer._stored_length() - t,
            scale=scaling,
            head_k=head_k[0] if head_k else None,
            head_v=head_v[0] if head_v else None,
            window_k=window_k,
            window_v=window_v,
            mask=None if visible else attention_mask,
            start=start,
        )
    return out.transpose(1, 2).contiguous(), None


def _sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, with the causal mask :func:`_fused_mask` may have skipped."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None and 1 < q_len < kv_len:
        # _fused_mask skipped the plain causal mask (fused layers apply it themselves); SDPA's is_causal
        # would align it top-left, so build the cache-aware (bottom-right) one for this layer
        attention_mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
    return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)


def _fused_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with :data:`FUSED_ATTENTION`: transformers' SDPA mask, except that the
    plain causal mask without padding is not built (``None``): fused layers apply the causal rule
    themselves, and a ``[chunk, context]`` mask per prefill chunk is memory that grows with the context."""
    padding = kwargs.get("attention_mask")
    if (
        not args
        and kwargs.get("mask_function") is causal_mask_function
        and kwargs.get("allow_is_causal_skip", True)
        and (padding is None or bool(padding.all()))
    ):
        return None
    return sdpa_mask(*args, **kwargs)


def enable_fused_attention(model: PreTrainedModel) -> None:
    """Register :func:`fused_attention` with transformers and make ``model`` use it.

    Layers that are not fused compressed layers (sliding windows, other caches) still run torch SDPA,
    so the model stays usable with any cache. Undo with ``model.set_attn_implementation("sdpa")``.

    A model on the CPU also loads (first use: builds) the C++ kernel here, so the first forward does not pay the
    build, and its first chunk is encoded by the kernel's ``tq`` packer as the later ones are (the same bits as
    the torch path, a few times faster).
    """
    if FUSED_ATTENTION not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(FUSED_ATTENTION, fused_attention)
        AttentionMaskInterface.register(FUSED_ATTENTION, _fused_mask)
    model.set_attn_implementation(FUSED_ATTENTION)
    if any(p.device.type == "cpu" for p in model.parameters()):
        load_kernel()
