"""The evaluation protocol behind ``walshkv eval``.

For each window of ``ctx`` tokens (each from an empty cache, one forward per window):

1. the reference: the same model with an uncompressed float cache (transformers'
   ``DynamicCache`` at the model's dtype, float32 by default), computed once per
   window and reused for every codec;
2. for each codec: the same forward with a :class:`~walshkv.cache.CompressedCache`,
   so the whole window's K/V is compressed on write before attention reads it.

Scored logits (see :func:`~walshkv.eval.windows.scored_positions`) are compared in
float64 over the full vocabulary.
"""

from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import torch

from walshkv.cache import CompressedCache
from walshkv.codecs.spec import parse_cache_spec
from walshkv.data import Text
from walshkv.eval.metrics import TokenMetrics, compare_logits
from walshkv.eval.windows import make_windows, scored_positions
from walshkv.models import LoadedModel

__all__ = ["DEFAULT_CODECS", "EvalResult", "evaluate"]

DEFAULT_CODECS = ("fp16", "int8", "int4", "rot+int4", "int3", "rot+int3", "int2", "rot+int2")


@dataclass
class EvalResult:
    """``meta`` describes the run; ``results`` has one dict of metrics per codec."""

    meta: dict[str, Any]
    results: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.results}


def library_versions() -> dict[str, str]:
    """Versions recorded in every result file."""
    import transformers

    import walshkv

    return {
        "walshkv": walshkv.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def _forward(model: Any, ids: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[0]


@torch.inference_mode()
def evaluate(
    lm: LoadedModel,
    text: Text,
    codecs: list[str] | tuple[str, ...] = DEFAULT_CODECS,
    *,
    ctx: int = 512,
    windows: int | None = 8,
    score: str = "half",
    residual: int = 0,
    calibration: Any = None,
    progress: bool = True,
) -> EvalResult:
    """Measure each codec against the uncompressed cache on the same tokens.

    Args:
        lm: the loaded model.
        text: evaluation text.
        codecs: cache specs (``"rot+int4"``, ``"int8/int4"``, ...).
        ctx: tokens per window.
        windows: number of windows (``None``: every full window of the text).
        score: ``"half"`` (second half of each window) or ``"all"``.
        residual: full-precision window of recent tokens (0 = compress every token).
        calibration: :class:`walshkv.calibration.KVStats` from *other* text, for calibrated codecs.
        progress: show a progress bar.

    Returns:
        An :class:`EvalResult`.
    """
    from transformers import DynamicCache

    specs = [parse_cache_spec(c) for c in codecs]  # fail fast on typos
    if not specs:
        raise ValueError("give at least one --codec")
    head_dim = lm.info["head_dim"]
    for spec in specs:
        spec.check_head_dim(head_dim)
        if spec.needs_calibration and calibration is None:
            spec.bind(0, None)  # raises, naming --calib-text
    sources = (calibration, getattr(calibration, "stats", None), getattr(calibration, "bias", None))
    if calibration is not None and text.name in {getattr(c, "text", None) for c in sources if c is not None}:
        raise ValueError(f"calibration text and evaluation text are both {text.name!r}; calibrate on other text")
    for spec in specs:  # bind every codec once now: calibration mismatches fail before any forward
        CompressedCache(spec, config=lm.model.config, residual=residual, calibration=calibration)
    first, last = scored_positions(ctx, score)
    win = make_windows(lm.tokenizer, text.content, ctx, windows)
    n_win = win.ids.shape[0]
    keep = ctx - first  # logits for positions first .. ctx-1; the last one has no target
    metrics = {s.spec: TokenMetrics() for s in specs}
    kv_bytes: dict[str, int] = {}
    layout_bits: dict[str, float] = {}
    kv_bits: dict[str, tuple[float, float]] = {}
    seconds = dict.fromkeys(metrics, 0.0)
    model = lm.model
    device = next(model.parameters()).device

    from tqdm.auto import tqdm

    bar = tqdm(total=n_win * (len(specs) + 1), desc="eval", unit="fwd", disable=not progress)
    started = time.perf_counter()
    for w in range(n_win):
        ids = win.ids[w : w + 1].to(device)
        targets = win.ids[w, first + 1 : last + 1].to(device)
        bar.set_postfix_str(f"window {w + 1}/{n_win}: reference")
        ref = _forward(model, ids, DynamicCache(config=model.config), keep)[: last - first]
        bar.update()
        for spec in specs:
            bar.set_postfix_str(f"window {w + 1}/{n_win}: {spec.spec}")
            t0 = time.perf_counter()
            cache = CompressedCache(spec, config=model.config, residual=residual, calibration=calibration)
            logits = _forward(model, ids, cache, keep)[: last - first]
            seconds[spec.spec] += time.perf_counter() - t0
            if w == 0:
                kv_bytes[spec.spec] = cache.nbytes()
                layout_bits[spec.spec] = cache.bits_per_element()
                kv_bits[spec.spec] = cache.bits_per_element_kv()
            metrics[spec.spec].add(*compare_logits(ref, logits, targets))
            del cache
            bar.update()
    bar.close()

    fp16_bytes = _fp16_bytes(lm, ctx)
    results = []
    for spec in specs:
        row: dict[str, Any] = {"codec": spec.spec}
        row.update(metrics[spec.spec].summary())
        bits = layout_bits[spec.spec]
        row.update(
            {
                "bits_k": kv_bits[spec.spec][0],
                "bits_v": kv_bits[spec.spec][1],
                "bits_per_element": bits,
                "compression": 16.0 / bits,
                "kv_bytes": kv_bytes[spec.spec],
                "kv_bytes_fp16": fp16_bytes,
                "seconds": seconds[spec.spec],
            }
        )
        results.append(row)
    meta = {
        "model": {"name": lm.name, "source": lm.source, **lm.info},
        "text": {"name": text.name, "source": text.source, "chars": len(text.content), "tokens": win.text_tokens},
        "ctx": ctx,
        "windows": n_win,
        "tokens_evaluated": n_win * ctx,
        "window_starts": [w * ctx for w in range(n_win)],
        "score": score,
        "scored_positions": (
            f"logits at positions {first}..{last - 1} of each window, predicting tokens "
            f"{first + 1}..{last} ({last - first} per window)"
        ),
        "scored_tokens": n_win * (last - first),
        "bos_first_token": win.bos,
        "residual": residual,
        "calibration": None if calibration is None else calibration.describe(),
        "reference": f"same model, uncompressed DynamicCache at {next(model.parameters()).dtype!s}",
        "quantize_on_write": True,
        "kv_bytes_note": "bytes held by the cache after one window of ctx tokens, batch 1",
        "metrics_dtype": "float64, full vocabulary",
        "seconds_total": time.perf_counter() - started,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": library_versions(),
    }
    return EvalResult(meta, results)


def _fp16_bytes(lm: LoadedModel, ctx: int) -> int:
    """Bytes an fp16 cache holds for one window of ``ctx`` tokens (sliding layers capped)."""
    cache = CompressedCache("fp16", config=lm.model.config)
    cfg = lm.model.config.get_text_config(decoder=True)
    total = 0
    for layer in cache.layers:
        tokens = min(ctx, layer.sliding_window - 1) if getattr(layer, "is_sliding", False) else ctx
        total += 2 * 2 * tokens * cfg.num_key_value_heads * lm.info["head_dim"]
    return total
