"""Writing a GGUF file atomically, with the bytes that reached the disk checked.

gguf-py's ``GGUFWriter`` opens a path itself and writes tensors with numpy's ``tofile``, which can lose a write
error (numpy does not check the flush of its own ``FILE*`` buffer): on a full disk or past a file-size limit a
small tensor's bytes vanish and the file comes out short with no exception. :func:`gguf_writer` writes to a
temporary file next to the target (:func:`walshkv.fileio.atomic_path`), compares its size with the writer's
position, and only then replaces the target: an old file survives any failure.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

import gguf

from walshkv.fileio import atomic_path

__all__ = ["gguf_writer"]


@contextlib.contextmanager
def gguf_writer(path: str | os.PathLike[str], arch: str) -> Iterator[gguf.GGUFWriter]:
    """Yield a ``GGUFWriter`` to fill (metadata, tensors); on a clean exit the file is written and replaces ``path``.

    Args:
        path: The GGUF file to (re)place; its directory must exist.
        arch: The writer's ``general.architecture``.

    Yields:
        The writer; add keys and tensors, do not write or close it.

    Raises:
        OSError: The file could not be written completely (``EIO`` for a short write that raised nothing, with
            its byte counts); ``path`` is unchanged and no temporary file is left.
    """
    with atomic_path(path) as temp:
        writer = gguf.GGUFWriter(str(temp), arch=arch)
        try:
            yield writer
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.flush()
            expected = sum(f.tell() for f in writer.fout or ())
        finally:
            writer.close()
        actual = temp.stat().st_size
        if actual != expected:
            raise OSError(
                errno.EIO,
                f"short write: {actual} of {expected} bytes reached the disk (disk full or a file-size limit?)",
                str(path),
            )
