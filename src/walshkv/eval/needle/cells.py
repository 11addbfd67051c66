"""The tables of a ``walshkv needle`` result: cells, summaries and overall rows from its trial rows.

A cell (task, length, depth) is measurable where the reference (:data:`BASELINE`) reaches ``min_baseline``; a
codec's loss counts only there. :class:`NeedleResult` holds a run's meta, its trial rows and these tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BASELINE",
    "MIN_BASELINE",
    "NeedleResult",
    "cell_key",
    "cell_rows",
    "mean",
    "measurable_cells",
    "overall_rows",
    "summary_rows",
    "trial_key",
]

#: The name of the reference rows: the same model with transformers' uncompressed ``DynamicCache``.
BASELINE = "uncompressed"
#: The reference accuracy a (task, length) cell needs for a codec's loss there to be reported.
MIN_BASELINE = 0.8


@dataclass
class NeedleResult:
    """``meta`` describes the run; ``trials`` one row per (trial, cache); ``cells`` per (task, cache, length,
    depth); ``summary`` per (task, cache, length); ``overall`` per (task, cache) over the measurable lengths."""

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
    """Per (task, codec, length, depth), the heatmaps' cells: trials, correct, accuracy, mean score, the reference's
    accuracy and whether the cell is measurable (the reference reaches ``min_baseline`` there)."""
    ok = measurable_cells(rows, min_baseline)
    base = {
        key: mean([float(r["correct"]) for r in group])
        for key, group in _group([r for r in rows if r["codec"] == BASELINE], ("task", "length", "depth")).items()
    }
    out = []
    for (task, codec, length, depth), group in _group(rows, ("task", "codec", "length", "depth")).items():
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "depth": depth,
                "trials": len(group),
                "correct": sum(bool(r["correct"]) for r in group),
                "accuracy": mean([float(r["correct"]) for r in group]),
                "score": mean([r["score"] for r in group]),
                "baseline_accuracy": base.get((task, length, depth), float("nan")),
                "measurable": ok.get((task, length, depth), False),
            }
        )
    return out


def _measured(group: Sequence[Mapping[str, Any]], ok: Mapping[tuple, bool], ref: Mapping[tuple, bool]) -> dict:
    """Accuracy, the reference's, retained, lost and gained over the trials of measurable cells in ``group``."""
    kept = [r for r in group if ok.get(cell_key(r), False)]
    right = [r for r in kept if ref.get(trial_key(r))]
    return {
        "measured_trials": len(kept),
        "measured_accuracy": mean([float(r["correct"]) for r in kept]) if kept else None,
        "measured_baseline_accuracy": mean([float(ref[trial_key(r)]) for r in kept]) if kept else None,
        "retained": mean([float(r["correct"]) for r in right]) if right else None,
        "lost": sum(not r["correct"] for r in right),
        "gained": sum(bool(r["correct"]) and not ref.get(trial_key(r)) for r in kept),
    }


def summary_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec, length): accuracy over every trial and over the measurable cells only.

    A cell (task, length, depth) is measurable where the reference's accuracy reaches ``min_baseline``; the
    ``measured_*`` keys, ``retained`` (of the trials the reference got right, the share the codec got right too;
    ``None`` when there are none), ``lost`` and ``gained`` (right with the reference and wrong with the codec, and
    the other way round) read measurable cells only. ``flagged_depths``: the depths left out.
    """
    ok = measurable_cells(rows, min_baseline)
    ref = {trial_key(r): bool(r["correct"]) for r in rows if r["codec"] == BASELINE}
    out = []
    for (task, codec, length), group in _group(rows, ("task", "codec", "length")).items():
        depths = sorted({r["depth"] for r in group})
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "trials": len(group),
                "accuracy": mean([float(r["correct"]) for r in group]),
                "score": mean([r["score"] for r in group]),
                "baseline_accuracy": mean([float(ref[trial_key(r)]) for r in group if trial_key(r) in ref]),
                **_measured(group, ok, ref),
                "flagged_depths": [d for d in depths if not ok.get((task, length, d), False)],
                "seconds_per_trial": mean([r["prefill_seconds"] + r["decode_seconds"] for r in group]),
            }
        )
    return out


def overall_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec), over the measurable cells of every length: as :func:`summary_rows`' ``measured_*`` keys,
    with ``cells`` and ``flagged_cells`` (how many (length, depth) cells there are, and how many were left out)."""
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
                **_measured(group, ok, ref),
            }
        )
    return out
