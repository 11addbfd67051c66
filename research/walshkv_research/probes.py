"""What the probe scripts (research/scripts/*_probe.py) share: a wrapper argument, and running ``walshkv eval``.

A probe registers wrappers that exist only in its script, runs ``walshkv eval`` with them (``eval`` only: it
decodes the cache through the codecs, so the result is the codec's whatever kernel could read it), and names
itself, not ``walshkv``, as the command in the ``--json`` result so the run can be repeated as written.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path

from walshkv.cli import main as cli
from walshkv.codecs.base import Codec
from walshkv.codecs.registry import register_wrapper
from walshkv.fileio import write_json_atomic

__all__ = ["count_argument", "run_probe_eval"]


def count_argument(args: str | None, what: str) -> int:
    """A wrapper argument that must be a whole number >= 1; ``what`` names it and gives an example.

    Raises:
        ValueError: ``{what}, got {args!r}``.
    """
    try:
        n = int(args or "")
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{what}, got {args!r}")
    return n


def run_probe_eval(
    argv: list[str], script: str, wrappers: Sequence[tuple[str, Callable[[str | None, Codec], Codec], str]]
) -> int:
    """Register ``wrappers`` (name, factory, help) and run ``walshkv eval ARGV[1:]``; record ``script`` as the command.

    Raises:
        SystemExit: ``argv`` does not start with ``eval`` (bench, needle and sweep may use the fused kernels,
            which read only the codecs walshkv ships).
    """
    name = Path(script).name
    if not argv or argv[0] != "eval":
        raise SystemExit(f"{name} runs `eval` only (bench, needle and sweep may use the fused kernels)")
    for wrapper, factory, help_text in wrappers:
        register_wrapper(wrapper, factory, help_text)
    rc = cli(argv)
    if rc == 0 and "--json" in argv and argv.index("--json") + 1 < len(argv):
        path = Path(argv[argv.index("--json") + 1])
        result = json.loads(path.read_text())
        result["meta"]["command"] = " ".join(["python", script, *map(shlex.quote, argv)])
        write_json_atomic(path, result)
    return rc
