"""What the commands share: parent parsers for the repeated options, and the calibration inputs.

Each ``*_parent`` function returns an ``argparse.ArgumentParser(add_help=False)`` to pass as
``sub.add_parser(..., parents=[...])``; the options sit in titled groups (``model and text``, ``windows``,
``calibration``, ``output``), listed in ``--help`` after the command's own options. Every default comes
from :mod:`walshkv.defaults`. The ``help`` arguments exist because a few commands word an option for
what it means there (``calibrate --text`` is calibration text).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from walshkv.data import TEXTS, Text
from walshkv.defaults import CALIB_TOKENS, CTX, DEFAULT_MODEL, DEFAULT_TEXT, WINDOWS
from walshkv.eval.calibrated import calibration_for
from walshkv.fileio import check_output_dir, check_output_path
from walshkv.models import MODELS

if TYPE_CHECKING:
    from walshkv.codecs import NamedSpec, SpecLike
    from walshkv.codecs.calibration import Calibration
    from walshkv.models import LoadedModel

__all__ = [
    "CALIB_MODEL_HELP",
    "CALIB_TEXT_HELP",
    "MODEL_HELP",
    "OUTPUT_DIRS",
    "OUTPUT_FILES",
    "SHOW_DEFAULT",
    "TEXT_HELP",
    "calibration_from_args",
    "calibration_parent",
    "check_outputs",
    "model_parent",
    "output_parent",
    "require_at_least",
    "windows_parent",
]

#: ``--model`` of the evaluating commands.
MODEL_HELP = f"offline model ({', '.join(MODELS)}), a .gguf path, a model folder or a hub id"
#: ``--text`` of the evaluating commands.
TEXT_HELP = f"{', '.join(TEXTS)}, or a path to a UTF-8 file"
#: ``--model`` of the commands that calibrate (calibrate, recommend).
CALIB_MODEL_HELP = "model name or path, as for eval"
#: ``--text`` of the commands that calibrate.
CALIB_TEXT_HELP = "calibration text (not the text you evaluate on)"
#: Appended to a help text by commands whose formatter does not show defaults itself.
SHOW_DEFAULT = " (default %(default)s)"
#: Options (``argparse`` dest -> flag) that name an output file: checked by :func:`check_outputs`.
OUTPUT_FILES = {"json": "--json", "csv": "--csv", "markdown": "--markdown", "output": "-o/--output"}
#: Options that name an output folder (created if missing); ``None`` there means a default folder in the cwd.
OUTPUT_DIRS = {"out": "--out"}


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before any work, output paths a command could not write (:func:`walshkv.main` runs it).

    Every option of :data:`OUTPUT_FILES` given as a path must name a file in an existing, writable directory
    (not a directory); every option of :data:`OUTPUT_DIRS` a folder that exists or can be created and is
    writable, or, when left out, a writable current directory (the commands' default folders go there).

    Raises:
        OSError: the first unwritable output, named with its option and the fix.
    """
    for dest, flag in OUTPUT_FILES.items():
        value = getattr(args, dest, None)
        if isinstance(value, str | Path):  # ``models --json`` is a switch, not a path
            check_output_path(value, what=flag)
    for dest, flag in OUTPUT_DIRS.items():
        if hasattr(args, dest):
            value = getattr(args, dest)
            what = flag if value is not None else f"{flag} (not given: a default folder in the current directory)"
            check_output_dir(Path.cwd() if value is None else value, what=what)


def require_at_least(args: argparse.Namespace, **minimums: int) -> None:
    """Refuse integer options below their minimum: ``require_at_least(args, ctx=4, tokens=1)``.

    Raises:
        ValueError: naming the first option (as ``--flag``), its minimum and the value given.
    """
    for dest, low in minimums.items():
        value = getattr(args, dest)
        if value is not None and value < low:
            raise ValueError(f"--{dest.replace('_', '-')} must be at least {low}, got {value}")


def model_parent(model_help: str = MODEL_HELP, text_help: str = TEXT_HELP) -> argparse.ArgumentParser:
    """``--model`` (default :data:`~walshkv.defaults.DEFAULT_MODEL`) and ``--text`` (``DEFAULT_TEXT``)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("model and text")
    group.add_argument("--model", default=DEFAULT_MODEL, help=model_help)
    group.add_argument("--text", default=DEFAULT_TEXT, help=text_help)
    return parent


def windows_parent(
    ctx_help: str = "tokens per window",
    windows_help: str | None = "number of windows (0: every full window)",
    windows: int = WINDOWS,
) -> argparse.ArgumentParser:
    """``--ctx`` (default :data:`~walshkv.defaults.CTX`) and, unless ``windows_help`` is None, ``--windows``."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("windows")
    group.add_argument("--ctx", type=int, default=CTX, help=ctx_help)
    if windows_help is not None:
        group.add_argument("--windows", type=int, default=windows, help=windows_help)
    return parent


def calibration_parent(tokens_help: str = "calibration tokens", inputs: bool = True) -> argparse.ArgumentParser:
    """``--calib-text``, ``--calib-tokens`` (default :data:`~walshkv.defaults.CALIB_TOKENS`), ``--kv-mean-center``.

    Args:
        tokens_help: the help of ``--calib-tokens``.
        inputs: False for ``--calib-tokens`` alone (a command that calibrates on its own text).
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("calibration")
    if inputs:
        group.add_argument(
            "--calib-text",
            metavar="TEXT",
            help="text for calibrated codecs (vht2 order=variance, auto@BITS); never the eval text",
        )
    group.add_argument("--calib-tokens", type=int, default=CALIB_TOKENS, help=tokens_help)
    if inputs:
        group.add_argument(
            "--kv-mean-center",
            metavar="FILE",
            help="calibration file from `walshkv calibrate` (or recommend) for center+ and eq+ codecs",
        )
    return parent


def output_parent(
    quiet: str = "no progress bars",
    *,
    json: str | None = None,
    csv: str | None = None,
    markdown: str | None = None,
    out: str | None = None,
) -> argparse.ArgumentParser:
    """``--quiet`` and the result files a command writes: each option whose help is given.

    Args:
        quiet: the help of ``--quiet``.
        json: the help of ``--json PATH``.
        csv: the help of ``--csv PATH``.
        markdown: the help of ``--markdown PATH``.
        out: the help of ``--out DIR`` (an output folder).
    """
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group("output")
    for flag, metavar, help in (("--json", "PATH", json), ("--csv", "PATH", csv), ("--markdown", "PATH", markdown)):
        if help is not None:
            group.add_argument(flag, metavar=metavar, help=help)
    if out is not None:
        group.add_argument("--out", metavar="DIR", help=out)
    group.add_argument("--quiet", action="store_true", help=quiet)
    return parent


def calibration_from_args(
    lm: LoadedModel,
    specs: Sequence[SpecLike],
    args: argparse.Namespace,
    text: Text,
) -> Calibration | None:
    """:func:`walshkv.eval.calibrated.calibration_for` with the inputs of :func:`calibration_parent`.

    Never calibrates on the evaluation text ``text``.
    """
    return calibration_for(
        lm,
        specs,
        kv_mean_center=getattr(args, "kv_mean_center", None),
        calib_text=args.calib_text,
        calib_tokens=args.calib_tokens,
        eval_text=text,
        progress=not args.quiet,
    )


def print_presets(codecs: Sequence[NamedSpec], *, quiet: bool = False) -> None:
    """Print on stderr which spec each preset of a run stands for, where it came from, and any note (an unknown
    model); ``codecs`` as :func:`walshkv.presets.name_specs` resolved them."""
    for named in codecs:
        if named.source is None:  # not a preset
            continue
        if not quiet:
            print(f"{named.label} = {named.text} ({named.source})", file=sys.stderr, flush=True)
        if named.note:
            print(f"note: {named.note}", file=sys.stderr, flush=True)
