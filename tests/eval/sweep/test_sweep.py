"""``walshkv sweep``: presets, resume, outputs and the CLI, on the tiny model (no download)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import walshkv.eval
import walshkv.eval.sweep
import walshkv.eval.sweep.run
import walshkv.models
from walshkv.cli import main
from walshkv.codecs import available_codecs, parse_cache_spec
from walshkv.data import Text
from walshkv.eval.harness import DEFAULT_CODECS
from walshkv.eval.sweep import (
    PRESETS,
    SweepConfig,
    canonical_specs,
    load_grid,
    pareto_front,
    resolve_grid,
    row_path,
    run_sweep,
    substitute_head_dim,
)
from walshkv.models import LoadedModel, _describe
from walshkv.presets import resolve_preset

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
DOCS = Path(__file__).resolve().parents[3] / "docs" / "sweep.md"
FAST = {"ctx": 32, "windows": 1, "progress": False}


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture
def count_evaluate(monkeypatch):
    """Record the spec list of every ``evaluate`` call the sweep makes."""
    calls: list[list[str]] = []
    real = walshkv.eval.evaluate

    def counting(lm, text, codecs, **kw):
        calls.append(list(codecs))
        return real(lm, text, codecs, **kw)

    monkeypatch.setattr(walshkv.eval.sweep.run, "evaluate", counting)
    return calls


@pytest.fixture
def stub_plot(monkeypatch):
    """Skip matplotlib's rendering (about half a second a plot) where the PNG is not under test."""
    plots: list[str] = []
    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: plots.append(title))
    return plots


def _bands(codec: str) -> list[int]:
    """``vht2:5,4,3[:opt=...]`` -> [5, 4, 3]."""
    name, _, rest = codec.partition(":")
    assert name == "vht2"
    return [int(b) for b in rest.split(":")[0].split(",")]


# --- presets -------------------------------------------------------------------------------------------


def test_presets_structure_and_counts():
    counts = {name: len(specs) for name, (_, specs) in PRESETS.items()}
    assert counts == {
        "baseline": len(DEFAULT_CODECS),
        "vht2-bits": 21,
        "vht2-bands": 6,
        "vht2-sk": 3,
        "vht2-claims": 14,
        "peers": 35,
        "rotation-int4": 9,
        "long-context": 15,
        "vht2-orders": 5,
        "vht2-v": 7,
    }
    for name, (description, specs) in PRESETS.items():
        assert description.strip(), name
        assert len(set(specs)) == len(specs), name
        if name.startswith("vht2") and name != "vht2-claims":  # K/V pairs (after {hd/N} is filled in)
            assert all(s.count("/") == 1 for s in resolve_grid(name, 64)), name
    assert PRESETS["baseline"][1] == list(DEFAULT_CODECS)

    bits = [s.split("/") for s in PRESETS["vht2-bits"][1]]
    assert {v for _, v in bits} == {"vht2:3", "vht2:4", "vht2:5"}
    assert len({k for k, _ in bits}) == 7 and "vht2:5,5,4,3" in {k for k, _ in bits}

    # "matched": the mean of the K band widths is 4.0 for every row, and the description says so
    description, specs = PRESETS["vht2-bands"]
    ks = [s.split("/")[0] for s in specs]
    assert [len(_bands(k)) for k in ks] == [1, 2, 3, 4, 5, 8]
    assert all(sum(_bands(k)) / len(_bands(k)) == 4.0 for k in ks)
    assert all(s.endswith("/vht2:4") for s in specs)
    assert "mean" in description and "4.0" in description

    orders = [s.split("/")[0].split(":order=")[1] for s in PRESETS["vht2-orders"][1]]
    assert orders == ["natural", "sequency", "squarefree", "squarefree-dc", "variance"]

    v_specs = PRESETS["vht2-v"][1]
    assert {s.split("/")[0] for s in v_specs} == {"vht2:5,5,4,3:order=squarefree"}
    vs = [s.split("/")[1] for s in v_specs]
    assert {"vht2:3", "vht2:4", "vht2:5", "vzc"} <= set(vs)
    assert any(len(_bands(v)) > 1 for v in vs if v != "vzc")


@pytest.mark.parametrize("head_dim", [64, 128])
def test_presets_resolve_with_head_dim(head_dim):
    for name, (_, specs) in PRESETS.items():
        resolved = resolve_grid(name, head_dim)
        assert len(resolved) == len(specs)
        assert not any("{" in s or "}" in s for s in resolved), name
    sk = resolve_grid("vht2-sk", head_dim)
    assert sk == [f"vht2:5,5,4,3:sk={n}/vht2:3" for n in (head_dim, head_dim // 2, head_dim // 4)]


def test_placeholder_errors():
    assert substitute_head_dim("vht2:4:sk={ hd/8 }", 64) == "vht2:4:sk=8"
    with pytest.raises(ValueError, match="divisible by 3"):
        substitute_head_dim("vht2:4:sk={hd/3}", 64)
    with pytest.raises(ValueError, match=r"\{hd\}"):
        substitute_head_dim("vht2:4:sk={dim}", 64)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match="unknown grid 'nope'") as err:
        resolve_grid("nope", 64)
    for name in PRESETS:
        assert name in str(err.value)
    assert ".yaml" in str(err.value)


def test_canonical_specs_parse_dedupe_and_head_dim():
    assert canonical_specs(["int4/int4", "int4", "ROT+int3/int2"], 16) == ["int4", "rot+int3/int2"]
    with pytest.raises(ValueError, match=r"'int9'.*unknown codec"):
        canonical_specs(["int4", "int9"], None)
    with pytest.raises(ValueError, match=r"rot\+int4"):
        canonical_specs(["rot+int4"], 12)  # not a power of two


# --- grid files ----------------------------------------------------------------------------------------


def test_grid_files_json_and_yaml(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"description": "two", "codecs": ["int4", "rot+int4:x"]}))
    assert load_grid(str(path)) == ("mine", "two", ["int4", "rot+int4:x"])  # specs are not parsed here
    yaml = pytest.importorskip("yaml")
    ypath = tmp_path / "g.yaml"
    ypath.write_text(yaml.safe_dump({"codecs": ["int8", "vht2:5,5,4,3:sk={hd/2}/vht2:3"]}))
    assert resolve_grid(str(ypath), 64) == ["int8", "vht2:5,5,4,3:sk=32/vht2:3"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ("{not json", "not valid JSON"),
        ('{"codecs": []}', "non-empty list"),
        ('{"codecs": ["int4", 4]}', "spec string"),
        ('{"specs": ["int4"]}', "'codecs' list"),
        ('{"codecs": ["int4"], "extra": 1}', "unknown keys"),
    ],
)
def test_bad_grid_files(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        load_grid(str(path))


def test_missing_grid_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_grid(str(tmp_path / "nope.yaml"))


# --- Pareto front --------------------------------------------------------------------------------------


def test_pareto_front_on_hand_made_rows():
    rows = [
        {"codec": "a", "bits_per_element": 4.0, "kld_mean": 0.10},
        {"codec": "b", "bits_per_element": 3.0, "kld_mean": 0.50},
        {"codec": "c", "bits_per_element": 4.0, "kld_mean": 0.05},  # beats a at equal bits
        {"codec": "d", "bits_per_element": 5.0, "kld_mean": 0.07},  # worse than c with more bits
        {"codec": "e", "bits_per_element": 8.0, "kld_mean": 0.001},
        {"codec": "f", "bits_per_element": 2.0, "kld_mean": math.nan},  # ignored
        {"codec": "g", "bits_per_element": 3.0, "kld_mean": 0.50},  # tie with b: first kept
        {"codec": "h", "bits_per_element": 16.0, "kld_mean": 0.0},
    ]
    assert [r["codec"] for r in pareto_front(rows)] == ["b", "c", "e", "h"]
    assert pareto_front([]) == []


# --- run_sweep -----------------------------------------------------------------------------------------


def test_run_sweep_writes_rows_and_outputs_then_resumes(tmp_path, tiny_lm, count_evaluate, monkeypatch):
    specs = ["fp32", "int8", "int4", "rot+int3/int2", "int2"]
    out = tmp_path / "sw"
    rows = run_sweep(
        tiny_lm, TEXT, SweepConfig(specs, chunk=2, command="walshkv sweep --grid x", title="x", **FAST), out
    )
    assert count_evaluate == [["fp32", "int8"], ["int4", "rot+int3/int2"], ["int2"]]
    assert [r["bits_per_element"] for r in rows] == sorted(r["bits_per_element"] for r in rows)
    assert {r["codec"] for r in rows} == set(specs)
    for spec in specs:
        record = json.loads(row_path(out, spec).read_text())
        assert set(record) == {"meta", "result"}
        assert record["result"]["codec"] == spec
        sweep = record["meta"]["sweep"]
        assert sweep["spec"] == spec and sweep["model"] == "tiny-llama" and sweep["text"] == "toy"
        assert (sweep["ctx"], sweep["windows"], sweep["score"], sweep["residual"]) == (32, 1, "half", 0)
        assert record["meta"]["command"] == "walshkv sweep --grid x"
    assert "/" not in row_path(out, "rot+int3/int2").name

    csv_lines = (out / "results.csv").read_text().splitlines()
    assert csv_lines[0].startswith("codec,") and len(csv_lines) == 1 + len(specs)
    assert [line.split(",")[0] for line in csv_lines[1:]] == [r["codec"] for r in rows]
    md = (out / "results.md").read_text()
    assert "| codec" in md and "walshkv sweep --grid x" in md and "tiny-llama" in md and "Pareto front" in md
    assert (out / "pareto.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # second run: everything finished, nothing evaluated, same rows
    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: None)
    count_evaluate.clear()
    again = run_sweep(tiny_lm, TEXT, SweepConfig(specs, chunk=2, **FAST), out)
    assert count_evaluate == []
    assert [r["kld_mean"] for r in again] == [r["kld_mean"] for r in rows]

    # a missing row and a corrupt row are rerun, together
    row_path(out, "int4").unlink()
    row_path(out, "int2").write_text("{truncated")
    run_sweep(tiny_lm, TEXT, SweepConfig(specs, chunk=4, **FAST), out)
    assert count_evaluate == [["int4", "int2"]]

    # different settings: every row is rerun
    count_evaluate.clear()
    run_sweep(tiny_lm, TEXT, SweepConfig(specs[:2], chunk=4, residual=4, **FAST), out)
    assert count_evaluate == [["fp32", "int8"]]
    assert json.loads(row_path(out, "int8").read_text())["meta"]["sweep"]["residual"] == 4
    # ... and the combined outputs cover only the specs of that run
    assert len((out / "results.csv").read_text().splitlines()) == 3


def test_run_sweep_meta_mismatch_reruns(tmp_path, tiny_lm, count_evaluate, stub_plot):
    out = tmp_path / "sw"
    run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "int8"], **FAST), out)
    record = json.loads(row_path(out, "int8").read_text())
    record["meta"]["sweep"]["ctx"] = 64
    row_path(out, "int8").write_text(json.dumps(record))
    count_evaluate.clear()
    run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "int8"], **FAST), out)
    assert count_evaluate == [["int8"]]
    other_text = Text("toy", "generated", TEXT.content[::-1])  # same name, other content
    count_evaluate.clear()
    run_sweep(tiny_lm, other_text, SweepConfig(["int4"], **FAST), out)
    assert count_evaluate == [["int4"]]


def test_run_sweep_rows_of_other_code_rerun_unless_reused(tmp_path, tiny_lm, count_evaluate, stub_plot, capsys):
    out = tmp_path / "sw"
    run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "int8"], **FAST), out)
    record = json.loads(row_path(out, "int8").read_text())
    record["meta"]["sweep"]["code"] = {"walshkv": "0.0.9", "commit": "abc1234"}
    row_path(out, "int8").write_text(json.dumps(record))
    count_evaluate.clear()
    # --reuse-rows: kept, said so, and results.md names both versions
    run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "int8"], reuse_rows=True, **{**FAST, "progress": True}), out)
    assert count_evaluate == []
    assert "keeping them (--reuse-rows) int8" in capsys.readouterr().err
    md = (out / "results.md").read_text()
    assert "more than one version of the code" in md and "walshkv 0.0.9 at abc1234: `int8`" in md
    # the default: re-run, said so
    run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "int8"], **{**FAST, "progress": True}), out)
    assert count_evaluate == [["int8"]]
    assert "re-running int8" in capsys.readouterr().err
    assert "more than one version" not in (out / "results.md").read_text()


def test_run_sweep_bad_spec_fails_before_running(tmp_path, tiny_lm, count_evaluate):
    with pytest.raises(ValueError, match="grid spec 'nope': unknown codec"):
        SweepConfig(["int4", "nope"], **FAST)  # the grammar: when the config is built
    with pytest.raises(ValueError, match="grid spec 'q4_0': head_dim must be a multiple of 32"):
        run_sweep(tiny_lm, TEXT, SweepConfig(["int4", "q4_0"], **FAST), tmp_path / "sw")  # the fit, before any work
    assert count_evaluate == []
    assert not (tmp_path / "sw").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"codecs": "int4"}, "codecs is a list of cache specs: give ['int4'], not 'int4'"),
        ({"codecs": []}, "the grid has no cache specs"),
        ({"ctx": 3}, "--ctx must be at least 4 tokens, got 3"),
        ({"windows": 0}, "--windows must be at least 1 (None: every full window), got 0"),
        ({"score": "first"}, "--score must be one of half, all, got 'first'"),
        ({"residual": -1}, "--residual must be at least 0 tokens, got -1"),
        ({"chunk": 0}, "--chunk must be at least 1 spec, got 0"),
        ({"decode_chunk": 0}, "--decode-chunk must be at least 1 token, got 0"),
    ],
)
def test_sweep_config_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError) as err:
        SweepConfig(**{"codecs": ["int4"], **settings})
    assert str(err.value) == message


def test_sweep_config_keeps_its_specs_as_a_tuple():
    config = SweepConfig(["int4", "int8"])
    assert config.codecs == ("int4", "int8") and (config.ctx, config.windows, config.chunk) == (512, 8, 4)
    assert SweepConfig(["int4"], windows=None).windows is None


def test_run_sweep_without_matplotlib(tmp_path, tiny_lm, monkeypatch, capsys):
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(__import__("sys").modules, mod, None)
    out = tmp_path / "sw"
    run_sweep(tiny_lm, TEXT, SweepConfig(["int8", "int2"], **FAST), out)
    err = capsys.readouterr().err
    assert "pareto.png skipped" in err and "walshkv[plot]" in err
    assert not (out / "pareto.png").exists()
    assert (out / "results.md").exists() and "pareto.png" not in (out / "results.md").read_text()


class _BackwardsExecutor:
    """An executor that takes every job first, then returns them last to first, in this process, 2 at once."""

    slots = 2

    def __init__(self) -> None:
        self.jobs: list = []

    def describe(self) -> dict:
        return {"kind": "backwards"}

    def map(self, lm, jobs, *, progress=False):
        self.jobs = list(jobs)
        for i in reversed(range(len(self.jobs))):
            yield i, walshkv.eval.sweep.run_job(lm, self.jobs[i])


def test_run_sweep_and_evaluate_specs_through_another_executor(tmp_path, tiny_lm, stub_plot):
    specs = ["int8", "int4", "rot+int3/int2"]
    here = run_sweep(tiny_lm, TEXT, SweepConfig(specs, chunk=1, **FAST), tmp_path / "here")
    backwards = _BackwardsExecutor()
    there = run_sweep(tiny_lm, TEXT, SweepConfig(specs, chunk=1, **FAST), tmp_path / "there", executor=backwards)
    assert [job.specs for job in backwards.jobs] == [(s,) for s in specs]
    assert [{**r, "seconds": 0} for r in there] == [{**r, "seconds": 0} for r in here]
    assert json.loads(row_path(tmp_path / "there", "int4").read_text())["meta"]["executor"] == {"kind": "backwards"}
    job = walshkv.eval.sweep.EvalJob(tuple(specs), TEXT, ctx=32, windows=1)
    split = walshkv.eval.sweep.evaluate_specs(tiny_lm, job, backwards)
    whole = walshkv.eval.sweep.evaluate_specs(tiny_lm, job)  # in process: one evaluate call
    assert [job.specs for job in backwards.jobs] == [("int8", "int4"), ("rot+int3/int2",)]
    assert [r["codec"] for r in split.results] == specs and "executor" not in whole.meta
    assert [r["kld_mean"] for r in split.results] == [r["kld_mean"] for r in whole.results]
    assert split.meta["executor"] == {"kind": "backwards", "jobs": 2}


def test_run_sweep_progress_lines(tmp_path, tiny_lm, capsys, stub_plot):
    config = SweepConfig(["int8", "int4", "int2"], ctx=32, windows=1, chunk=2, progress=True)
    run_sweep(tiny_lm, TEXT, config, tmp_path / "sw")
    err = capsys.readouterr().err
    assert "3 rows, 0 already finished" in err and "[1-2/3] int8, int4" in err and "[3/3] int2" in err


needs_vht2 = pytest.mark.skipif("vht2" not in available_codecs(), reason="the vht2 codec is not registered")


@needs_vht2
def test_run_sweep_calibrated_specs(tmp_path, tiny_lm, count_evaluate, stub_plot):
    from walshkv.calibration import collect_kv_stats

    specs = ["int4", "vht2:4,3:order=variance"]
    out = tmp_path / "sw"
    with pytest.raises(ValueError, match="calibration"):
        run_sweep(tiny_lm, TEXT, SweepConfig(specs, **FAST), out)
    assert count_evaluate == []
    other = Text("other", "generated", TEXT.content[::-1])
    calib = collect_kv_stats(tiny_lm, other, tokens=64, ctx=32, progress=False)
    run_sweep(tiny_lm, TEXT, SweepConfig(specs, calibration=calib, **FAST), out)
    assert count_evaluate == [specs]
    assert json.loads(row_path(out, "int4").read_text())["meta"]["sweep"]["calibration"] is None
    stored = json.loads(row_path(out, specs[1]).read_text())["meta"]["sweep"]["calibration"]
    assert stored == {"model": "tiny-llama", "text": "other", "tokens": 64}
    assert "Calibrated specs" in (out / "results.md").read_text()
    # other calibration: only the calibrated row is rerun
    count_evaluate.clear()
    calib = collect_kv_stats(tiny_lm, other, tokens=32, ctx=32, progress=False)
    run_sweep(tiny_lm, TEXT, SweepConfig(specs, calibration=calib, **FAST), out)
    assert count_evaluate == [specs[1:]]


# --- command line --------------------------------------------------------------------------------------


def test_cli_list_grids(capsys):
    assert main(["sweep", "--list-grids"]) == 0
    out = capsys.readouterr().out
    for name, (_, specs) in PRESETS.items():
        assert name in out and f"({len(specs)} rows)" in out


def test_cli_unknown_grid_and_missing_grid(capsys):
    assert main(["sweep", "--grid", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown grid 'nope'" in err and "vht2-bits" in err and "baseline" in err
    assert main(["sweep"]) == 2
    assert "--grid" in capsys.readouterr().err


def test_cli_bad_spec_in_grid_file_fails_before_loading(tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(walshkv.models, "load_model", no_load)
    grid = tmp_path / "g.json"
    grid.write_text(json.dumps({"codecs": ["int4", "int9"]}))
    assert main(["sweep", "--grid", str(grid), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "int9" in err and "unknown codec" in err
    grid.write_text(json.dumps({"codecs": ["int4", "vht2:4:sk={hd/3}"]}))
    assert main(["sweep", "--grid", str(grid), "--quiet"]) == 2  # smollm2's head_dim 64, from the registry
    assert "divisible by 3" in capsys.readouterr().err
    if "vht2" in available_codecs():  # order=variance without --calib-text
        assert main(["sweep", "--grid", "vht2-orders", "--quiet"]) == 2
        assert "--calib-text" in capsys.readouterr().err


def test_cli_end_to_end_on_tiny_model(tmp_path, tiny_lm, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    text = tmp_path / "toy.txt"
    text.write_text(TEXT.content)
    grid = tmp_path / "mine.json"
    grid.write_text(json.dumps({"codecs": ["int8", "rot+int4", "int2"]}))
    out = tmp_path / "out"
    argv = ["sweep", "--grid", str(grid), "--text", str(text), "--ctx", "32", "--ci", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "mean KLD" in stdout and "Pareto front" in stdout and "results.csv" in stdout
    record = json.loads(row_path(out, "rot+int4").read_text())
    assert record["meta"]["windows"] == 2 and record["meta"]["sweep"]["windows"] == 2  # --ci
    assert record["meta"]["command"].startswith("walshkv sweep --grid")
    for name in ("results.csv", "results.md", "pareto.png"):
        assert (out / name).is_file()


@needs_vht2
def test_cli_calibrated_grid(tmp_path, tiny_lm, monkeypatch, capsys, stub_plot):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    text, calib = tmp_path / "toy.txt", tmp_path / "calib.txt"
    text.write_text(TEXT.content)
    calib.write_text(TEXT.content[::-1])
    grid = tmp_path / "cal.json"
    grid.write_text(json.dumps({"codecs": ["int4", "vht2:4,3:order=variance"]}))
    argv = ["sweep", "--grid", str(grid), "--text", str(text), "--ctx", "32", "--windows", "1", "--quiet"]
    out = tmp_path / "out"
    assert main([*argv, "--out", str(out), "--calib-text", str(text)]) == 2
    assert "is the evaluation text" in capsys.readouterr().err
    assert main([*argv, "--out", str(out), "--calib-text", str(calib), "--calib-tokens", "512"]) == 0
    stored = json.loads(row_path(out, "vht2:4,3:order=variance").read_text())["meta"]["sweep"]["calibration"]
    assert stored == {"model": "tiny-llama", "text": "calib.txt", "tokens": 512}


def test_docs_cover_every_preset():
    doc = DOCS.read_text()
    for name in PRESETS:
        assert f"`{name}`" in doc
    for name in ("results.csv", "results.md", "pareto.png", "--list-grids", "--ci"):
        assert name in doc


def test_repository_grid_files_load_and_parse():
    # docs/grids/*.json drive the reproduce scripts: each must load and every spec must parse (presets by name)
    files = sorted((Path(__file__).resolve().parents[3] / "docs" / "grids").glob("*.json"))
    assert files
    for path in files:
        _, description, specs = load_grid(str(path))
        assert description and specs, path
        for spec in specs:
            parse_cache_spec(resolve_preset(spec, model="smollm2-135m").spec if spec.startswith("walshkv:") else spec)
