"""Honest evaluation: KL divergence against the same model with an uncompressed cache."""

from walshkv.eval.harness import DEFAULT_CODECS, EvalResult, evaluate
from walshkv.eval.metrics import TokenMetrics, compare_logits
from walshkv.eval.report import format_table, write_csv, write_json, write_markdown
from walshkv.eval.windows import Windows, make_windows, scored_positions

__all__ = [
    "DEFAULT_CODECS",
    "EvalResult",
    "TokenMetrics",
    "Windows",
    "compare_logits",
    "evaluate",
    "format_table",
    "make_windows",
    "scored_positions",
    "write_csv",
    "write_json",
    "write_markdown",
]
