"""Named presets a user picks by bit budget: ``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5``.

A preset is a cache spec whose bits per element (K and V together, every scale and norm counted)
fit its budget at every head size walshkv supports, plus the calibration it needs (a K mean:
``walshkv calibrate --preset NAME``). The built-in choice of spec was made by measurement on
calibration text, never on the evaluation text (``walshkv recommend`` on each model; the runs are
in docs/presets.md). ``walshkv recommend --bits B`` (:mod:`walshkv.recommend`) repeats that choice for a
model of your own and writes the winner into a calibration file; a file that names a spec for a preset
overrides the built-in one, for the model it was made on only.

This module holds the table and its resolution only; the search lives in :mod:`walshkv.recommend`.

Example:
    >>> resolve_preset("walshkv:4.5").spec  # doctest: +SKIP
    'center+tq:5/tq:3.5'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from walshkv.codecs import parse_cache_spec
from walshkv.codecs.base import find_wrapper
from walshkv.codecs.builtin_presets import BUILTIN, PRESET_BUDGETS, check_preset_name
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
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
    "PRESET_BUDGETS",
    "Preset",
    "candidates_for",
    "equalized_kinds",
    "is_preset",
    "k_mean_basis",
    "k_pre_rope",
    "preset_name_for_bits",
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
        source: ``built-in`` or the calibration file that chose the spec.
    """

    name: str
    budget: float
    spec: str
    source: str = "built-in"


def is_preset(text: object) -> bool:
    """Whether ``text`` names a preset (``walshkv:...``)."""
    return isinstance(text, str) and text.strip().lower().startswith("walshkv:")


def preset_name_for_bits(bits: float) -> str:
    """``walshkv:B`` for a budget ``B`` (any positive number; the built-in ones are 3, 3.5 and 4.5)."""
    if not bits > 0:
        raise ValueError(f"a bit budget must be positive, got {bits}")
    return f"walshkv:{bits:g}"


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


def resolve_preset(name: str, calibration: CalibrationLike | None = None) -> Preset:
    """The spec behind a preset name.

    Args:
        name: a preset name.
        calibration: a calibration file (:class:`~walshkv.export.KMeanBias`) or statistics; if it was
            written by ``walshkv recommend``/``calibrate --preset`` for this preset name, its spec wins.

    Raises:
        ValueError: unknown preset names (the message lists them).
    """
    file = _preset_file(calibration)
    meta = file.meta if file is not None else {}
    if str(meta.get(Keys.Preset.NAME, "")).lower() == name.strip().lower() and meta.get(Keys.Preset.SPEC):
        key = name.strip().lower()
        budget = PRESET_BUDGETS.get(key) or float(key.split(":", 1)[1])
        source = str(getattr(calibration, "source", "file"))
        return Preset(key, budget, meta[Keys.Preset.SPEC], source=source)
    key = check_preset_name(name)
    return Preset(key, PRESET_BUDGETS[key], BUILTIN[key])


def resolve_specs(
    codecs: Sequence[str], calibration: CalibrationLike | None = None
) -> tuple[list[str], dict[str, str]]:
    """Replace preset names by their specs.

    Returns:
        ``(specs, presets)``: the specs in order, and ``{spec: preset name}`` for the replaced ones.
    """
    out, names = [], {}
    for c in codecs:
        if is_preset(c):
            p = resolve_preset(c, calibration)
            out.append(p.spec)
            names[p.spec] = p.name
        else:
            out.append(c)
    return out, names


def candidates_for(
    bits: float, head_dim: int, extra: Sequence[str] = (), num_layers: int | None = None, ctx: int = CTX
) -> list[str]:
    """Candidate specs whose bits per element at ``head_dim`` fit ``bits``, most bits first.

    The built-in list of the nearest budget at or below ``bits`` (3, 3.5 or 4.5) is used, with its
    preset's spec, plus ``extra``. A per-layer (``layers:``) spec needs ``num_layers``. A ``sink:N:``
    spec's fp16 tokens are counted over a context of ``ctx`` tokens (the windows it is measured on).

    Returns:
        Canonical spec strings (what result rows and preset files name).
    """
    pool: list[str] = [*extra]
    budgets = [b for b in CANDIDATES if b <= bits + 1e-9]
    if budgets:
        budget = max(budgets)
        pool.extend(CANDIDATES[budget])
        pool.extend(spec for name, spec in BUILTIN.items() if PRESET_BUDGETS[name] == budget)
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
    """``{"k", "v"}`` or part of it: where some part of ``spec`` has ``eq+`` (its file must hold those)."""
    kinds: set[Kind] = set()
    for part in _parts(spec):
        if find_wrapper(part.k, Equalized) is not None:
            kinds.add("k")
        if find_wrapper(part.v, Equalized) is not None:
            kinds.add("v")
    return kinds


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
    k_eq = k_stats.equalizers("k") if "k" in kinds else None
    v_eq = stats.equalizers("v") if "v" in kinds else None
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
        extra=extra,
        k_equalizer=k_eq,
        v_equalizer=v_eq,
        rope=rope,
    )
    return basis
