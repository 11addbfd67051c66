"""Float storage: ``fp16``, ``bf16``, ``fp32`` (no quantization, just the cast)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from walshkv.codecs.base import Codec, Field, Packed

__all__ = ["FloatCodec"]

FLOAT_CODECS: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
}


@dataclass(frozen=True, repr=False)
class FloatCodec(Codec):
    """Store each vector at a float precision (``fp16``: 16 bits per element).

    Attributes:
        name: ``fp16``, ``bf16`` or ``fp32`` (also its spec).
        storage_dtype: the dtype the values are stored in, derived from ``name``.
    """

    name: str
    storage_dtype: torch.dtype = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.name not in FLOAT_CODECS:
            raise ValueError(f"unknown float codec {self.name!r}; choose one of {sorted(FLOAT_CODECS)}")
        self._set(storage_dtype=FLOAT_CODECS[self.name])
        super().__post_init__()

    def _spec(self) -> str:
        return self.name

    def layout(self, head_dim: int) -> dict[str, Field]:
        return {"values": Field((head_dim,), self.storage_dtype)}

    def _encode(self, x: torch.Tensor) -> Packed:
        limit = torch.finfo(self.storage_dtype).max
        if torch.finfo(x.dtype).max > limit and x.numel():
            peak = float(x.abs().max())
            if peak > limit:
                better = "'bf16' or 'fp32'" if self.storage_dtype == torch.float16 else "'fp32' or scale the input"
                raise ValueError(f"K/V values up to {peak:.4g} overflow {self.spec} (max {limit:.4g}); use {better}.")
        # A copy, never an alias of the caller's tensor: later in-place edits must not change the cache.
        return Packed({"values": x.to(self.storage_dtype, copy=True)}, x.shape[-1], x.dtype)

    def _decode(self, packed: Packed) -> torch.Tensor:
        return packed.tensors["values"].clone()
