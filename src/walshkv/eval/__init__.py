"""Honest evaluation: KL divergence against the same model with an uncompressed cache.

Modules: the protocol every command shares sits at this level: :mod:`~walshkv.eval.harness` (:func:`evaluate`),
:mod:`~walshkv.eval.metrics`, :mod:`~walshkv.eval.rows` (the typed result row), :mod:`~walshkv.eval.report` (run
descriptions and result files for every command), :mod:`~walshkv.eval.calibrated` (a run's calibration inputs),
:mod:`~walshkv.eval.fit` (a run's specs checked against the model before anything runs),
:mod:`~walshkv.eval.capture` (K/V of real text for the research studies) and :mod:`~walshkv.eval.provenance`; one
subpackage per command above it: :mod:`~walshkv.eval.sweep` (``walshkv sweep``: grids, Pareto front, rows on
disk), :mod:`~walshkv.eval.rd` (``walshkv rd``: measure, report), :mod:`~walshkv.eval.needle` (``walshkv needle``).
Token windows live one layer down, in :mod:`walshkv.data`; they are re-exported here.
"""

from walshkv.data import SCORE_MODES, Windows, describe_scored, make_windows, scored_positions
from walshkv.eval.harness import DEFAULT_CODECS, EvalResult, evaluate
from walshkv.eval.metrics import TokenMetrics, compare_logits
from walshkv.eval.report import (
    command_line,
    describe_run,
    format_table,
    run_meta,
    write_csv,
    write_json,
    write_markdown,
    write_result_files,
)
from walshkv.eval.rows import MetricSummary, ResultRow

__all__ = [
    "DEFAULT_CODECS",
    "SCORE_MODES",
    "EvalResult",
    "MetricSummary",
    "ResultRow",
    "TokenMetrics",
    "Windows",
    "command_line",
    "compare_logits",
    "describe_run",
    "describe_scored",
    "evaluate",
    "format_table",
    "make_windows",
    "run_meta",
    "scored_positions",
    "write_csv",
    "write_json",
    "write_markdown",
    "write_result_files",
]
