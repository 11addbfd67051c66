"""The machine a benchmark ran on, its copy bandwidth, and the timers every benchmark uses."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from walshkv.eval.report import library_versions

__all__ = ["copy_bandwidth", "interleaved_seconds", "machine_description", "median_seconds"]


def _proc_field(path: str, prefix: str) -> str | None:
    """The first line of ``path`` (a ``/proc`` file) that starts with ``prefix``; ``None``: no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(prefix):
                return line
    except OSError:
        pass
    return None


def machine_description() -> dict[str, Any]:
    """CPU model, cores visible to torch, memory, library versions."""
    cpu = platform.processor() or platform.machine()
    if (line := _proc_field("/proc/cpuinfo", "model name")) is not None:
        cpu = line.split(":", 1)[1].strip()
    mem = None
    if (line := _proc_field("/proc/meminfo", "MemTotal")) is not None:
        mem = int(line.split()[1]) * 1024
    versions = library_versions()
    return {
        "cpu": cpu,
        "logical_cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": mem,
        "torch": versions["torch"],
        "python": versions["python"],
        "platform": platform.platform(),
    }


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


def interleaved_seconds(
    fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2, budget: float = 3.0, device: str = "cpu"
) -> dict[str, list[float]]:
    """Per-call seconds of every function, timed in rounds that call each function once, in turn.

    At least ``repeats`` rounds, and up to ``3 * repeats`` while within ``budget`` seconds.
    """
    sync = _sync(device)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    times: dict[str, list[float]] = {name: [] for name in fns}
    started = time.perf_counter()
    rounds = 0
    while rounds < repeats or (rounds < 3 * repeats and time.perf_counter() - started < budget):
        for name, fn in fns.items():
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
