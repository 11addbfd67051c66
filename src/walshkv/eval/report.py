"""What every result file says about its run, and the files themselves.

One set of builders for all of walshkv's measuring commands (``eval``, ``sweep``, ``rd``, ``bench`` and the
research commands):

* the run's description: :func:`run_meta` (model, text, the command's own fields, duration, date,
  versions with the code's commit, CPU: :mod:`walshkv.eval.provenance`), :func:`describe_run` (that meta
  in one paragraph), :func:`calibration_meta` and :func:`describe_calibration`, :func:`library_versions`,
  :func:`command_line`;
* the files: :func:`write_result_files` (``<stem>.json``, ``<stem>.csv``, ``<stem>.md`` and the plots), and
  for ``walshkv eval``'s rows :func:`format_table`, :func:`write_json`, :func:`write_csv`,
  :func:`write_markdown`;
* :func:`agg_figure`: a matplotlib figure for the plots, or an error naming ``pip install 'walshkv[plot]'``.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import platform
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from tabulate import tabulate

from walshkv.eval.provenance import code_version, cpu_meta
from walshkv.eval.rows import ResultRow
from walshkv.fileio import atomic_write, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "MODEL_FIELDS",
    "TABLE_COLUMNS",
    "agg_figure",
    "calibration_meta",
    "command_line",
    "decode_note",
    "describe_calibration",
    "describe_model",
    "describe_run",
    "format_table",
    "library_versions",
    "model_meta",
    "preset_note",
    "run_meta",
    "run_settings",
    "text_meta",
    "timestamp",
    "write_csv",
    "write_json",
    "write_markdown",
    "write_result_files",
]

PLOT_HINT = "pip install 'walshkv[plot]'"

# ---------------------------------------------------------------------------------------------------------
# The run, described
# ---------------------------------------------------------------------------------------------------------


def library_versions() -> dict[str, str]:
    """Versions recorded in every result file; ``commit`` is the code's :func:`~walshkv.eval.provenance.code_commit`
    (``git describe --always --dirty`` of a source checkout, else the package version)."""
    return {
        **code_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def timestamp() -> str:
    """Now, in UTC, to the second (ISO 8601): the ``date`` of every result file."""
    return datetime.now(UTC).isoformat(timespec="seconds")


def command_line(args: argparse.Namespace) -> str:
    """The ``walshkv ...`` command line that produced a run, quoted for a shell."""
    return "walshkv " + " ".join(shlex.quote(a) for a in (getattr(args, "argv", None) or []))


def model_meta(lm: LoadedModel) -> dict[str, Any]:
    """``{"name", "source", **lm.info}``: the model of a result file."""
    return {"name": lm.name, "source": lm.source, **lm.info}


def text_meta(text: Text, tokens: int | None = None, *, chars: bool = True) -> dict[str, Any]:
    """``{"name", "source", "chars", "tokens"}`` of a text (``chars`` and ``tokens`` where asked for)."""
    out: dict[str, Any] = {"name": text.name, "source": text.source}
    if chars:
        out["chars"] = len(text.content)
    if tokens is not None:
        out["tokens"] = tokens
    return out


def run_meta(
    lm: LoadedModel,
    text: Text,
    *,
    text_tokens: int | None = None,
    text_chars: bool = True,
    started: float | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """The ``meta`` of a result file: model, text, the command's own ``fields``, duration, date, versions, CPU.

    Args:
        lm: the model that ran.
        text: the text it read.
        text_tokens: tokens in the whole text (recorded as ``text.tokens`` when given).
        text_chars: record the text's length in characters (``text.chars``).
        started: ``time.perf_counter()`` when the run began; adds ``seconds_total``.
        **fields: the command's own keys, in the order they should appear (``ctx``, ``windows``, ...).

    Returns:
        ``{"model", "text", **fields, ["seconds_total"], "date", "versions", "cpu"}``: ``versions`` with the
        code's commit (:func:`library_versions`), ``cpu`` as :func:`~walshkv.eval.provenance.cpu_meta`.
    """
    meta: dict[str, Any] = {"model": model_meta(lm), "text": text_meta(text, text_tokens, chars=text_chars)}
    meta.update(fields)
    if started is not None:
        meta["seconds_total"] = time.perf_counter() - started
    meta["date"] = timestamp()
    meta["versions"] = library_versions()
    meta["cpu"] = cpu_meta()
    return meta


def run_settings(
    lm: LoadedModel, text: Text, ctx: int, windows: int | None, score: str, residual: int
) -> dict[str, Any]:
    """What makes two runs of the eval protocol measure the same thing (a sweep reuses rows that match)."""
    return {
        "model": lm.name,
        "text": text.name,
        "text_sha256": hashlib.sha256(text.content.encode()).hexdigest(),
        "ctx": ctx,
        "windows": windows,
        "score": score,
        "residual": residual,
    }


def calibration_meta(calibration: CalibrationLike | None) -> dict[str, Any] | None:
    """Where calibration came from, for result files: its ``describe()``, else its text and tokens."""
    if calibration is None:
        return None
    describe = getattr(calibration, "describe", None)
    if callable(describe):
        return describe()
    return {"text": getattr(calibration, "text", None), "tokens": getattr(calibration, "tokens", None)}


def describe_calibration(c: Mapping[str, Any]) -> str:
    """A :func:`calibration_meta` (or a sweep's calibration key) in words."""
    if c.get("kind") == "kv-mean-center file":
        tokens, text = c.get("walshkv.tokens", "?"), c.get("walshkv.text", "?")
        return f"the K mean file {c['file']} ({c['basis']} basis, {tokens} tokens of {text})"
    if c.get("kind") == "merged":
        return f"{describe_calibration(c['stats'])} with the K mean of {describe_calibration(c['k_bias'])}"
    if c.get("kind") == "shipped":
        files = ", ".join(f"{f['file']} (sha256 {f['sha256'][:12]}...)" for f in c["files"])
        return f"the calibration shipped with walshkv for {c['model']}: {files}, {c['tokens']:,} tokens of {c['text']}"
    return f"the K/V statistics of {c['tokens']:,} tokens of {c['text']} on {c['model']}"


#: The model facts :func:`describe_model` states, and how.
MODEL_FIELDS: dict[str, str] = {
    "arch": "{}",
    "head_dim": "head_dim {}",
    "layers": "{} layers",
    "kv_heads": "{} KV heads",
}


def describe_model(model: Mapping[str, Any], fields: Sequence[str] = tuple(MODEL_FIELDS)) -> str:
    """``Model NAME (arch, head_dim D, L layers, H KV heads)`` from a :func:`model_meta`, with ``fields`` only."""
    facts = ", ".join(MODEL_FIELDS[f].format(model.get(f)) for f in fields)
    return f"Model {model.get('name')} ({facts})"


def describe_run(
    meta: Mapping[str, Any],
    windows_detail: str | None = None,
    clauses: Sequence[str] | None = None,
    *,
    model_fields: Sequence[str] = tuple(MODEL_FIELDS),
    text_tokens: bool | None = None,
) -> str:
    """The run of a result file in one paragraph: model; text; windows; the command's own clauses.

    Called with ``meta`` only, it describes a run of the eval protocol (:func:`walshkv.eval.evaluate`'s
    meta): the text's tokens, the scored positions and tokens, the reference and the full-precision
    window. Other commands pass their own ``windows_detail`` (appended to ``W windows of C tokens``) and
    ``clauses`` (each its own ``; ...`` part).

    Args:
        meta: a :func:`run_meta`.
        windows_detail: text right after ``W windows of C tokens`` (e.g. ``" (4,096 tokens captured)"``).
        clauses: further parts, joined by ``"; "``.
        model_fields: which of :data:`MODEL_FIELDS` to state about the model.
        text_tokens: state the text's token count (default: for the eval protocol only).
    """
    m, t = meta.get("model", {}), meta.get("text", {})
    protocol = windows_detail is None and clauses is None
    if protocol:
        windows_detail = f", {meta['scored_positions']}"
        clauses = (
            f"{meta['scored_tokens']:,} scored tokens",
            f"reference: {meta['reference']}",
            f"full-precision window: {meta['residual']} tokens",
        )
    text = f"text {t.get('name')}"
    if text_tokens is None:
        text_tokens = protocol
    if text_tokens:
        text += f" ({t['tokens']:,} tokens)"
    parts = [
        describe_model(m, model_fields),
        text,
        f"{meta.get('windows')} windows of {meta.get('ctx')} tokens{windows_detail or ''}",
        *(clauses or ()),
    ]
    return "; ".join(parts) + "."


# ---------------------------------------------------------------------------------------------------------
# walshkv eval's rows: tables, JSON, CSV, markdown
# ---------------------------------------------------------------------------------------------------------

# (key, header, format)
TABLE_COLUMNS: list[tuple[str, str, str]] = [
    ("codec", "codec", "{}"),
    ("bits_per_element", "bits/el", "{:.3f}"),
    ("compression", "x vs fp16", "{:.2f}"),
    ("kld_mean", "mean KLD", "{:.6f}"),
    ("kld_p99", "KLD p99", "{:.4f}"),
    ("top1_agreement", "same top-1 %", "{:.2%}"),
    ("ppl_ratio", "PPL ratio", "{:.4f}"),
    ("kv_bytes", "KV bytes/window", "{:,}"),
]


def _cells(results: Sequence[ResultRow]) -> list[list[str]]:
    rows = []
    for r in results:
        row = []
        for key, _, fmt in TABLE_COLUMNS:
            text = fmt.format(r[key])  # type: ignore[literal-required]
            if key == "codec" and r.get("preset"):  # a preset's row is named by the preset (spec: preset_note)
                text = str(r.get("preset"))
            if key == "codec" and (mark := _mark(r)):
                text += f" {mark}"
            row.append(text[:-1] if key == "top1_agreement" else text)
        rows.append(row)
    return rows


def format_table(results: Sequence[ResultRow], fmt: str = "simple") -> str:
    """Render results as a table (``fmt``: any tabulate format, e.g. ``github``)."""
    return tabulate(_cells(results), headers=[h for _, h, _ in TABLE_COLUMNS], tablefmt=fmt, disable_numparse=True)


def _mark(row: ResultRow) -> str:
    """``†``: fed token by token; ``‡``: fed a window at once but its newest tokens kept in fp16 (KIVI)."""
    return "†" if row.get("feed") == "decode" else "‡" if "fp_context_mean" in row else ""


def _fp_share(row: ResultRow) -> str:
    """How much of what attention read was full precision, for one row of a footnote."""
    window = f"full-precision window {row['fp_window']} tokens, " if "fp_window" in row else ""
    return (
        f"{row['codec']}: {window}{row['fp_context_mean']:.1%} of attended positions in full precision "
        f"on average, {row['scored_quantized_context_share']:.1%} of scored tokens saw only quantized "
        "earlier context"
    )


def preset_note(results: Sequence[ResultRow]) -> str:
    """``Presets: walshkv:3.5 = SPEC, ...`` (and ``Engines' own caches: vllm:NAME = SPEC, ...``): the spec behind
    each row named by a preset, a vLLM cache dtype or an LMCache serde, or ``""``."""
    named = [r for r in results if r.get("preset")]
    engines = ("vllm:", "lmcache:")
    presets = [f"`{r['preset']}` = `{r['codec']}`" for r in named if not str(r["preset"]).startswith(engines)]
    peers = [f"`{r['preset']}` = `{r['codec']}`" for r in named if str(r["preset"]).startswith(engines)]
    out = [f"Presets (the model's specs; docs/presets.md): {'; '.join(presets)}." if presets else ""]
    if peers:
        out.append(
            f"Engines' own caches, emulated (docs/serving.md; bf16 = the layers they keep at the model's dtype): "
            f"{'; '.join(peers)}."
        )
    return " ".join(x for x in out if x)


def decode_note(results: Sequence[ResultRow]) -> str:
    """The footnotes of rows marked † (fed token by token) and ‡ (KIVI's fp16 window), or ``""``,
    after the :func:`preset_note`."""
    notes = [n for n in (preset_note(results),) if n]
    if fed := [r for r in results if _mark(r) == "†"]:
        notes.append(
            "† fed as in generation: the unscored prefix in one forward, then one forward per scored token "
            "(Hugging Face's QuantizedCache returns its first write unquantized, so one forward per window "
            "would measure nothing). Bits per element are measured from the bytes held after the window, "
            "scales, zero points and the full-precision window included (hf-* rows count floats as an fp16 "
            "model holds them). " + "; ".join(map(_fp_share, fed)) + "."
        )
    if kept := [r for r in results if _mark(r) == "‡"]:
        notes.append(
            "‡ not quantized on write: KIVI keeps its newest tokens in an fp16 window (r to r+g-1 tokens; once "
            f"it holds r+g, the oldest g leave as one quantized group), counted in the bits per element. "
            f"{'; '.join(map(_fp_share, kept))}."
        )
    return "\n\n".join(notes)


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    """``payload`` as indented JSON, with a final newline (atomically: an old file survives any error)."""
    write_json_atomic(path, payload)


def write_csv(path: str | Path, results: Sequence[Mapping[str, Any]]) -> None:
    """One CSV line per row; the columns are every key of the rows, in order of first appearance."""
    keys: list[str] = []
    for r in results:
        keys.extend(k for k in r if k not in keys)
    with atomic_write(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(results)


def write_markdown(path: str | Path, meta: Mapping[str, Any], results: Sequence[ResultRow], command: str) -> None:
    """``walshkv eval --markdown``: the run described, the command, the table and the † note."""
    note = decode_note(results)
    body = f"{describe_run(meta)}\n\nProduced by `{command}`.\n\n{format_table(results, 'github')}\n"
    if note:
        body += f"\n{note}\n"
    write_text_atomic(path, body)


# ---------------------------------------------------------------------------------------------------------
# Every other command's files
# ---------------------------------------------------------------------------------------------------------


def write_result_files(
    out_dir: str | Path,
    stem: str,
    payload: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    csv_keys: Sequence[str],
    markdown: Sequence[str],
    plot: Callable[[Path], list[Path]] | None = None,
) -> list[Path]:
    """Write ``stem.json``, ``stem.csv`` and ``stem.md`` under ``out_dir``, then the plots.

    Args:
        out_dir: output folder (created).
        stem: file name stem (``"rd"``, ``"bench"``, ``"rope"``, ...).
        payload: what goes into the JSON file.
        rows: the CSV rows (missing keys are empty cells, extra keys are ignored).
        csv_keys: CSV columns.
        markdown: the lines of the markdown file.
        plot: called with the output folder, returns the image paths it wrote; skipped with a note
            when matplotlib is missing.

    Returns:
        Every path written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    write_json_atomic(path, payload)
    written = [path]
    path = out / f"{stem}.csv"
    with atomic_write(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(csv_keys), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in csv_keys})
    written.append(path)
    path = out / f"{stem}.md"
    write_text_atomic(path, "\n".join(markdown))
    written.append(path)
    if plot is not None:
        try:
            written += plot(out)
        except ImportError:
            print(f"{stem} plots skipped: matplotlib is not installed ({PLOT_HINT})", file=sys.stderr)
    return written


def agg_figure(**kwargs: Any) -> Figure:
    """A matplotlib ``Figure`` on the Agg canvas (no pyplot state, no display); ``kwargs`` go to ``Figure``.

    Raises:
        ImportError: matplotlib is not installed; the message says ``pip install 'walshkv[plot]'``.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plots need matplotlib, an optional dependency: {PLOT_HINT}") from err
    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig
