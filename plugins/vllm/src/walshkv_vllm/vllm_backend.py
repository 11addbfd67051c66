"""The vLLM (0.32) attention backend over walshkv pages; vLLM imports it by class path (:data:`BACKEND_PATH`).

Thin glue: vLLM's metadata and cache tensors in, :mod:`walshkv_vllm.paged` does the work.

- :meth:`WalshKVAttentionBackend.customize_spec` sets the page cell to the codecs' slot size
  (:class:`walshkv_vllm.layout.SlotLayout`), so vLLM allocates ``uint8`` pages of exactly the codecs' bytes; the
  layout is ``LBNHC`` (a layer's view ``[num_blocks, num_kv_heads, block_size, slot_bytes]`` whose
  ``transpose(1, 2)`` is the contiguous ``[num_blocks, block_size, num_kv_heads, slot_bytes]`` page tensor).
- :meth:`WalshKVAttentionImpl.do_kv_cache_update` encodes the step's K/V into their slots (vLLM calls it before
  ``forward``, ``forward_includes_kv_cache_update = False``); a K codec that turns keys by position (``ropeblock:G+``,
  ``prerope+``) and ``sink:N:`` rows read each row's position from the builder's :class:`walshkv_vllm.paged.Places`
  (``seq_lens[r] - q_len + i``, from the same metadata the attention reads).
- :meth:`WalshKVAttentionImpl.forward`: decode requests (one query token; vLLM orders them first) read their pages
  through the block table; prefill requests attend exactly to their own K/V (``WALSHKV_VLLM_PREFILL=exact``, the
  default, vLLM's convention) or to them as stored (``quantized``).

Not supported (refused at construction, naming the option): ALiBi, sliding windows, logit soft-capping,
attention sinks, encoder and cross attention, CUDA graphs over attention (the builder declares none, so vLLM runs
attention eagerly between captured pieces).
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout
from walshkv.codecs import CacheSpec, Codec

from walshkv_vllm.layout import SlotLayout
from walshkv_vllm.paged import Places, SinkRows, decode_paged, is_positional, prefill_paged, write_slots
from walshkv_vllm.registration import BACKEND_PATH
from walshkv_vllm.specs import (
    KV_CACHE_DTYPES,
    MODEL_ENV,
    PluginSettings,
    calibration_path,
    check_served_model,
    resolve_spec,
)

__all__ = ["BACKEND_PATH", "WalshKVAttentionBackend", "WalshKVAttentionImpl", "WalshKVMetadata"]

logger = init_logger(__name__)

#: The cache dtype the impls of this process were built with (customize_spec's spec does not carry it).
_ACTIVE: dict[str, str] = {}


def _cache_dtype() -> str:
    name = _ACTIVE.get("cache_dtype")
    if name is None:
        cfg = get_current_vllm_config().cache_config
        name = str(cfg.cache_dtype) if cfg is not None else "auto"
    return name


class WalshKVAttentionBackend(AttentionBackend):
    """Attention over walshkv-packed pages (``--kv-cache-dtype walshkv_*``)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = list(KV_CACHE_DTYPES)

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[WalshKVAttentionImpl]:
        return WalshKVAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[WalshKVMetadataBuilder]:
        return WalshKVMetadataBuilder

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBNHC,)

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype: Any) -> bool:
        return isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size > 0

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """One page cell per (token, kv head) of exactly the K and V codecs' bytes."""
        name = _cache_dtype()
        if spec.state_content_bytes is not None or name not in KV_CACHE_DTYPES:
            return spec
        cache = resolve_spec(name)
        layout = SlotLayout.of(cache.k, cache.v, spec.head_size, spec.num_kv_heads)
        return replace(spec, state_content_bytes=layout.slot_bytes)


@dataclass
class WalshKVMetadata(AttentionMetadata):
    """Per-step metadata (decode requests first, as the builder's reorder threshold makes vLLM order them)."""

    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens_cpu: torch.Tensor
    num_actual_tokens: int
    num_decodes: int
    num_decode_tokens: int
    places: Places | None = None


class WalshKVMetadataBuilder(AttentionMetadataBuilder[WalshKVMetadata]):
    """Builds :class:`WalshKVMetadata`; requests with one query token count as decodes."""

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str], vllm_config: Any, device: Any) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=False)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> WalshKVMetadata:
        cam = common_attn_metadata
        assert self.reorder_batch_threshold is not None
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cam, decode_threshold=self.reorder_batch_threshold
        )
        seq_lens_cpu = cam.seq_lens_cpu_upper_bound
        if seq_lens_cpu is None:
            seq_lens_cpu = cam.seq_lens.cpu()
        places = None
        if _needs_places():  # precise on the CPU: seq_lens_cpu_upper_bound is exact outside async speculative decoding
            places = Places.of(
                cam.query_start_loc_cpu, seq_lens_cpu, cam.block_table_tensor, num_rows=cam.slot_mapping.shape[0]
            )
        return WalshKVMetadata(
            seq_lens=cam.seq_lens,
            slot_mapping=cam.slot_mapping,
            block_table=cam.block_table_tensor,
            query_start_loc=cam.query_start_loc,
            query_start_loc_cpu=cam.query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
            num_actual_tokens=cam.num_actual_tokens,
            num_decodes=num_decodes,
            num_decode_tokens=num_decode_tokens,
            places=places,
        )


def _needs_places() -> bool:
    """True if this process's walshkv spec turns K by position or keeps sink rows (the write needs positions)."""
    return _spec_needs_places(_cache_dtype())


@functools.cache
def _spec_needs_places(name: str) -> bool:
    if name not in KV_CACHE_DTYPES:
        return False
    cache = resolve_spec(name)
    return bool(cache.sink) or is_positional(cache.k)


_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class WalshKVAttentionImpl(AttentionImpl[WalshKVMetadata]):
    """Writes K/V into walshkv slots and attends from them (see the module docstring)."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        unsupported = {
            "ALiBi slopes": alibi_slopes is not None,
            "a sliding window": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "attention sinks": kwargs.get("sinks") is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [what for what, yes in unsupported.items() if yes]
        if bad:
            raise ValueError(
                f"the walshkv attention backend does not support {', '.join(bad)}; serve this model with another "
                "--kv-cache-dtype (auto, fp8) and attention backend"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.cache: CacheSpec = resolve_spec(kv_cache_dtype)
        self.layout = SlotLayout.of(self.cache.k, self.cache.v, head_size, self.num_kv_heads)
        self.settings = PluginSettings.from_env()
        _ACTIVE["cache_dtype"] = kv_cache_dtype
        needs = self.cache.k.needs_calibration or self.cache.v.needs_calibration
        model_config = get_current_vllm_config().model_config
        named = os.environ.get(MODEL_ENV, "")
        if named and getattr(model_config, "hf_config", None) is not None:
            check_served_model(named, model_config.hf_config)  # a preset chosen for another model is refused
        arch = getattr(getattr(model_config, "hf_config", None), "model_type", None)
        path = calibration_path(kv_cache_dtype)
        self._calibration = self.settings.load_calibration(arch, path) if needs or path else None
        if needs and self._calibration is None:
            raise ValueError(
                f"{self.cache.spec} is calibrated: set WALSHKV_VLLM_CALIBRATION to a `walshkv calibrate` file (or, "
                f"for a preset, {MODEL_ENV} to a model walshkv ships its calibration for)"
            )
        self._bound: dict[str, tuple[Codec, Codec]] = {}
        self._sinks: dict[str, SinkRows] = {}
        self._places = bool(self.cache.sink) or is_positional(self.cache.k)
        logger.info_once(
            "walshkv attention backend: %s = %s, %d bytes a (token, kv head) slot (%.2f bits/element), prefill %s, "
            "decode backend %s",
            kv_cache_dtype,
            self.cache.spec,
            self.layout.slot_bytes,
            4.0 * self.layout.slot_bytes / head_size,
            self.settings.prefill,
            self.settings.decode_backend,
        )

    def _codecs(self, layer: Any) -> tuple[Codec, Codec]:
        name = str(getattr(layer, "layer_name", ""))
        codecs = self._bound.get(name)
        if codecs is None:
            found = _LAYER_INDEX.search(f".{name}.")
            index = int(found.group(1)) if found else 0
            codecs = (
                self.cache.k.bind(index, "k", self._calibration),
                self.cache.v.bind(index, "v", self._calibration),
            )
            self._bound[name] = codecs
        return codecs

    def _sink_rows(self, layer: Any) -> SinkRows | None:
        """The layer's ``sink:N:`` rows (``None`` for a spec without them)."""
        if not self.cache.sink:
            return None
        name = str(getattr(layer, "layer_name", ""))
        rows = self._sinks.get(name)
        if rows is None:
            rows = self._sinks[name] = SinkRows(self.cache.sink)
        return rows

    @staticmethod
    def _pages(kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's layer view ``[blocks, heads, block_size, slot_bytes]`` as ``[blocks, block_size, heads, slot]``."""
        return kv_cache.transpose(1, 2)

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        n = slot_mapping.shape[0]
        if n <= 0 or kv_cache.numel() == 0:
            return
        k_codec, v_codec = self._codecs(layer)
        k = key[:n].view(n, self.num_kv_heads, self.head_size)
        v = value[:n].view(n, self.num_kv_heads, self.head_size)
        places = None
        if self._places:
            metadata = get_attention_context(str(getattr(layer, "layer_name", "")))[0]
            places = getattr(metadata, "places", None)
            if places is None:
                raise ValueError(
                    f"{self.cache.spec}: the step's metadata carries no token positions (built by another backend's "
                    "builder?); this spec turns K by position or keeps sink rows, which the write needs"
                )
        write_slots(
            self._pages(kv_cache),
            self.layout,
            k_codec,
            v_codec,
            k,
            v,
            slot_mapping,
            places=places,
            sinks=self._sink_rows(layer),
        )

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: WalshKVMetadata | None,
        output: torch.Tensor | None = None,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the walshkv attention backend does not fuse output quantization")
        if output is None:
            output = torch.zeros(
                query.shape[0], self.num_heads * self.head_size, dtype=query.dtype, device=query.device
            )
        if attn_metadata is None:  # the profiling run
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        if n <= 0:
            return output
        q = query[:n].view(n, self.num_heads, self.head_size)
        pages = self._pages(kv_cache)
        k_codec, v_codec = self._codecs(layer)
        nd, ndt = attn_metadata.num_decodes, attn_metadata.num_decode_tokens
        out = torch.empty_like(q)
        seq_lens = attn_metadata.seq_lens_cpu
        if nd > 0:
            out[:ndt] = decode_paged(
                q[:ndt],
                pages,
                self.layout,
                k_codec,
                v_codec,
                attn_metadata.block_table[:nd],
                # on a GPU the lengths the device holds: read there by the kernel, nothing copied from the host (a
                # CUDA graph replays the step with the lengths of its batch)
                attn_metadata.seq_lens[:nd] if q.is_cuda else seq_lens[:nd],
                self.scale,
                backend=self.settings.decode_backend,
                sinks=self._sink_rows(layer),
            )
        if ndt < n:
            k = key[ndt:n].view(n - ndt, self.num_kv_heads, self.head_size)
            v = value[ndt:n].view(n - ndt, self.num_kv_heads, self.head_size)
            out[ndt:] = prefill_paged(
                q[ndt:],
                k,
                v,
                pages,
                self.layout,
                k_codec,
                v_codec,
                attn_metadata.block_table[nd:],
                attn_metadata.query_start_loc_cpu[nd:] - ndt,
                seq_lens[nd:],
                self.scale,
                mode=self.settings.prefill,
                sinks=self._sink_rows(layer),
            )
        output[:n].copy_(out.reshape(output[:n].shape))
        return output
