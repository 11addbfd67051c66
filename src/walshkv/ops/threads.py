"""One thread for the BLAS calls of a block too small to share between threads.

A decode step encodes one token per layer, and its transforms are matrix products of a few rows
(``[kv_heads, head_dim] @ [head_dim, head_dim]``). torch's CPU build hands those to MKL, which starts an OpenMP
region for each: with 2 threads and ``OMP_WAIT_POLICY=passive`` every product wakes a sleeping thread, which cost
more than the product itself (smollm2-135m, 30 layers, one token: the cache's update took about 3x as long on 2
threads as on 1). MKL's thread count can be set for the calling thread alone (``MKL_Set_Num_Threads_Local``, which
leaves other Python threads and the fused kernel's own OpenMP loops as they are); :func:`serial_blas` does that for
a block, and the products of a given shape then come out the same whatever the thread count (MKL's threaded
``sgemm`` sums some shapes in another order). On a torch build without MKL it does nothing.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SERIAL_BLAS_MAX", "serial_blas"]

#: Blocks of at most this many values run their BLAS calls on one thread (ATen's own grain size for splitting a
#: loop between threads): a decode step's token, and the decode chunks of the evaluation harness.
SERIAL_BLAS_MAX = 32768


def _mkl_local() -> Any:
    """MKL's ``MKL_Set_Num_Threads_Local`` (C interface: an int by value, returns the previous setting) from
    torch's CPU library, or ``None`` where torch has no MKL (or another platform's library name)."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        fn = lib.MKL_Set_Num_Threads_Local
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SET_LOCAL = _mkl_local()


@contextmanager
def serial_blas(active: bool = True) -> Iterator[None]:
    """Run this thread's MKL calls on one thread inside the block (``active=False``: change nothing).

    Restores the thread's previous setting on exit, exceptions included.
    """
    if not active or _SET_LOCAL is None:
        yield
        return
    previous = _SET_LOCAL(1)
    try:
        yield
    finally:
        _SET_LOCAL(previous)
