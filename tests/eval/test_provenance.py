"""Every result says which code and CPU produced it; a sweep re-runs rows measured by other code."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import walshkv.eval.sweep
import walshkv.eval.sweep.run
from walshkv._version import __version__
from walshkv.bench import machine_description
from walshkv.data import Text
from walshkv.eval import evaluate, provenance
from walshkv.eval.provenance import CPU_FLAGS, code_commit, code_version, cpu_meta
from walshkv.eval.report import library_versions
from walshkv.eval.sweep import SweepConfig, row_path, run_sweep
from walshkv.models import LoadedModel, _describe

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
ROOT = Path(__file__).resolve().parents[2]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


def _git(where: Path, *args: str) -> str:
    ident = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    done = subprocess.run(["git", *ident, "-C", str(where), *args], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_cpu_meta_names_the_model_and_the_flags_that_matter():
    cpu = cpu_meta()
    assert isinstance(cpu["model"], str) and cpu["model"]
    assert cpu["capability"] == torch.backends.cpu.get_cpu_capability()
    info = Path("/proc/cpuinfo")
    if not info.is_file():  # not Linux: no flags to read
        assert cpu["flags"] is None
        return
    flags = next(line for line in info.read_text().splitlines() if line.startswith("flags")).split(":", 1)[1].split()
    assert cpu["flags"] == [f for f in CPU_FLAGS if f in flags]
    assert cpu["model"] in info.read_text()


@needs_git
def test_the_commit_is_git_describe_of_this_checkout():
    commit = code_commit()
    if not (ROOT / ".git").exists():  # an unpacked sdist or an installed copy: the version stands in
        assert commit == __version__
        return
    assert commit.removesuffix("-dirty") == _git(ROOT, "describe", "--always")
    assert code_version() == {"walshkv": __version__, "commit": commit}
    assert library_versions()["commit"] == commit


@needs_git
def test_only_a_walshkv_checkout_gives_a_commit(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    package = tmp_path / "src" / "walshkv"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "c")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    uncached = code_commit.__wrapped__
    monkeypatch.setattr(provenance, "_PACKAGE", package.resolve())
    assert uncached() == _git(tmp_path, "describe", "--always") == head
    (package / "__init__.py").write_text("x = 1\n")  # a tracked file changed: dirty
    assert uncached() == f"{head}-dirty"
    (tmp_path / "untracked.txt").write_text("")  # untracked files do not count, as for git describe --dirty
    _git(tmp_path, "checkout", "-q", "--", "src")
    assert uncached() == head
    results = tmp_path / "docs" / "results" / "r.json"  # a result file a reproduce script rewrites: not code
    results.parent.mkdir(parents=True)
    results.write_text("{}")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "r")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    results.write_text('{"kld": 1}')
    (tmp_path / "README.md").write_text("pasted")
    assert uncached() == head
    other = tmp_path / "lib" / "site-packages" / "walshkv"  # an installed copy inside another repository
    other.mkdir(parents=True)
    monkeypatch.setattr(provenance, "_PACKAGE", other.resolve())
    assert uncached() == __version__


def test_every_result_meta_records_the_commit_and_the_cpu(tiny_lm):
    meta = evaluate(tiny_lm, TEXT, ["int8"], ctx=32, windows=1, progress=False).meta
    assert meta["versions"]["commit"] == code_commit() and meta["versions"]["walshkv"] == __version__
    assert meta["cpu"] == cpu_meta()
    machine = machine_description()  # walshkv bench's meta
    assert machine["commit"] == code_commit() and machine["cpu"] == cpu_meta()["model"]
    assert machine["cpu_flags"] == cpu_meta()["flags"]


def test_a_sweep_reruns_rows_of_other_code_and_says_so(tmp_path, tiny_lm, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: None)
    out = tmp_path / "sw"
    specs = ["int8", "int4", "int2"]
    run_sweep(tiny_lm, TEXT, SweepConfig(specs, ctx=32, windows=1, progress=False), out)
    assert json.loads(row_path(out, "int8").read_text())["meta"]["sweep"]["code"] == code_version()
    for spec, code in (("int8", {"walshkv": "0.0.9", "commit": "abc1234"}), ("int4", None)):
        record = json.loads(row_path(out, spec).read_text())
        if code is None:  # a row written before the code was part of the key
            del record["meta"]["sweep"]["code"]
        else:
            record["meta"]["sweep"]["code"] = code
        row_path(out, spec).write_text(json.dumps(record))
    capsys.readouterr()
    calls: list[list[str]] = []
    real = walshkv.eval.sweep.run.evaluate
    monkeypatch.setattr(
        walshkv.eval.sweep.run, "evaluate", lambda lm, t, c, **kw: calls.append(list(c)) or real(lm, t, c, **kw)
    )
    run_sweep(tiny_lm, TEXT, SweepConfig(specs, ctx=32, windows=1, progress=True), out)
    assert calls == [["int8", "int4"]]
    err = capsys.readouterr().err
    now = f"walshkv {__version__} at {code_commit()}"
    assert f"sweep: 1 rows were measured by walshkv 0.0.9 at abc1234, not {now}: re-running int8" in err
    assert f"sweep: 1 rows were measured by code of unknown version, not {now}: re-running int4" in err
    assert "3 rows, 1 already finished" in err
    for spec in specs:
        assert json.loads(row_path(out, spec).read_text())["meta"]["sweep"]["code"] == code_version()
