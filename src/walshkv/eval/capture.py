"""Capture a model's K (after and before RoPE) and V on real text, for the spectral lab.

K after RoPE is what ``Cache.update`` receives (captured as :func:`walshkv.eval.rd.capture_window` does).
K before RoPE is recovered exactly by rotating every key back by its own angle: RoPE at position ``p``
is the orthogonal map ``k' = k cos(p theta) + rotate_half(k) sin(p theta)``, so
``k = k' cos(p theta) - rotate_half(k') sin(p theta)`` (divided by the square of the table's attention
scaling where a RoPE variant scales cos and sin). The cos/sin come from the model's own rotary module,
with each layer's table (gemma3: local or global), so PrimePE-modified tables are undone too. The
result is the K projection's output after any K normalisation (gemma3's ``k_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from walshkv.data import make_windows
from walshkv.defaults import CTX
from walshkv.eval.rd import capture_window
from walshkv.export.kv_mean_center import to_llamacpp_channel_order
from walshkv.ops.rope import rope_tables, undo_rope

if TYPE_CHECKING:
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = ["CHANNEL_ORDERS", "KVCapture", "capture_kv", "unrotate_keys"]


@dataclass
class KVCapture:
    """K after RoPE, K before RoPE and V, each ``[layers, kv_heads, tokens, head_dim]`` float32.

    ``tokens`` is windows x ctx; positions restart at 0 in every window (each runs from an empty cache).
    """

    k_post: torch.Tensor
    k_pre: torch.Tensor
    v: torch.Tensor
    windows: int
    ctx: int
    channel_order: str = "hf"

    def kinds(self) -> dict[str, torch.Tensor]:
        """``{"k_post": ..., "k_pre": ..., "v": ...}``."""
        return {"k_post": self.k_post, "k_pre": self.k_pre, "v": self.v}


def unrotate_keys(model: Any, layer: int, k: torch.Tensor) -> torch.Tensor:
    """Undo RoPE on post-RoPE keys of one layer, positions ``0 .. T-1`` (:func:`walshkv.ops.rope.undo_rope`
    with the model's own table for ``layer``).

    Args:
        model: the Hugging Face model (its rotary module gives the tables).
        layer: the layer index (picks gemma3's local/global table).
        k: ``[batch, kv_heads, T, head_dim]`` keys after RoPE.

    Returns:
        ``[batch, kv_heads, T, head_dim]`` float32 keys before RoPE, on the CPU.
    """
    tables = rope_tables(model)
    if tables is None:
        raise ValueError("no rotary embedding module found: K before RoPE needs a RoPE model")
    return undo_rope(k.cpu(), tables[layer])


CHANNEL_ORDERS = ("hf", "llamacpp")


@torch.inference_mode()
def capture_kv(
    lm: LoadedModel,
    text: Text,
    *,
    tokens: int = 2048,
    ctx: int = CTX,
    channel_order: str = "hf",
    progress: bool = True,
) -> KVCapture:
    """Run ``tokens // ctx`` windows of ``text`` and keep every layer's K (post and pre RoPE) and V.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text`.
        tokens: tokens to capture (whole windows of ``ctx``).
        ctx: tokens per window.
        channel_order: ``hf`` (Hugging Face's K channel order, rotary pairs ``(i, i + d/2)``, what walshkv's
            codecs transform) or ``llamacpp`` (llama.cpp's, which differs for llama-architecture models:
            pairs ``(2i, 2i + 1)`` adjacent; what a WHT inside llama.cpp sees). V is never permuted.
        progress: show a progress bar.

    Returns:
        A :class:`KVCapture`.
    """
    if channel_order not in CHANNEL_ORDERS:
        raise ValueError(f"channel order must be one of {', '.join(CHANNEL_ORDERS)}, got {channel_order!r}")
    if ctx < 4 or tokens < ctx:
        raise ValueError(f"--tokens ({tokens}) must be at least --ctx ({ctx}), and --ctx at least 4")
    win = make_windows(lm.tokenizer, text.content, ctx, tokens // ctx)
    posts, pres, vs = [], [], []
    for w in tqdm(range(win.ids.shape[0]), desc="capture", unit="window", disable=not progress):
        ks, vals, _ = capture_window(lm, win.ids[w], queries=False)
        posts.append(torch.cat(ks, dim=0))
        pres.append(torch.cat([unrotate_keys(lm.model, i, k) for i, k in enumerate(ks)], dim=0))
        vs.append(torch.cat(vals, dim=0))
    arch = lm.shape.arch if channel_order == "llamacpp" else ""
    return KVCapture(
        k_post=to_llamacpp_channel_order(torch.cat(posts, dim=2), arch),
        k_pre=to_llamacpp_channel_order(torch.cat(pres, dim=2), arch),
        v=torch.cat(vs, dim=2),
        windows=win.ids.shape[0],
        ctx=ctx,
        channel_order=channel_order,
    )
