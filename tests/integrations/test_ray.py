"""``walshkv.integrations.ray``: sweeps and ``recommend`` as Ray tasks give the in-process numbers and resume.

One local 2-CPU Ray cluster serves the whole module (usage statistics off, shut down at the end). The model
is conftest's ``tiny_llama_hd64`` saved as a model folder with a character tokenizer, so that every Ray
worker loads it by path, as it would load a registry model by name.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

import walshkv.eval.sweep
import walshkv.eval.sweep.run
import walshkv.models
from walshkv.cli import main
from walshkv.data import load_text
from walshkv.eval.sweep import IN_PROCESS, EvalJob, SweepConfig, evaluate_specs, row_path, run_sweep, split_evenly
from walshkv.integrations.ray import RayExecutor, model_reference
from walshkv.models import LoadedModel, _describe
from walshkv.recommend import recommend

SPECS = ["int8", "int4", "rot+int3/int2", "tq:3/tq:2.5"]
FAST = {"ctx": 32, "windows": 2, "progress": False}


def _metrics(row: dict) -> str:
    """A result row without its timing (the only field that differs between runs), as JSON (NaN == NaN)."""
    return json.dumps({k: v for k, v in row.items() if k != "seconds"}, sort_keys=True)


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for the module (started by the executor, stopped at the end)."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    with RayExecutor("local", cpus=2) as executor:
        assert executor.slots == 2
        yield executor
    import ray

    assert not ray.is_initialized()


def _worker_loads(metas: list[dict]) -> dict[int, int]:
    """How often each worker process loaded the model, from the ``worker`` entry of result metas."""
    loads: dict[int, int] = {}
    for meta in metas:
        worker = meta["worker"]
        loads[worker["pid"]] = loads.get(worker["pid"], 0) + int(worker["loaded_model"])
    return loads


def test_sweep_on_ray_gives_the_in_process_rows_and_resumes(ray_lm, cluster, toy_text, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: None)
    here = run_sweep(ray_lm, toy_text, SweepConfig(SPECS, chunk=2, **FAST), tmp_path / "here")
    there = run_sweep(ray_lm, toy_text, SweepConfig(SPECS, chunk=1, **FAST), tmp_path / "ray", executor=cluster)
    assert [_metrics(r) for r in there] == [_metrics(r) for r in here]  # every KLD number identical
    records = {s: json.loads(row_path(tmp_path / "ray", s).read_text()) for s in SPECS}
    assert all(r["meta"]["executor"]["kind"] == "ray" for r in records.values())
    assert all(r["meta"]["sweep"]["evaluated_with"] == [s] for s, r in records.items())
    assert all(count <= 1 for count in _worker_loads([r["meta"] for r in records.values()]).values())

    # resume: two rows already on disk are reused byte for byte, only the other two go to the cluster
    seeded = tmp_path / "resume"
    (seeded / "rows").mkdir(parents=True)
    for spec in SPECS[:2]:
        row_path(seeded, spec).write_bytes(row_path(tmp_path / "here", spec).read_bytes())
    before = {s: row_path(seeded, s).read_bytes() for s in SPECS[:2]}
    capsys.readouterr()
    config = SweepConfig(SPECS, chunk=1, ctx=32, windows=2, progress=True)
    again = run_sweep(ray_lm, toy_text, config, seeded, executor=cluster)
    err = capsys.readouterr().err
    assert "4 rows, 2 already finished" in err and err.count("ray: job ") == 2
    assert {s: row_path(seeded, s).read_bytes() for s in SPECS[:2]} == before
    assert [_metrics(r) for r in again] == [_metrics(r) for r in here]
    assert json.loads(row_path(seeded, SPECS[2]).read_text())["meta"]["executor"]["kind"] == "ray"


def test_recommend_on_ray_chooses_as_in_process(ray_lm, cluster, toy_text):
    kwargs = {"windows": 1, "ctx": 32, "calib_tokens": 64, "per_layer": True, "progress": False}
    here = recommend(ray_lm, toy_text, 3.5, **kwargs)
    there = recommend(ray_lm, toy_text, 3.5, executor=cluster, **kwargs)
    assert [_metrics(r) for r in there.rows] == [_metrics(r) for r in here.rows]
    assert there.preset == here.preset
    assert here.plan is not None and there.plan is not None
    assert there.plan.moves == here.plan.moves and there.plan.chosen == here.plan.chosen
    assert there.plan.spec == here.plan.spec
    assert there.meta["executor"] == {**cluster.describe(), "jobs": 2} and "executor" not in here.meta
    assert there.meta["scored_tokens"] == here.meta["scored_tokens"]


def test_cli_sweep_and_recommend_with_ray(ray_lm, ray_model_dir, cluster, toy_text, tmp_path, capsys):
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"codecs": SPECS[:3]}))
    text = tmp_path / "t.txt"
    text.write_text(toy_text.content)
    out = tmp_path / "sw"
    argv = ["sweep", "--grid", str(grid), "--model", str(ray_model_dir), "--text", str(text), "--ctx", "32"]
    assert main([*argv, "--windows", "2", "--out", str(out), "--chunk", "1", "--ray", "local", "--quiet"]) == 0
    assert all(json.loads(row_path(out, s).read_text())["meta"]["executor"]["kind"] == "ray" for s in SPECS[:3])
    argv = ["recommend", "--model", str(ray_model_dir), "--text", str(text), "--bits", "3.5", "--ctx", "32"]
    argv += ["--windows", "1", "--calib-tokens", "64", "-o", str(tmp_path / "p.gguf")]
    argv += ["--json", str(tmp_path / "r.json")]
    assert main([*argv, "--ray", "local", "--quiet"]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    alone = recommend(ray_lm, load_text(str(text)), 3.5, windows=1, ctx=32, calib_tokens=64, progress=False)
    assert saved["winner"] == alone.preset.spec
    assert [r["kld_mean"] for r in saved["results"]] == [r["kld_mean"] for r in alone.rows]
    import ray

    assert ray.is_initialized()  # --ray local found the module's cluster running and left it alone


def test_errors_name_the_problem_and_the_fix(tiny_llama_hd64, toy_tokenizer, cluster, toy_text, monkeypatch, capsys):
    in_memory = LoadedModel(tiny_llama_hd64, toy_tokenizer, "tiny-hd64", "test", _describe(tiny_llama_hd64))
    with pytest.raises(ValueError, match=r"cannot load it: load it with walshkv.models.load_model"):
        model_reference(in_memory)
    with pytest.raises(ValueError, match=r"cannot load it"):
        evaluate_specs(in_memory, EvalJob(("int8", "int4"), toy_text, ctx=32, windows=1), cluster)
    with pytest.raises(ValueError, match="address='local'"):
        RayExecutor("auto", cpus=2)
    with pytest.raises(ValueError, match="cpus_per_task must be at least 1"):
        RayExecutor("local", cpus_per_task=0)
    assert main(["sweep", "--grid", "baseline", "--ray-cpus", "2"]) == 2
    assert "--ray-cpus sizes a cluster started here: add --ray local" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed: refused before loading
    monkeypatch.setattr(walshkv.models, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["recommend", "--bits", "3.5", "--ray", "local"]) == 2
    assert 'pip install "walshkv[ray]"' in capsys.readouterr().err


def test_in_process_is_one_evaluate_call_and_split_evenly():
    assert IN_PROCESS.slots == 1 and IN_PROCESS.describe() == {"kind": "in-process"}
    assert split_evenly(list("abcde"), 2) == [["a", "b", "c"], ["d", "e"]]
    assert split_evenly(list("ab"), 4) == [["a"], ["b"]]
    assert split_evenly([], 3) == []
