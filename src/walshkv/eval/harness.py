"""The evaluation protocol behind ``walshkv eval``.

For each window of ``ctx`` tokens (each from an empty cache, one forward per window):

1. the reference: the same model with an uncompressed float cache (transformers'
   ``DynamicCache`` at the model's dtype, float32 by default), computed once per
   window and reused for every codec;
2. for each codec: the same forward with a :class:`~walshkv.cache.CompressedCache`,
   so the whole window's K/V is compressed on write before attention reads it
   (``feed="window"``).

Hugging Face's ``QuantizedCache`` (``hf-quanto:B``, ``hf-hqq:B``, ``hf-fp8``) returns the
first write unquantized, so one forward per window would measure nothing. Those caches are
fed as in generation (``feed="decode"``): the unscored prefix in one forward, then every
scored token in its own forward. Each such row records how much of the context its scored
tokens saw in full precision. So does each KIVI row (``kivi2``, ``kivi4``): KIVI keeps its newest tokens
in an fp16 window, so those rows are not quantize-on-write either.

Scored logits (see :func:`~walshkv.data.scored_positions`) are compared in
float64 over the full vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from walshkv.cache import Footprint, context_state, footprint, fp_bytes, make_cache, prefill_is_exact
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, NamedSpec, SpecLike, name_spec
from walshkv.constants import Feed, Prefill, Score
from walshkv.data import describe_scored, make_windows, scored_positions
from walshkv.defaults import CTX, WINDOWS
from walshkv.eval.metrics import HeadLogits, ReferenceRows, TokenMetrics, compare_logits
from walshkv.eval.report import calibration_meta, run_meta
from walshkv.eval.rows import ResultRow

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "DEFAULT_CODECS",
    "FEEDS",
    "HEAD_LOGITS_MODELS",
    "EvalResult",
    "ResultRow",
    "evaluate",
    "forward_logits",
    "forward_scored",
    "output_head",
]

DEFAULT_CODECS = ("fp16", "int8", "int4", "rot+int4", "int3", "rot+int3", "int2", "rot+int2")


@dataclass
class EvalResult:
    """``meta`` describes the run; ``results`` has one :class:`ResultRow` (a dict) per codec."""

    meta: dict[str, Any]
    results: list[ResultRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.results}


FEEDS: tuple[Feed, ...] = ("auto", "window", "decode")
PREFILLS: tuple[Prefill, ...] = ("quantized", "exact")
#: The meta's ``prefill`` entry.
PREFILL_NOTES: dict[Prefill, str] = {
    "quantized": "quantize on write: every token attention reads was compressed first, the current block's included",
    "exact": (
        "serving-engine style (vLLM's TurboQuant backend, Hugging Face's QuantizedCache): the unscored prefix "
        "attends to its own exact K/V, which the cache stores compressed; scored tokens are decoded over the "
        "compressed cache"
    ),
}


def forward_logits(model: Any, ids: torch.Tensor, cache: Any, keep: int) -> torch.Tensor:
    """Logits ``[keep, vocab]`` of the last ``keep`` positions of one sequence ``ids`` ``[1, seq_len]``,
    the K/V going through ``cache`` (quantize on write for a compressed cache)."""
    out = model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=keep)
    return out.logits[0]


#: Causal LMs whose forward is ``logits = head(decoder(...).last_hidden_state[-keep:])``, with gemma's final
#: logit softcap where the config sets one: for these :func:`forward_scored` keeps hidden states, not logits
#: (tests/eval/test_harness.py checks each against the model's own forward).
HEAD_LOGITS_MODELS = frozenset(
    {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM"}
)


def output_head(model: Any) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The model's hidden-states-to-logits step (``lm_head``, then the final logit softcap if the config has one),
    or ``None`` for a model outside :data:`HEAD_LOGITS_MODELS`."""
    if type(model).__name__ not in HEAD_LOGITS_MODELS:
        return None
    lm_head = model.lm_head
    cap = getattr(model.config, "final_logit_softcapping", None)

    def head(hidden: torch.Tensor) -> torch.Tensor:
        logits = lm_head(hidden)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    return head


def forward_scored(model: Any, ids: torch.Tensor, cache: Any, keep: int) -> torch.Tensor | HeadLogits:
    """As :func:`forward_logits`, but for a model of :data:`HEAD_LOGITS_MODELS` the last ``keep`` positions come
    back as :class:`~walshkv.eval.metrics.HeadLogits` (hidden states ``[keep, hidden]``, logits made by rows in
    :func:`~walshkv.eval.metrics.compare_logits`): at 32k tokens the float32 logits of a scored half would take
    about 10 GB per forward on a 152k-token vocabulary."""
    head = output_head(model)
    if head is None:
        return forward_logits(model, ids, cache, keep)
    out = model.model(input_ids=ids, cache=cache, use_cache=True)
    return HeadLogits(out.last_hidden_state[0, -keep:], head, model.lm_head.out_features)


def _decode(
    model: Any, ids: torch.Tensor, cache: Any, first: int, last: int, chunk: int = 1
) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """Prefix ``0..first-1`` in one forward, then positions ``first..last-1`` ``chunk`` tokens per forward.

    Returns:
        ``(logits [last - first, vocab], per scored token (positions it attended to, of which held in full
        precision with the token itself, of which earlier than the token))``, from
        :func:`~walshkv.cache.context_state` (its first full-attention layer).
    """
    if first > 0:
        forward_scored(model, ids[:, :first], cache, 1)
    rows, states = [], []
    for p in range(first, last, chunk):
        n = min(chunk, last - p)
        cached, window, exact = context_state(cache)
        exact = exact or (n > 1 and prefill_is_exact(cache))
        for j in range(n):  # earlier tokens of this forward are full precision too if the cache shows them so
            earlier = window + (j if exact else 0)
            states.append((cached + j + 1, earlier + exact, earlier))
        rows.append(forward_scored(model, ids[:, p : p + n], cache, n))
    return HeadLogits.cat(rows), states


def _window_states(cache: Any, first: int, last: int) -> list[tuple[int, int, int]]:
    """:func:`_decode`'s per-token states for positions ``first..last-1`` of a window written in one forward.

    Attention read the tokens as the cache held them after the write (:func:`~walshkv.cache.context_state`,
    its first full-attention layer): the last ``window`` of them in full precision (KIVI's fp16 window), the rest
    quantized.
    """
    cached, window, _ = context_state(cache)
    quantized = cached - window  # positions 0..quantized-1 were read quantized
    return [(p + 1, max(0, p + 1 - quantized), max(0, p - quantized)) for p in range(first, last)]


def _fp_window(spec: CacheSpec | HFCacheSpec) -> int | None:
    """The full-precision window a spec keeps by design (``hf-*``: ``r=``; KIVI: ``r=``), else ``None``."""
    if isinstance(spec, HFCacheSpec):
        return spec.residual
    return spec.k.residual if isinstance(spec.k, KiviCodec) else None


def _feed_for(spec: CacheSpec | HFCacheSpec, feed: Feed, prefill: Prefill = "quantized") -> Feed:
    if feed == "auto":
        return "decode" if isinstance(spec, HFCacheSpec) or prefill == "exact" else "window"
    if feed == "window" and prefill == "exact":
        raise ValueError(
            "prefill='exact' shows a forward its own K/V as computed: one forward per window would read nothing "
            "compressed; use feed='decode' (CLI: --feed decode) or 'auto'"
        )
    if feed == "window" and isinstance(spec, HFCacheSpec):
        raise ValueError(
            f"{spec.spec} returns the first write unquantized: one forward per window would measure nothing; "
            "use feed='decode' (CLI: --feed decode) or 'auto'"
        )
    return feed


@dataclass
class _SpecRun:
    """One spec's measurement over the windows: the parsed spec, how it is fed, and what it accumulates."""

    spec: CacheSpec | HFCacheSpec
    feed: Feed
    fp_window: int | None  # the full-precision window it keeps by design (KIVI, hf-*), else None
    label: str | None = None  # the preset's or engine cache's name it was asked by (NamedSpec.label)
    metrics: TokenMetrics = field(default_factory=TokenMetrics)
    seconds: float = 0.0
    held: Footprint | None = None  # the cache after the first window
    # per scored token: (positions attended to, of which full precision with the token, of which earlier)
    fp_context: list[tuple[int, int, int]] = field(default_factory=list)

    def row(self, fp16_bytes: int, prefill: Prefill, decode_chunk: int) -> ResultRow:
        """The result row: its ``codec`` the spec's canonical text (the one string form files and JSON carry), and
        ``preset`` the name it was asked by, for a preset or an engine's cache."""
        assert self.held is not None  # every run sees at least one window
        row: ResultRow = {
            "codec": self.spec.spec,
            **self.metrics.summary(),
            "bits_k": self.held.bits_k,
            "bits_v": self.held.bits_v,
            "bits_per_element": self.held.bits_per_element,
            "compression": 16.0 / self.held.bits_per_element,
            "kv_bytes": self.held.kv_bytes,
            "kv_bytes_fp16": fp16_bytes,
            "seconds": self.seconds,
            "feed": self.feed,
            "prefill": prefill,
            "quantize_on_write": self.fp_window is None and prefill == "quantized",
        }
        states = self.fp_context
        if states:  # decode-fed and KIVI rows: how much of what attention read was full precision
            row["fp_context_mean"] = sum(fp / seen for seen, fp, _ in states) / len(states)
            # every earlier position it attended to was quantized (the token itself may be exact)
            row["scored_quantized_context_share"] = sum(earlier == 0 for _, _, earlier in states) / len(states)
            if self.feed == "decode":
                row["decode_chunk"] = decode_chunk
        if self.fp_window is not None:
            row["fp_window"] = self.fp_window
        if self.label is not None:
            row["preset"] = self.label
        return row


@torch.inference_mode()
def evaluate(
    lm: LoadedModel,
    text: Text,
    codecs: Sequence[SpecLike] = DEFAULT_CODECS,
    *,
    ctx: int = CTX,
    windows: int | None = WINDOWS,
    score: Score = "half",
    residual: int = 0,
    calibration: CalibrationLike | None = None,
    feed: Feed = "auto",
    decode_chunk: int = 1,
    prefill: Prefill = "quantized",
    progress: bool = True,
) -> EvalResult:
    """Measure each codec against the uncompressed cache on the same tokens.

    Args:
        lm: the loaded model.
        text: evaluation text.
        codecs: cache specs, as text (``"rot+int4"``, ``"int8/int4"``, ...), parsed (:class:`CacheSpec`) or named
            (:class:`~walshkv.codecs.NamedSpec`: :func:`walshkv.presets.name_specs` gives a model's own presets; a
            preset name as text stands for its built-in spec). A row's ``codec`` is the spec's canonical text; a
            codec asked by a preset's or an engine cache's name also gets that name as ``preset``.
        ctx: tokens per window.
        windows: number of windows (``None``: every full window of the text).
        score: ``"half"`` (second half of each window) or ``"all"``.
        residual: full-precision window of recent tokens (0 = compress every token).
        calibration: :class:`walshkv.calibration.KVStats` from *other* text, for calibrated codecs.
        feed: ``"window"`` (one forward per window, every token compressed on write),
            ``"decode"`` (the unscored prefix in one forward, then one forward per scored token, as in
            generation) or ``"auto"`` (decode for Hugging Face ``hf-*`` caches, window otherwise).
        decode_chunk: scored tokens per forward when decoding (1: exactly as in generation; more is
            faster, and a cache that shows its current write unquantized then shows up to
            ``decode_chunk - 1`` more recent tokens in full precision: measured in ``fp_context_mean``).
        prefill: ``"quantized"`` (quantize on write, the default) or ``"exact"`` (serving-engine style: the
            unscored prefix attends to its own exact K/V, stored compressed; then the scored tokens are decoded
            over the compressed cache; implies ``feed="decode"``), as for :class:`~walshkv.cache.CompressedCache`.
        progress: show a progress bar.

    Returns:
        An :class:`EvalResult`.
    """
    # parsed once (fail fast on typos); a spec given twice (in any spelling) is measured once, under the first name
    named: dict[str, NamedSpec] = {}
    for n in map(name_spec, codecs):
        named.setdefault(n.text, n)
    specs = [n.spec for n in named.values()]
    if not specs:
        raise ValueError("give at least one --codec")
    if feed not in FEEDS:
        raise ValueError(f"feed must be one of {', '.join(FEEDS)}, got {feed!r}")
    if prefill not in PREFILLS:
        raise ValueError(f"prefill must be one of {', '.join(PREFILLS)}, got {prefill!r}")
    if decode_chunk < 1:
        raise ValueError(f"decode_chunk must be at least 1 token, got {decode_chunk}")
    head_dim = lm.shape.head_dim
    for spec in specs:
        spec.check_head_dim(head_dim)
        if spec.needs_calibration and calibration is None:
            spec.bind(0, None)  # raises, naming --calib-text
    sources = (calibration, getattr(calibration, "stats", None), getattr(calibration, "bias", None))
    if calibration is not None and text.name in {getattr(c, "text", None) for c in sources if c is not None}:
        raise ValueError(f"calibration text and evaluation text are both {text.name!r}; calibrate on other text")
    for spec in specs:  # bind every codec once now: calibration mismatches fail before any forward
        make_cache(spec, config=lm.model.config, residual=residual, calibration=calibration, prefill=prefill)
    first, last = scored_positions(ctx, score)
    win = make_windows(lm.tokenizer, text.content, ctx, windows)
    n_win = win.ids.shape[0]
    keep = ctx - first  # logits for positions first .. ctx-1; the last one has no target
    runs = [_SpecRun(n.spec, _feed_for(n.spec, feed, prefill), _fp_window(n.spec), n.label) for n in named.values()]
    model = lm.model
    device = next(model.parameters()).device
    bar = tqdm(total=n_win * (len(specs) + 1), desc="eval", unit="fwd", disable=not progress)
    started = time.perf_counter()
    for w in range(n_win):
        ids = win.ids[w : w + 1].to(device)
        targets = win.ids[w, first + 1 : last + 1].to(device)
        bar.set_postfix_str(f"window {w + 1}/{n_win}: reference")
        # the reference's float64 side of the comparison, made once per window for every spec
        ref = ReferenceRows(forward_scored(model, ids, DynamicCache(config=model.config), keep)[: last - first])
        bar.update()
        for run in runs:
            bar.set_postfix_str(f"window {w + 1}/{n_win}: {run.spec.spec}")
            t0 = time.perf_counter()
            cache = make_cache(
                run.spec, config=model.config, residual=residual, calibration=calibration, prefill=prefill
            )
            if run.feed == "decode":
                logits, states = _decode(model, ids, cache, first, last, decode_chunk)
                run.fp_context.extend(states)
            else:
                logits = forward_scored(model, ids, cache, keep)[: last - first]
                if run.fp_window is not None:  # KIVI: its newest tokens stayed in fp16
                    run.fp_context.extend(_window_states(cache, first, last))
            run.seconds += time.perf_counter() - t0
            if run.held is None:
                run.held = footprint(cache)  # after the first window
            run.metrics.add(*compare_logits(ref, logits, targets))
            del cache
            bar.update()
    bar.close()
    fp16_bytes = fp_bytes(lm.model.config, ctx)
    results = [run.row(fp16_bytes, prefill, decode_chunk) for run in runs]
    meta = run_meta(
        lm,
        text,
        text_tokens=win.text_tokens,
        ctx=ctx,
        windows=n_win,
        tokens_evaluated=n_win * ctx,
        window_starts=[w * ctx for w in range(n_win)],
        score=score,
        scored_positions=describe_scored(first, last),
        scored_tokens=n_win * (last - first),
        bos_first_token=win.bos,
        residual=residual,
        calibration=calibration_meta(calibration),
        reference=f"same model, uncompressed DynamicCache at {next(model.parameters()).dtype!s}",
        quantize_on_write=_quantize_on_write(specs) if prefill == "quantized" else "no: prefill='exact'",
        prefill=PREFILL_NOTES[prefill],
        feed={
            "window": "one forward per window; every token compressed on write before attention reads it",
            "decode": f"tokens 0..{first - 1} in one forward, then {decode_chunk} scored position(s) per forward"
            + (" (as in generation)" if decode_chunk == 1 else ""),
        },
        kv_bytes_note="bytes held by the cache after one window of ctx tokens, batch 1",
        metrics_dtype="float64, full vocabulary",
        started=started,
    )
    return EvalResult(meta, results)


def _quantize_on_write(specs: Sequence[CacheSpec | HFCacheSpec]) -> bool | str:
    """The meta's ``quantize_on_write``: ``True``, or which rows are not (``hf-*`` and KIVI, by design)."""
    kinds = []
    if any(isinstance(s, HFCacheSpec) for s in specs):
        kinds.append("hf-* caches: no, by design")
    if any(isinstance(s, CacheSpec) and isinstance(s.k, KiviCodec) for s in specs):
        kinds.append("kivi: no, its newest r to r+g-1 tokens stay in fp16")
    return f"per row ({'; '.join(kinds)})" if kinds else True
