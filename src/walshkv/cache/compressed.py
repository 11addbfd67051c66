"""``CompressedCache``: a transformers ``Cache`` whose layers store packed codes.

The cache builds one layer per model layer from the model's config: :class:`CompressedLayer` for full
attention, :class:`CompressedSlidingWindowLayer` for sliding-window attention (gemma3's local layers),
:class:`KiviLayer` / :class:`KiviSlidingWindowLayer` for KIVI codecs; each is bound to its layer's calibrated
codecs. :func:`check_fits` refuses, from the config alone, a spec the model's layers cannot hold. Its byte and bit
accounting sums the layers' (full-precision windows and sink tokens included).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, get_args

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from walshkv.cache.fused import FUSED_ATTENTION, Marker
from walshkv.cache.kivi import KiviLayer, KiviSlidingWindowLayer
from walshkv.cache.layers import Checkpoint, CompressedLayer, CompressedSlidingWindowLayer
from walshkv.cache.persist import load_cache, save_cache
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, LayeredCacheSpec, parse_cache_spec
from walshkv.constants import Prefill
from walshkv.identity import head_dim_of, identity_config
from walshkv.presets import resolve_preset
from walshkv.shipped import shipped_calibration

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from walshkv.codecs.calibration import Calibration

#: Accepted values of ``prefill``.
PREFILLS: tuple[Prefill, ...] = get_args(Prefill)

__all__ = ["CompressedCache", "check_fits"]


_SLIDING_TYPES = ("sliding_attention", "chunked_attention")
#: The layer types a KIVI spec can hold (:class:`KiviLayer`, :class:`KiviSlidingWindowLayer`).
_KIVI_TYPES = ("full_attention", "sliding_attention")


def _layer_types(spec: CacheSpec, config: PretrainedConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """The model's layer types and their cache kwargs, once ``spec`` is checked against the model.

    Raises:
        ValueError: the head size, a ``layers:`` index or a layer type the spec cannot hold, naming the
            spec, what the model has and the fix.
    """
    text_config = config.get_text_config(decoder=True)
    head_dim = head_dim_of(text_config)
    spec.check_head_dim(head_dim)
    if isinstance(spec, LayeredCacheSpec):
        spec.check_layers(text_config.num_hidden_layers)
    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
    kivi = isinstance(spec.k, KiviCodec)
    allowed = _KIVI_TYPES if kivi else ("full_attention", *_SLIDING_TYPES)
    for layer_type in dict.fromkeys(layer_types):
        if layer_type in allowed:
            continue
        where = [i for i, t in enumerate(layer_types) if t == layer_type]
        held = "KIVI caches hold" if kivi else "CompressedCache holds"
        fix = (
            "use a spec of another family for this model (rot+q4_0, tq:4, a walshkv: preset)"
            if kivi and layer_type in _SLIDING_TYPES
            else "this model's cache cannot be compressed by walshkv"
        )
        raise ValueError(
            f"{spec.spec} cannot hold this model's {layer_type!r} layers ({len(where)} of "
            f"{len(layer_types)}: {', '.join(map(str, where[:6]))}{', ...' if len(where) > 6 else ''}): {held} "
            f"{' and '.join(allowed)} layers only; {fix}"
        )
    return layer_types, per_layer_kwargs


def check_fits(spec: str | CacheSpec, config: PretrainedConfig) -> None:
    """Refuse, from the model's config alone, a walshkv spec its cache layers cannot hold.

    What :class:`CompressedCache` checks when it is built, without calibration or tensors: the head size
    each codec needs, the layer indices of a ``layers:`` spec, and each layer's attention type against the
    layer kinds the codec has (every walshkv codec: full, sliding-window and chunked attention; KIVI: full and
    sliding-window). Run it on every spec of a run before any calibration or forward starts.

    Args:
        spec: a walshkv cache spec (``hf-*`` specs: :func:`walshkv.cache.check_spec_fits`).
        config: the model's config (its text config is read).

    Raises:
        ValueError: the first thing the model has that the spec cannot hold, with the fix.
    """
    parsed = parse_cache_spec(spec)
    if isinstance(parsed, HFCacheSpec):
        raise ValueError(f"{parsed.spec} is Hugging Face's QuantizedCache: check it with walshkv.cache.check_spec_fits")
    _layer_types(parsed, config)


class CompressedCache(Cache):
    """A transformers ``Cache`` whose layers hold packed K/V codes.

    Args:
        spec: a cache spec (``"rot+int4"``, ``"rot+int4/int3"``, ...) or a :class:`CacheSpec`.
        config: the model's config. With it, sliding-window layers (e.g. gemma3) keep
            only their window and the head size is checked up front. Without it,
            every layer is a full-attention layer created on first use.
        residual: keep the most recent ``residual`` tokens of each layer in full
            precision (default 0: every token is compressed before attention).
        fused: attention reads the packed codes directly (no float copy of the cache): decode steps
            through :func:`walshkv.attention.decode.decode_attention` (the fused CPU kernel where it reads
            the codecs), prefill through :func:`walshkv.attention.chunked.chunked_attention`. Needs
            ``enable_fused_attention(model)`` first (the model's attention then asks the cache). Same
            quantization, so the same results as the default path up to float rounding. ``prerope+`` keys
            (stored before RoPE) are rotated to their positions inside the kernels; ``sink:N:`` tokens join
            the full-precision window at decode and lead the keys at prefill.
        max_cache_len: tokens to allocate in each full-attention layer's packed store on the first
            write (e.g. prompt + new tokens), so that the store never grows by copying. Without it a
            store grows by 1/8 whenever a write does not fit. Either way the cache holds only
            packed codes; :meth:`reserved_nbytes` reports the allocation, :meth:`nbytes` the tokens held.
        prefill: ``"quantized"`` (default, quantize on write: every token attention reads was compressed
            first, the current block's included) or ``"exact"`` (serving-engine style, as vLLM's TurboQuant
            backend and Hugging Face's QuantizedCache do: the tokens of a multi-token forward, a prompt,
            attend to their own K/V as computed while the cache stores them compressed; one-token decode
            steps read everything compressed either way).

    Example:
        >>> cache = CompressedCache("rot+int4", config=model.config)  # doctest: +SKIP
        >>> out = model.generate(**inputs, cache=cache, max_new_tokens=50)  # doctest: +SKIP
        >>> cache.nbytes(), cache.bits_per_element()  # doctest: +SKIP
    """

    def __init__(
        self,
        spec: str | CacheSpec = "rot+int4",
        config: PretrainedConfig | None = None,
        *,
        residual: int = 0,
        calibration: Calibration | None = None,
        fused: bool = False,
        max_cache_len: int | None = None,
        prefill: Prefill = "quantized",
    ) -> None:
        if prefill not in PREFILLS:
            raise ValueError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
        self.prefill = prefill
        if max_cache_len is not None and (not isinstance(max_cache_len, int) or max_cache_len < 1):
            raise ValueError(f"max_cache_len must be a positive number of tokens (or None), got {max_cache_len!r}")
        self.max_cache_len = max_cache_len
        parsed = parse_cache_spec(spec)
        if isinstance(parsed, HFCacheSpec):
            raise ValueError(
                f"{parsed.spec} is Hugging Face's QuantizedCache, not a walshkv codec: build it with "
                "walshkv.cache.make_cache(spec, config)"
            )
        if residual and isinstance(parsed.k, KiviCodec):
            kivi = KiviCodec(parsed.k.bits, parsed.k.group, residual)
            raise ValueError(
                f"{parsed.spec} keeps its newest tokens in its own fp16 window (r={parsed.k.residual}: "
                f"{parsed.k.residual} to {parsed.k.residual + parsed.k.group - 1} tokens), so residual={residual} "
                f"does not apply: set the window in the spec ({kivi.spec}) and pass residual=0 (CLI: no --residual)"
            )
        if prefill == "exact" and isinstance(parsed.k, KiviCodec):
            raise ValueError(
                f"{parsed.spec} keeps its newest tokens in fp16 already; prefill='exact' is for the other walshkv "
                "codecs: use prefill='quantized' (CLI: no --prefill)"
            )
        self.cache_spec = parsed
        self._step: dict[int, Checkpoint] = {}  # the current step's layers, as they were before it
        self.residual = residual
        self.calibration = calibration
        self.fused = fused
        self.model_config = config  # the model's identity, recorded by save()
        if fused and (config is None or getattr(config, "_attn_implementation", None) != FUSED_ATTENTION):
            raise ValueError(
                "fused=True needs the model's attention to read the packed cache: call "
                "walshkv.cache.enable_fused_attention(model) first and pass config=model.config"
            )
        if residual < 0:
            raise ValueError(f"residual must be >= 0 tokens, got {residual}")
        if self.cache_spec.needs_calibration and calibration is None:
            self.cache_spec.bind(0, None)  # raises the message that names the fix
        self._kv_shape: tuple[int, int, int] | None = None  # (layers, kv heads, head_dim) of the config
        if config is None:
            if isinstance(parsed, LayeredCacheSpec) and parsed.counts_from_end:
                raise ValueError(
                    f"{parsed.spec} names layers counted from the model's end (a negative index): pass "
                    "config=model.config so the cache knows the model's depth"
                )
            super().__init__(layer_class_to_replicate=self._next_layer)
            return
        layer_types, per_layer_kwargs = _layer_types(self.cache_spec, config)  # refuses what cannot be held
        text_config = config.get_text_config(decoder=True)
        if isinstance(self.cache_spec, LayeredCacheSpec):  # layers counted from the end become this model's
            self.cache_spec = self.cache_spec.resolve(text_config.num_hidden_layers)
        head_dim = head_dim_of(text_config)
        self._kv_shape = (text_config.num_hidden_layers, text_config.num_key_value_heads, head_dim)
        if calibration is not None:
            calibration.check_matches(
                text_config.num_hidden_layers,
                text_config.num_key_value_heads,
                head_dim,
                model_config=identity_config(config),
            )
        layers: list[CacheLayerMixin] = []
        kivi = isinstance(self.cache_spec.k, KiviCodec)
        for idx, (layer_type, kwargs) in enumerate(zip(layer_types, per_layer_kwargs, strict=True)):
            spec_i = self.cache_spec.bind(idx, calibration)
            if kivi:
                if layer_type == "sliding_attention":
                    layers.append(KiviSlidingWindowLayer(spec_i, kwargs["sliding_window"]))
                else:
                    layers.append(KiviLayer(spec_i))
            elif layer_type == "full_attention":
                layers.append(CompressedLayer(spec_i, residual, self.cache_spec.sink))
                layers[-1].fused = fused
                layers[-1].reserve = max_cache_len or 0
                layers[-1].exact_prefill = prefill == "exact"
            else:  # one of _SLIDING_TYPES (_layer_types refused the rest)
                layers.append(CompressedSlidingWindowLayer(spec_i, kwargs["sliding_window"], residual))
                layers[-1].exact_prefill = prefill == "exact"
        super().__init__(layers=layers)

    def _next_layer(self) -> CompressedLayer:
        """Layers created on first use (no config): bound to their index in order."""
        spec = self.cache_spec.bind(len(self.layers), self.calibration)
        if isinstance(spec.k, KiviCodec):
            return KiviLayer(spec)
        layer = CompressedLayer(spec, self.residual, self.cache_spec.sink)
        layer.reserve = self.max_cache_len or 0
        layer.exact_prefill = self.prefill == "exact"
        return layer

    @classmethod
    def from_preset(
        cls,
        model: PreTrainedModel,
        name: str = "walshkv:4.5",
        *,
        calibration: Calibration | None = None,
        residual: int = 0,
        fused: bool = False,
        max_cache_len: int | None = None,
        prefill: Prefill = "quantized",
    ) -> CompressedCache:
        """A cache for ``model`` with the preset ``name`` (``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5``).

        On a model walshkv ships presets for (``walshkv models list``), no calibration is needed: the preset's
        calibration file ships with the package and is used after its sha256 and the model's identity are checked
        (:func:`walshkv.shipped.shipped_calibration`); a failed check raises, naming the file and the fix.

        Args:
            model: a transformers model (its ``config`` is used).
            name: the preset.
            calibration: what the preset needs; ``None`` (a known model): the shipped file. Else normally the file
                of ``walshkv calibrate --preset NAME`` (``walshkv.export.read_kv_mean_center(path)``) or
                ``collect_kv_stats(...)``; a file written for this preset by ``walshkv recommend`` also chooses the
                spec. A calibration given here always wins over the shipped one.
            residual: full-precision window of recent tokens (0: every token compressed).
            fused: attention reads the packed codes (after :func:`enable_fused_attention`), as for
                :class:`CompressedCache`.
            max_cache_len: tokens to allocate per layer on the first write, as for :class:`CompressedCache`.
            prefill: ``"quantized"`` or ``"exact"``, as for :class:`CompressedCache`.

        The resolved :class:`walshkv.presets.Preset` is kept as ``cache.preset``, and the calibration used as
        ``cache.calibration`` (the shipped one's ``describe()`` names its file and sha256).

        Raises:
            walshkv.shipped.ShippedCalibrationError: the shipped file is missing, fails its checksum, or was made
                for a model whose config differs from ``model``'s.
        """
        preset = resolve_preset(name, calibration, model=model)
        if preset.note:
            warnings.warn(preset.note, UserWarning, stacklevel=2)
        if calibration is None and preset.source.startswith("shipped:"):
            calibration = shipped_calibration(model, [preset.name])
        cache = cls(
            preset.spec,
            config=model.config,
            residual=residual,
            calibration=calibration,
            fused=fused,
            max_cache_len=max_cache_len,
            prefill=prefill,
        )
        cache.preset = preset
        return cache

    @classmethod
    def from_model(
        cls, model: PreTrainedModel, spec: str | CacheSpec = "rot+int4", *, residual: int = 0
    ) -> CompressedCache:
        """Build a cache for ``model`` (uses ``model.config``)."""
        return cls(spec, config=model.config, residual=residual)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write one layer's block; a refusal undoes the whole step (the model's forward) in every layer.

        A step starts when a layer is written a second time (layer 0 of the next forward); each layer's
        state before its write is kept (:meth:`CompressedLayer.checkpoint`) until the next step, so that a
        refusal in layer ``i`` (NaN, overflow, a fused cache read by another attention) leaves layers
        ``0..i-1`` as they were: a step is stored in every layer or in none.
        """
        try:
            self._check_write(key_states, value_states, layer_idx)
        except ValueError as err:
            # the write of a new step's first layer changes nothing; a later layer's undoes the step so far
            undone = [] if isinstance(layer_idx, int) and layer_idx in self._step else self.rollback_step()
            self._step = {}
            held = self.layers[0].get_seq_length() if self.layers else 0
            raise ValueError(
                f"{err} (the step was rolled back in layers {undone}: every layer holds the {held} tokens it held "
                "before it)"
            ) from err
        if self.layer_class_to_replicate is not None:
            while len(self.layers) <= layer_idx:
                self.layers.append(self.layer_class_to_replicate())
        if layer_idx in self._step:
            self._step = {}
        layer = self.layers[layer_idx]
        if isinstance(layer, CompressedLayer):
            self._step[layer_idx] = layer.checkpoint()
        try:
            keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except Exception as err:
            undone = self.rollback_step()
            if isinstance(err, (ValueError, TypeError)):
                held = self.layers[0].get_seq_length()
                raise type(err)(
                    f"layer {layer_idx} ({self.cache_spec.spec}): {err} (the step was rolled back in layers "
                    f"{undone}: every layer holds the {held} tokens it held before it)"
                ) from err
            raise
        for out in (keys, values):
            if isinstance(out, Marker):
                out.walshkv_misread = self.rollback_step
        return keys, values

    def _check_write(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> None:
        """Refuse a write this cache was not built for: a layer index past its layers, K/V of another shape.

        A cache built with ``config=`` holds that config's layers, kv heads and head size; a model with more
        layers (or other heads) than the config it was built from is named here, before any layer changes.
        """
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"layer_idx must be a layer index >= 0, got {layer_idx!r}")
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if not isinstance(x, torch.Tensor) or x.dim() != 4:
                shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be [batch, num_kv_heads, seq_len, head_dim], got {shape}")
        if self._kv_shape is None:
            return
        layers, heads, head_dim = self._kv_shape
        fix = "build the cache with config=model.config of the model that runs it (or CompressedCache.from_preset)"
        if layer_idx >= layers:
            raise ValueError(
                f"layer {layer_idx} was written, but this cache was built for a config of {layers} layers "
                f"(0..{layers - 1}): the model that runs it has more layers than that config; {fix}"
            )
        for name, x in (("key_states", key_states), ("value_states", value_states)):
            if x.shape[1] != heads or x.shape[-1] != head_dim:
                raise ValueError(
                    f"layer {layer_idx}: {name} {tuple(x.shape)} has {x.shape[1]} kv heads of size {x.shape[-1]}, "
                    f"but this cache was built for a config of {heads} kv heads of size {head_dim}; {fix}"
                )

    def rollback_step(self) -> list[int]:
        """Undo the current step in every layer it wrote; returns their indices."""
        undone = sorted(self._step)
        for idx in undone:
            self.layers[idx].rollback(self._step[idx])  # type: ignore[union-attr]
        self._step = {}
        return undone

    #: ``cache.save(path)``: write the cache to ``path`` (safetensors, atomically), see :func:`save_cache`.
    save = save_cache
    #: ``CompressedCache.load(path, model, calibration, *, spec=None, fused=None)``: a cache :meth:`save` wrote,
    #: bit-exact (same packed bytes, ``nbytes()``, next-token logits); refusals name the reason, see :func:`load_cache`.
    load = classmethod(load_cache)

    def _compressed_layers(self) -> list[CompressedLayer]:
        return [layer for layer in self.layers if isinstance(layer, CompressedLayer)]

    def nbytes(self) -> int:
        """Bytes actually held by every layer (packed fields and any full-precision window)."""
        return sum(layer.nbytes() for layer in self._compressed_layers())

    def reserved_nbytes(self) -> int:
        """Bytes allocated by every layer: :meth:`nbytes` plus unused store capacity (at most 1/9 of it
        after growth; ``max_cache_len`` reserves its tokens up front)."""
        return sum(layer.reserved_nbytes() for layer in self._compressed_layers())

    def layout_nbytes(self) -> int:
        """Bytes the codecs' layouts imply for the tokens held (should equal :meth:`nbytes`)."""
        return sum(layer.layout_nbytes() for layer in self._compressed_layers())

    def num_elements(self) -> int:
        """K and V elements held, over all layers."""
        return sum(layer.num_elements() for layer in self._compressed_layers())

    def bits_per_element(self) -> float:
        """Stored bits per K/V element, from the codecs' layouts (window included)."""
        n = self.num_elements()
        return 8.0 * self.layout_nbytes() / n if n else float("nan")

    def bits_per_element_kv(self) -> tuple[float, float]:
        """``(bits_k, bits_v)`` from each layer's codecs, averaged over the elements held."""
        kb = ke = vb = ve = 0.0
        for layer in self._compressed_layers():
            a, b, c, d = layer.bit_counts()
            kb, ke, vb, ve = kb + a, ke + b, vb + c, ve + d
        return (kb / ke if ke else float("nan"), vb / ve if ve else float("nan"))

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 cache would take for the same tokens (2 bytes per element)."""
        return 2 * self.num_elements()
