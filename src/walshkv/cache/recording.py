"""A ``DynamicCache`` that hands every K/V block it receives to a callback: how walshkv records K and V.

Calibration (:func:`walshkv.calibration.collect_kv_stats`) and rate-distortion capture
(:func:`walshkv.eval.rd.capture_window`) run the model with a :class:`RecordingCache`, so they see
exactly what a cache's ``update`` receives (K after RoPE), layer by layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import DynamicCache

if TYPE_CHECKING:
    from transformers import PretrainedConfig

__all__ = ["OnUpdate", "RecordingCache"]

#: ``(layer_idx, key_states, value_states)``, both ``[batch, num_kv_heads, new_tokens, head_dim]``.
OnUpdate = Callable[[int, torch.Tensor, torch.Tensor], None]


class RecordingCache(DynamicCache):
    """A transformers ``DynamicCache`` that calls ``on_update`` with every block before storing it.

    Args:
        on_update: called as ``on_update(layer_idx, key_states, value_states)`` on every ``update``,
            before the block is stored (the tensors are the model's own: detach or copy what you keep).
        config: the model's config, as for ``DynamicCache``.

    Example:
        >>> seen = {}
        >>> cache = RecordingCache(lambda i, k, v: seen.setdefault(i, k.shape), config=model.config)  # doctest: +SKIP
        >>> model(input_ids=ids, cache=cache, use_cache=True)  # doctest: +SKIP
    """

    def __init__(self, on_update: OnUpdate, *, config: PretrainedConfig | None = None) -> None:
        super().__init__(config=config)
        self.on_update = on_update

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.on_update(layer_idx, key_states, value_states)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)
