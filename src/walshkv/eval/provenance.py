"""Where a result came from: the code that produced it and the CPU it ran on.

Every result file records both: :func:`walshkv.eval.report.run_meta` (``versions["commit"]`` and ``cpu``),
``walshkv bench``'s machine description (:func:`walshkv.bench.machine.machine_description`), and a sweep's
resume key (:func:`code_version`: rows measured by other code are re-run).
"""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from walshkv._version import __version__

__all__ = ["CPU_FLAGS", "NOT_CODE", "code_commit", "code_version", "cpu_meta", "proc_line"]

#: The instruction-set flags (``/proc/cpuinfo`` names, spelled as the kernel spells them: ``avx512vbmi`` but
#: ``avx512_vnni``) that change which kernels run and how fast.
CPU_FLAGS = (
    "avx2",
    "avx_vnni",
    "avx512f",
    "avx512vbmi",
    "avx512_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

_PACKAGE = Path(__file__).resolve().parents[1]  # .../walshkv


def proc_line(path: str, prefix: str) -> str | None:
    """The first line of ``path`` (a ``/proc`` file) that starts with ``prefix``; ``None``: no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line
    except OSError:
        pass
    return None


def cpu_meta() -> dict[str, Any]:
    """``{"model", "flags", "capability"}``: the CPU's name, which of :data:`CPU_FLAGS` it has, and the
    vector extension torch dispatches to (``torch.backends.cpu.get_cpu_capability()``).

    ``flags`` is ``None`` where ``/proc/cpuinfo`` is missing (not Linux).
    """
    model = platform.processor() or platform.machine()
    if (line := proc_line("/proc/cpuinfo", "model name")) is not None:
        model = line.split(":", 1)[1].strip()
    flags = None
    if (line := proc_line("/proc/cpuinfo", "flags")) is not None:
        have = set(line.split(":", 1)[1].split())
        flags = [f for f in CPU_FLAGS if f in have]
    return {"model": model, "flags": flags, "capability": torch.backends.cpu.get_cpu_capability()}


def _git(*args: str) -> str | None:
    """``git -C <package> ARGS`` output, stripped; ``None`` if git fails or is missing (never takes a lock)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        done = subprocess.run(
            ["git", "-C", str(_PACKAGE), *args], capture_output=True, text=True, timeout=10, env=env, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


#: Paths of the work tree that hold results and prose, not code: changes there do not make a commit ``-dirty``.
NOT_CODE = ("docs", "README.md")


@functools.cache
def code_commit() -> str:
    """``git describe --always --dirty`` of the walshkv checkout this package runs from, else the version.

    Only a source checkout counts (the package at ``<top>/src/walshkv`` of its work tree): an installed
    copy inside some other repository reports the package version. ``-dirty`` means tracked files differ
    from the commit (untracked files do not count, as for ``git describe --dirty``), outside :data:`NOT_CODE`:
    a reproduce script that writes several result files into ``docs/`` in turn is still measuring the commit's
    code when it reaches the second one; the state is read
    once per process, at the first call: every ``walshkv`` command reads it as it starts, so a long run records
    the code it loaded, not a commit made in the checkout while it ran.
    """
    top = _git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() / "src" / "walshkv" != _PACKAGE:
        return __version__
    described = _git("describe", "--always")
    if described is None:
        return __version__
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":(exclude){p}" for p in NOT_CODE))
    return described + ("-dirty" if status else "")


def code_version() -> dict[str, str]:
    """``{"walshkv", "commit"}``: the code that measured a result (a sweep's rows are reused only on a match)."""
    return {"walshkv": __version__, "commit": code_commit()}
