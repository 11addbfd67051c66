"""The PrimePE alpha sweep (``walshkv rope sweep``): perplexity and KLD against the unmodified model.

The sweep cuts the text into windows (as ``walshkv eval`` does), runs every window once through the
unmodified model with an uncompressed cache (the reference), then once per configuration: a generator
(:data:`~walshkv_research.primepe.GENERATORS`), a convention (``multiply``/``divide``), an alpha, and a cache
(uncompressed, or each ``--codec``, compressed on write). Each row has mean/p99 KLD against the
reference, top-1 agreement and the perplexity ratio on the scored positions. The row with alpha 0 and
no codec is the unmodified model itself (KLD 0, PPL ratio 1: a check of the harness); alpha 0 with a
codec is the codec alone, the baseline against which composition is read.

The reports (``rope.json``, ``rope.csv``, ``rope.md``, ``rope.png``) are
:mod:`walshkv_research.rope_report`'s; the command line is :mod:`walshkv_research.cli.rope`'s.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from walshkv.cache import make_cache
from walshkv.codecs import parse_cache_spec
from walshkv.constants import Score
from walshkv.data import describe_scored, make_windows, scored_positions
from walshkv.defaults import CTX, WINDOWS
from walshkv.eval.harness import forward_logits
from walshkv.eval.metrics import TokenMetrics, compare_logits
from walshkv.eval.report import calibration_meta, run_meta
from walshkv_research.primepe import (
    CONVENTIONS,
    GENERATORS,
    PAIRINGS,
    frequency_factors,
    rope_factors_applied,
    rotary_tables,
)

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = ["DEFAULT_ALPHAS", "NONE", "RopeSweepResult", "measure_rope_sweep"]

DEFAULT_ALPHAS: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
#: The generator, convention and cache name of the unmodified model and of the uncompressed cache.
NONE = "none"


@dataclass
class RopeSweepResult:
    """``meta`` describes the run; ``rows`` has one dict per (generator, convention, alpha, codec)."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.rows}


def _configs(
    alphas: Sequence[float], generators: Sequence[str], conventions: Sequence[str]
) -> list[tuple[str, str, float]]:
    configs = [(NONE, NONE, 0.0)] if 0.0 in alphas else []
    for gen in generators:
        for conv in conventions:
            configs += [(gen, conv, a) for a in alphas if a != 0.0]
    return configs


@torch.inference_mode()
def measure_rope_sweep(
    lm: LoadedModel,
    text: Text,
    *,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    generators: Sequence[str] = ("composite", "prime"),
    conventions: Sequence[str] = CONVENTIONS,
    pairing: str = "published",
    codecs: Sequence[str] = (),
    ctx: int = CTX,
    windows: int | None = WINDOWS,
    score: Score = "half",
    calibration: CalibrationLike | None = None,
    progress: bool = True,
    command: str = "",
) -> RopeSweepResult:
    """Perplexity and KLD of PrimePE against the unmodified model, with and without KV codecs.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text` to evaluate on.
        alphas: blend weights in ``[0, 1]``; 0 is the unmodified rotary embedding.
        generators: from :data:`~walshkv_research.primepe.GENERATORS`.
        conventions: ``multiply`` and/or ``divide``.
        pairing: ``published`` or ``matched`` (see :mod:`walshkv_research.primepe`).
        codecs: cache specs to compose with (every configuration also runs uncompressed).
        ctx, windows, score: as for ``walshkv eval``.
        calibration: for calibrated codecs (computed on the unmodified model).
        progress: show a progress bar.
        command: the command line, recorded in the result.

    Returns:
        A :class:`RopeSweepResult`.
    """
    for a in alphas:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"--alpha values must be in [0, 1], got {a}")
    for g in generators:
        if g not in GENERATORS:
            raise ValueError(f"--generator must be among {', '.join(GENERATORS)}, got {g!r}")
    for c in conventions:
        if c not in CONVENTIONS:
            raise ValueError(f"--convention must be among {', '.join(CONVENTIONS)}, got {c!r}")
    if pairing not in PAIRINGS:
        raise ValueError(f"--pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
    specs = [parse_cache_spec(c) for c in codecs]
    for spec in specs:
        spec.check_head_dim(lm.shape.head_dim)
        make_cache(spec, config=lm.model.config, calibration=calibration)  # fail before any forward
    configs = _configs(alphas, generators, conventions)
    if not configs:
        raise ValueError("nothing to run: give at least one alpha")
    caches = [NONE, *[s.spec for s in specs]]
    model = lm.model
    device = next(model.parameters()).device
    first, last = scored_positions(ctx, score)
    win = make_windows(lm.tokenizer, text.content, ctx, windows)
    n_win = win.ids.shape[0]
    keep = ctx - first
    metrics = {(c, k): TokenMetrics() for c in configs for k in caches}
    factor_range: dict[tuple[str, str, float], tuple[float, float]] = {}
    for gen, _conv, a in configs:
        if gen != NONE:
            fs = [frequency_factors(getattr(m, b), gen, a, pairing) for _, m, b in rotary_tables(model)]
            factor_range[(gen, _conv, a)] = (min(float(f.min()) for f in fs), max(float(f.max()) for f in fs))
    bar = tqdm(total=n_win * (1 + len(configs) * len(caches)), desc="rope sweep", unit="fwd", disable=not progress)
    started = time.perf_counter()
    for w in range(n_win):
        ids = win.ids[w : w + 1].to(device)
        targets = win.ids[w, first + 1 : last + 1].to(device)
        ref = forward_logits(model, ids, DynamicCache(config=model.config), keep)[: last - first]
        bar.update()
        for gen, conv, a in configs:
            bar.set_postfix_str(f"window {w + 1}/{n_win}: {gen} {conv} alpha={a:g}")
            for cache_name, spec in zip(caches, [None, *specs], strict=True):
                if gen == NONE and cache_name == NONE:
                    logits = ref  # the unmodified, uncompressed model is the reference itself
                else:
                    cache = (
                        DynamicCache(config=model.config)
                        if spec is None
                        else make_cache(spec, config=model.config, calibration=calibration)
                    )
                    if gen == NONE:
                        logits = forward_logits(model, ids, cache, keep)[: last - first]
                    else:
                        with rope_factors_applied(model, gen, a, conv, pairing):
                            logits = forward_logits(model, ids, cache, keep)[: last - first]
                metrics[((gen, conv, a), cache_name)].add(*compare_logits(ref, logits, targets))
                bar.update()
    bar.close()
    rows = []
    for cfg in configs:
        for cache_name in caches:
            gen, conv, a = cfg
            row: dict[str, Any] = {"generator": gen, "convention": conv, "alpha": a, "codec": cache_name}
            row.update(metrics[(cfg, cache_name)].summary())
            lo, hi = factor_range.get(cfg, (1.0, 1.0))
            row.update({"factor_min": lo, "factor_max": hi})
            rows.append(row)
    meta = run_meta(
        lm,
        text,
        text_tokens=win.text_tokens,
        started=started,
        rotary_tables=[q for q, _, _ in rotary_tables(model)],
        ctx=ctx,
        windows=n_win,
        window_starts=[w * ctx for w in range(n_win)],
        score=score,
        scored_positions=describe_scored(first, last),
        scored_tokens=n_win * (last - first),
        bos_first_token=win.bos,
        pairing=pairing,
        reference="the same model, unmodified rotary embedding, uncompressed DynamicCache",
        codecs=list(caches[1:]),
        calibration=calibration_meta(calibration),
        quantize_on_write=True,
        command=command,
    )
    return RopeSweepResult(meta, rows)
