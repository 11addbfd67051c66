"""The tables of a ``walshkv needle`` result: cells, summaries and overall rows from its trial rows.

A cell (task, length, depth) is measurable where the reference (:data:`BASELINE`) reaches ``min_baseline``; a
codec's loss counts only there. :class:`NeedleResult` holds a run's meta, its trial rows and these tables.

Intervals. The unit is the trial: one prompt, right or wrong (``correct``). Every accuracy in the rows (and
``retained``) comes with its 95% Wilson score interval under the same name plus ``_ci95``, ``[low, high]``
(:func:`walshkv.eval.metrics.wilson_ci95`; ``None`` where the accuracy is ``None``, no trials). For
``multivalue`` a trial is right only when every value was found, so its accuracy and interval are those of full
retrieval; the share of values found (``score``) is reported as a mean with no interval: the shares of a trial's
values are not independent successes, and a bootstrap over five-odd trials gives intervals that cover too little
(all trials alike: no width at all).

The codec against the reference, on the same trials of the measurable cells (summary and overall rows): every
trial is a pair of outcomes, the reference's and the codec's, so the comparison uses the pairs, not two
independent accuracies. ``lost`` and ``gained`` are the discordant pairs (reference right and codec wrong, and
the reverse); ``difference`` is the codec's accuracy minus the reference's, ``(gained - lost) / measured_trials``,
with Newcombe's paired score interval ``difference_ci95`` (:func:`walshkv.eval.metrics.paired_proportion_difference`:
the two Wilson intervals combined with the pairs' correlation); ``mcnemar_p`` is the two-sided exact McNemar
p-value (:func:`walshkv.eval.metrics.mcnemar_exact_p`: do the discordant pairs lean one way, lost against
gained, more than fair coin flips would?). These three are ``None`` in the reference's own rows.

Caveat: the trials of one sample at different depths and lengths share their needle's key and value and their
haystack's start, so the trials pooled in a summary or overall row are not all independent; their intervals
assume they are (within a cell, every trial is a sample of its own). Intervals are always computed from the
trial rows (:meth:`NeedleResult.from_rows`), so runs added together (``--add-to``) get intervals over all their
trials, never averages of the parts'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from walshkv.eval.metrics import mcnemar_exact_p, paired_proportion_difference, wilson_ci95

__all__ = [
    "BASELINE",
    "INTERVALS_NOTE",
    "MIN_BASELINE",
    "NeedleResult",
    "cell_key",
    "cell_rows",
    "mean",
    "measurable_cells",
    "overall_rows",
    "share",
    "summary_rows",
    "trial_key",
]

#: The name of the reference rows: the same model with transformers' uncompressed ``DynamicCache``.
BASELINE = "uncompressed"
#: The reference accuracy a (task, length) cell needs for a codec's loss there to be reported.
MIN_BASELINE = 0.8
#: How the rows' intervals are made, as a result's meta records it (``meta["intervals"]``).
INTERVALS_NOTE = (
    "95% intervals, the trial as the unit: *_ci95 of each accuracy (and retained) is the Wilson score interval "
    "(multivalue: a trial is right when every value is found; the mean share, score, has none); difference_ci95 "
    f"(codec minus {BASELINE} on the same trials) is Newcombe's score interval for paired proportions; mcnemar_p "
    "is the exact two-sided McNemar p-value of the discordant pairs (lost, gained)"
)


@dataclass
class NeedleResult:
    """``meta`` describes the run; ``trials`` one row per (trial, cache); ``cells`` per (task, cache, length,
    depth); ``summary`` per (task, cache, length); ``overall`` per (task, cache) over the measurable lengths.

    The tables (and their intervals) are always computed from the trial rows (:meth:`from_rows`)."""

    meta: dict[str, Any]
    trials: list[dict[str, Any]]
    cells: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    overall: list[dict[str, Any]]

    @classmethod
    def from_rows(
        cls, meta: dict[str, Any], trials: list[dict[str, Any]], min_baseline: float = MIN_BASELINE
    ) -> NeedleResult:
        """A result whose cells, summary and overall rows are computed from its trial rows.

        Args:
            meta: the run's meta.
            trials: one row per (trial, cache).
            min_baseline: the reference accuracy a cell needs to be measurable.
        """
        return cls(
            meta,
            trials,
            cell_rows(trials, min_baseline),
            summary_rows(trials, min_baseline),
            overall_rows(trials, min_baseline),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "overall": self.overall,
            "summary": self.summary,
            "cells": self.cells,
            "trials": self.trials,
        }


def _group(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    out: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def mean(values: Sequence[float]) -> float:
    """The mean of ``values`` (NaN for none)."""
    return sum(values) / len(values) if values else float("nan")


def share(flags: Sequence[bool]) -> tuple[float | None, list[float] | None]:
    """The share of ``flags`` that are true and its 95% Wilson interval; ``(None, None)`` for none.

    Each flag is one trial (right or wrong): the interval is :func:`walshkv.eval.metrics.wilson_ci95`.
    """
    if not flags:
        return None, None
    right = sum(bool(f) for f in flags)
    return right / len(flags), wilson_ci95(right, len(flags))


def trial_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    """A row's trial: ``(task, length, depth, sample)``, the same for every cache."""
    return (r["task"], r["length"], r["depth"], r["sample"])


def cell_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    """A row's cell: ``(task, length, depth)``."""
    return (r["task"], r["length"], r["depth"])


def measurable_cells(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> dict[tuple, bool]:
    """``{(task, length, depth): the reference's accuracy there is at least min_baseline}``."""
    return {
        key: mean([float(r["correct"]) for r in group]) >= min_baseline
        for key, group in _group([r for r in rows if r["codec"] == BASELINE], ("task", "length", "depth")).items()
    }


def cell_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec, length, depth), the heatmaps' cells: trials, correct, accuracy and its Wilson interval
    ``accuracy_ci95``, mean score (no interval: see the module's docstring), the reference's accuracy there and its
    interval (``baseline_accuracy``, ``baseline_accuracy_ci95``; NaN and ``None`` without reference rows) and whether
    the cell is measurable (the reference reaches ``min_baseline`` there)."""
    ok = measurable_cells(rows, min_baseline)
    base = {
        key: share([bool(r["correct"]) for r in group])
        for key, group in _group([r for r in rows if r["codec"] == BASELINE], ("task", "length", "depth")).items()
    }
    out = []
    for (task, codec, length, depth), group in _group(rows, ("task", "codec", "length", "depth")).items():
        accuracy, accuracy_ci95 = share([bool(r["correct"]) for r in group])
        baseline, baseline_ci95 = base.get((task, length, depth), (float("nan"), None))
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "depth": depth,
                "trials": len(group),
                "correct": sum(bool(r["correct"]) for r in group),
                "accuracy": accuracy,
                "accuracy_ci95": accuracy_ci95,
                "score": mean([r["score"] for r in group]),
                "baseline_accuracy": baseline,
                "baseline_accuracy_ci95": baseline_ci95,
                "measurable": ok.get((task, length, depth), False),
            }
        )
    return out


def _measured(
    group: Sequence[Mapping[str, Any]], ok: Mapping[tuple, bool], ref: Mapping[tuple, bool], reference: bool
) -> dict[str, Any]:
    """Over the trials of measurable cells in ``group``: accuracy, the reference's, retained, lost and gained, each
    share with its Wilson interval; for a codec (not the ``reference``'s own rows) the paired difference against
    the reference, its interval and the exact McNemar p-value."""
    kept = [r for r in group if ok.get(cell_key(r), False)]
    mine = [bool(r["correct"]) for r in kept]
    theirs = [bool(ref[trial_key(r)]) for r in kept]
    accuracy, accuracy_ci95 = share(mine)
    baseline, baseline_ci95 = share(theirs)
    retained, retained_ci95 = share([m for m, t in zip(mine, theirs, strict=True) if t])
    lost = sum(t and not m for m, t in zip(mine, theirs, strict=True))
    gained = sum(m and not t for m, t in zip(mine, theirs, strict=True))
    both = sum(m and t for m, t in zip(mine, theirs, strict=True))
    difference, difference_ci95, p = None, None, None
    if kept and not reference:
        difference, difference_ci95 = paired_proportion_difference(both, gained, lost, len(kept) - both - lost - gained)
        p = mcnemar_exact_p(gained, lost)
    return {
        "measured_trials": len(kept),
        "measured_accuracy": accuracy,
        "measured_accuracy_ci95": accuracy_ci95,
        "measured_baseline_accuracy": baseline,
        "measured_baseline_accuracy_ci95": baseline_ci95,
        "retained": retained,
        "retained_ci95": retained_ci95,
        "lost": lost,
        "gained": gained,
        "difference": difference,
        "difference_ci95": difference_ci95,
        "mcnemar_p": p,
    }


def summary_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec, length): accuracy over every trial and over the measurable cells only.

    Over every trial: ``accuracy``, ``score`` (the mean share of values found), ``baseline_accuracy`` (the
    reference's on the same trials; NaN and ``None`` without reference rows), each accuracy with its Wilson interval
    (``*_ci95``). A cell (task, length, depth) is measurable where the reference's accuracy reaches
    ``min_baseline``; over the measurable cells only: the ``measured_*`` keys (``measured_trials``,
    ``measured_accuracy``, ``measured_baseline_accuracy`` and their ``*_ci95``), ``retained`` and ``retained_ci95``
    (of the trials the reference got right, the share the codec got right too; ``None`` when there are none),
    ``lost`` and ``gained`` (the discordant pairs: right with the reference and wrong with the codec, and the other
    way round), ``difference``, ``difference_ci95`` and ``mcnemar_p`` (the paired comparison with the reference, see
    the module's docstring; ``None`` in the reference's rows and without measured trials). ``flagged_depths``: the
    depths left out.
    """
    ok = measurable_cells(rows, min_baseline)
    ref = {trial_key(r): bool(r["correct"]) for r in rows if r["codec"] == BASELINE}
    out = []
    for (task, codec, length), group in _group(rows, ("task", "codec", "length")).items():
        depths = sorted({r["depth"] for r in group})
        accuracy, accuracy_ci95 = share([bool(r["correct"]) for r in group])
        baseline, baseline_ci95 = share([ref[trial_key(r)] for r in group if trial_key(r) in ref])
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "trials": len(group),
                "accuracy": accuracy,
                "accuracy_ci95": accuracy_ci95,
                "score": mean([r["score"] for r in group]),
                "baseline_accuracy": float("nan") if baseline is None else baseline,
                "baseline_accuracy_ci95": baseline_ci95,
                **_measured(group, ok, ref, codec == BASELINE),
                "flagged_depths": [d for d in depths if not ok.get((task, length, d), False)],
                "seconds_per_trial": mean([r["prefill_seconds"] + r["decode_seconds"] for r in group]),
            }
        )
    return out


def overall_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec), over the measurable cells of every length: as :func:`summary_rows`' ``measured_*``,
    ``retained``, ``lost``, ``gained``, ``difference`` and ``mcnemar_p`` keys (intervals included), with ``cells``
    and ``flagged_cells`` (how many (length, depth) cells there are, and how many were left out)."""
    ok = measurable_cells(rows, min_baseline)
    ref = {trial_key(r): bool(r["correct"]) for r in rows if r["codec"] == BASELINE}
    out = []
    for (task, codec), group in _group(rows, ("task", "codec")).items():
        cells = {cell_key(r) for r in group}
        out.append(
            {
                "task": task,
                "codec": codec,
                "cells": len(cells),
                "flagged_cells": sum(not ok.get(c, False) for c in cells),
                **_measured(group, ok, ref, codec == BASELINE),
            }
        )
    return out
