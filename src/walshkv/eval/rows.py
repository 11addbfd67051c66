"""The result row :func:`walshkv.eval.evaluate` writes for each codec, typed.

Rows stay plain dicts (they go to JSON and CSV as they are); :class:`ResultRow` names every key and its
type so that code reading ``row["kld_mean"]`` is checked. ``evaluate`` writes ``codec`` first, then the
:class:`MetricSummary` keys, then the rest in the order of :class:`ResultRow` (the CSV column order).
"""

from __future__ import annotations

from typing import NotRequired, TypedDict

from walshkv.constants import Feed, Prefill

__all__ = ["MetricSummary", "ResultRow"]


class MetricSummary(TypedDict):
    """What :meth:`walshkv.eval.metrics.TokenMetrics.summary` returns: the scored tokens of one codec."""

    kld_mean: float
    kld_p99: float
    kld_median: float
    top1_agreement: float
    ppl: float
    ppl_ref: float
    ppl_ratio: float
    #: 95% interval of ``ppl_ratio`` from the paired per-token differences, ``[low, high]``.
    ppl_ratio_ci95: list[float]
    scored_tokens: int
    #: 95% percentile-bootstrap intervals over windows (:func:`walshkv.eval.metrics.bootstrap_ci95`).
    kld_mean_ci95: list[float]
    top1_ci95: list[float]
    #: mean KLD and top-1 agreement of each window, in window order (for paired comparisons between rows).
    window_kld_mean: list[float]
    window_top1: list[float]


class ResultRow(MetricSummary):
    """One codec's row of :attr:`walshkv.eval.EvalResult.results` (also a sweep's rows)."""

    #: the canonical cache spec (``"rot+int4"``, ``"int8/int4"``, ...); first key of the row.
    codec: str
    bits_k: float
    bits_v: float
    #: stored bits per K/V element after one window (scales and zero points counted).
    bits_per_element: float
    #: ``16 / bits_per_element``.
    compression: float
    #: bytes the cache held after one window of ``ctx`` tokens, batch 1.
    kv_bytes: int
    #: bytes an fp16 cache holds for the same window.
    kv_bytes_fp16: int
    seconds: float
    #: how the window was fed: ``"window"`` or ``"decode"`` (never ``"auto"``, which picks one of them).
    feed: Feed
    prefill: Prefill
    #: whether every token was compressed before attention read it (not so for Hugging Face ``hf-*`` and KIVI).
    quantize_on_write: bool
    #: the preset name the row was asked for (``walshkv:3.5``), when ``codec`` is a preset's spec
    preset: NotRequired[str]
    # decode-fed and KIVI rows only:
    fp_context_mean: NotRequired[float]
    scored_quantized_context_share: NotRequired[float]
    # decode-fed rows only:
    decode_chunk: NotRequired[int]
    # Hugging Face ``hf-*`` and KIVI rows only: their full-precision window (``r=``; KIVI holds r to r+g-1).
    fp_window: NotRequired[int]
