"""``walshkv sweep``: a grid of cache specs through the eval protocol, rows on disk, the Pareto front.

Modules, bottom up: :mod:`~walshkv.eval.sweep.grids` (the named grids and how a spec list is resolved and
checked against the model), :mod:`~walshkv.eval.sweep.pareto` (the front and its plot),
:mod:`~walshkv.eval.sweep.run` (jobs, executors, rows on disk, :class:`SweepConfig`, :func:`run_sweep`). The
public names of ``run`` are re-exported here (``from walshkv.eval.sweep import run_sweep``).
"""

from walshkv.eval.sweep.run import (
    HF_PEERS,
    IN_PROCESS,
    PRESETS,
    EvalJob,
    Executor,
    InProcess,
    SweepConfig,
    canonical_specs,
    evaluate_specs,
    grid_files_hint,
    load_grid,
    needs_calibration,
    pareto_front,
    plot_pareto,
    resolve_grid,
    row_path,
    run_job,
    run_sweep,
    slug,
    split_evenly,
    substitute_head_dim,
)

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
