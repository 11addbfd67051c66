"""Atomic file writes and output-path checks: every file walshkv writes goes through here.

A write goes to a temporary file in the target's directory, is flushed and fsynced, then ``os.replace``-d
over the target (atomic on POSIX and Windows within one file system). On any error (a full disk, a
signal, an exception in the writer) the old file is untouched and the temporary file is removed, so a
reader sees either the old bytes or the new ones, never a truncated mix.

:func:`check_output_path` and :func:`check_output_dir` refuse an output that cannot be written before a
command starts its work. This module imports nothing of walshkv (layer 0 of tests/test_architecture.py).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "atomic_path",
    "atomic_write",
    "check_output_dir",
    "check_output_path",
    "save_figure_atomic",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


def _fsync_dir(directory: Path) -> None:
    """Persist a rename: fsync the directory entry (POSIX only; a no-op where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _temp_in(target: Path) -> Path:
    """Create (empty) and return a unique temporary file next to ``target``: same directory, same file system."""
    # The target's suffix is kept last, for writers that pick a format from it (matplotlib's ``savefig``).
    fd, name = tempfile.mkstemp(prefix=f".{target.stem}.", suffix=f".tmp{target.suffix}", dir=target.parent)
    os.close(fd)
    return Path(name)


def _keep_mode(target: Path, temp: Path) -> None:
    """Give the new file the old one's permission bits (``mkstemp`` creates 0600), or the umask default."""
    try:
        mode = target.stat().st_mode & 0o7777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    os.chmod(temp, mode)


def _naming(exc: OSError, target: Path) -> OSError:
    """The same OS error naming the file the caller asked for, not the temporary one (a failed write names none)."""
    if exc.errno is None:
        return exc
    return OSError(exc.errno, exc.strerror, str(target))  # OSError(errno, ...) builds the errno's subclass


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it replaces ``path``, on an error it is removed.

    For writers that insist on opening a path themselves (gguf's ``GGUFWriter``, matplotlib's ``savefig``).
    The temporary file exists (empty) when yielded; the writer may overwrite or truncate it.

    Args:
        path: The file to (re)place. Its parent directory must exist.

    Yields:
        The temporary path, in the same directory as ``path``.

    Raises:
        OSError: The temporary file could not be created, written or renamed; ``path`` is unchanged.
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(errno.EISDIR, "Is a directory", str(target))
    try:
        temp = _temp_in(target)
    except OSError as exc:
        raise _naming(exc, target) from exc
    try:
        yield temp
        _keep_mode(target, temp)
        with open(temp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(temp, target)
    except OSError as exc:
        _remove_quietly(temp)
        raise _naming(exc, target) from exc
    except BaseException:
        _remove_quietly(temp)
        raise
    _fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_write(path: str | os.PathLike[str], mode: str = "wb", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """Yield an open file that replaces ``path`` when the block exits cleanly; on an error ``path`` is unchanged.

    Args:
        path: The file to (re)place. Its parent directory must exist.
        mode: ``"wb"`` (bytes) or ``"w"`` (text; ``encoding`` defaults to UTF-8).
        **open_kwargs: Passed to ``open`` (``encoding``, ``newline``).

    Yields:
        The file object to write to.

    Raises:
        ValueError: ``mode`` is not a write mode (allowed: "w", "wb", "wt").
        OSError: The temporary file could not be written or renamed; ``path`` is unchanged.
    """
    if mode not in ("w", "wb", "wt"):
        raise ValueError(f"atomic_write mode {mode!r} is not a write mode; allowed: 'w', 'wt', 'wb'")
    if "b" not in mode:
        open_kwargs.setdefault("encoding", "utf-8")
    with atomic_path(path) as temp, open(temp, mode, **open_kwargs) as handle:
        yield handle
        handle.flush()


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically."""
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Replace ``path`` with ``text`` (UTF-8) atomically."""
    with atomic_write(path, "w") as handle:
        handle.write(text)


def write_json_atomic(path: str | os.PathLike[str], payload: Any, *, indent: int | None = 2) -> None:
    """Replace ``path`` with ``payload`` as JSON (and a final newline) atomically.

    The payload is serialised before anything is opened, so an unserialisable value leaves no trace.
    """
    write_text_atomic(path, json.dumps(payload, indent=indent) + "\n")


def save_figure_atomic(figure: Figure, path: str | os.PathLike[str], **savefig_kwargs: Any) -> Path:
    """``figure.savefig`` through a temporary file; the format is the one ``path``'s suffix names.

    Args:
        figure: A matplotlib figure.
        path: The image to (re)place (``.png``, ``.svg``, ``.pdf``).
        **savefig_kwargs: Passed to ``savefig`` (``dpi``).

    Returns:
        ``path``, as a ``Path``.
    """
    target = Path(path)
    if target.suffix and "format" not in savefig_kwargs:
        savefig_kwargs["format"] = target.suffix[1:]
    with atomic_path(target) as temp:
        figure.savefig(str(temp), **savefig_kwargs)
    return target


def _writable_here(directory: Path, what: str, target: Path) -> None:
    """Create and remove a temporary file in ``directory`` (catches permissions and read-only file systems)."""
    try:
        _remove_quietly(_temp_in(directory / "probe"))
    except OSError as exc:
        raise PermissionError(
            f"{what} {str(target)!r}: cannot write in {str(directory)!r} ({exc.strerror or exc}); "
            "choose a writable directory",
        ) from exc


def check_output_path(path: str | os.PathLike[str], *, what: str = "output") -> Path:
    """Refuse an output file that cannot be written, before any work: the message names the problem and the fix.

    The path must not be a directory, its parent must exist and be a directory, and the parent must be writable
    (tested by creating and removing a temporary file there). Nothing is left behind.

    Args:
        path: The output file a command will write.
        what: How the message names it (``"--json"``, ``"-o"``).

    Returns:
        The path, as a ``Path``.

    Raises:
        OSError: ``IsADirectoryError``, ``FileNotFoundError``, ``NotADirectoryError`` or ``PermissionError``
            with a message naming the path and the fix.
    """
    target = Path(path)
    if target.is_dir():
        raise IsADirectoryError(f"{what} {str(target)!r} is a directory; give a file path (e.g. inside it)")
    parent = target.parent
    if not parent.exists():
        if any(p.exists() and not p.is_dir() for p in parent.parents):
            raise NotADirectoryError(
                f"{what} {str(target)!r}: a part of {str(parent)!r} is a file, not a directory; choose another path"
            )
        raise FileNotFoundError(
            f"{what} {str(target)!r}: directory {str(parent)!r} does not exist; create it first (mkdir -p)"
        )
    if not parent.is_dir():
        raise NotADirectoryError(
            f"{what} {str(target)!r}: {str(parent)!r} is a file, not a directory; choose another path"
        )
    _writable_here(parent, what, target)
    return target


def check_output_dir(path: str | os.PathLike[str], *, what: str = "--out") -> Path:
    """Refuse an output folder that cannot be created or written, before any work.

    The folder may be missing (it is created with its parents later); then its nearest existing ancestor must be
    a writable directory. An existing path must be a writable directory.

    Args:
        path: The folder a command will write its files into.
        what: How the message names it.

    Returns:
        The path, as a ``Path``.

    Raises:
        OSError: ``NotADirectoryError`` or ``PermissionError`` with a message naming the path and the fix.
    """
    target = Path(path)
    existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        where = "is a file" if existing == target else f"is under the file {str(existing)!r}"
        raise NotADirectoryError(f"{what} {str(target)!r} {where}, not a folder; choose a folder path")
    _writable_here(existing, what, target)
    return target
