"""Named presets a user picks by bit budget: ``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5``.

A preset is a cache spec whose bits per element (K and V together, every scale and norm counted)
fit its budget at every head size walshkv supports, plus the calibration it needs (a K mean:
``walshkv calibrate --preset NAME``). The built-in choice of spec was made by measurement on
calibration text, never on the evaluation text (``walshkv recommend`` on each model; the runs are
in docs/presets.md). The measured winner of each known model ships with the package
(``walshkv/model_presets.json``, written by ``scripts/ship_presets.py`` from docs/results/presets, each
entry with its provenance), so a preset on a known model resolves to that model's winner; other models get
the built-in spec and a note that ``walshkv recommend --bits B`` (:mod:`walshkv.recommend`) chooses one for
them. A calibration file that names a spec for a preset (``recommend``'s output, or ``calibrate --preset``'s)
overrides both, for the model it was made on only.

Resolution order: the calibration file's spec, then the model's shipped spec, then the built-in one.

This module holds the table and its resolution only: the search lives in :mod:`walshkv.recommend`, and what a
preset's calibration file holds (and its writer) in :mod:`walshkv.preset_file`.

Example:
    >>> resolve_preset("walshkv:4.5").spec  # doctest: +SKIP
    'center+tq:5/tq:3.5'
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from walshkv.codecs import NamedSpec, SpecLike, name_spec, parse_cache_spec
from walshkv.codecs.base import find_wrapper
from walshkv.codecs.blockrope import RopeBlock
from walshkv.codecs.builtin_presets import (
    BUILTIN,
    FAST_BUDGETS,
    FAST_SUFFIX,
    MAX_BUDGETS,
    MAX_SUFFIX,
    PRESET_BUDGETS,
    base_preset_name,
    builtin_preset_spec,
    check_preset_name,
    is_fast_preset,
    is_max_preset,
    preset_budget,
)
from walshkv.codecs.equalize import DiagonalEqualized, Equalized
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, LayeredCacheSpec
from walshkv.constants import Keys
from walshkv.identity import head_dim_of

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = [
    "BUILTIN",
    "FAST_BUDGETS",
    "FAST_SUFFIX",
    "MAX_BUDGETS",
    "MAX_SUFFIX",
    "MODEL_PRESETS_FILE",
    "PRESET_BUDGETS",
    "KeyWork",
    "Preset",
    "dense_key_map",
    "is_fast_preset",
    "is_max_preset",
    "is_preset",
    "key_work",
    "known_model",
    "model_presets",
    "name_specs",
    "preset_key",
    "preset_name_for_bits",
    "public_name",
    "resolve_engine_preset",
    "resolve_preset",
    "spec_name",
    "spec_parts",
]


@dataclass(frozen=True)
class Preset:
    """A resolved preset.

    Attributes:
        name: ``walshkv:3``, ``walshkv:3.5`` or ``walshkv:4.5``.
        budget: bits per element for K and V together.
        spec: the cache spec it stands for (canonical string: presets are written into files and tables).
        source: ``built-in``, ``shipped:MODEL`` (the model's measured winner, shipped with the package) or the
            calibration file that chose the spec.
        note: what a user should know about the choice (e.g. that the model is unknown and ``walshkv
            recommend`` can choose a spec for it); empty when there is nothing to say.
        provenance: for a shipped spec, how it was chosen (selection text, context, windows, the run's
            result file and commit); empty otherwise.
    """

    name: str
    budget: float
    spec: str
    source: str = "built-in"
    note: str = ""
    provenance: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)


#: The package data file with each known model's measured preset specs (``scripts/ship_presets.py``).
MODEL_PRESETS_FILE = "model_presets.json"
_SHAPE_KEYS = ("arch", "layers", "q_heads", "kv_heads", "head_dim", "params")


@cache
def model_presets() -> dict[str, dict[str, Any]]:
    """The shipped table ``{model name: {"shape": {...}, "presets": {preset: {"spec", provenance...}}}}``."""
    text = resources.files("walshkv").joinpath(MODEL_PRESETS_FILE).read_text(encoding="utf-8")
    data = json.loads(text)
    if data.get("format") != 1:
        raise ValueError(
            f"walshkv/{MODEL_PRESETS_FILE} has format {data.get('format')!r}, this walshkv reads format 1: "
            "reinstall walshkv"
        )
    return data["models"]


def preset_key(model: str, name: str) -> str:
    """The entry of ``model``'s shipped table that preset ``name`` stands for.

    Entries are keyed by how they were selected: ``walshkv:B`` with no limit on decode work (the dense per-key map
    allowed), ``walshkv:B-fast`` among the specs decoded without one. ``walshkv:B-max`` always names the first;
    ``walshkv:B`` names the second where the model's naming rule gave it the plain name (``names`` in
    model_presets.json, written by ``scripts/ship_presets.py``; docs/presets.md, "Which kind the plain name
    means"), else the first.

    Args:
        model: a name of the shipped table (:func:`known_model`).
        name: a preset name.

    Raises:
        ValueError: an unknown preset name.
    """
    key = check_preset_name(name)
    if is_max_preset(key):
        return base_preset_name(key)
    return model_presets()[model].get("names", {}).get(key, key)


def public_name(model: str, key: str) -> str:
    """How users name the entry ``key`` of ``model``'s shipped table (the inverse of :func:`preset_key`):
    ``walshkv:B`` for the entry the plain name stands for, ``walshkv:B-max`` for a no-limit entry the plain name
    no longer names, else ``key``."""
    names = model_presets()[model].get("names", {})
    for public, entry in names.items():
        if entry == key:
            return public
    return f"{key}{MAX_SUFFIX}" if key in names else key


def _shape_of(model: Any) -> dict[str, Any] | None:
    """``{arch, layers, q_heads, kv_heads, head_dim, params}`` of a loaded model, a shape or a transformers model."""
    shape = getattr(model, "shape", model)
    if all(hasattr(shape, k) for k in _SHAPE_KEYS):
        return {k: getattr(shape, k) for k in _SHAPE_KEYS}
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "parameters"):
        return None
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = head_dim_of(cfg)
    return {
        "arch": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "q_heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "params": sum(p.numel() for p in model.parameters()),
    }


def known_model(model: Any) -> str | None:
    """The shipped table's name for ``model``, or ``None`` for a model walshkv has not measured.

    Args:
        model: a model name (``smollm2-135m``), a :class:`~walshkv.models.LoadedModel` (its name, else its
            shape), a :class:`~walshkv.models.ModelShape` or a transformers model (matched by shape: decoder
            type, layers, heads, head size and parameter count, all equal).
    """
    if model is None:
        return None
    table = model_presets()
    name = model if isinstance(model, str) else getattr(model, "name", None)
    shape = None if isinstance(model, str) else _shape_of(model)
    if isinstance(name, str) and name.strip().lower() in table:
        key = name.strip().lower()
        if shape is None or shape == table[key]["shape"]:
            return key
        return None  # loaded by a known name, but another model: nothing measured for it
    if shape is not None:
        for key, entry in table.items():
            if entry["shape"] == shape:
                return key
    return None


def _model_label(model: Any) -> str:
    if isinstance(model, str):
        return model
    name = getattr(model, "name", None)
    if isinstance(name, str):
        return name
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or getattr(config, "model_type", "this model"))


def is_preset(text: object) -> bool:
    """Whether ``text`` names a preset (``walshkv:...``)."""
    return isinstance(text, str) and text.strip().lower().startswith("walshkv:")


def preset_name_for_bits(bits: float, fast: bool = False) -> str:
    """``walshkv:B`` for a budget ``B`` (any positive number; the built-in ones are 3, 3.5 and 4.5), ``walshkv:B-fast``
    with ``fast``."""
    if not bits > 0:
        raise ValueError(f"a bit budget must be positive, got {bits}")
    return f"walshkv:{bits:g}{FAST_SUFFIX if fast else ''}"


@runtime_checkable
class PresetMeta(Protocol):
    """Anything that carries a calibration file's ``walshkv.*`` metadata (a :class:`KMeanBias` does)."""

    meta: dict[str, Any]


def _preset_file(calibration: CalibrationLike | None) -> PresetMeta | None:
    """The calibration file behind ``calibration``: itself, or the K-mean file of merged statistics."""
    for obj in (calibration, getattr(calibration, "bias", None)):
        if isinstance(obj, PresetMeta) and isinstance(obj.meta, dict):
            return obj
    return None


def resolve_preset(name: str, calibration: CalibrationLike | None = None, *, model: Any = None) -> Preset:
    """The spec behind a preset name.

    Args:
        name: a preset name.
        calibration: a calibration file (:class:`~walshkv.export.KMeanBias`) or statistics; if it was
            written by ``walshkv recommend``/``calibrate --preset`` for this preset name, its spec wins.
        model: the model the preset will run on (a name, a :class:`~walshkv.models.LoadedModel` or a
            transformers model): a known model gets its shipped, measured spec (:func:`known_model`); any other
            gets the built-in spec with a :attr:`Preset.note`. ``None``: the built-in spec, no note.

    Raises:
        ValueError: unknown preset names (the message lists them).
    """
    file = _preset_file(calibration)
    meta = file.meta if file is not None else {}
    if str(meta.get(Keys.Preset.NAME, "")).lower() == name.strip().lower() and meta.get(Keys.Preset.SPEC):
        key = name.strip().lower()
        budget = preset_budget(key)
        source = str(getattr(calibration, "source", "file"))
        return Preset(key, budget, meta[Keys.Preset.SPEC], source=source)
    key = check_preset_name(name)
    budget, builtin = preset_budget(key), builtin_preset_spec(key)
    if model is None:
        return Preset(key, budget, builtin)
    known = known_model(model)
    entry = model_presets()[known]["presets"].get(preset_key(known, key)) if known else None
    if entry is not None:
        provenance = {k: v for k, v in entry.items() if k != "spec"}
        return Preset(key, budget, entry["spec"], source=f"shipped:{known}", provenance=provenance)
    label = _model_label(model)
    why = f"walshkv has no measured {key} spec for {label}" if known else f"{label} is not a model walshkv has measured"
    fast = " --fast" if is_fast_preset(key) else ""
    note = (
        f"{why}; {key} uses the built-in spec {builtin}. `walshkv recommend --model {label} --bits "
        f"{budget:g}{fast} --text python-docs -o {key.replace(':', '-')}.gguf` chooses one for it (pass the "
        "file as --kv-mean-center)"
    )
    return Preset(key, budget, builtin, note=note)


def resolve_engine_preset(
    name: str,
    *,
    engine: str,
    model: str | None = None,
    calibration: CalibrationLike | None = None,
    how: str = "name the model",
) -> Preset:
    """The spec a serving engine's integration stores for a preset: the model's own, never a generic one.

    A preset is chosen per model (``model_presets.json``; docs/presets.md). Outside walshkv's own cache the
    integrations (the LMCache serde, the vLLM plugin) cannot see the model's weights, so the model must be named,
    or the calibration file that ``walshkv calibrate --preset`` / ``walshkv recommend`` wrote for this preset
    (which records its spec) must be given. Without either, the built-in spec (:func:`resolve_preset` with no
    model) would be stored: a spec whose quality no table measures for that model, so it is refused.

    Args:
        name: a preset name (``walshkv:3.5``).
        engine: who asks, for messages (``"walshkv serde"``, ``"walshkv vLLM plugin"``).
        model: a model name from ``walshkv models list`` (the shipped table's names), or ``None``.
        calibration: the calibration file given to the integration, or ``None``.
        how: how a user names the model in that integration (for the message).

    Returns:
        The preset with the model's shipped spec, or the spec the calibration file records for ``name``.

    Raises:
        ValueError: an unknown preset name; no model and no file written for the preset; a model walshkv has
            not measured (the message lists the models that ship presets and how to choose one).
    """
    key = check_preset_name(name)
    known = known_model(model)
    preset = resolve_preset(key, calibration, model=known)
    if preset.source != "built-in":  # the file's spec, or the model's shipped one
        return preset
    shipped = sorted(m for m, entry in model_presets().items() if preset_key(m, key) in entry["presets"])
    fix = (
        f"or give the calibration file that `walshkv calibrate --preset {key} --model MODEL -o FILE` (a model "
        f"walshkv ships presets for) or `walshkv recommend --model MODEL --bits {preset.budget:g} -o FILE` wrote; "
        "or give a spec instead of a preset name"
    )
    if model is None:
        raise ValueError(
            f"{engine}: {key} is chosen per model ({', '.join(shipped) or 'none shipped'} ship one), and no model is "
            f"named: {how}, {fix}. The built-in spec is not substituted: no table measures it on your model"
        )
    why = f"walshkv has no measured {key} for {model}" if known else f"{model!r} is not a model walshkv has measured"
    raise ValueError(
        f"{engine}: {why} (models with {key}: {', '.join(shipped) or 'none'}): {how} with one of them, {fix}"
    )


def name_specs(
    codecs: Sequence[SpecLike], calibration: CalibrationLike | None = None, *, model: Any = None
) -> list[NamedSpec]:
    """A run's codecs as :class:`~walshkv.codecs.NamedSpec` objects, presets resolved by :func:`resolve_preset`.

    A preset name (or a :class:`~walshkv.codecs.NamedSpec` asked as one) resolves with ``calibration`` and
    ``model`` (the file's spec, then the model's shipped one, then the built-in one), keeping its name as the
    label, where its spec came from and any note; anything else is named as :func:`~walshkv.codecs.name_spec`
    names it. A command resolves once before calibrating (to check the specs against the model) and again with
    the calibration it then holds: the objects go in, the objects come out, no spec text is parsed twice.

    Args:
        codecs: the run's codecs: text as given, parsed specs, or :class:`~walshkv.codecs.NamedSpec`.
        calibration: the run's calibration (a preset file may name the preset's spec), or ``None``.
        model: the model the presets run on (a name, a :class:`~walshkv.models.LoadedModel`, a transformers model),
            or ``None`` for the built-in specs.

    Raises:
        ValueError: an unknown preset name or a spec that does not parse (the message lists what exists).
    """
    out = []
    for codec in codecs:
        asked = codec.asked if isinstance(codec, NamedSpec) else codec
        if is_preset(asked):
            p = resolve_preset(str(asked), calibration, model=model)
            same = isinstance(codec, NamedSpec) and codec.text == p.spec  # resolved to the spec it holds: kept
            spec = codec.spec if same else parse_cache_spec(p.spec)
            out.append(NamedSpec(p.name, spec, label=p.name, source=p.source, note=p.note))
        else:
            out.append(name_spec(codec))
    return out


def dense_key_map(spec: str | CacheSpec) -> bool:
    """True if the fused decode kernels map each cached key of ``spec`` by a dense ``head_dim x head_dim`` matrix
    at every step: K stored before RoPE (``prerope+``) with ``eq+``'s dense transform, in any part.

    ``prerope+`` without ``eq+`` or with ``eqd+`` (a fast Walsh-Hadamard map with sign flips, ``d log2 d`` additions
    per key) and every post-RoPE spec (rotations and ``eq+`` move onto the query) are False: what a fast preset may
    use (:func:`candidates_for` with ``fast``).
    """
    for part in spec_parts(spec):
        if isinstance(part.k, PreRope):
            eq = find_wrapper(part.k, Equalized)
            if eq is not None and not isinstance(eq, DiagonalEqualized):
                return True
    return False


@dataclass(frozen=True)
class KeyWork:
    """The multiply-adds a decode step spends per cached key and kv head, for a spec at a model's attention shape.

    Attributes:
        score: ``2 * group * head_dim``: the ``group`` query heads' scores against the key and their sums of its
            value: what plain attention spends per key, and the unit of :attr:`ratio`.
        key_map: what the spec's K transforms add per key: ``head_dim²`` for ``prerope+`` with ``eq+``'s dense
            matrix; ``head_dim * log2(head_dim) + 2 * head_dim`` for other ``prerope+`` keys (a fast Walsh-Hadamard
            map and RoPE per key); ``group * head_dim² / G + head_dim`` for the block frame (``ropeblock:G+``: each
            block's query product shared by its ``G`` keys, and the table row added to each); 0 after RoPE (every
            map moves onto the query, once per step). The largest over a ``layers:`` spec's parts.
    """

    score: int
    key_map: float

    @property
    def ratio(self) -> float:
        """:attr:`key_map` in units of :attr:`score`: 0 for a post-RoPE spec, about 10 or more with a dense map."""
        return self.key_map / self.score


def key_work(spec: str | CacheSpec, head_dim: int, group: int) -> KeyWork:
    """The K transforms' decode work per cached key of ``spec`` (:class:`KeyWork`), counted from its wrappers.

    Args:
        spec: a cache spec or preset spec.
        head_dim: the model's head size.
        group: query heads per kv head (GQA).

    Raises:
        ValueError: ``head_dim`` or ``group`` below 1.
    """
    if head_dim < 1 or group < 1:
        raise ValueError(
            f"key_work needs head_dim >= 1 and group >= 1 query heads per kv head, got {head_dim}, {group}"
        )
    d = head_dim
    work = 0.0
    for part in spec_parts(spec):
        if isinstance(part.k, RopeBlock):
            work = max(work, group * d * d / part.k.block + d)
        elif isinstance(part.k, PreRope):
            dense = dense_key_map(part)
            work = max(work, d * d if dense else d * math.log2(d) + 2 * d)
    return KeyWork(score=2 * group * d, key_map=work)


def spec_parts(spec: str | CacheSpec) -> list[CacheSpec]:
    """The plain specs of ``spec``: its parts for a ``layers:`` spec, else itself (``hf-*`` specs have none)."""
    parsed = parse_cache_spec(spec)
    if isinstance(parsed, HFCacheSpec):
        return []
    return [p for p, _ in parsed.parts] if isinstance(parsed, LayeredCacheSpec) else [parsed]


def spec_name(spec: str | CacheSpec) -> str:
    """``spec`` as text: a string as given, a parsed spec by its canonical form."""
    return spec if isinstance(spec, str) else spec.spec
