"""Result files shared by the lab commands (``rd``, ``rope sweep``, ``spectrum``, ``reconstruct``).

Every command writes ``<stem>.json`` (meta and rows), ``<stem>.csv`` (one line per row, fixed
columns), ``<stem>.md`` (the run described, the command, the tables) and its plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["command_line", "write_result_files"]


def command_line(args: argparse.Namespace) -> str:
    """The ``walshkv ...`` command line that produced a run, quoted for a shell."""
    return "walshkv " + " ".join(shlex.quote(a) for a in (getattr(args, "argv", None) or []))


def write_result_files(
    out_dir: str | Path,
    stem: str,
    payload: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    csv_keys: Sequence[str],
    markdown: Sequence[str],
    plot: Callable[[Path], list[Path]] | None = None,
) -> list[Path]:
    """Write ``stem.json``, ``stem.csv`` and ``stem.md`` under ``out_dir``, then the plots.

    Args:
        out_dir: output folder (created).
        stem: file name stem (``"rd"``, ``"rope"``, ...).
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
    path.write_text(json.dumps(payload, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    written = [path]
    path = out / f"{stem}.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(csv_keys), extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in csv_keys})
    written.append(path)
    path = out / f"{stem}.md"
    path.write_text("\n".join(markdown), encoding="utf-8")
    written.append(path)
    if plot is not None:
        try:
            written += plot(out)
        except ImportError:
            print(f"{stem} plots skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
    return written
