"""The machine a benchmark ran on, its copy bandwidth, and the timers every benchmark uses."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from walshkv.attention.cpu import kernel_march
from walshkv.eval.provenance import cpu_meta, proc_line
from walshkv.eval.report import library_versions

__all__ = [
    "COLD_FLUSH_BYTES",
    "available_memory",
    "copy_bandwidth",
    "interleaved_seconds",
    "machine_description",
    "median_seconds",
    "thread_speedup",
]


def available_memory(device: str = "cpu") -> int | None:
    """Bytes a benchmark may still allocate: ``MemAvailable`` (CPU) or the device's free memory; ``None``: unknown."""
    if device.startswith("cuda"):
        return int(torch.cuda.mem_get_info(torch.device(device))[0]) if torch.cuda.is_available() else None
    line = proc_line("/proc/meminfo", "MemAvailable")
    return None if line is None else int(line.split()[1]) * 1024


def machine_description() -> dict[str, Any]:
    """CPU model and flags, cores visible to torch, memory, the code's version and commit, library versions.

    ``cpu`` is the model name; ``cpu_flags`` and ``cpu_capability`` as in
    :func:`walshkv.eval.provenance.cpu_meta` (the CPU every result file's meta records).
    """
    cpu = cpu_meta()
    mem = None
    if (line := proc_line("/proc/meminfo", "MemTotal")) is not None:
        mem = int(line.split()[1]) * 1024
    versions = library_versions()
    return {
        "cpu": cpu["model"],
        "cpu_flags": cpu["flags"],
        "cpu_capability": cpu["capability"],
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "walshkv": versions["walshkv"],
        "commit": versions["commit"],
        "torch": versions["torch"],
        "python": versions["python"],
        "platform": platform.platform(),
        # OpenMP's wait policy: spinning workers (the default) cost several-fold on vCPUs that share a core
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "thread_speedup": thread_speedup(),
        # the fused kernel's -march: "native" unless WALSHKV_CPU_MARCH names one
        "kernel_march": kernel_march(),
    }


def thread_speedup(size: int = 384, repeats: int = 5) -> float:
    """How much faster a float32 matmul loop runs on ``torch.get_num_threads()`` threads than on one.

    About the thread count on a machine whose cores are its own; near 1 (or below) where the logical CPUs share
    physical cores or a neighbour holds them: a benchmark's multi-threaded ratios are to be read with it.
    """
    a = torch.randn(size, size)
    n = torch.get_num_threads()

    def rate(threads: int) -> float:
        torch.set_num_threads(threads)
        try:
            return median_seconds(lambda: [a @ a for _ in range(8)], repeats, warmup=1)
        finally:
            torch.set_num_threads(n)

    return rate(1) / rate(n) if n > 1 else 1.0


def _sync(device: str) -> Callable[[], None]:
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def median_seconds(
    fn: Callable[[], Any], repeats: int, warmup: int = 2, budget: float = 2.0, device: str = "cpu"
) -> float:
    """Median seconds per call of ``fn``: ``repeats`` calls at least, up to ``3 * repeats`` within ``budget``."""
    sync = _sync(device)
    for _ in range(warmup):
        fn()
    sync()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats or (len(times) < 3 * repeats and time.perf_counter() - started < budget):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if time.perf_counter() - started > 4 * budget and len(times) >= 3:
            break
    return statistics.median(times)


#: Bytes a cold timing writes before every timed call (:func:`interleaved_seconds`' ``flush_bytes``): more than the
#: last-level cache of the CPUs this project runs on, so the call finds none of its data there
COLD_FLUSH_BYTES = 256 << 20


def interleaved_seconds(
    fns: dict[str, Callable[[], Any]],
    repeats: int,
    warmup: int = 2,
    budget: float = 3.0,
    device: str = "cpu",
    flush_bytes: int = 0,
) -> dict[str, list[float]]:
    """Per-call seconds of every function, timed in rounds that call each function once, in turn.

    At least ``repeats`` rounds, and up to ``3 * repeats`` while within ``budget`` seconds (the flushes not counted in
    the budget's timing of a call, but in its wall clock).

    Args:
        fns: the functions, by name.
        repeats: rounds at least.
        warmup: untimed calls of each function first.
        budget: seconds within which more rounds run, up to ``3 * repeats``.
        device: ``cpu`` or ``cuda[:N]`` (synchronized after each call).
        flush_bytes: ``> 0``: write a buffer of this many bytes on ``device`` before every timed call, so that each
            call starts with cold caches, as a layer's attention does inside a model, whatever ran before it in the
            round (:data:`COLD_FLUSH_BYTES`); 0: each call runs right after the one before it, warm with whatever
            that one left in the caches.
    """
    sync = _sync(device)
    flush = torch.zeros(flush_bytes // 4, device=device) if flush_bytes > 0 else None
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    started = time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < 3 * repeats and time.perf_counter() - started < budget):
        for name, fn in fns.items():
            if flush is not None:
                flush.add_(1)
                sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return times


def copy_bandwidth(megabytes: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """The device's copy bandwidth in GB/s (bytes read + written per second), ``dst.copy_(src)``."""
    n = megabytes * 2**20 // 4
    src = torch.rand(n, device=device)
    dst = torch.empty_like(src)
    sec = median_seconds(lambda: dst.copy_(src), repeats, warmup=1, device=device)
    return 2 * src.numel() * 4 / sec / 1e9
