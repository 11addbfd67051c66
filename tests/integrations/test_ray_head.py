"""``--ray HOST:PORT``: walshkv against an external Ray head, started with ``ray start --head`` on loopback as a user
starts a cluster's head node, and stopped at the end. A separate module from test_ray.py: this process may hold one
Ray connection at a time, and that module's keeps a cluster of its own."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from walshkv.cli import main
from walshkv.eval.sweep import SweepConfig, row_path, run_sweep
from walshkv.integrations.ray import RayExecutor

SPECS = ["int8", "rot+int3/int2", "tq:3"]


def _ray_cli() -> str:
    """The ``ray`` command of this interpreter's environment."""
    here = Path(sys.executable).with_name("ray")
    found = str(here) if here.exists() else shutil.which("ray")
    assert found, "the ray command is missing: pip install 'walshkv[ray]'"
    return found


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Ray head on this machine with 2 CPUs (its own temp dir), as ``ray start --head`` starts one, joined as
    ``127.0.0.1:PORT``; stopped after."""
    import ray

    assert not ray.is_initialized()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    temp = tmp_path_factory.mktemp("ray-head")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    start = [
        _ray_cli(),
        "start",
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        "--num-cpus=2",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--temp-dir={temp}",
    ]
    proc = subprocess.run(start, env=env, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}"
    finally:
        if ray.is_initialized():
            ray.shutdown()
        subprocess.run([_ray_cli(), "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)


def _metrics(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if k != "seconds"}, sort_keys=True)


def test_sweep_on_an_external_head_gives_the_in_process_rows(
    head, ray_lm, ray_model_dir, toy_text, tmp_path, monkeypatch
):
    import ray

    import walshkv.eval.sweep.run

    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: None)
    fast = {"ctx": 32, "windows": 2, "progress": False}
    here = run_sweep(ray_lm, toy_text, SweepConfig(SPECS, chunk=3, **fast), tmp_path / "here")
    with RayExecutor(head) as executor:
        assert executor.slots == 2  # the head's CPUs, not this machine's count
        there = run_sweep(ray_lm, toy_text, SweepConfig(SPECS, chunk=1, **fast), tmp_path / "ray", executor=executor)
        assert ray.get_runtime_context().gcs_address.endswith(f":{head.rsplit(':', 1)[1]}")
    assert not ray.is_initialized()  # the executor connected, so it disconnected; the head keeps running
    assert [_metrics(r) for r in there] == [_metrics(r) for r in here]
    meta = json.loads(row_path(tmp_path / "ray", SPECS[0]).read_text())["meta"]
    assert meta["executor"]["kind"] == "ray" and meta["executor"]["address"] == head

    # the CLI, as a user on the head node runs it: --ray HOST:PORT
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"codecs": SPECS[:2]}))
    text = tmp_path / "t.txt"
    text.write_text(toy_text.content)
    argv = ["sweep", "--grid", str(grid), "--model", str(ray_model_dir), "--text", str(text), "--ctx", "32"]
    out = tmp_path / "cli"
    assert main([*argv, "--windows", "2", "--out", str(out), "--chunk", "1", "--ray", head, "--quiet"]) == 0
    rows = [json.loads(row_path(out, s).read_text()) for s in SPECS[:2]]
    assert [r["meta"]["executor"]["address"] for r in rows] == [head, head]


def test_a_head_that_is_not_there_is_named(head):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError, match="ray start --head"), RayExecutor(dead) as executor:
        executor.slots  # noqa: B018  (connecting is what fails)
