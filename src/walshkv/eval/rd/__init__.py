"""``walshkv rd``: rate-distortion of codecs on a model's real K/V.

:mod:`~walshkv.eval.rd.report` holds what a run returns (:class:`RDResult`) and how it is shown (tables, the
Shannon bound, Lloyd-Max points, the plot, result files); :mod:`~walshkv.eval.rd.measure` captures K/V and
measures each codec (:class:`RDConfig`, :func:`measure_rd`). Their public names are re-exported here.
"""

from walshkv.eval.rd.measure import DEFAULT_RD_CODECS, RDConfig, capture_window, measure_rd, resolve_specs
from walshkv.eval.rd.report import (
    RDResult,
    describe_rd,
    format_rd_table,
    lloyd_max_points,
    plot_rd,
    shannon_bound,
    write_rd_outputs,
)

__all__ = [
    "DEFAULT_RD_CODECS",
    "RDConfig",
    "RDResult",
    "capture_window",
    "describe_rd",
    "format_rd_table",
    "lloyd_max_points",
    "measure_rd",
    "plot_rd",
    "resolve_specs",
    "shannon_bound",
    "write_rd_outputs",
]
