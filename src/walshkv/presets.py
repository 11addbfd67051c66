"""Named presets a user picks by bit budget: ``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5``.

A preset is a cache spec whose bits per element (K and V together, every scale and norm counted)
fit its budget at every head size walshkv supports, plus the calibration it needs (a K mean:
``walshkv calibrate --preset NAME``). The built-in choice of spec was made by measurement on
calibration text, never on the evaluation text (``walshkv recommend`` on each model; the runs are
in docs/presets.md). ``walshkv recommend --bits B`` repeats that choice for a model of your own
and writes the winner into a calibration file; a file that names a spec for a preset overrides the
built-in one, for the model it was made on only.

Example:
    >>> resolve_preset("walshkv:4.5").spec  # doctest: +SKIP
    'center+tq:5/tq:3.5'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUILTIN",
    "CANDIDATES",
    "PRESET_BUDGETS",
    "Preset",
    "Recommendation",
    "candidates_for",
    "is_preset",
    "k_mean_basis",
    "preset_name_for_bits",
    "recommend",
    "resolve_preset",
    "resolve_specs",
    "split_text",
    "write_preset_file",
]

PRESET_BUDGETS: dict[str, float] = {"walshkv:3": 3.0, "walshkv:3.5": 3.5, "walshkv:4.5": 4.5}

# The built-in spec of each preset: the winner on smollm2-135m of `walshkv recommend --text python-docs
# --windows 8 --bits B` (K mean from the first half of python-docs, 8 windows of its second half);
# other models may choose another (a preset file records it). With the default 4 windows, 4.5 bits
# picks center+rot+iq4_nl/rot+iq4_nl by a hair (docs/presets.md shows both on the evaluation text).
BUILTIN: dict[str, str] = {
    "walshkv:3": "center+tq:3.5/tq:2",
    "walshkv:3.5": "center+tq:4/tq:2.5",
    "walshkv:4.5": "center+tq:5/tq:3.5",
}

# What `walshkv recommend` tries, by budget; specs over the budget at the model's head_dim are dropped.
# K gets more bits than V in most: K is the sensitive half on every model measured.
CANDIDATES: dict[float, tuple[str, ...]] = {
    3.0: (
        "center+tq:3.5/tq:2",
        "center+tq:3/tq:2.5",
        "center+rot+int3/tq:2.5",
        "center+tq:2.5/tq:3",
    ),
    3.5: (
        "center+tq:4/tq:2.5",
        "center+rot+int4/tq:2.5",
        "center+tq:3.5/tq:3",
        "center+tq:3/tq:3.5",
        "center+tq:3/tq:3",
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
    ),
}

_FILE_NAME = "walshkv.preset.name"
_FILE_SPEC = "walshkv.preset.spec"


@dataclass(frozen=True)
class Preset:
    """A resolved preset.

    Attributes:
        name: ``walshkv:3``, ``walshkv:3.5`` or ``walshkv:4.5``.
        budget: bits per element for K and V together.
        spec: the cache spec it stands for.
        source: ``built-in`` or the calibration file that chose the spec.
    """

    name: str
    budget: float
    spec: str
    source: str = "built-in"


def is_preset(text: Any) -> bool:
    """Whether ``text`` names a preset (``walshkv:...``)."""
    return isinstance(text, str) and text.strip().lower().startswith("walshkv:")


def _check_name(name: str) -> str:
    key = name.strip().lower()
    if key not in PRESET_BUDGETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_BUDGETS)}")
    return key


def preset_name_for_bits(bits: float) -> str:
    """``walshkv:B`` for a budget ``B`` (any positive number; the built-in ones are 3, 3.5 and 4.5)."""
    if not bits > 0:
        raise ValueError(f"a bit budget must be positive, got {bits}")
    return f"walshkv:{bits:g}"


def resolve_preset(name: str, calibration: Any = None) -> Preset:
    """The spec behind a preset name.

    Args:
        name: a preset name.
        calibration: a calibration file (:class:`~walshkv.export.KMeanBias`) or statistics; if it was
            written by ``walshkv recommend``/``calibrate --preset`` for this preset name, its spec wins.

    Raises:
        ValueError: unknown preset names (the message lists them).
    """
    meta = _file_meta(calibration)
    if meta.get(_FILE_NAME, "").lower() == name.strip().lower() and meta.get(_FILE_SPEC):
        key = name.strip().lower()
        budget = PRESET_BUDGETS.get(key) or float(key.split(":", 1)[1])
        return Preset(key, budget, meta[_FILE_SPEC], source=str(getattr(calibration, "source", "file")))
    key = _check_name(name)
    return Preset(key, PRESET_BUDGETS[key], BUILTIN[key])


def _file_meta(calibration: Any) -> dict[str, Any]:
    for obj in (calibration, getattr(calibration, "bias", None)):
        meta = getattr(obj, "meta", None)
        if isinstance(meta, dict):
            return meta
    return {}


def resolve_specs(codecs: Sequence[str], calibration: Any = None) -> tuple[list[str], dict[str, str]]:
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


def candidates_for(bits: float, head_dim: int, extra: Sequence[str] = ()) -> list[str]:
    """Candidate specs whose bits per element at ``head_dim`` fit ``bits``, most bits first.

    The built-in list of the nearest budget at or below ``bits`` (3, 3.5 or 4.5) is used, with its
    preset's spec, plus ``extra``.
    """
    from walshkv.codecs import parse_cache_spec

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
        b = parsed.bits_per_element(head_dim)
        if b <= bits + 1e-9:
            fits.setdefault(parsed.spec, b)
    if not fits:
        raise ValueError(f"no candidate spec fits {bits} bits per element at head_dim {head_dim}")
    return sorted(fits, key=lambda s: -fits[s])


def k_mean_basis(spec: str) -> str:
    """The basis a spec's K mean is subtracted in: ``rot`` for ``center+rot+...``, else ``plain``."""
    from walshkv.codecs import parse_cache_spec

    k = parse_cache_spec(spec).k
    return getattr(k, "basis", "plain") if getattr(k, "is_centering", False) else "plain"


def split_text(text: Any) -> tuple[Any, Any]:
    """Cut a calibration text in two by characters: ``(T[calib], T[select])``.

    ``recommend`` takes the K mean from the first half and ranks candidates on the second, so the
    choice is never scored on the text its statistics came from (nor on any evaluation text).
    """
    from walshkv.data import Text

    half = len(text.content) // 2
    return (
        Text(f"{text.name}[calib]", text.source, text.content[:half]),
        Text(f"{text.name}[select]", text.source, text.content[half:]),
    )


@dataclass
class Recommendation:
    """What :func:`recommend` measured and chose.

    Attributes:
        preset: the winner as a preset for this model.
        rows: one result row per candidate (as :func:`walshkv.eval.evaluate` returns them), best first.
        meta: the evaluation's meta (model, selection text, windows, ...).
        stats: the K/V statistics of the calibration half (the K mean the file stores).
    """

    preset: Preset
    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    stats: Any


def recommend(
    lm: Any,
    text: Any,
    bits: float,
    *,
    windows: int = 4,
    ctx: int = 512,
    calib_tokens: int = 8192,
    extra: Sequence[str] = (),
    progress: bool = True,
) -> Recommendation:
    """Run the candidate specs that fit ``bits`` on calibration text and pick the lowest mean KLD.

    Args:
        lm: the loaded model.
        text: calibration text: its first half gives the K mean, its second half ranks the candidates.
            Never pass the text you will evaluate on.
        bits: the budget in bits per element (K and V together).
        windows, ctx: selection windows of the second half.
        calib_tokens: tokens of the first half for the statistics.
        extra: more candidate specs (kept if they fit the budget).
        progress: progress bars.
    """
    from walshkv.calibration import collect_kv_stats
    from walshkv.eval import evaluate

    head_dim = lm.info["head_dim"]
    specs = candidates_for(bits, head_dim, extra)
    calib, select = split_text(text)
    stats = collect_kv_stats(lm, calib, tokens=calib_tokens, ctx=ctx, progress=progress)
    result = evaluate(lm, select, specs, ctx=ctx, windows=windows, calibration=stats, progress=progress)
    rows = sorted(result.results, key=lambda r: (r["kld_mean"], r["bits_per_element"]))
    name = preset_name_for_bits(bits)
    return Recommendation(Preset(name, bits, rows[0]["codec"], source="recommend"), rows, result.meta, stats)


def write_preset_file(path: Any, lm: Any, preset: Preset, stats: Any, note: str = "") -> str:
    """Write the calibration file of ``preset`` for ``lm``: the K mean in the basis its spec needs.

    The GGUF holds llama.cpp's ``kv_bar.blk.<il>.k`` tensors and, under ``walshkv.``, the model,
    the calibration text and the preset's name and spec (``walshkv.preset.name/spec/budget``).

    Returns:
        The basis written (``rot`` or ``plain``).
    """
    import torch

    from walshkv.export import write_kv_mean_center

    basis = k_mean_basis(preset.spec)
    mean = torch.stack([stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    extra = {_FILE_NAME: preset.name, _FILE_SPEC: preset.spec, "walshkv.preset.budget": f"{preset.budget:g}"}
    if note:
        extra["walshkv.preset.note"] = note
    write_kv_mean_center(
        path,
        mean,
        arch=lm.info["arch"],
        basis=basis,
        tokens=stats.tokens,
        text=stats.text,
        model=lm.name,
        extra=extra,
    )
    return basis
