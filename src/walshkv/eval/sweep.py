"""``walshkv sweep``: a grid of cache specs through the ``walshkv eval`` protocol.

A grid is a named preset (:data:`PRESETS`) or a ``.yaml``/``.json`` file with ``codecs: [spec, ...]``.
Every spec is measured exactly as ``walshkv eval`` measures it (:func:`walshkv.eval.evaluate`); the
sweep adds resumability (one JSON file per finished row, reused when its settings match), a combined
CSV and markdown table sorted by bits per element, and a plot of mean KLD against bits with the
Pareto front marked.

Preset specs may contain the placeholders ``{hd}``, ``{hd/2}``, ``{hd/4}`` (any ``{hd/N}``), replaced
by the model's head_dim when the grid is resolved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from walshkv.codecs.kivi import KiviCodec
from walshkv.eval.harness import DEFAULT_CODECS

__all__ = [
    "PRESETS",
    "add_sweep_parser",
    "canonical_specs",
    "load_grid",
    "needs_calibration",
    "pareto_front",
    "plot_pareto",
    "resolve_grid",
    "row_path",
    "run_sweep",
    "substitute_head_dim",
]

# ---------------------------------------------------------------------------------------------------------
# Grid presets
# ---------------------------------------------------------------------------------------------------------

_BITS_K = ("5,5,4,3", "5,4,4,3", "4,4,4,3", "4,3,3,3", "3,3,3,3", "5,4,4", "8,8,8,8")
_BITS_V = ("3", "4", "5")
_BANDS = ("4", "5,3", "5,4,3", "5,4,4,3", "5,5,4,3,3", "5,5,4,4,4,4,3,3")
_ORDERS = ("natural", "sequency", "squarefree", "squarefree-dc", "variance")
_V_FORMATS = ("vht2:3", "vht2:4", "vht2:5", "vht2:4,3,3,2", "vht2:4,4,3,3", "vht2:5,4,3,2", "vzc")

# Hugging Face's QuantizedCache backends in the peers preset (left out where they cannot run).
HF_PEERS = ("hf-quanto:4", "hf-quanto:2", "hf-hqq:4", "hf-hqq:3", "hf-fp8")

PRESETS: dict[str, tuple[str, list[str]]] = {
    "baseline": (
        "The foundation's default codec list (walshkv.eval.DEFAULT_CODECS: fp16, int8..int2, with and "
        "without the Walsh-Hadamard rotation). Small and fast; handy for CI.",
        list(DEFAULT_CODECS),
    ),
    "vht2-bits": (
        "VHT2 bit allocation: banded K (per-band bit widths 5,5,4,3 / 5,4,4,3 / 4,4,4,3 / 4,3,3,3 / "
        "3,3,3,3 / 5,4,4 / 8,8,8,8) crossed with flat V of 3, 4 and 5 bits (vht2:K/vht2:V).",
        [f"vht2:{k}/vht2:{v}" for k in _BITS_K for v in _BITS_V],
    ),
    "vht2-bands": (
        "VHT2 number of bands at matched bits: K split into 1, 2, 3, 4, 5 and 8 bands, V flat vht2:4. "
        "'Matched' means the arithmetic mean of the K band bit widths is exactly 4.0 (the flat vht2:4 "
        "row), counted before any scale overhead; the measured bits_per_element column includes scales.",
        [f"vht2:{b}/vht2:4" for b in _BANDS],
    ),
    "vht2-sk": (
        "VHT2 skeleton size: K vht2:5,5,4,3 keeping only the first sk = head_dim (all), head_dim/2 and "
        "head_dim/4 coefficients (the {hd} placeholders are filled in with the model's head_dim), V flat vht2:3.",
        [f"vht2:5,5,4,3:sk={hd}/vht2:3" for hd in ("{hd}", "{hd/2}", "{hd/4}")],
    ),
    "vht2-orders": (
        "VHT2 coefficient order before banding: K vht2:5,5,4,3 with order natural, sequency, squarefree, "
        "squarefree-dc and variance, V flat vht2:3. order=variance is calibrated: give --calib-text.",
        [f"vht2:5,5,4,3:order={o}/vht2:3" for o in _ORDERS],
    ),
    "vht2-v": (
        "VHT2 value formats: K vht2:5,5,4,3:order=squarefree with V flat vht2:3/4/5, banded V at the same "
        "mean band width as a flat one (vht2:4,3,3,2 = 3.0) or between two (vht2:4,4,3,3 and "
        "vht2:5,4,3,2 = 3.5), and the vzc sign-bitmap format.",
        [f"vht2:5,5,4,3:order=squarefree/{v}" for v in _V_FORMATS],
    ),
    "peers": (
        "Every codec users compare against, at the bits they ship: llama.cpp's cache types with and without "
        "the Walsh-Hadamard rotation (q8_0 .. iq4_nl, and q8_0 K with q4_0 V), KIVI (2/4-bit, G=32, R=32), "
        "TurboQuant-class (tq:2..4, 2.5, 3.5; tqprod:3), and walshkv's own: rot+intB, VHT2 5/5/4/3+V3, "
        "and K mean-centering (center+..., needs --kv-mean-center FILE or --calib-text); Hugging Face's "
        "QuantizedCache (hf-quanto:2/4, hf-hqq:3/4, hf-fp8: needs walshkv[hf]; fed token by token; "
        "full-attention models only, left out elsewhere).",
        [
            *(f"{r}{t}" for t in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl") for r in ("", "rot+")),
            "q8_0/q4_0",
            "rot+q8_0/rot+q4_0",
            "kivi2",
            "kivi4",
            "tq:2",
            "tq:2.5",
            "tq:3",
            "tq:3.5",
            "tq:4",
            "tqprod:3",
            "rot+int8/rot+int4",
            "rot+int4",
            "rot+int3",
            "vht2:5,5,4,3/vht2:3",
            "center+rot+q4_0",
            "center+rot+int4",
            "center+rot+int3",
            "center+rot+int4/rot+int3",
            *HF_PEERS,
        ],
    ),
    "vht2-claims": (
        "The VHT2 document's remaining claims, one row each: its pairings (natural and squarefree order); "
        "the 3-bit floor (one 2-bit K band, 2-bit V); whether 5,5,4,3 beats the same widths in other orders "
        "(reversed 3,4,5,5 and shuffled 4,5,5,3) and a flat-ish 4,4,5,4; the foundation's rotated int codecs "
        "bracketing it (rot+int5/rot+int3 has exactly 5/5/4/3+V3's bits at head_dim 64); and measured bit "
        "allocation (vht2:auto@B, calibrated: give --calib-text) at 5/5/4/3+V3's bits for head_dim 64 and 128.",
        [
            "vht2:5,5,4,3/vht2:3",
            "vht2:5,5,4,3:order=squarefree/vht2:3",
            "vht2:5,5,4,2/vht2:3",
            "vht2:3,3,3,2/vht2:3",
            "vht2:5,5,4,3/vht2:2",
            "vht2:3,4,5,5/vht2:3",
            "vht2:4,5,5,3/vht2:3",
            "vht2:4,4,5,4/vht2:3",
            "rot+int5/rot+int3",
            "rot+int4/rot+int3",
            "rot+int4",
            "vht2:auto@5.25/vht2:auto@3.25",
            "vht2:auto@4.75/vht2:auto@3.125",
            "vht2:auto@4.25",
        ],
    ),
}

_PLACEHOLDER = re.compile(r"\{\s*hd\s*(?:/\s*(\d+)\s*)?\}")


def substitute_head_dim(spec: str, head_dim: int) -> str:
    """Replace ``{hd}`` and ``{hd/N}`` in a spec by the head_dim (divided by N).

    Args:
        spec: a cache spec, possibly with placeholders.
        head_dim: the model's head size.

    Returns:
        The spec with every placeholder replaced.

    Raises:
        ValueError: ``head_dim`` is not divisible by N, or an unknown ``{...}`` placeholder remains.
    """

    def repl(m: re.Match[str]) -> str:
        div = int(m.group(1) or 1)
        if div <= 0 or head_dim % div:
            raise ValueError(
                f"placeholder {m.group(0)} in {spec!r} needs a head_dim divisible by {div}, got head_dim "
                f"{head_dim}; write the number instead of the placeholder"
            )
        return str(head_dim // div)

    out = _PLACEHOLDER.sub(repl, spec)
    if "{" in out or "}" in out:
        raise ValueError(
            f"unknown placeholder in spec {spec!r}; the only placeholders are {{hd}} and {{hd/N}} "
            "(the model's head_dim, divided by N)"
        )
    return out


def _grid_files_hint() -> str:
    return f"valid presets: {', '.join(PRESETS)}; or a .yaml/.yml/.json file with 'codecs: [spec, ...]'"


def _is_grid_file(grid: str) -> bool:
    return grid.lower().endswith((".yaml", ".yml", ".json")) or Path(grid).expanduser().is_file()


def load_grid(grid: str) -> tuple[str, str, list[str]]:
    """Look up a preset or read a grid file, without substituting placeholders or parsing specs.

    Args:
        grid: a preset name (see :data:`PRESETS`) or a path to a ``.yaml``/``.yml``/``.json`` file
            holding ``{"codecs": [spec, ...], "description": "..."}`` (``description`` optional).

    Returns:
        ``(name, description, specs)``; ``name`` is the preset name or the file's stem.

    Raises:
        ValueError: unknown preset (the message lists the valid ones), missing or malformed file.
    """
    if grid in PRESETS:
        description, specs = PRESETS[grid]
        return grid, description, list(specs)
    if not _is_grid_file(grid):
        raise ValueError(f"unknown grid {grid!r}; {_grid_files_hint()}")
    path = Path(grid).expanduser()
    if not path.is_file():
        raise ValueError(f"grid file {path} does not exist; {_grid_files_hint()}")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read grid file {path}: {err}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f'grid file {path} is not valid JSON ({err}); expected {{"codecs": [...]}}') from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"reading {path} needs PyYAML (pip install pyyaml), which walshkv does not require; "
                'or write the grid as JSON: {"codecs": [spec, ...]}'
            ) from None
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ValueError(f"grid file {path} is not valid YAML: {err}") from None
    if isinstance(data, list):
        data = {"codecs": data}
    if not isinstance(data, dict) or "codecs" not in data:
        raise ValueError(f"grid file {path} must hold a mapping with a 'codecs' list, e.g. codecs: [int4, rot+int4]")
    unknown = set(data) - {"codecs", "description"}
    if unknown:
        raise ValueError(f"grid file {path} has unknown keys {sorted(unknown)}; allowed: codecs, description")
    specs = data["codecs"]
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"grid file {path}: 'codecs' must be a non-empty list of cache specs")
    bad = [s for s in specs if not isinstance(s, str) or not s.strip()]
    if bad:
        raise ValueError(
            f"grid file {path}: every entry of 'codecs' must be a spec string, got {bad!r} "
            "(in YAML, quote specs that could read as numbers or contain ', ' in a [flow, list])"
        )
    description = data.get("description") or f"grid file {path.name}"
    if not isinstance(description, str):
        raise ValueError(f"grid file {path}: 'description' must be a string")
    return path.stem, description, [s.strip() for s in specs]


def resolve_grid(grid: str, head_dim: int) -> list[str]:
    """The cache specs of a preset or grid file, placeholders replaced by ``head_dim``.

    The specs are not parsed here (see :func:`canonical_specs`).

    Args:
        grid: preset name or path to a ``.yaml``/``.yml``/``.json`` grid file.
        head_dim: the model's head size, for ``{hd}`` and ``{hd/N}``.

    Returns:
        The spec strings in grid order.

    Raises:
        ValueError: unknown preset, bad file, or a placeholder that cannot be filled in.
    """
    _, _, specs = load_grid(grid)
    return [substitute_head_dim(s, head_dim) for s in specs]


def canonical_specs(specs: Sequence[str], head_dim: int | None) -> list[str]:
    """Parse every spec, check it against ``head_dim`` and return canonical, de-duplicated specs.

    Args:
        specs: cache specs (placeholders already substituted).
        head_dim: the model's head size, or ``None`` to check the grammar only.

    Returns:
        Canonical spec strings (``CacheSpec.spec``), first occurrence kept, grid order.

    Raises:
        ValueError: the first spec that does not parse or does not fit ``head_dim``, with the parser's hint.
    """
    from walshkv.codecs import parse_cache_spec

    out: list[str] = []
    for s in specs:
        try:
            parsed = parse_cache_spec(s)
            if head_dim is not None:
                parsed.check_head_dim(head_dim)
        except (ValueError, TypeError) as err:
            raise ValueError(f"grid spec {s!r}: {err}") from None
        if parsed.spec not in out:
            out.append(parsed.spec)
    if not out:
        raise ValueError("the grid has no cache specs")
    return out


def _unrunnable_specs(specs: Sequence[str], lm: Any) -> dict[str, str]:
    """Peer specs this model or environment cannot run, with the reason.

    A sweep leaves them out (and says so in its table) instead of failing: Hugging Face ``hf-*``
    caches without their optional backend, and caches that support full-attention layers only
    (``hf-*``, KIVI) on a model with sliding-window layers (gemma3).
    """
    from walshkv.cache import make_cache
    from walshkv.codecs import parse_cache_spec

    out = {}
    for spec in specs:
        parsed = parse_cache_spec(spec)
        if spec.startswith("hf-") or isinstance(getattr(parsed, "k", None), KiviCodec):
            try:
                make_cache(parsed, lm.model.config)
            except (ImportError, ValueError) as err:
                out[spec] = str(err)
    return out


def needs_calibration(spec: str) -> bool:
    """Whether a (parseable) cache spec needs calibration statistics (``order=variance``, ``auto@BITS``)."""
    from walshkv.codecs import parse_cache_spec

    return bool(getattr(parse_cache_spec(spec), "needs_calibration", False))


# ---------------------------------------------------------------------------------------------------------
# Rows on disk
# ---------------------------------------------------------------------------------------------------------

_SETTINGS_KEYS = ("model", "text", "text_sha256", "ctx", "windows", "score", "residual")


def _slug(text: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9.=-]+", "_", text).strip("_.")[:limit] or "spec"


def row_path(out_dir: str | Path, spec: str) -> Path:
    """Where the row of ``spec`` (canonical) lives: ``OUT/rows/<slug>-<hash8>.json``."""
    digest = hashlib.sha256(spec.encode()).hexdigest()[:8]
    return Path(out_dir) / "rows" / f"{_slug(spec)}-{digest}.json"


def _calibration_key(calibration: Any) -> dict[str, Any] | None:
    if calibration is None:
        return None
    if all(hasattr(calibration, a) for a in ("model", "text", "tokens")):  # KVStats
        return {"model": calibration.model, "text": calibration.text, "tokens": calibration.tokens}
    return calibration.describe()  # a K mean file, or statistics merged with one


def _describe_calibration(c: dict[str, Any]) -> str:
    if c.get("kind") == "kv-mean-center file":
        tokens, text = c.get("walshkv.tokens", "?"), c.get("walshkv.text", "?")
        return f"the K mean file {c['file']} ({c['basis']} basis, {tokens} tokens of {text})"
    if c.get("kind") == "merged":
        return f"{_describe_calibration(c['stats'])} with the K mean of {_describe_calibration(c['k_bias'])}"
    return f"the K/V statistics of {c['tokens']:,} tokens of {c['text']} on {c['model']}"


def _settings(lm: Any, text: Any, ctx: int, windows: int | None, score: str, residual: int) -> dict[str, Any]:
    return {
        "model": lm.name,
        "text": text.name,
        "text_sha256": hashlib.sha256(text.content.encode()).hexdigest(),
        "ctx": ctx,
        "windows": windows,
        "score": score,
        "residual": residual,
    }


def _finished_row(path: Path, spec: str, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The stored ``{"meta", "result"}`` of a finished row, or ``None`` if it must be (re)run."""
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        sweep = record["meta"]["sweep"]
        result = record["result"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(result, dict) or sweep.get("spec") != spec or result.get("codec") != spec:
        return None
    if any(sweep.get(k) != v for k, v in settings.items()):
        return None
    return record


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------------------
# Pareto front and plot
# ---------------------------------------------------------------------------------------------------------


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def pareto_front(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows no other row beats: none has fewer-or-equal ``bits_per_element`` and a lower ``kld_mean``.

    Ties (same bits and KLD) keep the first row. Rows with a missing or non-finite value are ignored.

    Args:
        rows: result rows with ``bits_per_element`` and ``kld_mean``.

    Returns:
        The front, by increasing bits (so by strictly decreasing KLD).
    """
    usable = [r for r in rows if _finite(r.get("bits_per_element")) and _finite(r.get("kld_mean"))]
    ordered = sorted(enumerate(usable), key=lambda ir: (ir[1]["bits_per_element"], ir[1]["kld_mean"], ir[0]))
    front: list[dict[str, Any]] = []
    best = math.inf
    for _, r in ordered:
        if r["kld_mean"] < best:
            front.append(r)
            best = r["kld_mean"]
    return front


def plot_pareto(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Plot mean KLD (log scale) against bits per element, the Pareto front as a labelled step line.

    Uses matplotlib's Agg canvas directly (no pyplot state, no display). Rows with KLD 0 cannot sit on
    a log axis; they are named in a note under the plot.

    Args:
        rows: result rows (``codec``, ``bits_per_element``, ``kld_mean``).
        path: PNG file to write.
        title: plot title.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'walshkv[plot]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    front = pareto_front(rows)
    front_ids = {id(r) for r in front}
    shown = [r for r in rows if _finite(r.get("bits_per_element")) and _finite(r.get("kld_mean")) and r["kld_mean"] > 0]
    shown_ids = {id(r) for r in shown}
    hidden = [str(r.get("codec")) for r in rows if id(r) not in shown_ids]

    fig = Figure(figsize=(10, 6.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    others = [r for r in shown if id(r) not in front_ids]
    ax.scatter(
        [r["bits_per_element"] for r in others],
        [r["kld_mean"] for r in others],
        s=22,
        color="0.6",
        label="other specs",
        zorder=2,
    )
    fshown = [r for r in front if id(r) in shown_ids]
    if fshown:
        xs = [r["bits_per_element"] for r in fshown]
        ys = [r["kld_mean"] for r in fshown]
        ax.step(xs, ys, where="post", color="tab:blue", linewidth=1.5, zorder=3, label="Pareto front")
        ax.scatter(xs, ys, s=36, color="tab:blue", zorder=4)
        for i, r in enumerate(fshown):
            dy = 9 if i % 2 == 0 else -15
            ax.annotate(
                r["codec"],
                (r["bits_per_element"], r["kld_mean"]),
                xytext=(6, dy),
                textcoords="offset points",
                fontsize=8.5,
                color="tab:blue",
                bbox={"boxstyle": "round,pad=0.15", "facecolor": "white", "edgecolor": "none", "alpha": 0.8},
                zorder=5,
            )
    if shown:
        ax.set_yscale("log")
        xs_all = [r["bits_per_element"] for r in shown]
        span = max(xs_all) - min(xs_all) or 1.0
        ax.set_xlim(min(xs_all) - 0.04 * span, max(xs_all) + 0.25 * span)
    else:
        ax.text(0.5, 0.5, "no row with a positive mean KLD", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("stored bits per K/V element (scales included)")
    ax.set_ylabel("mean KLD vs uncompressed cache (nats/token, log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", alpha=0.35)
    ax.grid(True, which="minor", alpha=0.12)
    ax.legend(loc="upper right", fontsize=8.5)
    if hidden:
        fig.text(0.01, 0.005, "not on the log axis (KLD 0 or missing): " + ", ".join(hidden), fontsize=8)
    fig.savefig(path, dpi=150)


# ---------------------------------------------------------------------------------------------------------
# The sweep
# ---------------------------------------------------------------------------------------------------------


def _say(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def run_sweep(
    lm: Any,
    text: Any,
    specs: Sequence[str],
    out_dir: str | Path,
    *,
    ctx: int = 512,
    windows: int | None = 8,
    score: str = "half",
    residual: int = 0,
    progress: bool = True,
    command: str = "",
    calibration: Any = None,
    chunk: int = 4,
    title: str = "sweep",
    description: str = "",
    decode_chunk: int = 1,
) -> list[dict[str, Any]]:
    """Evaluate every spec not already finished in ``out_dir``, then write the combined outputs.

    A row is finished when ``OUT/rows/<slug>-<hash>.json`` exists and its ``meta["sweep"]`` matches this
    run's settings (model, text name and content hash, ctx, windows, score, residual, and for calibrated
    specs the calibration's model, text and token count); anything else is (re)run. Pending specs go
    through :func:`walshkv.eval.evaluate` ``chunk`` at a time (one reference forward per window per
    chunk), and each row's JSON is written as soon as its chunk finishes.

    Afterwards ``OUT/results.csv``, ``OUT/results.md`` and (with matplotlib) ``OUT/pareto.png`` hold every
    row of ``specs``, sorted by ``bits_per_element``.

    Args:
        lm: the loaded model (:class:`walshkv.models.LoadedModel`).
        text: evaluation text (:class:`walshkv.data.Text`).
        specs: cache specs (placeholders already substituted); parsed and de-duplicated here.
        out_dir: output folder, created if needed.
        ctx: tokens per window.
        windows: number of windows (``None``: every full window).
        score: ``"half"`` or ``"all"``.
        residual: full-precision window of recent tokens.
        progress: progress bars and one ``[i-j/n]`` line per chunk on stderr.
        command: the command line, recorded in each row and in ``results.md``.
        calibration: :class:`walshkv.calibration.KVStats` from other text than ``text``, for calibrated
            specs (``order=variance``, ``auto@BITS``); passed to ``evaluate`` for chunks that need it.
        chunk: specs per :func:`~walshkv.eval.evaluate` call (at least 1).
        title: heading of ``results.md`` and of the plot (e.g. the grid name).
        description: one paragraph under the heading of ``results.md``.
        decode_chunk: scored tokens per forward for Hugging Face ``hf-*`` rows (fed as in generation; see
            :func:`walshkv.eval.evaluate`); part of those rows' settings.

    Returns:
        The result rows (``evaluate``'s metric dicts), sorted by ``bits_per_element``.

    Raises:
        ValueError: a spec that does not parse or fit the model's head_dim (before anything runs),
            ``chunk < 1``, or any error of :func:`~walshkv.eval.evaluate`.
    """
    from walshkv.eval import evaluate

    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    canon = canonical_specs(specs, lm.info["head_dim"])
    skipped = _unrunnable_specs(canon, lm)
    for spec in skipped:
        _say(progress, f"sweep: skipping {spec}: {skipped[spec]}")
    canon = [s for s in canon if s not in skipped]
    if not canon:
        raise ValueError("no runnable cache specs left: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    calibrated = {s for s in canon if needs_calibration(s)}
    if calibrated and calibration is None:
        raise ValueError(
            f"{', '.join(sorted(calibrated))} need calibration statistics: pass calibration=collect_kv_stats(...) "
            "on other text than the evaluation text (CLI: --calib-text TEXT)"
        )
    out = Path(out_dir)
    (out / "rows").mkdir(parents=True, exist_ok=True)
    base = _settings(lm, text, ctx, windows, score, residual)
    settings = {s: {**base, "calibration": _calibration_key(calibration) if s in calibrated else None} for s in canon}
    for s in canon:  # Hugging Face caches are fed token by token, decode_chunk tokens per forward
        if s.startswith("hf-"):
            settings[s]["decode_chunk"] = decode_chunk

    records: dict[str, dict[str, Any]] = {}
    pending: list[str] = []
    for spec in canon:
        record = _finished_row(row_path(out, spec), spec, settings[spec])
        if record is None:
            pending.append(spec)
        else:
            records[spec] = record
    total = len(canon)
    _say(progress, f"sweep: {total} rows, {len(records)} already finished in {out}, {len(pending)} to run")

    for start in range(0, len(pending), chunk):
        part = pending[start : start + chunk]
        first = len(records) + 1
        last = first + len(part) - 1
        _say(progress, f"[{first}{'' if last == first else f'-{last}'}/{total}] {', '.join(part)}")
        extra = {"calibration": calibration} if calibrated.intersection(part) else {}
        result = evaluate(
            lm,
            text,
            part,
            ctx=ctx,
            windows=windows,
            score=score,
            residual=residual,
            progress=progress,
            decode_chunk=decode_chunk,
            **extra,
        )
        result.meta["command"] = command
        for spec, row in zip(part, result.results, strict=True):
            meta = {**result.meta, "sweep": {**settings[spec], "spec": spec, "evaluated_with": part}}
            record = {"meta": meta, "result": row}
            _write_json_atomic(row_path(out, spec), record)
            records[spec] = record

    rows = sorted(
        (records[s]["result"] for s in canon),
        key=lambda r: (r["bits_per_element"], r["kld_mean"] if _finite(r["kld_mean"]) else math.inf),
    )
    meta = records[canon[0]]["meta"]
    notes = []
    if calibrated:
        used = {json.dumps(records[s]["meta"]["sweep"]["calibration"], sort_keys=True) for s in calibrated}
        notes.append(
            f"Calibrated specs ({', '.join(f'`{s}`' for s in sorted(calibrated))}) used "
            + "; ".join(_describe_calibration(c) for c in map(json.loads, sorted(used)))
            + " (never the evaluation text)."
        )
    if skipped:
        notes.append("Left out: " + "; ".join(f"`{k}` ({v})" for k, v in skipped.items()) + ".")
    _write_outputs(out, rows, meta, command, title, description, notes)
    return rows


def _write_outputs(
    out: Path,
    rows: list[dict[str, Any]],
    meta: dict[str, Any],
    command: str,
    title: str,
    description: str,
    notes: list[str],
) -> None:
    from walshkv.eval.report import decode_note, describe_run, format_table, write_csv

    write_csv(out / "results.csv", rows)
    front = pareto_front(rows)
    plot_title = (
        f"{title}: {meta['model']['name']} on {meta['text']['name']}, "
        f"{meta['windows']} windows of {meta['ctx']} tokens (score {meta['score']}, residual {meta['residual']})"
    )
    plotted = True
    try:
        plot_pareto(rows, out / "pareto.png", plot_title)
    except ImportError:
        plotted = False
        print("pareto.png skipped: matplotlib is not installed (pip install 'walshkv[plot]')", file=sys.stderr)
    paras = [f"# Sweep: {title}"]
    if description:
        paras.append(description)
    paras.append(describe_run(meta))
    paras.extend(notes)
    if command:
        paras.append(f"Produced by `{command}`.")
    paras.append(format_table(rows, "github"))
    if note := decode_note(rows):
        paras.append(note)
    paras.append(
        "Pareto front (no other row has a lower mean KLD at fewer or equal bits per element): "
        + ", ".join(f"`{r['codec']}`" for r in front)
        + "."
    )
    if plotted:
        paras.append("![mean KLD against bits per element](pareto.png)")
    (out / "results.md").write_text("\n\n".join(paras) + "\n")


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------


def _head_dim_hint(model: str) -> int | None:
    """head_dim from the registry or a local config.json, without loading weights (``None`` if unknown)."""
    from walshkv.models import MODELS

    if model in MODELS:
        return MODELS[model].head_dim
    cfg_path = Path(model).expanduser() / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def _list_grids() -> str:
    lines = []
    for name, (description, specs) in PRESETS.items():
        lines.append(f"{name}  ({len(specs)} rows)")
        lines.extend(textwrap.wrap(description, width=100, initial_indent="    ", subsequent_indent="    "))
        lines.extend(
            textwrap.wrap(" ".join(specs), width=100, initial_indent="    specs: ", subsequent_indent="      ")
        )
    lines.append("or --grid FILE.yaml|FILE.json with  codecs: [spec, ...]  (and an optional description)")
    return "\n".join(lines)


def _cmd_sweep(args: argparse.Namespace) -> int:
    if args.list_grids:
        print(_list_grids())
        return 0
    if not args.grid:
        raise ValueError(f"give --grid PRESET|FILE (see walshkv sweep --list-grids); {_grid_files_hint()}")
    if args.chunk < 1:
        raise ValueError(f"--chunk must be at least 1, got {args.chunk}")
    windows = 2 if args.ci else args.windows

    name, description, raw_specs = load_grid(args.grid)
    hint = _head_dim_hint(args.model)
    # fail before loading anything: the grammar always, head_dim fit when the head_dim is known
    early = canonical_specs([substitute_head_dim(s, hint or 64) for s in raw_specs], hint)
    calibrated = [s for s in early if needs_calibration(s)]
    from walshkv.cli import _only_centering
    from walshkv.codecs import parse_cache_spec

    bias_is_enough = bool(getattr(args, "kv_mean_center", None)) and all(
        _only_centering(parse_cache_spec(s)) for s in calibrated
    )
    if calibrated and not args.calib_text and not bias_is_enough:
        raise ValueError(
            f"{', '.join(calibrated)} need calibration (center+, vht2 order=variance or auto@BITS): add "
            "--calib-text TEXT (any text other than the evaluation text), or --kv-mean-center FILE for center+"
        )

    from walshkv import models
    from walshkv.cli import calibrate_if_needed
    from walshkv.data import load_text
    from walshkv.eval.report import format_table

    text = load_text(args.text)
    if calibrated and args.calib_text and load_text(args.calib_text).content == text.content:
        raise ValueError("--calib-text is the evaluation text; calibrate on different text")
    lm = models.load_model(args.model, progress=not args.quiet)
    head_dim = lm.info["head_dim"]
    specs = [substitute_head_dim(s, head_dim) for s in raw_specs]
    calibration = calibrate_if_needed(lm, specs, args, text)
    from walshkv.presets import resolve_specs

    specs, preset_of = resolve_specs(specs, calibration)  # a preset file may choose its spec
    for spec, preset in preset_of.items():
        _say(not args.quiet, f"{preset} = {spec}")
    out = Path(args.out or f"sweep-{_slug(name)}-{_slug(lm.name)}")
    command = "walshkv " + " ".join(shlex.quote(a) for a in (args.argv or []))
    rows = run_sweep(
        lm,
        text,
        specs,
        out,
        ctx=args.ctx,
        windows=windows,
        score=args.score,
        residual=args.residual,
        progress=not args.quiet,
        command=command,
        calibration=calibration,
        chunk=args.chunk,
        title=name,
        description=description,
        decode_chunk=args.decode_chunk,
    )
    print(format_table(rows))
    print("Pareto front: " + ", ".join(r["codec"] for r in pareto_front(rows)))
    written = ["results.csv", "results.md"]
    if (out / "pareto.png").is_file():
        written.append("pareto.png")
    print(f"wrote {out}/{{{','.join(written)}}} and {len(rows)} row files in {out}/rows/")
    return 0


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``sweep`` subcommand on the CLI's subparsers."""
    from walshkv.data import DEFAULT_TEXT, TEXTS
    from walshkv.models import DEFAULT_MODEL, MODELS

    sw = sub.add_parser(
        "sweep",
        help="run a grid of cache specs through the eval protocol (resumable; CSV, markdown, Pareto plot)",
        description="Run every cache spec of a grid preset or file through the same protocol as "
        "'walshkv eval'. One JSON per finished row is kept under --out and reused on the next run when "
        "its settings match, so an interrupted sweep resumes. Writes results.csv, results.md and "
        "pareto.png (mean KLD against bits per element, Pareto front marked; needs matplotlib).",
        epilog="presets: " + ", ".join(PRESETS) + " (details: walshkv sweep --list-grids)\n"
        "examples:\n"
        "  walshkv sweep --grid baseline --ci\n"
        "  walshkv sweep --grid vht2-bits --model qwen2.5-1.5b --out sweeps/bits-qwen\n"
        "  walshkv sweep --grid my-grid.yaml --windows 4",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sw.add_argument("--grid", metavar="PRESET|FILE", help="a preset name or a .yaml/.json file with codecs: [...]")
    sw.add_argument("--list-grids", action="store_true", help="list the presets with descriptions and row counts")
    sw.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"offline model ({', '.join(MODELS)}), a .gguf path, a model folder or a hub id (default %(default)s)",
    )
    sw.add_argument(
        "--text", default=DEFAULT_TEXT, help=f"{', '.join(TEXTS)}, or a path to a UTF-8 file (default %(default)s)"
    )
    sw.add_argument("--out", metavar="DIR", help="output folder (default sweep-GRID-MODEL)")
    sw.add_argument("--ctx", type=int, default=512, help="tokens per window (default %(default)s)")
    sw.add_argument(
        "--windows", type=int, default=8, help="number of windows, 0: every full window (default %(default)s)"
    )
    sw.add_argument(
        "--ci", "--quick", action="store_true", dest="ci", help="CI-sized run: 2 windows (overrides --windows)"
    )
    sw.add_argument(
        "--score", choices=["half", "all"], default="half", help="score the second half of each window or all"
    )
    sw.add_argument(
        "--residual", type=int, default=0, help="keep this many recent tokens in full precision (default 0)"
    )
    sw.add_argument(
        "--chunk", type=int, default=4, help="specs per evaluation pass, sharing one reference (default %(default)s)"
    )
    sw.add_argument(
        "--decode-chunk",
        type=int,
        default=1,
        metavar="N",
        help="hf-* rows are fed as in generation: N scored tokens per forward (default %(default)s, exactly "
        "as in generation; larger is faster and the extra full-precision context is reported)",
    )
    from walshkv.cli import add_calibration_args

    add_calibration_args(sw)
    sw.add_argument("--quiet", action="store_true", help="no progress bars or per-chunk lines")
    sw.set_defaults(func=_cmd_sweep)
