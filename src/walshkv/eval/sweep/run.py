"""``walshkv sweep``: a grid of cache specs through the ``walshkv eval`` protocol.

A grid is a named preset (:data:`PRESETS`) or a ``.yaml``/``.json`` file with ``codecs: [spec, ...]``
(:mod:`walshkv.eval.sweep.grids`). Every spec is measured exactly as ``walshkv eval`` measures it
(:func:`walshkv.eval.evaluate`); the sweep adds resumability (one JSON file per finished row, reused when
its settings match), a combined CSV and markdown table sorted by bits per element, and a plot of mean KLD
against bits with the Pareto front marked (:mod:`walshkv.eval.sweep.pareto`).

Preset specs may contain the placeholders ``{hd}``, ``{hd/2}``, ``{hd/4}`` (any ``{hd/N}``), replaced
by the model's head_dim when the grid is resolved.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, get_args

from walshkv.codecs import check_spec_list
from walshkv.constants import Score
from walshkv.defaults import CTX, WINDOWS
from walshkv.eval.harness import EvalResult, evaluate
from walshkv.eval.metrics import is_finite_number
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
from walshkv.eval.sweep.grids import (
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
from walshkv.eval.sweep.pareto import pareto_front, plot_pareto
from walshkv.fileio import write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.codecs.hf import HFCacheSpec
    from walshkv.codecs.spec import CacheSpec
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "HF_PEERS",
    "IN_PROCESS",
    "PRESETS",
    "EvalJob",
    "Executor",
    "InProcess",
    "SweepConfig",
    "canonical_specs",
    "evaluate_specs",
    "grid_files_hint",
    "load_grid",
    "needs_calibration",
    "pareto_front",
    "plot_pareto",
    "resolve_grid",
    "row_path",
    "run_job",
    "run_sweep",
    "slug",
    "split_evenly",
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
# Where evaluations run: in this process (the default) or elsewhere (walshkv.integrations.ray)
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvalJob:
    """One :func:`walshkv.eval.evaluate` call, as data: the specs and every setting besides the model.

    A job holds what a worker elsewhere needs to repeat the call exactly (the text itself, not its name;
    the calibration object, not a path), so an :class:`Executor` can run it in another process or on another
    machine that loads the same model.

    Attributes:
        specs: the cache specs, evaluated together (one reference forward per window is shared by them).
        text: the evaluation (or selection) text.
        ctx, windows, score, residual, decode_chunk: as :func:`~walshkv.eval.evaluate` takes them.
        calibration: the calibration for calibrated specs, or ``None``.
    """

    specs: tuple[str | CacheSpec | HFCacheSpec, ...]
    text: Text
    ctx: int = CTX
    windows: int | None = WINDOWS
    score: Score = "half"
    residual: int = 0
    decode_chunk: int = 1
    calibration: CalibrationLike | None = None

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~walshkv.eval.evaluate` besides text, specs and calibration."""
        return {
            "ctx": self.ctx,
            "windows": self.windows,
            "score": self.score,
            "residual": self.residual,
            "decode_chunk": self.decode_chunk,
        }


def run_job(lm: LoadedModel, job: EvalJob, *, progress: bool = False) -> EvalResult:
    """Run one :class:`EvalJob` on ``lm`` here: exactly ``evaluate(lm, job.text, job.specs, ...)``."""
    extra = {} if job.calibration is None else {"calibration": job.calibration}
    return evaluate(lm, job.text, list(job.specs), **job.options(), **extra, progress=progress)


class Executor(Protocol):
    """Where :func:`run_sweep` and :func:`walshkv.recommend.recommend` run their evaluations.

    :data:`IN_PROCESS` (the default) runs each job here, one after another, exactly as before executors
    existed; :class:`walshkv.integrations.ray.RayExecutor` sends each job to a Ray cluster as a task.
    The callers keep every decision (which rows are finished, what wins): an executor only runs jobs.
    """

    @property
    def slots(self) -> int:
        """How many jobs run at once (callers split a batch of specs into this many jobs)."""
        ...

    def describe(self) -> dict[str, Any]:
        """Where the jobs ran, for result files (``{"kind": "in-process"}``, ``{"kind": "ray", ...}``)."""
        ...

    def map(
        self, lm: LoadedModel, jobs: Iterable[EvalJob], *, progress: bool = False
    ) -> Iterator[tuple[int, EvalResult]]:
        """Run every job of ``jobs`` on ``lm`` (or on the same model loaded elsewhere).

        Args:
            lm: the loaded model; an executor that runs jobs elsewhere loads the same model by name there.
            jobs: the jobs; read lazily by an in-process executor (each job is taken when it starts).
            progress: progress bars (in-process) or one line per finished job (elsewhere).

        Yields:
            ``(index of the job in jobs, its result)`` as each job finishes, in any order.
        """
        ...


class InProcess:
    """The default :class:`Executor`: every job in this process, in order, each as soon as it is taken."""

    @property
    def slots(self) -> int:
        return 1

    def describe(self) -> dict[str, Any]:
        return {"kind": "in-process"}

    def map(
        self, lm: LoadedModel, jobs: Iterable[EvalJob], *, progress: bool = False
    ) -> Iterator[tuple[int, EvalResult]]:
        for i, job in enumerate(jobs):
            yield i, run_job(lm, job, progress=progress)


#: The in-process executor (what ``executor=None`` means).
IN_PROCESS = InProcess()


def split_evenly(items: Sequence[Any], parts: int) -> list[list[Any]]:
    """``items`` cut into at most ``parts`` consecutive, non-empty parts whose sizes differ by at most one."""
    n = max(1, min(parts, len(items)))
    size, more = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < more else 0)
        out.append(list(items[start:end]))
        start = end
    return [p for p in out if p]


def _merge_quantize_on_write(values: list[Any]) -> Any:
    """The meta's ``quantize_on_write`` of jobs evaluated apart: ``True``, or the per-row notes of all."""
    if all(v == values[0] for v in values):
        return values[0]
    notes: list[str] = []
    for v in values:
        if isinstance(v, str) and v.startswith("per row (") and v.endswith(")"):
            notes.extend(v[len("per row (") : -1].split("; "))
        elif v is not True:
            notes.append(str(v))
    return f"per row ({'; '.join(dict.fromkeys(notes))})"


def evaluate_specs(
    lm: LoadedModel, job: EvalJob, executor: Executor | None = None, *, progress: bool = False
) -> EvalResult:
    """Evaluate ``job.specs`` through ``executor``, cut into ``executor.slots`` jobs, as one result.

    In process (``executor`` ``None`` or :data:`IN_PROCESS`) this is one :func:`run_job` call, exactly
    ``evaluate(lm, job.text, job.specs, ...)``. Elsewhere, each part shares its own reference forward: the
    metrics of every spec are the same, its ``seconds`` and the meta's ``seconds_total`` are not.

    Returns:
        One :class:`~walshkv.eval.EvalResult`: the rows in the order of ``job.specs``; the meta of the first
        part with ``quantize_on_write`` merged and, when there were several parts, ``seconds_total`` the wall
        time of all and ``executor`` (:meth:`Executor.describe` plus ``jobs``).
    """
    executor = executor or IN_PROCESS
    parts = split_evenly(job.specs, executor.slots)
    jobs = [replace(job, specs=tuple(p)) for p in parts]
    started = time.perf_counter()
    results: dict[int, EvalResult] = dict(executor.map(lm, jobs, progress=progress))
    ordered = [results[i] for i in range(len(jobs))]
    if len(ordered) == 1:
        return ordered[0]
    meta = dict(ordered[0].meta)
    meta["quantize_on_write"] = _merge_quantize_on_write([r.meta.get("quantize_on_write") for r in ordered])
    meta["seconds_total"] = time.perf_counter() - started
    meta["executor"] = {**executor.describe(), "jobs": len(jobs)}
    return EvalResult(meta, [row for r in ordered for row in r.results])


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


def _say(progress: bool, message: str) -> None:
    """A progress line on stderr (only with ``progress``)."""
    if progress:
        print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SweepConfig:
    """How :func:`run_sweep` measures a grid: its specs, the eval protocol's settings, and the report's words.

    Attributes:
        codecs: cache specs as text (placeholders already substituted: :func:`substitute_head_dim`; presets
            resolved: :func:`walshkv.presets.name_specs`, as their canonical text); their grammar is checked here,
            their fit to the model by :func:`run_sweep`, which measures each canonical spec once. Kept as a tuple.
        ctx: tokens per window.
        windows: number of windows (``None``: every full window of the text).
        score: ``"half"`` (the second half of each window) or ``"all"``.
        residual: full-precision window of recent tokens (0: every token compressed).
        calibration: what calibrated specs need (``order=variance``, ``auto@BITS``, ``center+``): a
            :class:`walshkv.calibration.KVStats` from other text than the evaluation text, or a K mean file; sent
            with the chunks that hold such a spec.
        chunk: specs per :func:`~walshkv.eval.evaluate` call (one reference forward per window per chunk).
        decode_chunk: scored tokens per forward for Hugging Face ``hf-*`` rows (fed as in generation; see
            :func:`walshkv.eval.evaluate`); part of those rows' settings.
        reuse_rows: keep finished rows that another version or commit of walshkv measured (same settings
            otherwise) instead of re-running them: for long runs resumed across commits that do not change what
            is measured. Off by default: a row belongs to the code that measured it.
        title: heading of ``results.md`` and of the plot (e.g. the grid name).
        description: one paragraph under the heading of ``results.md``.
        command: the command line, recorded in each row and in ``results.md``.
        progress: progress bars, and one ``[i-j/n]`` line per chunk on stderr.

    Raises:
        ValueError: ``codecs`` a single string, empty, or with a spec that does not parse; ``ctx`` below 4;
            ``windows`` below 1 (``None`` reads every full window); ``score`` not one of ``half``, ``all``;
            ``residual`` below 0; ``chunk`` or ``decode_chunk`` below 1.
    """

    codecs: Sequence[str]
    ctx: int = CTX
    windows: int | None = WINDOWS
    score: Score = "half"
    residual: int = 0
    calibration: CalibrationLike | None = None
    chunk: int = 4
    decode_chunk: int = 1
    reuse_rows: bool = False
    title: str = "sweep"
    description: str = ""
    command: str = ""
    progress: bool = True

    def __post_init__(self) -> None:
        check_spec_list(self.codecs)
        if self.ctx < 4:
            raise ValueError(f"--ctx must be at least 4 tokens, got {self.ctx}")
        if self.windows is not None and self.windows < 1:
            raise ValueError(f"--windows must be at least 1 (None: every full window), got {self.windows}")
        if self.score not in get_args(Score):
            raise ValueError(f"--score must be one of {', '.join(get_args(Score))}, got {self.score!r}")
        if self.residual < 0:
            raise ValueError(f"--residual must be at least 0 tokens, got {self.residual}")
        if self.chunk < 1:
            raise ValueError(f"--chunk must be at least 1 spec, got {self.chunk}")
        if self.decode_chunk < 1:
            raise ValueError(f"--decode-chunk must be at least 1 token, got {self.decode_chunk}")
        canonical_specs(self.codecs, None)  # the grammar: raises naming the spec, or an empty grid
        object.__setattr__(self, "codecs", tuple(self.codecs))


def run_sweep(
    lm: LoadedModel, text: Text, config: SweepConfig, out_dir: str | Path, *, executor: Executor | None = None
) -> list[ResultRow]:
    """Evaluate every spec of ``config`` not already finished in ``out_dir``, then write the combined outputs.

    A row is finished when ``OUT/rows/<slug>-<hash>.json`` exists and its ``meta["sweep"]`` matches this
    run's settings (model, text name and content hash, ctx, windows, score, residual, the code's version and
    commit, and for calibrated specs the calibration's model, text and token count); anything else is
    (re)run, a row measured by other code with a line that says so (``config.reuse_rows``: kept, with a line
    that says so; each row records the commit that measured it, and ``results.md`` lists them). Pending specs
    go through :func:`walshkv.eval.evaluate` ``config.chunk`` at a time (one reference forward per window per
    chunk), and each row's JSON is written as soon as its chunk finishes.

    Afterwards ``OUT/results.csv``, ``OUT/results.md`` and (with matplotlib) ``OUT/pareto.png`` hold every
    row of ``config.codecs``, sorted by ``bits_per_element``.

    Args:
        lm: the loaded model (:class:`walshkv.models.LoadedModel`).
        text: evaluation text (:class:`walshkv.data.Text`).
        config: the specs and every setting of the run (:class:`SweepConfig`).
        out_dir: output folder, created if needed.
        executor: where the chunks run (:class:`Executor`); ``None``: here, one after another. Whatever runs
            them, this process decides what is pending and writes each row's file as soon as its chunk
            comes back (``walshkv.integrations.ray.RayExecutor``: chunks as Ray tasks, in parallel).

    Returns:
        The result rows (``evaluate``'s metric dicts), sorted by ``bits_per_element``.

    Raises:
        ValueError: a spec that does not fit the model's head_dim (before anything runs), calibrated specs
            without ``config.calibration``, no runnable spec left, or any error of :func:`~walshkv.eval.evaluate`.
    """
    plan = _runnable_specs(lm, config)
    out = Path(out_dir)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    code = code_version()
    plan.settings = _row_settings(lm, text, config, plan, code)
    _find_finished_rows(out, plan, code, config)
    done, todo = len(plan.records), len(plan.pending)
    _say(config.progress, f"sweep: {len(plan.specs)} rows, {done} already finished in {out}, {todo} to run")
    _run_pending(lm, text, config, out, plan, executor)
    rows: list[ResultRow] = sorted(
        (plan.records[s]["result"] for s in plan.specs),
        key=lambda r: (r["bits_per_element"], r["kld_mean"] if is_finite_number(r["kld_mean"]) else math.inf),
    )
    _write_outputs(out, rows, plan.records[plan.specs[0]]["meta"], config, _notes(plan))
    return rows


@dataclass
class _Plan:
    """A sweep's rows as :func:`run_sweep` works through them.

    Attributes:
        specs: the canonical specs this model runs, in grid order.
        skipped: the specs it cannot run, with the reason.
        calibrated: those of ``specs`` that need calibration.
        settings: per spec, the settings its row records (``meta["sweep"]``) and a finished row must match.
        records: per spec, its finished row (``{"meta", "result"}``), read from disk or just measured.
        pending: the specs still to run, in grid order.
    """

    specs: list[str]
    skipped: dict[str, str]
    calibrated: set[str]
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)


# Step 1: the specs against the model -------------------------------------------------------------------------


def _runnable_specs(lm: LoadedModel, config: SweepConfig) -> _Plan:
    """The canonical specs this model runs, those it cannot (with the reason, each said on stderr) and the
    calibrated ones among the first; refuses a spec that does not fit the head size, no runnable spec, and
    calibrated specs without calibration."""
    canon = canonical_specs(config.codecs, lm.shape.head_dim)
    skipped = unrunnable_specs(canon, lm)
    for spec in skipped:
        _say(config.progress, f"sweep: skipping {spec}: {skipped[spec]}")
    canon = [s for s in canon if s not in skipped]
    if not canon:
        raise ValueError("no runnable cache specs left: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    calibrated = {s for s in canon if needs_calibration(s)}
    if calibrated and config.calibration is None:
        raise ValueError(
            f"{', '.join(sorted(calibrated))} need calibration statistics: pass calibration=collect_kv_stats(...) "
            "on other text than the evaluation text (CLI: --calib-text TEXT)"
        )
    return _Plan(canon, skipped, calibrated)


# Step 2: the rows finished already ---------------------------------------------------------------------------


def _row_settings(
    lm: LoadedModel, text: Text, config: SweepConfig, plan: _Plan, code: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Per spec, the settings its row records (``meta["sweep"]``) and a finished row must match."""
    base = {**run_settings(lm, text, config.ctx, config.windows, config.score, config.residual), "code": code}
    key = _calibration_key(config.calibration) if plan.calibrated else None
    settings = {s: {**base, "calibration": key if s in plan.calibrated else None} for s in plan.specs}
    for s in plan.specs:  # Hugging Face caches are fed token by token, decode_chunk tokens per forward
        if s.startswith("hf-"):
            settings[s]["decode_chunk"] = config.decode_chunk
    return settings


def _find_finished_rows(out: Path, plan: _Plan, code: dict[str, Any], config: SweepConfig) -> None:
    """Fill ``plan.records`` with the finished rows of ``out`` that this run keeps and ``plan.pending`` with the
    specs still to run; a line on stderr for rows that other code measured."""
    other_code: dict[str, list[str]] = {}  # rows measured by other code, by what measured them
    for spec in plan.specs:
        record = _finished_row(row_path(out, spec), spec, plan.settings[spec])
        if record is not None and (stored := record["meta"]["sweep"].get("code")) != code:
            other_code.setdefault(_describe_code(stored), []).append(spec)
            record = record if config.reuse_rows else None
        if record is None:
            plan.pending.append(spec)
        else:
            plan.records[spec] = record
    for old, specs_of in other_code.items():
        now = _describe_code(code)
        verb = "keeping them (--reuse-rows)" if config.reuse_rows else "re-running"
        _say(
            config.progress,
            f"sweep: {len(specs_of)} rows were measured by {old}, not {now}: {verb} {', '.join(specs_of)}",
        )


# Step 3: the pending rows ------------------------------------------------------------------------------------


def _run_pending(
    lm: LoadedModel, text: Text, config: SweepConfig, out: Path, plan: _Plan, executor: Executor | None
) -> None:
    """Run ``plan.pending``, ``config.chunk`` specs per job, through ``executor`` and write each row's file as soon
    as its job comes back; the rows join ``plan.records``."""
    total, done = len(plan.specs), len(plan.records)
    starts = range(0, len(plan.pending), config.chunk)
    parts = [plan.pending[start : start + config.chunk] for start in starts]

    def jobs() -> Iterator[EvalJob]:  # read lazily: in process, each line comes as its chunk starts
        for start, part in zip(starts, parts, strict=True):
            first, last = done + start + 1, done + start + len(part)
            _say(config.progress, f"[{first}{'' if last == first else f'-{last}'}/{total}] {', '.join(part)}")
            job_calibration = config.calibration if plan.calibrated.intersection(part) else None
            yield EvalJob(
                tuple(part),
                text,
                config.ctx,
                config.windows,
                config.score,
                config.residual,
                config.decode_chunk,
                job_calibration,
            )

    runner = executor or IN_PROCESS
    for i, result in runner.map(lm, jobs(), progress=config.progress):
        part = parts[i]
        result.meta["command"] = config.command
        if not isinstance(runner, InProcess):
            result.meta["executor"] = runner.describe()
        for spec, row in zip(part, result.results, strict=True):
            meta = {**result.meta, "sweep": {**plan.settings[spec], "spec": spec, "evaluated_with": part}}
            record = {"meta": meta, "result": row}
            write_json_atomic(row_path(out, spec), record)  # an interrupted sweep leaves no half-written row
            plan.records[spec] = record


# Step 4: the combined outputs --------------------------------------------------------------------------------


def _notes(plan: _Plan) -> list[str]:
    """The paragraphs of ``results.md`` after the run's description: the calibration calibrated specs used, the
    specs left out, the code versions when rows were measured by more than one."""
    notes = []
    if plan.calibrated:
        used = {json.dumps(plan.records[s]["meta"]["sweep"]["calibration"], sort_keys=True) for s in plan.calibrated}
        notes.append(
            f"Calibrated specs ({', '.join(f'`{s}`' for s in sorted(plan.calibrated))}) used "
            + "; ".join(describe_calibration(c) for c in map(json.loads, sorted(used)))
            + " (never the evaluation text)."
        )
    if plan.skipped:
        notes.append("Left out: " + "; ".join(f"`{k}` ({v})" for k, v in plan.skipped.items()) + ".")
    measured_by: dict[str, list[str]] = {}
    for s in plan.specs:
        measured_by.setdefault(_describe_code(plan.records[s]["meta"]["sweep"].get("code")), []).append(s)
    if len(measured_by) > 1:  # rows kept with --reuse-rows
        notes.append(
            "Rows measured by more than one version of the code: "
            + "; ".join(f"{who}: {', '.join(f'`{s}`' for s in specs_of)}" for who, specs_of in measured_by.items())
            + "."
        )
    return notes


def _write_outputs(
    out: Path, rows: list[ResultRow], meta: dict[str, Any], config: SweepConfig, notes: list[str]
) -> None:
    """``results.csv``, ``pareto.png`` (with matplotlib) and ``results.md`` of every row."""
    title, description, command = config.title, config.description, config.command
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
