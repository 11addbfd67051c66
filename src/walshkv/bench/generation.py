"""``walshkv bench generation``: decode speed, per-step time split and peak memory of compressed caches
against DynamicCache (fp32 and bf16).

Each run is a fresh subprocess (:func:`_generation_child`), so its peak resident memory is its own; see
:mod:`walshkv.bench` for what a row holds. The compressed caches are named by cache specs or presets
(``walshkv:3.5``); :func:`resolve_generation_codecs` turns presets into the spec their calibration file chose
and gets the calibration a spec needs (a ``walshkv calibrate --preset`` / ``recommend`` file, or statistics of
a calibration text), with the functions ``walshkv eval`` uses
(:func:`walshkv.eval.calibrated.calibration_for`, :func:`walshkv.presets.name_specs`). A run's settings are
one :class:`GenerationBenchConfig`, which :func:`bench_generation` takes.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, get_args

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from walshkv.attention import kernel_available
from walshkv.cache import CompressedCache, enable_fused_attention, footprint
from walshkv.codecs import check_spec_list, parse_cache_spec
from walshkv.constants import Keys, Prefill
from walshkv.data import load_text
from walshkv.defaults import CALIB_TOKENS, DEFAULT_MODEL, DEFAULT_TEXT
from walshkv.eval.calibrated import calibration_for
from walshkv.eval.provenance import cpu_meta
from walshkv.export import KMeanBias
from walshkv.models import load_model
from walshkv.presets import (
    FAST_BUDGETS,
    FAST_SUFFIX,
    MAX_SUFFIX,
    PRESET_BUDGETS,
    is_preset,
    known_model,
    name_specs,
    preset_key,
)
from walshkv.shipped import check_file, shipped_file

if TYPE_CHECKING:
    from walshkv.codecs.calibration import Calibration

__all__ = [
    "DEFAULT_CONTEXTS",
    "DEFAULT_GENERATION_CODECS",
    "DYNAMIC_DTYPES",
    "CodecRequest",
    "GenerationBenchConfig",
    "GenerationCodec",
    "bench_generation",
    "crossover",
    "default_generation_codecs",
    "position_notes",
    "resolve_generation_codecs",
    "shipped_preset_file",
]

DEFAULT_CONTEXTS: tuple[int, ...] = (1024, 8192, 32768)
#: The compressed caches of the default table besides the model's shipped presets (:func:`default_generation_codecs`).
DEFAULT_GENERATION_CODECS: tuple[str, ...] = ("rot+int4", "q4_0")
#: The dtypes of the DynamicCache rows: the model is loaded in that dtype, so its cache holds K/V in it too.
DYNAMIC_DTYPES: tuple[str, ...] = ("float32", "bfloat16")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SHORT = {"float32": "fp32", "bfloat16": "bf16"}

#: A codec to bench: a spec or preset name, alone or with its own calibration file.
CodecRequest = str | tuple[str, str | Path | None]


@dataclass(frozen=True, eq=False)
class GenerationCodec:
    """A compressed cache of a generation bench, resolved: the spec it runs and the calibration it reads.

    Attributes:
        spec: the canonical cache spec (a preset's is the one its calibration file chose, else the built-in).
        preset: the preset name it was asked for (``walshkv:3.5``), or ``None``.
        calibration: what the spec needs (``None`` when it needs nothing), sent to each run.
        calibration_source: the calibration's origin for the rows: the file, ``TEXT (N tokens)``, or both.
    """

    spec: str
    preset: str | None = None
    calibration: Calibration | None = field(default=None, repr=False)
    calibration_source: str | None = None

    @property
    def name(self) -> str:
        """The row's name: ``walshkv:3.5 = SPEC`` for a preset, else the spec."""
        return f"{self.preset} = {self.spec}" if self.preset else self.spec


def _vm(key: str) -> int:
    """``key`` (``VmRSS``, ``VmHWM``) of this process's ``/proc/self/status``, in bytes (0 if absent)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def shipped_preset_file(model: str, preset: str) -> Path | None:
    """The calibration file walshkv ships for ``preset`` on ``model`` (:mod:`walshkv.shipped`), its sha256 checked.

    Returns:
        The path, or ``None`` if walshkv ships none (a model it has not measured, or a preset without a shipped spec).

    Raises:
        walshkv.shipped.ShippedCalibrationError: the file is missing or fails its checksum.
    """
    try:
        file = shipped_file(model, preset)
    except ValueError:  # not a built-in preset name: nothing ships for it (the spec's parse names the presets)
        return None
    if file is None:
        return None
    check_file(file)
    return file.path


def _display(path: str | Path) -> str:
    """``path`` as ``walshkv/calibrations/...`` for a shipped file, relative to the current directory where it lies
    under it, else as given."""
    p = Path(path).resolve()
    package = Path(__file__).resolve().parents[1]
    if p.is_relative_to(package):
        return str(Path("walshkv") / p.relative_to(package))
    if p.is_relative_to(Path.cwd()):
        return str(p.relative_to(Path.cwd()))
    return str(path)


def default_generation_codecs(model: str = DEFAULT_MODEL) -> tuple[list[CodecRequest], list[str]]:
    """The compressed caches of the default table: :data:`DEFAULT_GENERATION_CODECS` and the model's shipped
    presets, each with the calibration file walshkv ships for it (:func:`shipped_preset_file`).

    Returns:
        ``(requests, notes)``: the codecs (presets as ``(name, file)``) and a line for each preset left out.
    """
    requests: list[CodecRequest] = list(DEFAULT_GENERATION_CODECS)
    missing = []
    # each budget's plain name, then its other kind where a file exists: B-fast, or B-max where the naming rule gave
    # B to the fast entry (walshkv.presets.preset_key)
    known = known_model(model)
    other = [
        f"{p}{MAX_SUFFIX}" if known and preset_key(known, p) == preset_key(known, f"{p}{FAST_SUFFIX}") else f
        for p, f in zip(PRESET_BUDGETS, FAST_BUDGETS, strict=True)
    ]
    for preset in [*PRESET_BUDGETS, *other]:
        path = shipped_preset_file(model, preset)
        if path is not None:
            requests.append((preset, str(path)))
        elif preset in PRESET_BUDGETS:
            missing.append(preset)
    notes = []
    if missing:
        notes.append(
            f"note: walshkv ships no calibration for {model} for {', '.join(missing)}, so the default table has no "
            f"row for {'it' if len(missing) == 1 else 'them'}; write one with `walshkv calibrate --preset "
            f"{missing[0]} --model {model} -o FILE` and pass --gen-codec {missing[0]} --kv-mean-center FILE"
        )
    return requests, notes


def _split(request: CodecRequest, kv_mean_center: str | Path | None) -> tuple[str, str | None]:
    if isinstance(request, tuple):
        codec, path = request
    else:
        codec, path = request, kv_mean_center
    if not isinstance(codec, str) or not codec.strip():
        raise ValueError(f"a generation codec is a cache spec or a preset name (walshkv:3.5), got {codec!r}")
    return codec.strip(), None if path is None else str(path)


def _check_requests(
    model: str, requests: Sequence[tuple[str, str | None]], calib_text: str | None, calib_tokens: int
) -> None:
    """Refuse, before loading anything, specs that do not parse and calibrated specs without a calibration input."""
    if calib_tokens < 1:
        raise ValueError(f"--calib-tokens must be at least 1, got {calib_tokens}")
    for codec, path in requests:
        parsed = parse_cache_spec(codec)  # unknown presets and bad specs: the message lists what exists
        if path is not None and not Path(path).is_file():
            raise ValueError(
                f"--kv-mean-center {path}: no such file; pass a file written by `walshkv calibrate --preset NAME` "
                "or `walshkv recommend`"
            )
        if not parsed.needs_calibration or path is not None or calib_text:
            continue
        if is_preset(codec):
            shipped = shipped_preset_file(model, codec)
            example = f" (walshkv ships {_display(shipped)})" if shipped else ""
            raise ValueError(
                f"--gen-codec {codec} needs its calibration: add --kv-mean-center FILE, the file `walshkv calibrate "
                f"--preset {codec} --model {model} -o FILE` or `walshkv recommend` writes{example}, or --calib-text "
                "TEXT to calibrate in the run on a text other than the bench text"
            )
        raise ValueError(
            f"--gen-codec {codec} needs calibration (center+, eq+, order=variance or auto@BITS): add --kv-mean-center "
            "FILE (from `walshkv calibrate`) or --calib-text TEXT (a text other than the bench text)"
        )


def resolve_generation_codecs(
    model: str = DEFAULT_MODEL,
    codecs: Sequence[CodecRequest] | None = None,
    *,
    kv_mean_center: str | Path | None = None,
    calib_text: str | None = None,
    calib_tokens: int = CALIB_TOKENS,
    text: str = DEFAULT_TEXT,
    progress: bool = True,
) -> tuple[list[GenerationCodec], list[str]]:
    """The compressed caches of a generation bench, with presets resolved and calibration in hand.

    Presets resolve as in ``walshkv eval``: a preset file chooses its spec, else the built-in spec runs; the
    model is loaded here (once, then freed) only when a spec needs calibration or a file is given, and a file
    made for another model is refused (:meth:`walshkv.export.KMeanBias.check_matches`).

    Args:
        model: registry name or path.
        codecs: specs or preset names; a ``(codec, file)`` pair carries its own calibration file. ``None``:
            the default table (:func:`default_generation_codecs`).
        kv_mean_center: the calibration file of every codec given without its own.
        calib_text: a text to collect statistics on in this run (never the bench text ``text``).
        calib_tokens: tokens of ``calib_text``.
        text: the bench text.
        progress: progress bars while calibrating.

    Returns:
        ``(codecs, notes)``: one :class:`GenerationCodec` per request, in order, and printable notes (presets
        the default table leaves out).

    Raises:
        ValueError: a spec that does not parse, a calibrated spec without calibration (the message names the
            fix), a missing file, a file made for another model, ``calib_text`` equal to the bench text.
    """
    notes: list[str] = []
    if codecs is None:
        if kv_mean_center is not None or calib_text:
            raise ValueError(
                "--kv-mean-center/--calib-text calibrate the codecs you name: add --gen-codec SPEC (e.g. --gen-codec "
                "walshkv:3.5); the default table reads each shipped preset's file itself"
            )
        codecs, notes = default_generation_codecs(model)
    if not codecs:
        raise ValueError("no generation codec: pass --gen-codec SPEC (repeatable), e.g. --gen-codec rot+int4")
    requests = [_split(r, kv_mean_center) for r in codecs]
    _check_requests(model, requests, calib_text, calib_tokens)
    if not any(parse_cache_spec(c).needs_calibration or p is not None for c, p in requests):
        return [GenerationCodec(parse_cache_spec(c).spec) for c, _ in requests], notes
    lm = load_model(model, progress=False)
    bench_text = load_text(text)
    groups: dict[str | None, list[str]] = {}
    for codec, path in requests:
        groups.setdefault(path, []).append(codec)
    resolved: dict[tuple[str, str | None], GenerationCodec] = {}
    for path, group in groups.items():
        needs = any(parse_cache_spec(c).needs_calibration for c in group)
        cal = calibration_for(
            lm,
            group,
            kv_mean_center=path,
            calib_text=calib_text if needs else None,
            calib_tokens=calib_tokens,
            eval_text=bench_text,
            progress=progress,
        )
        named = name_specs(group, cal, model=lm)
        made_for = str((getattr(getattr(cal, "bias", cal), "meta", None) or {}).get(Keys.Preset.NAME, ""))
        for codec, n in zip(group, named, strict=True):
            if path and made_for and is_preset(codec) and made_for.lower() != codec.lower():
                own = shipped_preset_file(model, codec)
                raise ValueError(
                    f"--kv-mean-center {path} was written for {made_for}, not {codec}: give each preset its own file"
                    + (f" (walshkv ships {_display(own)})" if own else "")
                    + ", one preset per run, or leave out --gen-codec for the default table"
                )
            parsed = n.spec
            parsed.check_head_dim(lm.shape.head_dim)
            source = None
            if parsed.needs_calibration:
                parts = [] if isinstance(cal, KMeanBias) else [f"{calib_text} ({calib_tokens} tokens)"]
                source = " + ".join([*parts, *([_display(path)] if path else [])])
            resolved[(codec, path)] = GenerationCodec(
                n.text,
                n.label if n.source is not None else None,
                cal if parsed.needs_calibration else None,
                source,
            )
    del lm
    gc.collect()
    return [resolved[r] for r in requests], notes


class _Timer:
    """Seconds inside wrapped functions, per category; a call made inside another wrapped call counts once."""

    def __init__(self) -> None:
        self.seconds = {"update": 0.0, "attn": 0.0}
        self._depth = 0

    def wrap(self, category: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] += time.perf_counter() - t0
                self._depth -= 1

        return timed


def _instrument(model: Any, cache: Any) -> _Timer:
    """Time the cache's ``update`` (encoding and bookkeeping) and the model's attention function."""
    timer = _Timer()
    cache.update = timer.wrap("update", cache.update)
    for name in dict.fromkeys([model.config._attn_implementation, "sdpa"]):
        if name in ALL_ATTENTION_FUNCTIONS:  # the fused attention's SDPA fallbacks nest inside it: counted once
            ALL_ATTENTION_FUNCTIONS[name] = timer.wrap("attn", ALL_ATTENTION_FUNCTIONS[name])
    return timer


def _median_ms(values: Sequence[float]) -> float:
    return 1000 * statistics.median(values)


@torch.inference_mode()
def _generation_child(job: dict[str, Any]) -> dict[str, Any]:
    """One generation run (called in a fresh process by :func:`bench_generation`)."""
    torch.manual_seed(0)
    dtype = job.get("dtype", "float32")
    lm = load_model(job["model"], dtype=_DTYPES[dtype], progress=False)
    model = lm.model
    text = load_text(job["text"]).content
    ids = lm.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    ctx = job["ctx"]
    while ids.shape[1] < ctx:  # repeat the text for contexts longer than it
        ids = torch.cat([ids, ids], dim=1)
    ids = ids[:, :ctx]
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    calibration = None
    if job.get("calibration_file"):
        calibration = torch.load(job.pop("calibration_file"), weights_only=False)
    if job["cache"] == "dynamic":
        model.set_attn_implementation("sdpa")
        cache: Any = DynamicCache(config=model.config)
    else:
        fused = job["cache"] == "fused"
        if fused:
            enable_fused_attention(model)
        else:
            model.set_attn_implementation("sdpa")
        reserve = ctx + job["new_tokens"] if job.get("reserve") else None
        cache = CompressedCache(
            job["codec"],
            config=model.config,
            fused=fused,
            max_cache_len=reserve,
            calibration=calibration,
            prefill=job.get("prefill", "quantized"),
        )
    # load (or build) the fused C++ kernel now, so that the first decode step does not time its import
    cpu_kernel = kernel_available() if job["cache"] == "fused" else None
    timer = _instrument(model, cache)
    rss_loaded = _vm("VmRSS")
    t0 = time.perf_counter()
    out = None
    for s in range(0, ctx, job["prefill_chunk"]):
        out = model(input_ids=ids[:, s : s + job["prefill_chunk"]], cache=cache, use_cache=True, logits_to_keep=1)
    prefill = time.perf_counter() - t0
    prefill_split = dict(timer.seconds)
    assert out is not None
    token = out.logits[:, -1:].argmax(-1)
    steps, updates, attns = [], [], []
    for _ in range(job["new_tokens"]):
        before = dict(timer.seconds)
        t1 = time.perf_counter()
        out = model(input_ids=token, cache=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        steps.append(time.perf_counter() - t1)
        updates.append(timer.seconds["update"] - before["update"])
        attns.append(timer.seconds["attn"] - before["attn"])
    held = footprint(cache)
    cache_bytes = held.kv_bytes
    decode_s = statistics.median(steps)
    cpu = cpu_meta()
    text_config = model.config.get_text_config(decoder=True)
    return {
        **job,
        "weights_bytes": weights,
        "prefill_seconds": prefill,
        "prefill_update_seconds": prefill_split["update"],
        "prefill_attn_seconds": prefill_split["attn"],
        "decode_seconds_median": decode_s,
        "decode_tokens_per_s": 1.0 / decode_s,
        "step_ms": 1000 * decode_s,
        "update_ms": _median_ms(updates),
        "attn_ms": _median_ms(attns),
        "other_ms": _median_ms([s - u - a for s, u, a in zip(steps, updates, attns, strict=True)]),
        "cache_bytes": cache_bytes,
        "cache_reserved_bytes": held.reserved_bytes,
        "rss_after_load": rss_loaded,
        "peak_rss": _vm("VmHWM"),
        "peak_minus_loaded_minus_cache": _vm("VmHWM") - rss_loaded - cache_bytes,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu["model"],
        "cpu_capability": cpu["capability"],
        "cpu_flags": " ".join(cpu["flags"] or []),
        "cpu_kernel": cpu_kernel,
        "max_position_embeddings": getattr(text_config, "max_position_embeddings", None),
    }


def _label(row: dict[str, Any]) -> str:
    if row["cache"] == "dynamic":
        dtype = row.get("dtype", "float32")
        return f"DynamicCache {_SHORT.get(dtype, dtype)}" + (" (model in bf16)" if dtype == "bfloat16" else "")
    name = f"{row['preset']} = {row['codec']}" if row.get("preset") else row["codec"]
    return f"{row['cache']} {name}"


@dataclass(frozen=True)
class GenerationBenchConfig:
    """What :func:`bench_generation` runs: the model and text (by name: each run loads them in a fresh process), the
    contexts, the compressed caches with their calibration inputs, and how each run generates.

    Attributes:
        model: registry name or path.
        contexts: context lengths (tokens read before generating). Kept as a tuple.
        codecs: the compressed caches: specs, preset names (``walshkv:3.5``) or ``(codec, file)`` pairs, resolved
            by :func:`bench_generation` (:func:`resolve_generation_codecs`); or :class:`GenerationCodec` objects
            resolved already. ``None``: the default table (``rot+int4``, ``q4_0`` and the model's shipped presets; a
            note on stderr names the presets without a file); empty: the DynamicCache rows alone. Kept as a tuple.
        kv_mean_center: calibration file for the codecs given without one (see :func:`resolve_generation_codecs`).
        calib_text: text to calibrate on in this run (not the bench text).
        calib_tokens: tokens of ``calib_text``.
        dynamic_dtypes: a DynamicCache row per dtype (:data:`DYNAMIC_DTYPES`), the model loaded in it. Kept as a
            tuple.
        text: text the context is cut from (repeated if shorter).
        new_tokens: tokens generated one at a time (the median step is reported).
        prefill_chunk: tokens per prefill forward.
        decoded: also run each compressed cache without fusion (every step decodes the whole cache, as
            most Python KV-quantization tools do), at contexts up to ``decoded_max_ctx``.
        decoded_max_ctx: the longest context the non-fused runs are measured at.
        reserve: build the compressed caches with ``max_cache_len = ctx + new_tokens``.
        malloc_mmap_threshold: ``MALLOC_MMAP_THRESHOLD_`` for the child processes (glibc), 0 = unset.
        prefill: the compressed caches' prefill, ``"quantized"`` (quantize on write) or ``"exact"`` (the prompt
            attends to its exact K/V, as serving engines do; see :class:`walshkv.cache.CompressedCache`).
        runs: runs of every row, each in a fresh process, the rows taking turns; a row reports the medians of its
            runs (:func:`combine_runs`; under glibc's default allocator peak memory moves by about 100 MiB between
            identical runs, so one run cannot decide a memory target).
        progress: show a progress bar.

    Raises:
        ValueError: ``codecs`` a single string; ``kv_mean_center`` or ``calib_text`` with :class:`GenerationCodec`
            objects (they carry their calibration); ``contexts`` empty or below 1; a dtype not one of
            :data:`DYNAMIC_DTYPES`; ``prefill`` not one of ``quantized``, ``exact``; ``calib_tokens``,
            ``new_tokens``, ``prefill_chunk``, ``decoded_max_ctx`` or ``runs`` below 1 (``runs`` a whole number);
            ``malloc_mmap_threshold`` below 0.
        TypeError: ``codecs`` mixing :class:`GenerationCodec` objects with specs or presets.
    """

    model: str = DEFAULT_MODEL
    contexts: Sequence[int] = DEFAULT_CONTEXTS
    codecs: Sequence[CodecRequest | GenerationCodec] | None = None
    kv_mean_center: str | Path | None = None
    calib_text: str | None = None
    calib_tokens: int = CALIB_TOKENS
    dynamic_dtypes: Sequence[str] = DYNAMIC_DTYPES
    text: str = DEFAULT_TEXT
    new_tokens: int = 16
    prefill_chunk: int = 1024
    decoded: bool = False
    decoded_max_ctx: int = 8192
    reserve: bool = True
    malloc_mmap_threshold: int = 65536
    prefill: Prefill = "quantized"
    runs: int = 1
    progress: bool = True

    def __post_init__(self) -> None:
        self._check_codecs()
        if not self.contexts or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in self.contexts):
            raise ValueError(f"contexts (--ctx) must be token counts of at least 1, got {list(self.contexts)}")
        for d in self.dynamic_dtypes:
            if d not in _DTYPES:
                raise ValueError(f"dynamic dtype {d!r} (--dynamic-dtype): choose from {', '.join(_DTYPES)}")
        if self.prefill not in get_args(Prefill):
            raise ValueError(f"--prefill must be one of {', '.join(get_args(Prefill))}, got {self.prefill!r}")
        for flag, value in (
            ("--calib-tokens", self.calib_tokens),
            ("--new-tokens", self.new_tokens),
            ("--prefill-chunk", self.prefill_chunk),
            ("decoded_max_ctx", self.decoded_max_ctx),
        ):
            if value < 1:
                raise ValueError(f"{flag} must be at least 1 token, got {value}")
        if isinstance(self.runs, bool) or not isinstance(self.runs, int) or self.runs < 1:
            raise ValueError(f"runs (--gen-runs) must be a whole number >= 1, got {self.runs!r}")
        if self.malloc_mmap_threshold < 0:
            raise ValueError(
                "--malloc-mmap-threshold must be at least 0 bytes (0: glibc's default), got "
                f"{self.malloc_mmap_threshold}"
            )
        object.__setattr__(self, "contexts", tuple(self.contexts))
        object.__setattr__(self, "dynamic_dtypes", tuple(self.dynamic_dtypes))

    def _check_codecs(self) -> None:
        """Refuse a single string, a mix of resolved and unresolved codecs, and calibration inputs for codecs that
        carry their own; keep ``codecs`` as a tuple."""
        if self.codecs is None:
            return
        check_spec_list(self.codecs, "cache specs or presets")
        kinds = {isinstance(c, GenerationCodec) for c in self.codecs}
        if len(kinds) > 1:
            raise TypeError("pass either GenerationCodec objects or specs/presets, not both")
        if kinds == {True} and (self.kv_mean_center is not None or self.calib_text):
            raise ValueError(
                "kv_mean_center and calib_text calibrate codecs given as specs or presets; GenerationCodec objects "
                "carry their own calibration (resolve_generation_codecs)"
            )
        object.__setattr__(self, "codecs", tuple(self.codecs))

    @property
    def resolved(self) -> bool:
        """Whether ``codecs`` are :class:`GenerationCodec` objects already (an empty tuple counts as resolved)."""
        return self.codecs is not None and all(isinstance(c, GenerationCodec) for c in self.codecs)


def bench_generation(config: GenerationBenchConfig | None = None) -> list[dict[str, Any]]:
    """Decode speed, per-step time split and peak memory of compressed caches against DynamicCache, per context.

    The compressed caches that are not resolved yet are resolved first (:func:`resolve_generation_codecs`, with the
    config's calibration inputs); each run is then a fresh process (:func:`_generation_child`).

    Args:
        config: the model, contexts, caches and how each run generates (default ``GenerationBenchConfig()``: the
            default table on :data:`~walshkv.defaults.DEFAULT_MODEL` at :data:`DEFAULT_CONTEXTS`).

    Returns:
        One row per (context, cache) with the fields of :mod:`walshkv.bench`'s docstring.

    Raises:
        ValueError: as :func:`resolve_generation_codecs`.
    """
    config = GenerationBenchConfig() if config is None else config
    if config.resolved:
        resolved = [c for c in config.codecs or () if isinstance(c, GenerationCodec)]
    else:
        requests = None if config.codecs is None else [c for c in config.codecs if not isinstance(c, GenerationCodec)]
        resolved, notes = resolve_generation_codecs(
            config.model,
            requests,
            kv_mean_center=config.kv_mean_center,
            calib_text=config.calib_text,
            calib_tokens=config.calib_tokens,
            text=config.text,
            progress=config.progress,
        )
        for line in notes:
            print(line, file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="walshkv-bench-") as tmp:
        rows = _run_jobs(config, _jobs(config, resolved, Path(tmp)))
    _add_ratios(config.contexts, rows)
    return rows


def _jobs(config: GenerationBenchConfig, resolved: Sequence[GenerationCodec], tmp: Path) -> list[dict[str, Any]]:
    """One job per row, context by context: the DynamicCache rows, then each codec's fused (and decoded) row; the
    codecs' calibrations saved under ``tmp`` for the child processes to load."""
    base = {
        "model": config.model,
        "text": config.text,
        "new_tokens": config.new_tokens,
        "prefill_chunk": config.prefill_chunk,
        "malloc_mmap_threshold": config.malloc_mmap_threshold,
        "prefill": config.prefill,
    }
    files: dict[int, str] = {}
    for i, c in enumerate(resolved):
        if c.calibration is not None:
            files[i] = str(tmp / f"calibration-{i}.pt")
            torch.save(c.calibration, files[i])
    jobs = []
    for ctx in config.contexts:
        for d in config.dynamic_dtypes:
            jobs.append({**base, "ctx": ctx, "cache": "dynamic", "dtype": d, "codec": None, "reserve": False})
        for i, c in enumerate(resolved):
            for kind in ("fused", "decoded") if config.decoded else ("fused",):
                if kind == "decoded" and ctx > config.decoded_max_ctx:
                    continue
                jobs.append(
                    {
                        **base,
                        "ctx": ctx,
                        "cache": kind,
                        "dtype": "float32",
                        "codec": c.spec,
                        "preset": c.preset,
                        "calibration": c.calibration_source,
                        "calibration_file": files.get(i),
                        "reserve": config.reserve,
                    }
                )
    return jobs


def _run_jobs(config: GenerationBenchConfig, jobs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every job ``config.runs`` times, each run a fresh process, the jobs taking turns; a row per job
    (:func:`combine_runs`)."""
    done: list[list[dict[str, Any]]] = [[] for _ in jobs]
    total = len(jobs) * config.runs
    with tqdm(total=total, desc="bench generation", unit="run", disable=not config.progress) as bar:
        for _ in range(config.runs):  # in turn, so that a slow spell of the machine falls on every row alike
            for i, job in enumerate(jobs):
                done[i].append(_run_child(job, config.malloc_mmap_threshold))
                bar.update()
    return [combine_runs(r) for r in done]


def _add_ratios(contexts: Sequence[int], rows: list[dict[str, Any]]) -> None:
    """Label every row and add its ratios against the DynamicCache rows of its context (``None`` without one)."""
    for ctx in contexts:
        here = [r for r in rows if r["ctx"] == ctx]
        refs = {r.get("dtype", "float32"): r for r in here if r["cache"] == "dynamic"}
        for r in here:
            r["label"] = _label(r)
            for dtype, key in (("float32", "speedup_vs_dynamic"), ("bfloat16", "speedup_vs_dynamic_bf16")):
                ref = refs.get(dtype)
                r[key] = None if ref is None else r["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
            ref = refs.get("float32")
            r["prefill_vs_dynamic"] = None if ref is None else r["prefill_seconds"] / ref["prefill_seconds"]


#: The fields of a row that :func:`combine_runs` takes the median of (the rest are the same in every run).
RUN_MEDIANS = (
    "decode_seconds_median",
    "step_ms",
    "update_ms",
    "attn_ms",
    "other_ms",
    "prefill_seconds",
    "prefill_update_seconds",
    "prefill_attn_seconds",
    "rss_after_load",
    "peak_rss",
)
#: What each row keeps of every run (``row["run_values"]``), for the spread.
RUN_FIELDS = ("step_ms", "prefill_seconds", "rss_after_load", "peak_rss")


def combine_runs(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from identical runs: the median of each of :data:`RUN_MEDIANS`, ``runs`` (their count) and
    ``run_values`` (:data:`RUN_FIELDS` of every run); a single run is returned as it is.

    ``decode_tokens_per_s`` is the inverse of the median step and ``peak_minus_loaded_minus_cache`` the median peak
    minus the median loaded size minus the cache, so the row's columns agree with each other.
    """
    if len(runs) == 1:
        return runs[0]
    row = dict(runs[0])
    for key in RUN_MEDIANS:
        row[key] = statistics.median(r[key] for r in runs)
    row["decode_tokens_per_s"] = 1.0 / row["decode_seconds_median"]
    row["peak_minus_loaded_minus_cache"] = row["peak_rss"] - row["rss_after_load"] - row["cache_bytes"]
    row["runs"] = len(runs)
    row["run_values"] = [{k: r[k] for k in RUN_FIELDS} for r in runs]
    return row


def _run_child(job: dict[str, Any], malloc_mmap_threshold: int) -> dict[str, Any]:
    """Run :func:`_generation_child` in a fresh interpreter; returns its row (without the calibration file)."""
    code = "import json, sys; from walshkv.bench.generation import _generation_child; " + (
        "print(json.dumps(_generation_child(json.loads(sys.argv[1]))))"
    )
    env = dict(os.environ)
    if malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(malloc_mmap_threshold)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    proc = subprocess.run(
        [sys.executable, "-c", code, json.dumps(job)], capture_output=True, text=True, check=False, env=env
    )
    shown = {k: v for k, v in job.items() if k != "calibration_file"}
    if proc.returncode != 0:
        raise RuntimeError(f"generation run {shown} failed:\n{proc.stderr[-3000:]}")
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row.pop("calibration_file", None)
    return row


def crossover(rows: Sequence[dict[str, Any]], kind: str = "fused", codec: str | None = None) -> int | None:
    """The smallest measured context from which on the ``kind`` cache decodes at least as fast as DynamicCache
    (fp32).

    Args:
        rows: generation rows.
        kind: ``fused`` or ``decoded``.
        codec: the spec of the rows to read; ``None``: every ``kind`` row (one codec).
    """
    mine = [r for r in rows if r["cache"] == kind and (codec is None or r.get("codec") == codec)]
    ctxs = sorted({r["ctx"] for r in mine})
    ok = [c for c in ctxs if (next(r for r in mine if r["ctx"] == c)["speedup_vs_dynamic"] or 0) >= 1]
    for c in ctxs:
        if all(x in ok for x in ctxs if x >= c):
            return c
    return None


def position_notes(rows: Sequence[dict[str, Any]]) -> list[str]:
    """A line per context whose positions (context + new tokens) pass the model's ``max_position_embeddings``."""
    out = []
    for r in rows:
        most = r.get("max_position_embeddings")
        end = r["ctx"] + r["new_tokens"]
        line = (
            f"note: ctx {r['ctx']:,} + {r['new_tokens']} new tokens passes {r['model']}'s max_position_embeddings "
            f"{most:,}: the model was not trained on those positions (the speed is measured all the same); the "
            f"longest context it supports here is {most - r['new_tokens']:,}"
            if most and end > most
            else None
        )
        if line and line not in out:
            out.append(line)
    return out
