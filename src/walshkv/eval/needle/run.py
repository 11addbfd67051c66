"""Running ``walshkv needle``: every cache on the same prompts, prefilled in chunks, decoded greedily, scored.

:func:`run_needle` takes the trials (:func:`~walshkv.eval.needle.trials.make_trials`) and a
:class:`NeedleConfig` (the caches and how each reads a prompt) and runs in four steps: check the inputs
against the model, bind every cache once, the trial loop (the uncompressed reference, then each codec, per
group of trials that share a prefix), and the result (rows, cells, summaries and the meta).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, get_args

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from walshkv.cache import (
    CompressedCache,
    croppable_to_prefix,
    enable_fused_attention,
    footprint,
    make_cache,
)
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, SpecLike, check_spec_list, name_spec
from walshkv.constants import Prefill
from walshkv.eval.needle.cells import BASELINE, INTERVALS_NOTE, MIN_BASELINE, NeedleResult
from walshkv.eval.needle.scoring import complete_numbers, score_answer
from walshkv.eval.needle.trials import NEEDLE_PATTERN, Trial
from walshkv.eval.report import calibration_meta, run_meta

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = ["DEFAULT_NEEDLE_CODECS", "NeedleConfig", "run_needle"]

DEFAULT_NEEDLE_CODECS: tuple[str, ...] = ("rot+int4", "q4_0")

#: A cache under test: its name in the rows and its spec (``None``: the uncompressed reference).
_Cache = tuple[str, CacheSpec | HFCacheSpec | None]
#: Per cache name: the longest trial length it ran and its bits per element and bytes after that trial.
_Sizes = dict[str, tuple[int, dict[str, float | int]]]


@dataclass(frozen=True)
class NeedleConfig:
    """How :func:`run_needle` runs its trials: the caches under test and how each reads a prompt.

    Attributes:
        codecs: cache specs: text, parsed, or :class:`~walshkv.codecs.NamedSpec` (presets resolved for the model:
            :func:`walshkv.presets.name_specs`; a preset name as text stands for its built-in spec); may be empty
            (the reference alone, to check that the model succeeds before measuring codecs). Kept as a tuple.
        calibration: what calibrated specs need (from other text than the haystack's).
        prefill: ``"quantized"`` (quantize on write, walshkv's convention) or ``"exact"`` (the prompt's chunks
            attend to their own exact K/V, stored compressed: the serving-engine convention).
        residual: full-precision window of recent tokens for walshkv codecs (0: every token compressed).
        prefill_chunk: prompt tokens per forward.
        fused: attention reads walshkv's packed codes directly (:func:`walshkv.cache.enable_fused_attention`; the
            model's attention implementation is restored afterwards): same quantization, faster decoding.
        share_prefix: the trials of one (task, length, sample) differ only from their first needle on, so each
            cache, run over them deepest needle first, keeps the prompt tokens the previous trial had in common
            (``cache.crop``) and prefills the rest: the same codes (every token is compressed on its own), so the
            same answers up to float rounding, for less work. Caches that cannot be cropped to what a fresh one
            holds (KIVI, ``hf-*``, sliding windows, ``residual``) always start empty. ``reused_tokens`` in the rows.
        min_baseline: the reference accuracy a (task, length) needs for the codecs' numbers there to count.
        presets: ``{spec: preset name}`` for rows of specs that stand for presets, added to the names the
            :class:`~walshkv.codecs.NamedSpec` codecs carry (their ``label``).
        progress: show a progress bar.
        specs: the parsed ``codecs`` (set from them; not an argument).

    Raises:
        ValueError: ``codecs`` a single string or with a spec that does not parse, twice or named ``uncompressed``;
            ``prefill`` not one of ``quantized``, ``exact``; ``prefill_chunk`` below 1; ``min_baseline`` outside
            ``[0, 1]``; ``residual`` below 0.
    """

    codecs: Sequence[SpecLike] = DEFAULT_NEEDLE_CODECS
    calibration: CalibrationLike | None = None
    prefill: Prefill = "quantized"
    residual: int = 0
    prefill_chunk: int = 1024
    fused: bool = False
    share_prefix: bool = True
    min_baseline: float = MIN_BASELINE
    presets: Mapping[str, str] | None = None
    progress: bool = True
    specs: tuple[CacheSpec | HFCacheSpec, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_spec_list(self.codecs)
        if self.prefill not in get_args(Prefill):
            raise ValueError(f"prefill must be one of {', '.join(get_args(Prefill))}, got {self.prefill!r}")
        if self.prefill_chunk < 1:
            raise ValueError(f"--prefill-chunk must be at least 1 token, got {self.prefill_chunk}")
        if not 0.0 <= self.min_baseline <= 1.0:
            raise ValueError(f"--min-baseline must be a share in [0, 1] (0.8 = 80%), got {self.min_baseline}")
        if self.residual < 0:
            raise ValueError(f"--residual must be at least 0 tokens, got {self.residual}")
        named = [name_spec(c) for c in self.codecs]
        specs = tuple(n.spec for n in named)
        names = [s.spec for s in specs]
        if len(set(names)) != len(names) or BASELINE in names:
            raise ValueError(
                f"each --codec once, and not {BASELINE!r} (the reference runs anyway): got {', '.join(names)}"
            )
        labels = {n.text: n.label for n in named if n.label is not None}
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "presets", {**labels, **(self.presets or {})} or None)

    @property
    def caches(self) -> list[_Cache]:
        """``(name, spec)`` of every cache a trial runs with: the reference (spec ``None``) first, then each codec
        under its canonical spec."""
        return [(BASELINE, None), *((s.spec, s) for s in self.specs)]


@torch.inference_mode()
def run_needle(
    lm: LoadedModel, text: Text, trials: Sequence[Trial], config: NeedleConfig | None = None, **meta_fields: Any
) -> NeedleResult:
    """Run every trial with the uncompressed reference and with each codec; score; summarise.

    Args:
        lm: the loaded model.
        text: the haystack text the trials were made from (recorded in the meta).
        trials: from :func:`~walshkv.eval.needle.trials.make_trials` (one or more tasks).
        config: the caches and how they run (default ``NeedleConfig()``: :data:`DEFAULT_NEEDLE_CODECS`).
        **meta_fields: more entries for the meta (the command line, the trials' settings).

    Returns:
        A :class:`~walshkv.eval.needle.cells.NeedleResult`: one row per (trial, cache), the reference first.

    Raises:
        ValueError: no trials, a spec that does not fit the model, calibration missing or made on ``text``.
    """
    config = NeedleConfig() if config is None else config
    _check_inputs(lm, text, trials, config)
    with _attention(lm.model, config.fused):
        build = _cache_builder(lm.model, config)
        started = time.perf_counter()
        rows, sizes = _run_trials(lm, trials, build, config)
        seconds = time.perf_counter() - started
    return _result(lm, text, trials, config, rows, sizes, seconds, meta_fields)


# Step 1: the inputs against the model ------------------------------------------------------------------------


def _check_inputs(lm: LoadedModel, text: Text, trials: Sequence[Trial], config: NeedleConfig) -> None:
    """Refuse, before any forward, what cannot run: no trials, a spec the model's heads do not fit, a calibrated
    spec without calibration, calibration made on the haystack's own text."""
    if not trials:
        raise ValueError("no trials: give at least one task, length, depth and sample")
    calibration = config.calibration
    for spec in config.specs:
        spec.check_head_dim(lm.shape.head_dim)
        if spec.needs_calibration and calibration is None:
            spec.bind(0, None)  # raises, naming --calib-text / --kv-mean-center
    sources = (calibration, getattr(calibration, "stats", None), getattr(calibration, "bias", None))
    if calibration is not None and text.name in {getattr(c, "text", None) for c in sources if c is not None}:
        raise ValueError(f"calibration text and haystack text are both {text.name!r}; calibrate on other text")


# Step 2: the caches ------------------------------------------------------------------------------------------


@contextmanager
def _attention(model: Any, fused: bool) -> Iterator[None]:
    """With ``fused``, attention reads packed codes inside the block; the model's own implementation after it."""
    base_impl = model.config._attn_implementation
    if fused:
        enable_fused_attention(model)
    try:
        yield
    finally:
        if fused:
            model.set_attn_implementation(base_impl)


def _cache_builder(model: Any, config: NeedleConfig) -> Callable[[CacheSpec | HFCacheSpec | None], Any]:
    """A function that makes an empty cache for a spec (``None``: the reference's ``DynamicCache``); every codec is
    bound once here, so a calibration mismatch fails before any forward."""

    def build(spec: CacheSpec | HFCacheSpec | None) -> Any:
        if spec is None:
            return DynamicCache(config=model.config)
        if isinstance(spec, HFCacheSpec):
            return make_cache(spec, model.config)
        return CompressedCache(
            spec,
            config=model.config,
            residual=config.residual,
            calibration=config.calibration,
            fused=config.fused,
            prefill=config.prefill,
        )

    for spec in config.specs:
        build(spec)
    return build


# Step 3: the trial loop --------------------------------------------------------------------------------------


def _run_trials(
    lm: LoadedModel,
    trials: Sequence[Trial],
    build: Callable[[CacheSpec | HFCacheSpec | None], Any],
    config: NeedleConfig,
) -> tuple[list[dict[str, Any]], _Sizes]:
    """Every trial with every cache: per group of trials that share a prefix (:func:`_share_groups`), each cache
    over the group, reusing what the previous trial's prompt had in common where the cache can be cropped.

    Returns:
        ``(rows, sizes)``: one row per (trial, cache) in trial order, the reference first; per cache name its
        longest trial's length and footprint (:func:`_cache_bits`).
    """
    stop = _stop_ids(lm)
    dtype = next(lm.model.parameters()).dtype
    caches = config.caches
    sizes: _Sizes = {}
    done: dict[tuple[int, int], dict[str, Any]] = {}
    groups = _share_groups(trials) if config.share_prefix else [[i] for i in range(len(trials))]
    bar = tqdm(total=len(trials) * len(caches), desc="needle", unit="trial", disable=not config.progress)
    for group in groups:
        for c, (name, spec) in enumerate(caches):
            cache, previous = None, ()
            for i in group:
                trial = trials[i]
                bar.set_postfix_str(f"{trial.task} L={trial.length} d={trial.depth:g}: {name}")
                cache, reuse = _cache_for(trial, cache, previous, partial(build, spec), config.residual)
                done[(i, c)] = _trial_row(lm, trial, name, cache, reuse, config, stop)
                previous = trial.ids
                if name not in sizes or trial.length > sizes[name][0]:
                    sizes[name] = (trial.length, _cache_bits(cache, spec, dtype))
                bar.update()
            del cache
    bar.close()
    return [done[key] for key in sorted(done)], sizes


def _share_groups(trials: Sequence[Trial]) -> list[list[int]]:
    """Trial indices grouped by (task, length, sample), deepest needle first: consecutive prompts then share the
    haystack up to the next needle."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for i, t in enumerate(trials):
        groups.setdefault((t.task, t.length, t.sample), []).append(i)
    return [sorted(g, key=lambda i: -trials[i].depth) for g in groups.values()]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _cache_for(
    trial: Trial, cache: Any, previous: Sequence[int], fresh: Callable[[], Any], residual: int
) -> tuple[Any, int]:
    """The cache ``trial`` starts from: the previous trial's, cropped to the prompt tokens the two have in common
    (at least one token left to prefill), where it can be cropped to what a fresh cache would hold; else a fresh one.

    Returns:
        ``(cache, reuse)``: ``reuse`` is how many of ``trial.ids`` the cache holds already (0 for a fresh one).
    """
    reuse = 0
    if cache is not None and croppable_to_prefix(cache, residual):
        reuse = min(_common_prefix(previous, trial.ids), trial.prompt_tokens - 1)
    if reuse > 0:
        cache.crop(reuse - cache.get_seq_length())  # keep the first ``reuse`` tokens
        return cache, reuse
    return fresh(), 0


def _stop_ids(lm: LoadedModel) -> set[int]:
    """End-of-sequence token ids: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    for source in (
        getattr(lm.tokenizer, "eos_token_id", None),
        getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return ids


def _generate(
    lm: LoadedModel, trial: Trial, cache: Any, chunk: int, stop: set[int], need: int, reuse: int = 0
) -> tuple[list[int], float, float]:
    """Prefill ``trial.ids[reuse:]`` ``chunk`` tokens per forward (the cache holds the first ``reuse``), then decode
    greedily.

    Returns:
        ``(generated ids, prefill seconds, decode seconds)``; decoding stops at an end-of-sequence token,
        after ``trial.new_tokens`` tokens, or once ``need`` numbers are written.
    """
    model = lm.model
    device = next(model.parameters()).device
    ids = torch.tensor([trial.ids], dtype=torch.long, device=device)  # [1, prompt_tokens]
    t0 = time.perf_counter()
    out = None
    for s in range(reuse, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s : s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    assert out is not None
    t1 = time.perf_counter()
    token = out.logits[0, -1].argmax()
    generated: list[int] = []
    while True:
        generated.append(int(token))
        if generated[-1] in stop or len(generated) >= trial.new_tokens:
            break
        if complete_numbers(lm.tokenizer.decode(generated, skip_special_tokens=True)) >= need:
            break
        out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        token = out.logits[0, -1].argmax()
    return generated, t1 - t0, time.perf_counter() - t1


def _trial_row(
    lm: LoadedModel, trial: Trial, name: str, cache: Any, reuse: int, config: NeedleConfig, stop: set[int]
) -> dict[str, Any]:
    """One trial's answer with the cache ``name`` (``cache``, holding ``reuse`` prompt tokens already), scored: its
    row of the result."""
    generated, t_prefill, t_decode = _generate(lm, trial, cache, config.prefill_chunk, stop, len(trial.answers), reuse)
    output = lm.tokenizer.decode(generated, skip_special_tokens=True)
    correct, score, numbers = score_answer(trial.task, output, trial.answers)
    return {
        "task": trial.task,
        "length": trial.length,
        "depth": trial.depth,
        "sample": trial.sample,
        "codec": name,
        "preset": (config.presets or {}).get(name),
        "correct": correct,
        "score": score,
        "answers": " ".join(trial.answers),
        "numbers": " ".join(numbers),
        "output": output,
        "key": trial.key,
        "prompt_tokens": trial.prompt_tokens,
        "needle_token": trial.needle_token,
        "depth_actual": trial.depth_actual,
        "haystack_tokens": trial.haystack_tokens,
        "haystack_start": trial.haystack_start,
        "reused_tokens": reuse,
        "generated_tokens": len(generated),
        "prefill_seconds": t_prefill,
        "decode_seconds": t_decode,
    }


def _cache_bits(cache: Any, spec: CacheSpec | HFCacheSpec | None, dtype: torch.dtype) -> dict[str, float | int]:
    """Bits per K/V element and bytes a cache held after a trial (the reference: its float dtype)."""
    held = footprint(cache, dtype=dtype if spec is None else None)
    return {"bits_per_element": held.bits_per_element, "kv_bytes": held.kv_bytes}


# Step 4: the result ------------------------------------------------------------------------------------------


def _quantize_on_write(spec: CacheSpec | HFCacheSpec | None, prefill: Prefill) -> bool | None:
    """Whether every token attention read was compressed first (``None`` for the reference)."""
    if spec is None:
        return None
    if isinstance(spec, HFCacheSpec) or isinstance(spec.k, KiviCodec):
        return False
    return prefill == "quantized"


def _codec_meta(config: NeedleConfig, sizes: _Sizes) -> dict[str, dict[str, Any]]:
    """Per cache name: its bits per element and bytes at its longest trial, whether it quantized on write, its
    preset."""
    presets = config.presets or {}
    out = {}
    for name, spec in config.caches:
        length, bits = sizes[name]
        out[name] = {
            **bits,
            "measured_at_length": length,
            "quantize_on_write": _quantize_on_write(spec, config.prefill),
            **({"preset": presets[name]} if name in presets else {}),
        }
    return out


def _result(
    lm: LoadedModel,
    text: Text,
    trials: Sequence[Trial],
    config: NeedleConfig,
    rows: list[dict[str, Any]],
    sizes: _Sizes,
    seconds: float,
    meta_fields: Mapping[str, Any],
) -> NeedleResult:
    """The rows with each cache's bits per element, their cells and summaries, and the meta that describes the run."""
    codec_meta = _codec_meta(config, sizes)
    for row in rows:
        row["bits_per_element"] = codec_meta[row["codec"]]["bits_per_element"]
    min_baseline, prefill = config.min_baseline, config.prefill
    dtype = next(lm.model.parameters()).dtype
    meta = run_meta(
        lm,
        text,
        **meta_fields,
        tasks=list(dict.fromkeys(t.task for t in trials)),
        lengths=sorted({t.length for t in trials}),
        depths=sorted({t.depth for t in trials}),
        samples=max(t.sample for t in trials) + 1,
        trials=len(trials),
        prompt=" / ".join(dict.fromkeys(t.prompt for t in trials)),
        new_tokens={t.task: t.new_tokens for t in trials},
        needles_per_trial={t.task: len(t.needles) for t in trials},
        needle=NEEDLE_PATTERN,
        reference=f"{BASELINE}: the same model, transformers' DynamicCache at {dtype!s}",
        min_baseline=min_baseline,
        threshold_note=(
            f"a codec's accuracy counts only in the cells (task, length, depth) where the {BASELINE} model reaches at "
            f"least {min_baseline:.0%}; the others are flagged (measurable = false) and left out of every summary"
        ),
        prefill=prefill,
        prefill_note=(
            "quantized: quantize on write, every prompt token attention reads was compressed first"
            if prefill == "quantized"
            else "exact: each prefill chunk attends to its own exact K/V, stored compressed (serving-engine style)"
        ),
        prefill_chunk=config.prefill_chunk,
        fused=config.fused,
        share_prefix=config.share_prefix,
        residual=config.residual,
        decoding="greedy, one token per forward; stops at EOS, after new_tokens, or once the numbers asked for are "
        "written",
        scoring="exact match: single/multikey: the answer's first number is the value; multivalue: every value among "
        "the answer's numbers (score: the share found)",
        intervals=INTERVALS_NOTE,
        codecs=codec_meta,
        calibration=calibration_meta(config.calibration),
        seconds_trials=seconds,
        seconds_per_trial={
            name: sum(r["prefill_seconds"] + r["decode_seconds"] for r in rows if r["codec"] == name) / len(trials)
            for name in codec_meta
        },
    )
    return NeedleResult.from_rows(meta, rows, min_baseline)
