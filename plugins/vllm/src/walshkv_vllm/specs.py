"""Which walshkv cache specs a vLLM page can hold, and the ``--kv-cache-dtype`` names that stand for them.

A page slot has a fixed size, so only codecs that store every (token, kv head) vector on its own, in the same
number of bytes, fit: the plain storing codecs (``fp16``, ``intB``, ggml ``q4_0``/``q8_0``/..., ``tq:B``,
``tqprod:B``, ``tcq:B``, ``vht2``, ``vzc``, ``sqfree``) under ``rot+``/``rrot+``, ``center+`` and ``eq+``/``eqd+``/
``eqr+`` (calibrated, K only for the last), and K's frames ``ropeblock:G+`` and ``prerope+``, which turn each key by
its position: the backend passes the positions vLLM's metadata gives (CPU pages only). ``sink:N:`` keeps the first
``N`` tokens of each sequence in fp16 beside the pages (:class:`walshkv_vllm.paged.SinkRows`; CPU pages only,
``N`` at most a page's block size). Refused: ``kivi`` (K quantized per channel over groups of tokens), ``layers:``
specs (the pages of one vLLM KV cache group must all have one size), and the ``hf-*`` peers.

A preset name (``WALSHKV_VLLM_SPEC=walshkv:3.5``) stands for the served model's own preset: ``$WALSHKV_VLLM_MODEL``
names the model (``walshkv models list``; checked against the engine's config when the backend starts), or
``$WALSHKV_VLLM_CALIBRATION`` is the file ``walshkv calibrate --preset`` wrote for it. The built-in spec is never
stored in its place, and a preset with a part the pages cannot hold is refused with the part named.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from walshkv.codecs import CacheSpec, Codec, FloatCodec, GGMLCodec, IntCodec, Rotated, parse_cache_spec, wrappers
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.spec import LayeredCacheSpec
from walshkv.codecs.trellis import TrellisQuant
from walshkv.codecs.turbo import TurboQuant, TurboQuantProd
from walshkv.codecs.vht2 import SqfreeCodec, VHT2Codec, VZCCodec
from walshkv.presets import Preset, is_preset, known_model, model_presets, resolve_engine_preset

if TYPE_CHECKING:
    from walshkv.codecs import CalibrationLike

__all__ = [
    "CALIBRATION_ENV",
    "DECODE_BACKEND_ENV",
    "KV_CACHE_DTYPES",
    "MODEL_ENV",
    "PREFILL_ENV",
    "PREFILL_MODES",
    "SPEC_ENV",
    "PluginSettings",
    "calibration_path",
    "check_fixed_size",
    "check_served_model",
    "resolve_spec",
]

#: ``--kv-cache-dtype`` names the plugin adds to vLLM, and the walshkv cache spec each stands for
#: (``walshkv_spec``: the spec in ``$WALSHKV_VLLM_SPEC``).
KV_CACHE_DTYPES: dict[str, str] = {
    "walshkv_rot_int4": "rot+int4",
    "walshkv_rot_int4_int3": "rot+int4/rot+int3",
    "walshkv_q4_0": "q4_0",
    "walshkv_q8_0": "q8_0",
    "walshkv_q8_0_q4_0": "q8_0/q4_0",
    "walshkv_tq3": "tq:3",
    "walshkv_tq4": "tq:4",
    "walshkv_center_rot_int4": "center+rot+int4",
    "walshkv_spec": "",
}

#: Environment variables the backend reads (they reach vLLM's worker processes).
SPEC_ENV = "WALSHKV_VLLM_SPEC"
CALIBRATION_ENV = "WALSHKV_VLLM_CALIBRATION"
PREFILL_ENV = "WALSHKV_VLLM_PREFILL"
DECODE_BACKEND_ENV = "WALSHKV_VLLM_DECODE_BACKEND"
MODEL_ENV = "WALSHKV_VLLM_MODEL"

#: ``exact``: a prompt's queries attend to its own K/V in full precision (vLLM's convention; earlier chunks and
#: cached prefixes are read from the pages). ``quantized``: they attend to the K/V as stored (quantize-on-write,
#: what walshkv's CompressedCache and its KL-divergence numbers do).
PREFILL_MODES = ("exact", "quantized")

_STORING = (
    FloatCodec,
    IntCodec,
    GGMLCodec,
    TurboQuant,
    TurboQuantProd,
    TrellisQuant,
    VHT2Codec,
    VZCCodec,
    SqfreeCodec,
)
_WRAPPING = (Rotated, Centered, Equalized, RopeBlock, PreRope)


def check_fixed_size(codec: Codec, what: str = "codec") -> None:
    """Refuse a codec that cannot live in a fixed-size page slot (the module docstring says which do).

    Raises:
        ValueError: naming the codec, what the slots need and the codecs that fit.
    """
    fits = (
        "fp16, intB, q4_0, q8_0 (and the other ggml types), tq:B, tqprod:B, tcq:B, vht2, vzc, sqfree, under "
        "rot+/center+/eq+ (ropeblock:G+ or prerope+ outermost on K)"
    )
    for w in wrappers(codec):
        if not isinstance(w, _WRAPPING):
            raise ValueError(
                f"{what} {codec.spec!r}: the vLLM plugin cannot store {w.prefix}+ (it is not wired into the plugin); "
                f"use one of: {fits}"
            )
    core = wrappers(codec)[-1].inner if wrappers(codec) else codec
    if not isinstance(core, _STORING):
        raise ValueError(
            f"{what} {codec.spec!r}: {core.spec!r} does not store each token vector on its own in a fixed number "
            f"of bytes, which a vLLM page slot needs; use one of: {fits}"
        )


def resolve_spec(name: str, env: dict[str, str] | None = None) -> CacheSpec:
    """The cache spec a ``--kv-cache-dtype`` name (``walshkv_q4_0``) or a walshkv spec string stands for.

    Args:
        name: a key of :data:`KV_CACHE_DTYPES`, or a spec such as ``"rot+int4/q8_0"``; a preset name
            (``walshkv:3.5``, also in ``$WALSHKV_VLLM_SPEC``) resolves to the served model's own preset
            (``$WALSHKV_VLLM_MODEL``, or the preset file in ``$WALSHKV_VLLM_CALIBRATION``).
        env: where ``walshkv_spec`` reads ``$WALSHKV_VLLM_SPEC`` (default ``os.environ``).

    Raises:
        ValueError: an unknown name, ``walshkv_spec`` without the variable, or a spec the slots cannot hold; a
            preset with no model named, for a model walshkv has not measured, or with a part the slots cannot hold.
    """
    env = os.environ if env is None else env
    text = name
    if name.startswith("walshkv_"):
        if name not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv cache dtype {name!r}; the plugin adds {', '.join(KV_CACHE_DTYPES)}")
        text = KV_CACHE_DTYPES[name] or env.get(SPEC_ENV, "")
        if not text:
            raise ValueError(f"--kv-cache-dtype walshkv_spec reads the spec from ${SPEC_ENV}: set it, e.g. 'rot+int4'")
    if is_preset(text):
        preset = _preset(text, env)
        try:
            return _checked(preset.spec)
        except ValueError as e:
            raise ValueError(
                f"{preset.name} ({preset.source}) is {preset.spec!r}, which vLLM pages cannot hold: {e}. Serve this "
                f"model with a fixed-size spec in {SPEC_ENV} (or a --kv-cache-dtype the plugin adds)"
            ) from None
    return _checked(text)


def _preset(text: str, env: Mapping[str, str]) -> Preset:
    """The served model's own preset (``$WALSHKV_VLLM_MODEL``, or the preset file in ``$WALSHKV_VLLM_CALIBRATION``)."""
    return _resolved_preset(text, env.get(MODEL_ENV) or None, env.get(CALIBRATION_ENV) or None)


@functools.cache
def _resolved_preset(text: str, model: str | None, calibration_path: str | None) -> Preset:
    """:func:`_preset`, once per process: every layer's backend resolves the same names (the file read once)."""
    calibration = None
    if calibration_path:
        from walshkv.export import read_kv_mean_center  # needs gguf; read only for a preset or a calibrated spec

        calibration = read_kv_mean_center(calibration_path)
    return resolve_engine_preset(
        text,
        engine="walshkv vLLM plugin",
        model=model,
        calibration=calibration,
        how=f"set {MODEL_ENV} to the served model's name in `walshkv models list`",
    )


def check_served_model(name: str, hf_config: object) -> None:
    """Refuse a ``$WALSHKV_VLLM_MODEL`` that is not the model the engine serves (compared by shape).

    Args:
        name: the model name the preset was resolved for.
        hf_config: the engine's transformers config (``vllm_config.model_config.hf_config``).

    Raises:
        ValueError: the architecture, layers, heads or head size differ from the named model's.
    """
    known = known_model(name)
    if known is None:
        return  # resolve_engine_preset has refused unknown names already
    entry = model_presets()[known]
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(cfg, "num_attention_heads", None)
    served = {
        "arch": getattr(cfg, "model_type", None),
        "layers": getattr(cfg, "num_hidden_layers", None),
        "q_heads": heads,
        "kv_heads": getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or (getattr(cfg, "hidden_size", 0) // max(1, heads or 1)),
    }
    want = {k: entry["shape"][k] for k in served}
    if served != want:
        raise ValueError(
            f"{MODEL_ENV}={name!r} ({want}) is not the model vLLM serves ({served}): its preset was chosen and "
            f"calibrated for another model; set {MODEL_ENV} to the served model's name, or give a spec"
        )


def _checked(text: str) -> CacheSpec:
    """``text`` parsed, if vLLM's pages can hold it (see :func:`resolve_spec`)."""
    spec = parse_cache_spec(text)
    if not isinstance(spec, CacheSpec) or isinstance(spec, LayeredCacheSpec):
        raise ValueError(
            f"{text!r}: the vLLM plugin takes one K codec and one V codec for every layer (KSPEC/VSPEC); "
            "layers: specs and hf-* peers give pages of other sizes per layer or are not walshkv codecs"
        )
    check_fixed_size(spec.k, "K codec")
    check_fixed_size(spec.v, "V codec")
    return spec


@dataclass(frozen=True)
class PluginSettings:
    """What the backend reads from the environment, checked once.

    Attributes:
        prefill: one of :data:`PREFILL_MODES`.
        decode_backend: ``walshkv.attention.decode_attention``'s ``backend`` (``auto``, ``reference``, ``cpu``,
            ``triton``).
        calibration: path of a ``walshkv calibrate`` K-mean file (``center+`` specs), or ``""``.
    """

    prefill: str = "exact"
    decode_backend: str = "auto"
    calibration: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PluginSettings:
        env = os.environ if env is None else env
        prefill = env.get(PREFILL_ENV, "exact")
        if prefill not in PREFILL_MODES:
            raise ValueError(f"${PREFILL_ENV}={prefill!r}; choose one of {', '.join(PREFILL_MODES)}")
        return cls(prefill, env.get(DECODE_BACKEND_ENV, "auto"), env.get(CALIBRATION_ENV, ""))

    def load_calibration(self, model_arch: str | None = None, path: str | None = None) -> CalibrationLike | None:
        """The calibration file ``path`` (default: ``$WALSHKV_VLLM_CALIBRATION``; ``None`` when neither is set)."""
        path = self.calibration if path is None else path
        if not path:
            return None
        from walshkv.export import read_kv_mean_center  # needs gguf; only calibrated specs read a file

        return read_kv_mean_center(path, model_arch)


def calibration_path(name: str, env: Mapping[str, str] | None = None) -> str:
    """The calibration file the backend reads for ``--kv-cache-dtype name``: ``$WALSHKV_VLLM_CALIBRATION`` if set,
    else, for a preset of a known model (``$WALSHKV_VLLM_MODEL``), the file walshkv ships for that preset (checked
    against its checksum), else ``""``.

    Raises:
        walshkv.shipped.ShippedCalibrationError: the shipped file is missing or damaged.
    """
    env = os.environ if env is None else env
    if env.get(CALIBRATION_ENV):
        return env[CALIBRATION_ENV]
    text = (KV_CACHE_DTYPES[name] or env.get(SPEC_ENV, "")) if name in KV_CACHE_DTYPES else name
    model = env.get(MODEL_ENV)
    if not model or not is_preset(text):
        return ""
    from walshkv.shipped import check_file, shipped_file  # the package's files, checked before they are read

    file = shipped_file(model, text)
    if file is None:
        return ""
    check_file(file)
    return str(file.path)
