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

This module holds the table and its resolution only; the search lives in :mod:`walshkv.recommend`.

Example:
    >>> resolve_preset("walshkv:4.5").spec  # doctest: +SKIP
    'center+tq:5/tq:3.5'
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from walshkv.codecs import parse_cache_spec
from walshkv.codecs.base import find_wrapper
from walshkv.codecs.builtin_presets import (
    BUILTIN,
    FAST_BUDGETS,
    FAST_SUFFIX,
    PRESET_BUDGETS,
    builtin_preset_spec,
    check_preset_name,
    is_fast_preset,
    preset_budget,
)
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import DiagonalEqualized, Equalized
from walshkv.codecs.prerope import PreRope
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, LayeredCacheSpec
from walshkv.constants import Keys
from walshkv.defaults import CTX
from walshkv.export import write_kv_mean_center

if TYPE_CHECKING:
    from walshkv.calibration import KVStats
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.constants import Basis, Kind
    from walshkv.models import LoadedModel

__all__ = [
    "BUILTIN",
    "CANDIDATES",
    "FAST_BUDGETS",
    "MODEL_PRESETS_FILE",
    "PRESET_BUDGETS",
    "Preset",
    "candidates_for",
    "dense_key_map",
    "equalized_kinds",
    "fast_candidate",
    "is_fast_preset",
    "is_preset",
    "k_mean_basis",
    "k_pre_rope",
    "known_model",
    "model_presets",
    "preset_name_for_bits",
    "resolve_engine_preset",
    "resolve_preset",
    "resolve_specs",
    "write_preset_file",
]

# What `walshkv recommend` tries, by budget; specs over the budget at the model's head_dim are dropped
# (sink:1: specs counted over the selection windows' length: their fp16 token costs (16 - b) / 512 bits
# at 512 tokens, so they fit where the plain spec leaves room, e.g. tq's fp16 norm at head_dim 128).
# K gets more bits than V in most: K is the sensitive half on every model measured. eq+ (a calibrated
# query-weighted K transform) joins the best plain specs; it pays most beside a sink (the first token's
# K lies where the transform, fitted to the typical token, amplifies error). prerope+ (K quantized before
# RoPE, so that center+ removes a channel's whole offset) joins the eq+ ones.
CANDIDATES: dict[float, tuple[str, ...]] = {
    3.0: (
        "center+tq:3.5/tq:2",
        "center+tq:3/tq:2.5",
        "center+rot+int3/tq:2.5",
        "center+tq:2.5/tq:3",
        "sink:1:center+tq:3.5/tq:2",
        "sink:1:center+tq:3/tq:2.5",
        "center+eq+tq:3.5/tq:2",
        "center+eq+tq:3/tq:2.5",
        "sink:1:center+eq+tq:3.5/tq:2",
        "prerope+center+eq+tq:3.5/tq:2",
        "prerope+center+eq+tq:3/tq:2.5",
        "sink:1:prerope+center+eq+tq:3.5/tq:2",
        "sink:1:prerope+center+eq+tq:3/tq:2.5",
    ),
    3.5: (
        "center+tq:4/tq:2.5",
        "center+rot+int4/tq:2.5",
        "center+tq:3.5/tq:3",
        "center+tq:3/tq:3.5",
        "center+tq:3/tq:3",
        "sink:1:center+tq:4/tq:2.5",
        "sink:1:center+tq:3.5/tq:3",
        "sink:1:center+tq:3.5/tq:2.5",
        "center+eq+tq:4/tq:2.5",
        "center+eq+tq:3.5/tq:3",
        "sink:1:center+eq+tq:3.5/tq:3",
        "sink:1:center+eq+tq:4/tq:2.5",
        "prerope+center+eq+tq:4/tq:2.5",
        "prerope+center+eq+tq:3.5/tq:3",
        "sink:1:prerope+center+eq+tq:3.5/tq:3",
        "sink:1:prerope+center+eq+tq:4/tq:2.5",
    ),
    4.5: (
        "center+tq:5/tq:3.5",
        "center+rot+int5/tq:3.5",
        "center+rot+iq4_nl/rot+iq4_nl",
        "center+tq:4.5/tq:4",
        "center+rot+q4_0",
        "center+rot+q5_0/tq:3",
        "center+rot+q4_0/tq:4",
        "center+tq:5/tq:3",
        "sink:1:center+tq:5/tq:3.5",
        "sink:1:center+rot+iq4_nl/tq:4",
        "sink:1:center+rot+q4_0/tq:4",
        "center+eq+tq:5/tq:3.5",
        "center+eq+tq:4.5/tq:4",
        "sink:1:center+eq+tq:5/tq:3.5",
        "sink:1:center+eq+rot+iq4_nl/tq:4",
        "prerope+center+eq+tq:5/tq:3.5",
        "prerope+center+eq+tq:4.5/tq:4",
        "sink:1:prerope+center+eq+tq:5/tq:3.5",
        "sink:1:prerope+center+eq+rot+iq4_nl/tq:4",
    ),
}


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


def _shape_of(model: Any) -> dict[str, Any] | None:
    """``{arch, layers, q_heads, kv_heads, head_dim, params}`` of a loaded model, a shape or a transformers model."""
    shape = getattr(model, "shape", model)
    if all(hasattr(shape, k) for k in _SHAPE_KEYS):
        return {k: getattr(shape, k) for k in _SHAPE_KEYS}
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "parameters"):
        return None
    cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
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
    entry = model_presets()[known]["presets"].get(key) if known else None
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
    shipped = sorted(m for m, entry in model_presets().items() if key in entry["presets"])
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


def resolve_specs(
    codecs: Sequence[str], calibration: CalibrationLike | None = None, *, model: Any = None
) -> tuple[list[str], dict[str, str]]:
    """Replace preset names by their specs (:func:`resolve_preset`, with the same ``calibration`` and ``model``).

    Notes on the choices (an unknown model) are not returned: use :func:`resolve_preset` to read them.

    Returns:
        ``(specs, presets)``: the specs in order, and ``{spec: preset name}`` for the replaced ones.
    """
    out, names = [], {}
    for c in codecs:
        if is_preset(c):
            p = resolve_preset(c, calibration, model=model)
            out.append(p.spec)
            names[p.spec] = p.name
        else:
            out.append(c)
    return out, names


def dense_key_map(spec: str | CacheSpec) -> bool:
    """True if the fused decode kernels map each cached key of ``spec`` by a dense ``head_dim x head_dim`` matrix
    at every step: K stored before RoPE (``prerope+``) with ``eq+``'s dense transform, in any part.

    ``prerope+`` without ``eq+`` or with ``eqd+`` (a fast Walsh-Hadamard map with sign flips, ``d log2 d`` additions
    per key) and every post-RoPE spec (rotations and ``eq+`` move onto the query) are False: what a fast preset may
    use (:func:`candidates_for` with ``fast``).
    """
    for part in _parts(spec):
        if isinstance(part.k, PreRope):
            eq = find_wrapper(part.k, Equalized)
            if eq is not None and not isinstance(eq, DiagonalEqualized):
                return True
    return False


def fast_candidate(spec: str) -> str:
    """``spec`` with each ``prerope+`` part's dense ``eq+`` on K replaced by ``eqd+`` (its best diagonal): the fast
    preset's version of a built-in candidate. Specs without a dense key map come back unchanged."""
    if not dense_key_map(spec):
        return spec
    # prerope+ is K's outermost wrapper (refused elsewhere), so V never matches
    out = spec.replace("prerope+center+eq+", "prerope+center+eqd+").replace("prerope+eq+", "prerope+eqd+")
    if dense_key_map(out):
        raise ValueError(f"{spec!r}: found no eqd+ form of its dense prerope+ eq+ key map; write it without eq+")
    return parse_cache_spec(out).spec


def candidates_for(
    bits: float,
    head_dim: int,
    extra: Sequence[str] = (),
    num_layers: int | None = None,
    ctx: int = CTX,
    fast: bool = False,
) -> list[str]:
    """Candidate specs whose bits per element at ``head_dim`` fit ``bits``, most bits first.

    The built-in list of the nearest budget at or below ``bits`` (3, 3.5 or 4.5) is used, with its
    preset's spec, plus ``extra``. A per-layer (``layers:``) spec needs ``num_layers``. A ``sink:N:``
    spec's fp16 tokens are counted over a context of ``ctx`` tokens (the windows it is measured on).
    With ``fast`` (the ``walshkv:B-fast`` presets), each built-in candidate whose keys the kernels would map by
    a dense matrix per key (:func:`dense_key_map`) takes ``eqd+`` in place of ``eq+`` (:func:`fast_candidate`).

    Returns:
        Canonical spec strings (what result rows and preset files name).

    Raises:
        ValueError: nothing fits; with ``fast``, an ``extra`` spec with a dense key map (the message names it).
    """
    if fast:
        dense = [e for e in extra if dense_key_map(e)]
        if dense:
            raise ValueError(
                f"a fast preset's candidates map keys without a dense matrix, but {dense[0]!r} stores K before RoPE "
                f"with eq+'s dense transform: write eqd+ in place of eq+ (e.g. {fast_candidate(dense[0])!r}), or "
                "drop --fast"
            )
    pool: list[str] = [*extra]
    budgets = [b for b in CANDIDATES if b <= bits + 1e-9]
    if budgets:
        budget = max(budgets)
        built_in = [*CANDIDATES[budget], *(spec for name, spec in BUILTIN.items() if PRESET_BUDGETS[name] == budget)]
        pool.extend(fast_candidate(s) for s in built_in) if fast else pool.extend(built_in)
    fits: dict[str, float] = {}
    for spec in pool:
        parsed = parse_cache_spec(spec)
        try:
            parsed.check_head_dim(head_dim)
        except ValueError:
            continue
        if isinstance(parsed, LayeredCacheSpec):
            if num_layers is None:
                raise ValueError(f"{spec!r} sets widths per layer: its bits per element need the model's layer count")
            parsed.check_layers(num_layers)
        b = (
            parsed.bits_at(head_dim, ctx, num_layers)
            if isinstance(parsed, CacheSpec)
            else parsed.bits_per_element(head_dim)
        )
        if b <= bits + 1e-9:
            fits.setdefault(parsed.spec, b)
    if not fits:
        raise ValueError(f"no candidate spec fits {bits} bits per element at head_dim {head_dim}")
    return sorted(fits, key=lambda s: -fits[s])


def _parts(spec: str | CacheSpec) -> list[CacheSpec]:
    """The plain specs of ``spec``: its parts for a ``layers:`` spec, else itself (``hf-*`` specs have none)."""
    parsed = parse_cache_spec(spec)
    if isinstance(parsed, HFCacheSpec):
        return []
    return [p for p, _ in parsed.parts] if isinstance(parsed, LayeredCacheSpec) else [parsed]


def _name(spec: str | CacheSpec) -> str:
    return spec if isinstance(spec, str) else spec.spec


def k_mean_basis(spec: str | CacheSpec) -> Basis:
    """The basis a spec's K mean is subtracted in: ``rot`` for ``center+rot+...``, else ``plain``."""
    bases = {p.k.basis if isinstance(p.k, Centered) else "plain" for p in _parts(spec)} or {"plain"}
    if len(bases) > 1:
        raise ValueError(
            f"{_name(spec)!r} centers K in different bases per layer ({', '.join(sorted(bases))}); a preset file "
            "holds one K mean basis: use the same K wrapper (center+ or center+rot+) in every part"
        )
    return bases.pop()


def k_pre_rope(spec: str | CacheSpec) -> bool:
    """True if ``spec`` quantizes K before RoPE (``prerope+``); every part of a per-layer spec must agree."""
    kinds = {isinstance(p.k, PreRope) for p in _parts(spec)} or {False}
    if len(kinds) > 1:
        raise ValueError(
            f"{_name(spec)!r} quantizes K before RoPE in some layers only; a preset file holds K statistics of one "
            "kind: write prerope+ in every part or in none"
        )
    return kinds.pop()


def equalized_kinds(spec: str | CacheSpec) -> set[Kind]:
    """``{"k", "v"}`` or part of it: where some part of ``spec`` has ``eq+`` or ``eqd+`` (its file must hold those)."""
    kinds: set[Kind] = set()
    for part in _parts(spec):
        if find_wrapper(part.k, Equalized) is not None:
            kinds.add("k")
        if find_wrapper(part.v, Equalized) is not None:
            kinds.add("v")
    return kinds


def diagonal_equalizers(spec: str | CacheSpec, kind: Kind) -> bool:
    """True if ``spec``'s ``kind`` transforms are ``eqd+``'s (diagonal), False if ``eq+``'s (dense).

    Raises:
        ValueError: some parts of a per-layer spec write ``eq+`` and others ``eqd+`` on ``kind``: a file holds
            transforms of one kind.
    """
    found = set()
    for part in _parts(spec):
        eq = find_wrapper(part.k if kind == "k" else part.v, Equalized)
        if eq is not None:
            found.add(isinstance(eq, DiagonalEqualized))
    if len(found) > 1:
        raise ValueError(
            f"{_name(spec)!r} writes eq+ in some layers and eqd+ in others on {kind.upper()}; a preset file holds "
            "transforms of one kind: write the same one in every part"
        )
    return found == {True}


def write_preset_file(path: str | Path, lm: LoadedModel, preset: Preset, stats: KVStats, note: str = "") -> Basis:
    """Write the calibration file of ``preset`` for ``lm``: the K mean in the basis its spec needs
    (and the ``eq+`` K / V transforms where its spec has ``eq+``).

    The GGUF holds llama.cpp's ``kv_bar.blk.<il>.k`` tensors and, under ``walshkv.``, the model,
    the calibration text and the preset's name and spec (``walshkv.preset.name/spec/budget``).

    Returns:
        The basis written (``rot`` or ``plain``).
    """
    basis = k_mean_basis(preset.spec)
    pre = k_pre_rope(preset.spec)
    k_stats = stats.pre_rope() if pre else stats
    mean = torch.stack([k_stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    kinds = equalized_kinds(preset.spec)
    k_eq = k_stats.equalizers("k", diagonal_equalizers(preset.spec, "k")) if "k" in kinds else None
    v_eq = stats.equalizers("v", diagonal_equalizers(preset.spec, "v")) if "v" in kinds else None
    extra = {Keys.Preset.NAME: preset.name, Keys.Preset.SPEC: preset.spec, Keys.Preset.BUDGET: f"{preset.budget:g}"}
    if note:
        extra[Keys.Preset.NOTE] = note
    rope = None
    if pre:
        assert stats.rope_inv_freq is not None and stats.rope_scaling is not None  # pre_rope() above checked
        rope = (stats.rope_inv_freq, stats.rope_scaling)
    write_kv_mean_center(
        path,
        mean,
        arch=lm.shape.arch,
        basis=basis,
        tokens=stats.tokens,
        text=stats.text,
        model=lm.name,
        model_config=stats.model_config,
        extra=extra,
        k_equalizer=k_eq,
        v_equalizer=v_eq,
        rope=rope,
    )
    return basis
