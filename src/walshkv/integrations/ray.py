"""``walshkv sweep --ray`` and ``walshkv recommend --ray``: evaluations as Ray tasks on a cluster.

:class:`RayExecutor` is an :class:`walshkv.eval.sweep.Executor`: :func:`walshkv.eval.sweep.run_sweep` and
:func:`walshkv.recommend.recommend` hand it their jobs (:class:`~walshkv.eval.sweep.EvalJob`: specs, text,
windows, calibration) and it runs each as one Ray task. The driver keeps every decision: which sweep rows
are finished (it writes each row's file as soon as its task comes back, so an interrupted sweep resumes),
which candidate wins. A task never receives a loaded model: it gets the model's name (or path), loads it
once per worker process (:func:`worker_model`, a module-level cache) and evaluates exactly as
:func:`walshkv.eval.evaluate` does in process, so the metrics are the same numbers.

Ray is imported here, lazily: ``pip install "walshkv[ray]"`` (``ray==2.60.0``; the plain package is enough
for a local cluster and for ``ray start`` clusters). Usage statistics are off
(``RAY_USAGE_STATS_ENABLED=0`` unless set), the dashboard is not started, and the workers' output is not
forwarded to the driver.

Example:
    >>> with RayExecutor("local", cpus=2) as ex:  # doctest: +SKIP
    ...     rows = run_sweep(lm, text, SweepConfig(specs), "sweeps/x", executor=ex)
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from walshkv.eval.provenance import code_version
from walshkv.eval.sweep import EvalJob, run_job
from walshkv.models import MODELS, load_model

if TYPE_CHECKING:
    from types import ModuleType

    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.eval.harness import EvalResult
    from walshkv.models import LoadedModel

__all__ = ["INSTALL_HINT", "RayExecutor", "model_reference", "require_ray", "worker_model"]

#: How to install what this module needs (named in every "ray is missing" error).
INSTALL_HINT = 'pip install "walshkv[ray]" (or pip install "ray==2.60.0")'

#: Models loaded in this worker process, by (name or path, dtype): each worker loads a model once.
_WORKER_MODELS: dict[tuple[str, str], LoadedModel] = {}


def require_ray() -> ModuleType:
    """The ``ray`` package, or an ImportError that names the install line (call it before loading models)."""
    try:
        import ray
    except ImportError as err:
        raise ImportError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from err
    return ray


def model_reference(lm: LoadedModel) -> str:
    """What a worker passes to :func:`walshkv.models.load_model` to load the same model as ``lm``.

    Registry models go by name, hub models by their id, ``.gguf`` files and model folders by absolute path
    (which must exist on every node of the cluster, as the same file).

    Raises:
        ValueError: ``lm`` was built in memory (not loaded by :func:`~walshkv.models.load_model`), so no
            worker can load it.
    """
    if lm.name in MODELS:
        return lm.name
    if lm.source.startswith("hub:"):
        return lm.source.removeprefix("hub:")
    path = Path(lm.source).expanduser()
    if path.exists():
        return str(path.resolve())
    raise ValueError(
        f"model {lm.name!r} (source {lm.source!r}) was not loaded by name or path, so Ray workers cannot load it: "
        "load it with walshkv.models.load_model(NAME|PATH) (a registry name, a .gguf file or a model folder)"
    )


def worker_model(reference: str, dtype: str = "float32") -> LoadedModel:
    """The model ``reference`` at ``dtype``, loaded once per process (later calls return the same object).

    A worker keeps one model: loading another drops the first (a cluster of 1.5B models must not hold two
    per worker).
    """
    key = (reference, dtype)
    if key not in _WORKER_MODELS:
        _WORKER_MODELS.clear()
        _WORKER_MODELS[key] = load_model(reference, dtype=getattr(torch, dtype), progress=False)
    return _WORKER_MODELS[key]


def _worker_has(reference: str, dtype: str) -> bool:
    """Whether this process has loaded ``reference`` at ``dtype`` already."""
    return (reference, dtype) in _WORKER_MODELS


def _evaluate_task(
    reference: str,
    dtype: str,
    name: str,
    threads: int,
    specs: tuple[Any, ...],
    options: dict[str, Any],
    text: Text,
    calibration: CalibrationLike | None,
) -> tuple[EvalResult, dict[str, str]]:
    """One Ray task: load the model (once per worker), run the job, say what ran it.

    Args:
        reference, dtype: what :func:`worker_model` loads; ``name``: the name the driver's model has.
        threads: torch threads (the task's CPUs).
        specs, options: the job's specs and :meth:`~walshkv.eval.sweep.EvalJob.options`.
        text, calibration: the job's text and calibration (Ray objects put once per batch, resolved by Ray).

    Returns:
        ``(result, code_version())``; the result's meta has ``worker``: ``host``, ``pid``, ``loaded_model``
        (whether this task loaded the model, the first task of each worker process does) and ``seconds``.
    """
    started = time.perf_counter()
    torch.set_num_threads(threads)
    loaded = not _worker_has(reference, dtype)
    lm = worker_model(reference, dtype)
    if lm.name != name:
        raise ValueError(f"the worker on {socket.gethostname()} loaded {reference!r} as {lm.name!r}, not {name!r}")
    result = run_job(lm, EvalJob(specs, text, **options, calibration=calibration), progress=False)
    result.meta["worker"] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "loaded_model": loaded,
        "seconds": time.perf_counter() - started,
    }
    return result, code_version()


def _use_cluster_token() -> None:
    """Send the cluster's token when joining one: Ray 2.60's ``ray start --head`` turns token authentication on and
    saves the token (``~/.ray/auth_token``), but a driver joining by address sends none unless ``RAY_AUTH_MODE=token``
    is set, and the head refuses it. Where ``RAY_AUTH_MODE`` is unset and a token is available, this turns token mode on
    for this process (Ray's own helper, as its local clusters do; ray is pinned to 2.60.0, whose private module this
    is); a ``RAY_AUTH_MODE`` the user set is left alone."""
    from ray._private.authentication.authentication_token_setup import (
        maybe_enable_token_auth_if_token_available,
    )

    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse at once a ``HOST:PORT`` address where nothing listens (``auto`` and ``ray://`` are left to Ray).

    Raises:
        ConnectionError: no TCP listener at the address within ``timeout`` seconds; the message says how to start a
            head there.
    """
    if address == "auto" or "://" in address:
        return
    host, _, port = address.rpartition(":")
    host, port = (host or address, int(port)) if port.isdigit() else (address, 6379)
    try:
        socket.create_connection((host.strip("[]"), port), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(
            f"no Ray cluster at {address!r}: nothing answers on {host}:{port} ({err}). Start one with "
            f"`ray start --head --port {port}` on that node (and `ray start --address {host}:{port}` on the others), "
            "or use --ray local"
        ) from err


class RayExecutor:
    """Run :class:`~walshkv.eval.sweep.EvalJob` s as Ray tasks (an :class:`~walshkv.eval.sweep.Executor`).

    Use it as a context manager (or call :meth:`close`): it connects on first use and, if it connected or
    started the cluster itself, disconnects (and stops a ``"local"`` cluster) at the end. If Ray is already
    initialised in this process (``ray.init`` was called), it uses that connection and leaves it open.

    Args:
        address: ``"local"``: start a cluster on this machine with ``cpus`` CPUs (default: every CPU);
            ``"auto"``: join the cluster that ``ray start --head`` started on this machine (or
            ``RAY_ADDRESS``); ``HOST:PORT``: the head node's GCS address (port 6379 by default);
            ``ray://HOST:10001``: Ray Client (needs ``ray[client]``).
        cpus: CPUs of a ``"local"`` cluster (only with ``"local"``).
        cpus_per_task: CPUs each task reserves, and the torch threads it uses (1: as many tasks as CPUs).

    Raises:
        ValueError: ``cpus`` or ``cpus_per_task`` below 1, or ``cpus`` with another address than ``"local"``.
    """

    def __init__(self, address: str = "auto", *, cpus: int | None = None, cpus_per_task: int = 1) -> None:
        if cpus is not None and cpus < 1:
            raise ValueError(f"cpus must be at least 1, got {cpus}")
        if cpus is not None and address != "local":
            raise ValueError(f"cpus sizes a cluster this process starts: give address='local', not {address!r}")
        if cpus_per_task < 1:
            raise ValueError(f"cpus_per_task must be at least 1, got {cpus_per_task}")
        self.address = address
        self.cpus = cpus
        self.cpus_per_task = cpus_per_task
        self._owned = False
        self._connected = False
        self._ray: ModuleType | None = None

    # --- connection ----------------------------------------------------------------------------------

    def _connect(self) -> ModuleType:
        """Ray, initialised (connecting or starting the cluster on first use)."""
        if self._ray is not None and self._connected:
            return self._ray
        ray = require_ray()
        if not ray.is_initialized():
            os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
            quiet: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING}
            if self.address == "local":
                ray.init(
                    num_cpus=self.cpus or os.cpu_count() or 1,
                    include_dashboard=False,
                    **quiet,
                )
            else:
                _check_reachable(self.address)  # Ray itself retries a dead address for minutes before it says so
                _use_cluster_token()
                try:
                    ray.init(address=self.address, **quiet)
                except ConnectionError as err:
                    raise ConnectionError(
                        f"no Ray cluster at {self.address!r} ({err}): start one with `ray start --head` on the "
                        "head node (and `ray start --address HEAD:6379` on the others), or use --ray local"
                    ) from err
            self._owned = True
        self._ray, self._connected = ray, True
        return ray

    def close(self) -> None:
        """Disconnect (stopping a ``"local"`` cluster) if this executor connected; otherwise nothing."""
        if self._ray is not None and self._owned and self._ray.is_initialized():
            self._ray.shutdown()
        self._owned = self._connected = False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- the Executor protocol -----------------------------------------------------------------------

    @property
    def slots(self) -> int:
        """Tasks that run at once: the cluster's CPUs over ``cpus_per_task`` (at least 1)."""
        cpus = int(self._connect().cluster_resources().get("CPU", 1))
        return max(1, cpus // self.cpus_per_task)

    def describe(self) -> dict[str, Any]:
        """``{"kind": "ray", "address", "cpus_per_task", "slots"}`` (for result files)."""
        return {"kind": "ray", "address": self.address, "cpus_per_task": self.cpus_per_task, "slots": self.slots}

    def map(
        self, lm: LoadedModel, jobs: Iterable[EvalJob], *, progress: bool = False
    ) -> Iterator[tuple[int, EvalResult]]:
        """Submit every job as a Ray task, then yield ``(index, result)`` as each finishes.

        The text and calibration of the jobs are put into Ray's object store once (by identity), not once
        per task. Tasks still running when the caller stops reading (an error, Ctrl-C) are cancelled.

        Raises:
            ValueError: ``lm`` cannot be loaded by a worker (:func:`model_reference`), or a worker runs
                other walshkv code than this process (its version or commit differs).
            Any error a task raised (Ray re-raises it here with the worker's traceback).
        """
        ray = self._connect()
        reference = model_reference(lm)
        dtype = str(next(lm.model.parameters()).dtype).removeprefix("torch.")
        task = ray.remote(num_cpus=self.cpus_per_task, max_retries=0)(_evaluate_task)
        here = code_version()
        objects: dict[int, Any] = {}  # id of a text or calibration -> its Ray object

        def put(obj: Any) -> Any:
            if obj is None:
                return None
            if id(obj) not in objects:
                objects[id(obj)] = ray.put(obj)
            return objects[id(obj)]

        pending: dict[Any, int] = {}
        for i, job in enumerate(jobs):
            args = (reference, dtype, lm.name, self.cpus_per_task, job.specs, job.options())
            pending[task.remote(*args, put(job.text), put(job.calibration))] = i
        total, done = len(pending), 0
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                i = pending.pop(ready[0])
                result, theirs = ray.get(ready[0])
                worker = result.meta["worker"]
                host = worker["host"]
                if theirs != here:
                    raise ValueError(
                        f"the Ray worker on {host} runs walshkv {theirs.get('walshkv')} at {theirs.get('commit')}, "
                        f"this process {here.get('walshkv')} at {here.get('commit')}: install the same walshkv on "
                        "every node, so that every row is measured by the same code"
                    )
                done += 1
                if progress:
                    loaded = ", model loaded" if worker["loaded_model"] else ""
                    print(
                        f"ray: job {i + 1} done on {host} (pid {worker['pid']}{loaded}) in {worker['seconds']:.1f} s "
                        f"({done}/{total})",
                        file=sys.stderr,
                        flush=True,
                    )
                yield i, result
        finally:
            for ref in pending:
                ray.cancel(ref)
