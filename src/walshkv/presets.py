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

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from walshkv.codecs.base import find_wrapper
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.prerope import PreRope

__all__ = [
    "BUILTIN",
    "CANDIDATES",
    "PRESET_BUDGETS",
    "LayerPlan",
    "Preset",
    "Recommendation",
    "allocate_layers",
    "candidates_for",
    "equalized_kinds",
    "is_preset",
    "k_mean_basis",
    "preset_name_for_bits",
    "recommend",
    "resolve_preset",
    "resolve_specs",
    "shift_width",
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


def candidates_for(
    bits: float, head_dim: int, extra: Sequence[str] = (), num_layers: int | None = None, ctx: int = 512
) -> list[str]:
    """Candidate specs whose bits per element at ``head_dim`` fit ``bits``, most bits first.

    The built-in list of the nearest budget at or below ``bits`` (3, 3.5 or 4.5) is used, with its
    preset's spec, plus ``extra``. A per-layer (``layers:``) spec needs ``num_layers``. A ``sink:N:``
    spec's fp16 tokens are counted over a context of ``ctx`` tokens (the windows it is measured on).
    """
    from walshkv.codecs import parse_cache_spec
    from walshkv.codecs.spec import CacheSpec, LayeredCacheSpec

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


def k_mean_basis(spec: str) -> str:
    """The basis a spec's K mean is subtracted in: ``rot`` for ``center+rot+...``, else ``plain``."""
    from walshkv.codecs import parse_cache_spec
    from walshkv.codecs.spec import LayeredCacheSpec

    parsed = parse_cache_spec(spec)
    parts = [p for p, _ in parsed.parts] if isinstance(parsed, LayeredCacheSpec) else [parsed]
    bases = {p.k.basis if isinstance(p.k, Centered) else "plain" for p in parts}
    if len(bases) > 1:
        raise ValueError(
            f"{spec!r} centers K in different bases per layer ({', '.join(sorted(bases))}); a preset file holds one "
            "K mean basis: use the same K wrapper (center+ or center+rot+) in every part"
        )
    return bases.pop()


def k_pre_rope(spec: str) -> bool:
    """True if ``spec`` quantizes K before RoPE (``prerope+``); every part of a per-layer spec must agree."""
    from walshkv.codecs import parse_cache_spec
    from walshkv.codecs.spec import LayeredCacheSpec

    parsed = parse_cache_spec(spec)
    parts = [p for p, _ in parsed.parts] if isinstance(parsed, LayeredCacheSpec) else [parsed]
    kinds = {isinstance(p.k, PreRope) for p in parts}
    if len(kinds) > 1:
        raise ValueError(
            f"{spec!r} quantizes K before RoPE in some layers only; a preset file holds K statistics of one kind: "
            "write prerope+ in every part or in none"
        )
    return kinds.pop()


def equalized_kinds(spec: str) -> set[str]:
    """``{"k", "v"}`` or part of it: where some part of ``spec`` has ``eq+`` (its file must hold those)."""
    from walshkv.codecs import parse_cache_spec
    from walshkv.codecs.spec import LayeredCacheSpec

    parsed = parse_cache_spec(spec)
    parts = [p for p, _ in parsed.parts] if isinstance(parsed, LayeredCacheSpec) else [parsed]
    kinds: set[str] = set()
    for part in parts:
        for kind, codec in (("k", part.k), ("v", part.v)):
            if find_wrapper(codec, Equalized) is not None:
                kinds.add(kind)
    return kinds


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
        plan: the per-layer allocation (``per_layer=True``), else ``None``.
    """

    preset: Preset
    rows: list[dict[str, Any]]
    meta: dict[str, Any]
    stats: Any
    plan: LayerPlan | None = None


def recommend(
    lm: Any,
    text: Any,
    bits: float,
    *,
    windows: int = 4,
    ctx: int = 512,
    calib_tokens: int = 8192,
    extra: Sequence[str] = (),
    per_layer: bool = False,
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
        per_layer: then move widths between layers (:func:`allocate_layers`, from the best uniform ``tq``
            candidate, on the same selection windows), spending any bits it leaves unused, and keep the
            result if it beats the uniform winner.
        progress: progress bars.
    """
    from walshkv.calibration import collect_kv_stats
    from walshkv.eval import evaluate

    head_dim = lm.info["head_dim"]
    specs = candidates_for(bits, head_dim, extra, lm.info["layers"], ctx=ctx)
    calib, select = split_text(text)
    stats = collect_kv_stats(lm, calib, tokens=calib_tokens, ctx=ctx, progress=progress)
    result = evaluate(lm, select, specs, ctx=ctx, windows=windows, calibration=stats, progress=progress)
    rows = sorted(result.results, key=lambda r: (r["kld_mean"], r["bits_per_element"]))
    name = preset_name_for_bits(bits)
    winner, plan = rows[0]["codec"], None
    if per_layer:  # from the best candidate whose widths can move (tq), which need not be the winner
        movable = [r["codec"] for r in rows if _movable(r["codec"])]
        if movable:
            plan = allocate_layers(
                lm, select, stats, movable[0], windows=windows, ctx=ctx, budget=bits, progress=progress
            )
        if plan is not None and plan.spec != plan.base:
            rows = sorted([*rows, *(r for r in plan.rows if r["codec"] == plan.spec)], key=lambda r: r["kld_mean"])
            winner = rows[0]["codec"]
    return Recommendation(Preset(name, bits, winner, source="recommend"), rows, result.meta, stats, plan)


_TQ_WIDTH = re.compile(r"^(?P<head>(?:.*\+)?tq:)(?P<bits>\d+(?:\.\d+)?)$")


def shift_width(codec_spec: str, delta: float) -> str | None:
    """``codec_spec`` with its ``tq`` width moved by ``delta`` bits (``center+tq:4`` -> ``center+tq:4.5``).

    Returns ``None`` if the spec is not a (wrapped) ``tq:B`` or the new width is not a ``tq`` width.
    """
    from walshkv.codecs.turbo import TQ_BITS

    m = _TQ_WIDTH.match(codec_spec)
    if m is None:
        return None
    bits = float(m["bits"]) + delta
    if bits not in TQ_BITS:
        return None
    return f"{m['head']}{bits:g}"


def _movable(spec: str) -> bool:
    from walshkv.codecs import parse_cache_spec
    from walshkv.codecs.spec import LayeredCacheSpec

    parsed = parse_cache_spec(spec)
    if isinstance(parsed, LayeredCacheSpec):  # moves start from one uniform spec (a sink:N: one included)
        return False
    return shift_width(parsed.k.spec, 0) is not None and shift_width(parsed.v.spec, 0) is not None


@dataclass
class LayerPlan:
    """What :func:`allocate_layers` measured and chose.

    Attributes:
        spec: the chosen spec: a ``layers:...`` spec, or ``base`` if no move paid off.
        base: the uniform spec the moves start from.
        moves: one dict per measured single-layer move: ``layer``, ``kind`` (``k``/``v``), ``delta``
            (bits), ``spec`` and ``kld_change`` (mean KLD of the move minus the base's).
        chosen: the moves applied: pairs of a +step and a -step (the budget unchanged), then, with a
            ``budget``, single raises that spend the bits the base left unused.
        rows: the evaluation rows of the final check (base and chosen spec), best first.
    """

    spec: str
    base: str
    moves: list[dict[str, Any]]
    chosen: list[dict[str, Any]]
    rows: list[dict[str, Any]]


def _layered(base_k: str, base_v: str, widths: dict[int, tuple[str, str]], num_layers: int, sink: int = 0) -> str:
    """``layers:`` spec for per-layer (K, V) codec specs; layers not in ``widths`` keep the base."""
    groups: dict[tuple[str, str], list[int]] = {}
    for layer in range(num_layers):
        groups.setdefault(widths.get(layer, (base_k, base_v)), []).append(layer)
    base = (base_k, base_v)
    prefix = f"sink:{sink}:" if sink else ""
    if set(groups) == {base}:
        return f"{prefix}{base_k}/{base_v}"
    parts = [f"{k}/{v}@{','.join(str(i) for i in layers)}" for (k, v), layers in groups.items() if (k, v) != base]
    from walshkv.codecs import parse_cache_spec

    return parse_cache_spec(prefix + "layers:" + ";".join([*parts, f"{base_k}/{base_v}"])).spec  # canonical


def allocate_layers(
    lm: Any,
    select: Any,
    stats: Any,
    base: str,
    *,
    step: float = 0.5,
    windows: int = 4,
    ctx: int = 512,
    budget: float | None = None,
    progress: bool = True,
) -> LayerPlan | None:
    """Per-layer widths at the same budget: move ``step`` bits from insensitive layers to sensitive ones.

    For every layer and for K and V separately, the base spec is measured with that one layer's width
    raised and lowered by ``step`` (``2 x 2 x layers`` runs on ``select``, the selection half of the
    calibration text). Moves are then paired greedily, the largest KLD gain of a raise with the
    smallest KLD loss of a lowering, while the gain exceeds the loss; each pair keeps the bits per
    element unchanged (every layer holds the same number of elements). Assuming the layers' effects
    add up, which the final check tests: the chosen spec and the base are evaluated together and the
    better one is kept. With a ``budget``, the bits the base leaves unused (``tq``'s half-bit widths
    rarely fill a budget exactly, and a ``sink:N:`` base counts its fp16 tokens over ``ctx``) go to the
    remaining raises that gained most, as many as fit.

    Args:
        lm: the loaded model.
        select: selection text (never the evaluation text).
        stats: calibration statistics for ``center+`` (from the other half of the calibration text).
        base: a uniform spec whose K and V are (wrapped) ``tq:B`` codecs, e.g. ``center+tq:4/tq:2.5``
            (``sink:N:`` allowed: every spec built from it keeps the sink).
        step: bits per move.
        windows, ctx: selection windows.
        budget: bits per element the result may use (at ``ctx`` tokens); ``None``: only paired moves.
        progress: progress bars.

    Returns:
        The plan, or ``None`` if ``base`` has no ``tq`` widths to move.
    """
    from walshkv.codecs import parse_cache_spec
    from walshkv.eval import evaluate

    parsed = parse_cache_spec(base)
    base_k, base_v = parsed.k.spec, parsed.v.spec  # type: ignore[union-attr]
    if shift_width(base_k, 0) is None or shift_width(base_v, 0) is None:
        return None
    sink = getattr(parsed, "sink", 0)
    num_layers = lm.info["layers"]
    moves: list[dict[str, Any]] = []
    for layer in range(num_layers):
        for kind, own in (("k", base_k), ("v", base_v)):
            for delta in (step, -step):
                moved = shift_width(own, delta)
                if moved is None:
                    continue
                k, v = (moved, base_v) if kind == "k" else (base_k, moved)
                spec = _layered(base_k, base_v, {layer: (k, v)}, num_layers, sink)
                moves.append({"layer": layer, "kind": kind, "delta": delta, "spec": spec})
    specs = [_layered(base_k, base_v, {}, num_layers, sink), *(m["spec"] for m in moves)]
    result = evaluate(lm, select, specs, ctx=ctx, windows=windows, calibration=stats, progress=progress)
    kld = [r["kld_mean"] for r in result.results]  # in the order of specs
    for m, value in zip(moves, kld[1:], strict=True):
        m["kld_change"] = value - kld[0]
    ups = sorted((m for m in moves if m["delta"] > 0), key=lambda m: m["kld_change"])  # most negative first
    downs = sorted((m for m in moves if m["delta"] < 0), key=lambda m: m["kld_change"])  # smallest loss first
    used: set[tuple[int, str]] = set()
    chosen: list[dict[str, Any]] = []
    di = 0
    for up in ups:
        if (up["layer"], up["kind"]) in used:
            continue
        while di < len(downs) and (downs[di]["layer"], downs[di]["kind"]) in used | {(up["layer"], up["kind"])}:
            di += 1
        if di >= len(downs) or -up["kld_change"] <= downs[di]["kld_change"]:
            break
        down = downs[di]
        di += 1
        chosen += [up, down]
        used |= {(up["layer"], up["kind"]), (down["layer"], down["kind"])}

    def build(applied: list[dict[str, Any]]) -> str:
        widths: dict[int, list[str]] = {}
        for m in applied:
            pair = widths.setdefault(m["layer"], [base_k, base_v])
            i = 0 if m["kind"] == "k" else 1
            pair[i] = shift_width(pair[i], m["delta"]) or pair[i]
        return _layered(base_k, base_v, {k: (a, b) for k, (a, b) in widths.items()}, num_layers, sink)

    if budget is not None:  # spend what the base leaves unused on the best remaining raises
        head_dim = lm.info["head_dim"]
        for up in ups:
            if up["kld_change"] >= 0:
                break
            if (up["layer"], up["kind"]) in used:
                continue
            trial = build([*chosen, up])
            if parse_cache_spec(trial).bits_at(head_dim, ctx, num_layers) <= budget + 1e-9:  # type: ignore[union-attr]
                chosen.append(up)
                used.add((up["layer"], up["kind"]))
    plan_spec = build(chosen)
    rows = list(result.results[:1])
    if plan_spec != specs[0]:
        check = evaluate(lm, select, [plan_spec], ctx=ctx, windows=windows, calibration=stats, progress=progress)
        rows = sorted([*rows, *check.results], key=lambda r: r["kld_mean"])
    best = rows[0]["codec"]
    spec = plan_spec if best == plan_spec else specs[0]
    return LayerPlan(spec, specs[0], moves, chosen, rows)


def write_preset_file(path: Any, lm: Any, preset: Preset, stats: Any, note: str = "") -> str:
    """Write the calibration file of ``preset`` for ``lm``: the K mean in the basis its spec needs
    (and the ``eq+`` K / V transforms where its spec has ``eq+``).

    The GGUF holds llama.cpp's ``kv_bar.blk.<il>.k`` tensors and, under ``walshkv.``, the model,
    the calibration text and the preset's name and spec (``walshkv.preset.name/spec/budget``).

    Returns:
        The basis written (``rot`` or ``plain``).
    """
    import torch

    from walshkv.export import write_kv_mean_center

    basis = k_mean_basis(preset.spec)
    pre = k_pre_rope(preset.spec)
    k_stats = stats.pre_rope() if pre else stats
    mean = torch.stack([k_stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    kinds = equalized_kinds(preset.spec)
    k_eq = k_stats.equalizers("k") if "k" in kinds else None
    v_eq = stats.equalizers("v") if "v" in kinds else None
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
        k_equalizer=k_eq,
        v_equalizer=v_eq,
        rope=(stats.rope_inv_freq, stats.rope_scaling) if pre else None,
    )
    return basis
