"""The preset search behind ``walshkv recommend``: rank the candidate specs of a budget on calibration text.

``recommend`` takes a K mean from the first half of a calibration text and ranks the candidates of
:func:`candidates_for` on its second half (never on an evaluation text); with
``per_layer=True``, :func:`allocate_layers` then moves ``tq`` widths between layers. Specs travel as
:class:`~walshkv.codecs.spec.CacheSpec` objects; their canonical strings appear only where a spec leaves the
search: result rows, :class:`LayerPlan` (written to JSON), the chosen :class:`~walshkv.presets.Preset`.

Example:
    >>> rec = recommend(load_model(), load_text(), 3.5)  # doctest: +SKIP
    >>> rec.preset.spec  # doctest: +SKIP
    'center+tq:4/tq:2.5'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from walshkv.calibration import KVStats, collect_kv_stats
from walshkv.codecs import parse_cache_spec, parse_codec
from walshkv.codecs.base import Codec, rewrap, unwrap
from walshkv.codecs.spec import CacheSpec, LayeredCacheSpec
from walshkv.codecs.turbo import TQ_BITS, TurboQuant
from walshkv.data import Text
from walshkv.defaults import CALIB_TOKENS, CTX, RECOMMEND_WINDOWS
from walshkv.eval.sweep import EvalJob, evaluate_specs
from walshkv.presets import BUILTIN, PRESET_BUDGETS, Preset, dense_key_map, key_work, preset_name_for_bits

if TYPE_CHECKING:
    from walshkv.constants import Kind
    from walshkv.eval.sweep import Executor
    from walshkv.models import LoadedModel

__all__ = [
    "CANDIDATES",
    "LayerPlan",
    "Recommendation",
    "allocate_layers",
    "block_candidate",
    "candidates_for",
    "fast_candidate",
    "recommend",
    "shift_codec",
    "shift_width",
    "split_text",
]

# What `walshkv recommend` tries, by budget; specs over the budget at the model's head_dim are dropped
# (sink:1: specs counted over the selection windows' length: their fp16 token costs (16 - b) / 512 bits
# at 512 tokens, so they fit where the plain spec leaves room, e.g. tq's fp16 norm at head_dim 128).
# K gets more bits than V in most: K is the sensitive half on every model measured. eq+ (a calibrated
# query-weighted K transform) joins the best plain specs; it pays most beside a sink (the first token's
# K lies where the transform, fitted to the typical token, amplifies error). prerope+ (K quantized before
# RoPE, so that center+ removes a channel's whole offset) joins the eq+ ones.
CANDIDATES: dict[float, tuple[str, ...]] = {
    2.5: (
        "center+tq:3/tq:1.5",
        "center+tq:2.5/tq:2",
        "center+tcq:3/tcq:1.5",
        "center+tcq:2.5/tcq:2",
        "center+eq+tcq:2.5/tcq:2",
        "prerope+center+eq+tq:2.5/tq:2",
        "prerope+center+eq+tcq:2.5/tcq:2",
        "prerope+center+eq+tcq:3/tcq:1.5",
        "sink:1:prerope+center+eq+tcq:2.5/tcq:2",
        "sink:1:prerope+center+eq+tcq:3/tcq:1.5",
    ),
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
        "prerope+center+eq+tcq:3.5/tcq:2",
        "prerope+center+eq+tcq:3/tcq:2.5",
        "sink:1:prerope+center+eq+tcq:3.5/tcq:2",
        "sink:1:prerope+center+eq+tcq:3/tcq:2.5",
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
        "prerope+center+eq+tcq:4/tcq:2.5",
        "prerope+center+eq+tcq:3.5/tcq:3",
        "sink:1:prerope+center+eq+tcq:3.5/tcq:3",
        "sink:1:prerope+center+eq+tcq:4/tcq:2.5",
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
        "prerope+center+eq+tcq:5/tcq:3.5",
        "prerope+center+eq+tcq:4.5/tcq:4",
        "sink:1:prerope+center+eq+tcq:4/tcq:4",
        "sink:1:prerope+center+eq+tcq:5/tcq:3.5",
    ),
}


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


#: The block the block-frame twins use (``ropeblock:64+eqr:64+``): chosen on Emma, the development text, among
#: 16, 64, 256 and 1024 (docs/long-context.md, "K in the block frame").
FRAME_BLOCK = 64


def block_candidate(spec: str, block: int = FRAME_BLOCK) -> str:
    """``spec`` with each ``prerope+`` K (and its ``center+`` and ``eq+``/``eqd+``) stored in the block frame instead:
    ``ropeblock:G+eqr:G+`` (:mod:`walshkv.codecs.blockrope`), the core codecs, ``sink:N:`` and per-layer widths kept.
    Decoded without a per-key map (the query is turned and mapped once per block of ``G`` keys). Specs without
    ``prerope+`` come back unchanged."""
    frame = f"ropeblock:{block}+"
    out = spec
    for old, new in (
        ("prerope+center+eqd+", f"{frame}eqr:{block}+"),
        ("prerope+center+eq+", f"{frame}eqr:{block}+"),
        ("prerope+eqd+", f"{frame}eqr:{block}+"),
        ("prerope+eq+", f"{frame}eqr:{block}+"),
        ("prerope+center+", frame),
        ("prerope+", frame),
    ):
        out = out.replace(old, new)
    return out if out == spec else parse_cache_spec(out).spec


def candidates_for(
    bits: float,
    head_dim: int,
    extra: Sequence[str] = (),
    num_layers: int | None = None,
    ctx: int = CTX,
    fast: bool = False,
    builtin: bool = True,
    max_key_work: float | None = None,
    group: int = 1,
) -> list[str]:
    """Candidate specs whose bits per element at ``head_dim`` fit ``bits``, most bits first.

    The built-in list of the nearest budget at or below ``bits`` (3, 3.5 or 4.5) is used, with its
    preset's spec, plus ``extra``. A per-layer (``layers:``) spec needs ``num_layers``. A ``sink:N:``
    spec's fp16 tokens are counted over a context of ``ctx`` tokens (the windows it is measured on).
    With ``fast`` (the ``walshkv:B-fast`` presets), each built-in candidate whose keys the kernels would map by
    a dense matrix per key (:func:`dense_key_map`) takes ``eqd+`` in place of ``eq+`` (:func:`fast_candidate`).
    With ``builtin=False`` only ``extra`` is ranked (a re-selection between named specs). With ``max_key_work``,
    only specs whose K transforms cost at most that many times plain attention's work per cached key
    (:func:`walshkv.presets.key_work` at ``head_dim`` and ``group`` query heads per kv head) are kept.

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
    budgets = [b for b in CANDIDATES if b <= bits + 1e-9] if builtin else []
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
        if max_key_work is not None and key_work(parsed, head_dim, group).ratio > max_key_work + 1e-9:
            continue
        if b <= bits + 1e-9:
            fits.setdefault(parsed.spec, b)
    if not fits:
        within = "" if max_key_work is None else f" with K transforms within {max_key_work:g}x the score work per key"
        raise ValueError(f"no candidate spec fits {bits} bits per element at head_dim {head_dim}{within}")
    return sorted(fits, key=lambda s: -fits[s])


#: One result row as :func:`walshkv.eval.evaluate` returns it (``row["codec"]`` is the canonical spec).
Row = dict[str, Any]


def split_text(text: Text) -> tuple[Text, Text]:
    """Cut a calibration text in two by characters: ``(T[calib], T[select])``.

    ``recommend`` takes the K mean from the first half and ranks candidates on the second, so the
    choice is never scored on the text its statistics came from (nor on any evaluation text).
    """
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
    rows: list[Row]
    meta: dict[str, Any]
    stats: KVStats
    plan: LayerPlan | None = None


def recommend(
    lm: LoadedModel,
    text: Text,
    bits: float,
    *,
    windows: int = RECOMMEND_WINDOWS,
    ctx: int = CTX,
    calib_tokens: int = CALIB_TOKENS,
    extra: Sequence[str] = (),
    per_layer: bool = False,
    fast: bool = False,
    builtin: bool = True,
    max_key_work: float | None = None,
    progress: bool = True,
    executor: Executor | None = None,
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
        fast: choose the fast preset (``walshkv:B-fast``): only candidates the fused kernels decode without a
            dense per-key matrix (:func:`candidates_for` with ``fast``; ``eqd+`` in place of
            ``prerope+``'s ``eq+``).
        builtin: rank the built-in candidates of the budget with ``extra`` (default); ``False``: ``extra`` only.
        max_key_work: the work ceiling: only candidates whose K transforms cost at most this many times plain
            attention's work per cached key at the model's shape (:func:`walshkv.presets.key_work`); ``None``: any.
            Every row records its own (``key_work``).
        progress: progress bars.
        executor: where the candidates run (:class:`walshkv.eval.sweep.Executor`); ``None``: here, all in one
            evaluation. ``walshkv.integrations.ray.RayExecutor`` spreads them (and the per-layer moves) over a
            Ray cluster; the statistics are collected here and the choice is made here, on the same numbers.
    """
    d, group = lm.shape.head_dim, lm.shape.q_heads // lm.shape.kv_heads
    names = candidates_for(
        bits, d, extra, lm.shape.layers, ctx=ctx, fast=fast, builtin=builtin, max_key_work=max_key_work, group=group
    )
    specs = {s.spec: s for s in (parse_cache_spec(n) for n in names)}  # canonical string -> spec, in order
    calib, select = split_text(text)
    stats = collect_kv_stats(lm, calib, tokens=calib_tokens, ctx=ctx, progress=progress)
    job = EvalJob(tuple(specs.values()), select, ctx=ctx, windows=windows, calibration=stats)
    result = evaluate_specs(lm, job, executor, progress=progress)
    rows = sorted(result.results, key=lambda r: (r["kld_mean"], r["bits_per_element"]))
    winner, plan = rows[0]["codec"], None
    if per_layer:  # from the best candidate whose widths can move (tq), which need not be the winner
        movable = [specs[r["codec"]] for r in rows if _movable(specs[r["codec"]])]
        if movable:
            plan = allocate_layers(
                lm,
                select,
                stats,
                movable[0],
                windows=windows,
                ctx=ctx,
                budget=bits,
                progress=progress,
                executor=executor,
            )
        if plan is not None and plan.spec != plan.base:
            rows = sorted([*rows, *(r for r in plan.rows if r["codec"] == plan.spec)], key=lambda r: r["kld_mean"])
            winner = rows[0]["codec"]
    for row in rows:
        row["key_work"] = round(key_work(row["codec"], d, group).ratio, 4)
    preset = Preset(preset_name_for_bits(bits, fast), bits, winner, source="recommend")
    return Recommendation(preset, rows, result.meta, stats, plan)


def shift_codec(codec: Codec, delta: float) -> Codec | None:
    """``codec`` with its ``tq`` width moved by ``delta`` bits: the same wrapper chain around a wider or
    narrower :class:`~walshkv.codecs.turbo.TurboQuant` (same seed and codebook), rebuilt from the objects
    (:func:`dataclasses.replace` on the storing codec, :func:`~walshkv.codecs.base.rewrap` around it).

    Returns:
        The rebuilt codec (unbound for an unbound ``codec``), or ``None`` if ``codec`` does not store with ``tq``
        or the new width is not a ``tq`` width (``TQ_BITS``: 1 to 8 in half bits).
    """
    store = unwrap(codec)
    if not isinstance(store, TurboQuant):
        return None
    bits = store.bits + delta
    if bits not in TQ_BITS:
        return None
    return rewrap(codec, replace(store, bits=bits))


def shift_width(codec_spec: str, delta: float) -> str | None:
    """:func:`shift_codec` on a codec spec string: ``center+tq:4`` moved by 0.5 is ``center+tq:4.5``.

    Returns:
        The canonical spec, or ``None`` if the spec is not a (wrapped) ``tq:B`` or the new width is not a
        ``tq`` width.
    """
    moved = shift_codec(parse_codec(codec_spec), delta)
    return None if moved is None else moved.spec


def _movable(spec: object) -> bool:
    """A uniform (``sink:N:`` allowed) walshkv spec whose K and V both store with ``tq``."""
    if not isinstance(spec, CacheSpec) or isinstance(spec, LayeredCacheSpec):
        return False
    return shift_codec(spec.k, 0) is not None and shift_codec(spec.v, 0) is not None


@dataclass
class LayerPlan:
    """What :func:`allocate_layers` measured and chose (canonical spec strings: this is written to JSON).

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
    rows: list[Row]


def _layered(base: CacheSpec, widths: dict[int, tuple[Codec, Codec]], num_layers: int) -> CacheSpec:
    """``base`` with per-layer (K, V) codecs: a ``layers:`` spec (``base`` itself if ``widths`` is empty).

    Layers not in ``widths`` keep the base; layers whose codecs are the same objects share a part, in the
    order of their first layer, and the base part comes last (the canonical ``layers:`` form).
    """
    groups: list[tuple[Codec, Codec, list[int]]] = []
    for layer in range(num_layers):
        k, v = widths.get(layer, (base.k, base.v))
        for gk, gv, layers in groups:
            if gk is k and gv is v:
                layers.append(layer)
                break
        else:
            groups.append((k, v, [layer]))
    moved = [(CacheSpec(k, v), frozenset(layers)) for k, v, layers in groups if not (k is base.k and v is base.v)]
    if not moved:
        return base
    parts = (*moved, (CacheSpec(base.k, base.v), None))
    return LayeredCacheSpec(base.k, base.v, sink=base.sink, parts=parts)


def allocate_layers(
    lm: LoadedModel,
    select: Text,
    stats: KVStats,
    base: str | CacheSpec,
    *,
    step: float = 0.5,
    windows: int = RECOMMEND_WINDOWS,
    ctx: int = CTX,
    budget: float | None = None,
    progress: bool = True,
    executor: Executor | None = None,
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
        executor: where the moves run (see :func:`recommend`); ``None``: here, all in one evaluation.

    Returns:
        The plan, or ``None`` if ``base`` has no ``tq`` widths to move.
    """
    parsed = parse_cache_spec(base)
    if not _movable(parsed):
        return None
    assert isinstance(parsed, CacheSpec)
    uniform = CacheSpec(parsed.k, parsed.v, parsed.sink)
    num_layers = lm.shape.layers
    # each (layer, kind) moves at most once: one rebuilt codec per (kind, delta), shared by every spec using it
    shifted: dict[tuple[Kind, float], Codec | None] = {
        (kind, delta): shift_codec(own, delta)
        for kind, own in (("k", uniform.k), ("v", uniform.v))
        for delta in (step, -step)
    }

    def build(applied: list[dict[str, Any]]) -> CacheSpec:
        widths: dict[int, list[Codec]] = {}
        for m in applied:
            pair = widths.setdefault(m["layer"], [uniform.k, uniform.v])
            i = 0 if m["kind"] == "k" else 1
            pair[i] = shifted[m["kind"], m["delta"]] or pair[i]
        return _layered(uniform, {layer: (k, v) for layer, (k, v) in widths.items()}, num_layers)

    moves: list[dict[str, Any]] = []
    candidates: list[CacheSpec] = [uniform]
    for layer in range(num_layers):
        for kind in ("k", "v"):
            for delta in (step, -step):
                if shifted[kind, delta] is None:
                    continue
                move = {"layer": layer, "kind": kind, "delta": delta}
                spec = build([move])
                candidates.append(spec)
                moves.append({**move, "spec": spec.spec})
    job = EvalJob(tuple(candidates), select, ctx=ctx, windows=windows, calibration=stats)
    result = evaluate_specs(lm, job, executor, progress=progress)
    kld = [r["kld_mean"] for r in result.results]  # in the order of candidates
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

    if budget is not None:  # spend what the base leaves unused on the best remaining raises
        head_dim = lm.shape.head_dim
        for up in ups:
            if up["kld_change"] >= 0:
                break
            if (up["layer"], up["kind"]) in used:
                continue
            if build([*chosen, up]).bits_at(head_dim, ctx, num_layers) <= budget + 1e-9:
                chosen.append(up)
                used.add((up["layer"], up["kind"]))
    plan = build(chosen)
    rows = list(result.results[:1])
    if plan.spec != uniform.spec:
        check = evaluate_specs(lm, replace(job, specs=(plan,)), executor, progress=progress)
        rows = sorted([*rows, *check.results], key=lambda r: r["kld_mean"])
    spec = plan.spec if rows[0]["codec"] == plan.spec else uniform.spec
    return LayerPlan(spec, uniform.spec, moves, chosen, rows)
