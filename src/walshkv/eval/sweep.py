"""``walshkv sweep``: a grid of cache specs through the ``walshkv eval`` protocol.

A grid is a named preset (:data:`PRESETS`) or a ``.yaml``/``.json`` file with ``codecs: [spec, ...]``
(:mod:`walshkv.eval.grids`). Every spec is measured exactly as ``walshkv eval`` measures it
(:func:`walshkv.eval.evaluate`); the sweep adds resumability (one JSON file per finished row, reused when
its settings match), a combined CSV and markdown table sorted by bits per element, and a plot of mean KLD
against bits with the Pareto front marked (:mod:`walshkv.eval.pareto`).

Preset specs may contain the placeholders ``{hd}``, ``{hd/2}``, ``{hd/4}`` (any ``{hd/N}``), replaced
by the model's head_dim when the grid is resolved.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from walshkv.constants import Score
from walshkv.defaults import CTX, WINDOWS
from walshkv.eval.grids import (
    HF_PEERS,
    PRESETS,
    canonical_specs,
    grid_files_hint,
    load_grid,
    needs_calibration,
    resolve_grid,
    substitute_head_dim,
    unrunnable_specs,
)
from walshkv.eval.harness import evaluate
from walshkv.eval.metrics import is_finite_number
from walshkv.eval.pareto import pareto_front, plot_pareto
from walshkv.eval.provenance import code_version
from walshkv.eval.report import (
    PLOT_HINT,
    decode_note,
    describe_calibration,
    describe_run,
    format_table,
    run_settings,
    write_csv,
)
from walshkv.eval.rows import ResultRow
from walshkv.fileio import write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "HF_PEERS",
    "PRESETS",
    "canonical_specs",
    "grid_files_hint",
    "load_grid",
    "needs_calibration",
    "pareto_front",
    "plot_pareto",
    "resolve_grid",
    "row_path",
    "run_sweep",
    "slug",
    "substitute_head_dim",
]

# ---------------------------------------------------------------------------------------------------------
# Rows on disk
# ---------------------------------------------------------------------------------------------------------


def slug(text: str, limit: int = 80) -> str:
    """``text`` made safe for a file name (at most ``limit`` characters)."""
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_.")[:limit] or "spec"


def row_path(out_dir: str | Path, spec: str) -> Path:
    """Where the row of ``spec`` (canonical) lives: ``OUT/rows/<slug>-<hash8>.json``."""
    digest = hashlib.sha256(spec.encode()).hexdigest()[:8]
    return Path(out_dir) / "rows" / f"{slug(spec)}-{digest}.json"


def _calibration_key(calibration: CalibrationLike | None) -> dict[str, Any] | None:
    """The part of a row's settings that says which calibration a calibrated spec used."""
    if calibration is None:
        return None
    if all(hasattr(calibration, a) for a in ("model", "text", "tokens")):  # KVStats
        return {"model": calibration.model, "text": calibration.text, "tokens": calibration.tokens}
    return calibration.describe()  # a K mean file, or statistics merged with one


def _finished_row(path: Path, spec: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The stored ``{"meta", "result"}`` of a finished row, or ``None`` if it must be (re)run.

    A row whose settings match except the code that measured it (``settings["code"]``) is returned too:
    the caller re-runs it and says so.
    """
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        sweep = record["meta"]["sweep"]
        result = record["result"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(result, dict) or sweep.get("spec") != spec or result.get("codec") != spec:
        return None
    if any(sweep.get(k) != v for k, v in settings.items() if k != "code"):
        return None
    return record


def _describe_code(code: Any) -> str:
    """A row's ``sweep["code"]`` in words (``walshkv 0.1.0 at 27d800a``; rows from before it was kept: unknown)."""
    if not isinstance(code, dict):
        return "code of unknown version"
    return f"walshkv {code.get('walshkv')} at {code.get('commit')}"


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


def _say(progress: bool, message: str) -> None:
    """A progress line on stderr (only with ``progress``)."""
    if progress:
        print(message, file=sys.stderr, flush=True)


def run_sweep(
    lm: LoadedModel,
    text: Text,
    specs: Sequence[str],
    out_dir: str | Path,
    *,
    ctx: int = CTX,
    windows: int | None = WINDOWS,
    score: Score = "half",
    residual: int = 0,
    progress: bool = True,
    command: str = "",
    calibration: CalibrationLike | None = None,
    chunk: int = 4,
    title: str = "sweep",
    description: str = "",
    decode_chunk: int = 1,
) -> list[ResultRow]:
    """Evaluate every spec not already finished in ``out_dir``, then write the combined outputs.

    A row is finished when ``OUT/rows/<slug>-<hash>.json`` exists and its ``meta["sweep"]`` matches this
    run's settings (model, text name and content hash, ctx, windows, score, residual, the code's version and
    commit, and for calibrated specs the calibration's model, text and token count); anything else is
    (re)run, a row measured by other code with a line that says so. Pending specs go
    through :func:`walshkv.eval.evaluate` ``chunk`` at a time (one reference forward per window per
    chunk), and each row's JSON is written as soon as its chunk finishes.

    Afterwards ``OUT/results.csv``, ``OUT/results.md`` and (with matplotlib) ``OUT/pareto.png`` hold every
    row of ``specs``, sorted by ``bits_per_element``.

    Args:
        lm: the loaded model (:class:`walshkv.models.LoadedModel`).
        text: evaluation text (:class:`walshkv.data.Text`).
        specs: cache specs (placeholders already substituted); parsed and de-duplicated here.
        out_dir: output folder, created if needed.
        ctx: tokens per window.
        windows: number of windows (``None``: every full window).
        score: ``"half"`` or ``"all"``.
        residual: full-precision window of recent tokens.
        progress: progress bars and one ``[i-j/n]`` line per chunk on stderr.
        command: the command line, recorded in each row and in ``results.md``.
        calibration: :class:`walshkv.calibration.KVStats` from other text than ``text``, for calibrated
            specs (``order=variance``, ``auto@BITS``); passed to ``evaluate`` for chunks that need it.
        chunk: specs per :func:`~walshkv.eval.evaluate` call (at least 1).
        title: heading of ``results.md`` and of the plot (e.g. the grid name).
        description: one paragraph under the heading of ``results.md``.
        decode_chunk: scored tokens per forward for Hugging Face ``hf-*`` rows (fed as in generation; see
            :func:`walshkv.eval.evaluate`); part of those rows' settings.

    Returns:
        The result rows (``evaluate``'s metric dicts), sorted by ``bits_per_element``.

    Raises:
        ValueError: a spec that does not parse or fit the model's head_dim (before anything runs),
            ``chunk < 1``, or any error of :func:`~walshkv.eval.evaluate`.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    canon = canonical_specs(specs, lm.shape.head_dim)
    skipped = unrunnable_specs(canon, lm)
    for spec in skipped:
        _say(progress, f"sweep: skipping {spec}: {skipped[spec]}")
    canon = [s for s in canon if s not in skipped]
    if not canon:
        raise ValueError("no runnable cache specs left: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    calibrated = {s for s in canon if needs_calibration(s)}
    if calibrated and calibration is None:
        raise ValueError(
            f"{', '.join(sorted(calibrated))} need calibration statistics: pass calibration=collect_kv_stats(...) "
            "on other text than the evaluation text (CLI: --calib-text TEXT)"
        )
    out = Path(out_dir)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    base = {**run_settings(lm, text, ctx, windows, score, residual), "code": code_version()}
    settings = {s: {**base, "calibration": _calibration_key(calibration) if s in calibrated else None} for s in canon}
    for s in canon:  # Hugging Face caches are fed token by token, decode_chunk tokens per forward
        if s.startswith("hf-"):
            settings[s]["decode_chunk"] = decode_chunk

    records: dict[str, dict[str, Any]] = {}
    pending: list[str] = []
    other_code: dict[str, list[str]] = {}  # rows measured by other code, by what measured them
    for spec in canon:
        record = _finished_row(row_path(out, spec), spec, settings[spec])
        if record is not None and (stored := record["meta"]["sweep"].get("code")) != base["code"]:
            other_code.setdefault(_describe_code(stored), []).append(spec)
            record = None
        if record is None:
            pending.append(spec)
        else:
            records[spec] = record
    for old, specs_of in other_code.items():
        now = _describe_code(base["code"])
        _say(
            progress, f"sweep: {len(specs_of)} rows were measured by {old}, not {now}: re-running {', '.join(specs_of)}"
        )
    total = len(canon)
    _say(progress, f"sweep: {total} rows, {len(records)} already finished in {out}, {len(pending)} to run")

    for start in range(0, len(pending), chunk):
        part = pending[start : start + chunk]
        first = len(records) + 1
        last = first + len(part) - 1
        _say(progress, f"[{first}{'' if last == first else f'-{last}'}/{total}] {', '.join(part)}")
        extra = {"calibration": calibration} if calibrated.intersection(part) else {}
        result = evaluate(
            lm,
            text,
            part,
            ctx=ctx,
            windows=windows,
            score=score,
            residual=residual,
            progress=progress,
            decode_chunk=decode_chunk,
            **extra,
        )
        result.meta["command"] = command
        for spec, row in zip(part, result.results, strict=True):
            meta = {**result.meta, "sweep": {**settings[spec], "spec": spec, "evaluated_with": part}}
            record = {"meta": meta, "result": row}
            write_json_atomic(row_path(out, spec), record)  # an interrupted sweep leaves no half-written row
            records[spec] = record

    rows: list[ResultRow] = sorted(
        (records[s]["result"] for s in canon),
        key=lambda r: (r["bits_per_element"], r["kld_mean"] if is_finite_number(r["kld_mean"]) else math.inf),
    )
    meta = records[canon[0]]["meta"]
    notes = []
    if calibrated:
        used = {json.dumps(records[s]["meta"]["sweep"]["calibration"], sort_keys=True) for s in calibrated}
        notes.append(
            f"Calibrated specs ({', '.join(f'`{s}`' for s in sorted(calibrated))}) used "
            + "; ".join(describe_calibration(c) for c in map(json.loads, sorted(used)))
            + " (never the evaluation text)."
        )
    if skipped:
        notes.append("Left out: " + "; ".join(f"`{k}` ({v})" for k, v in skipped.items()) + ".")
    _write_outputs(out, rows, meta, command, title, description, notes)
    return rows


def _write_outputs(
    out: Path,
    rows: list[ResultRow],
    meta: dict[str, Any],
    command: str,
    title: str,
    description: str,
    notes: list[str],
) -> None:
    """``results.csv``, ``pareto.png`` (with matplotlib) and ``results.md`` of every row."""
    write_csv(out / "results.csv", rows)
    front = pareto_front(rows)
    plot_title = (
        f"{title}: {meta['model']['name']} on {meta['text']['name']}, "
        f"{meta['windows']} windows of {meta['ctx']} tokens (score {meta['score']}, residual {meta['residual']})"
    )
    plotted = True
    try:
        plot_pareto(rows, out / "pareto.png", plot_title)
    except ImportError:
        plotted = False
        print(f"pareto.png skipped: matplotlib is not installed ({PLOT_HINT})", file=sys.stderr)
    paras = [f"# Sweep: {title}"]
    if description:
        paras.append(description)
    paras.append(describe_run(meta))
    paras.extend(notes)
    if command:
        paras.append(f"Produced by `{command}`.")
    paras.append(format_table(rows, "github"))
    if note := decode_note(rows):
        paras.append(note)
    paras.append(
        "Pareto front (no other row has a lower mean KLD at fewer or equal bits per element): "
        + ", ".join(f"`{r['codec']}`" for r in front)
        + "."
    )
    if plotted:
        paras.append("![mean KLD against bits per element](pareto.png)")
    write_text_atomic(out / "results.md", "\n\n".join(paras) + "\n")
