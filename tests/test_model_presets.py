"""The per-model preset specs shipped with the package (walshkv/model_presets.json) and their resolution."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import walshkv.presets as presets_module
from walshkv import CompressedCache
from walshkv.codecs import parse_cache_spec
from walshkv.codecs.builtin_presets import BUILTIN, is_fast_preset, preset_budget
from walshkv.constants import Keys
from walshkv.models import ModelShape
from walshkv.presets import (
    dense_key_map,
    known_model,
    model_presets,
    name_specs,
    resolve_engine_preset,
    resolve_preset,
)

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = ModelShape(arch="llama", layers=30, q_heads=9, kv_heads=3, head_dim=64, params=134515008)


class _Loaded:
    """What resolve_preset reads of a LoadedModel: its name and shape."""

    def __init__(self, name: str, shape: ModelShape) -> None:
        self.name, self.shape = name, shape


def _load_ship():
    spec = importlib.util.spec_from_file_location("ship_presets", ROOT / "scripts" / "ship_presets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_ship = _load_ship()


def test_a_tolerance_rule_ships_the_twin_within_it_and_the_shipped_spec_beyond():
    """Table set 4's rule (docs/trellis.md): the twin ships when its KLD is at most 1.01x the shipped spec's in the
    run, whichever recommend ranked first; a run that does not hold exactly the pair is refused."""
    path = Path("recommend-3.5-t4-ctx4096.json")

    def run(twin_kld: float) -> dict:
        rows = [{"codec": "tcq:3.5:tables=2", "kld_mean": 0.0200}, {"codec": "tcq:3.5:tables=4", "kld_mean": twin_kld}]
        return {"winner": min(rows, key=lambda r: r["kld_mean"])["codec"], "results": rows}

    assert _ship.winner(path, run(0.0201)) == "tcq:3.5:tables=4"  # recommend ranked the shipped spec first
    assert _ship.winner(path, run(0.0190)) == "tcq:3.5:tables=4"
    assert _ship.winner(path, run(0.0203)) == "tcq:3.5:tables=2"
    assert _ship.winner(Path("recommend-3.5-t2-ctx4096.json"), run(0.0201)) == "tcq:3.5:tables=2"  # no tolerance
    with pytest.raises(SystemExit, match="ranks one shipped spec and its twin"):
        _ship.winner(path, {"winner": "x", "results": [{"codec": "tcq:3:tables=4", "kld_mean": 1.0}]})


def test_shipped_file_is_up_to_date_with_the_recommend_runs():
    """Nothing typed by hand: the file is what scripts/ship_presets.py makes of docs/results/presets."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "ship_presets.py"), "--check"], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr


def test_every_shipped_spec_parses_fits_its_budget_and_has_provenance():
    table = model_presets()
    assert {"smollm2-135m", "qwen2.5-1.5b", "gemma3-270m"} <= set(table)
    for name, entry in table.items():
        shape = entry["shape"]
        for preset, choice in entry["presets"].items():
            spec = parse_cache_spec(choice["spec"])
            bits = spec.bits_at(shape["head_dim"], choice["ctx"], shape["layers"])
            assert bits <= preset_budget(preset) + 1e-9, (name, preset, bits)
            assert not (is_fast_preset(preset) and dense_key_map(spec)), (name, preset, "a fast preset maps keys fast")
            assert choice["selected_on"].startswith("python-docs"), "selection on python-docs only"
            assert choice["source"].startswith(("docs/results/presets/", "docs/results/long-context/select/"))
            assert (ROOT / choice["source"]).is_file()
            run = json.loads((ROOT / choice["source"]).read_text())
            assert (_ship.winner(ROOT / choice["source"], run), run["meta"]["ctx"]) == (choice["spec"], choice["ctx"])


def test_the_longest_selection_context_ships():
    # qwen2.5-1.5b's walshkv:4.5 was re-selected at 4k tokens (docs/long-context.md), then again at 4k with tcq
    # (docs/trellis.md): the later 4k run ships, not the 512 one nor the first 4k one
    choice = model_presets()["qwen2.5-1.5b"]["presets"]["walshkv:4.5"]
    folder = ROOT / "docs/results/long-context/select/qwen2.5-1.5b"
    runs = [json.loads((folder / f"recommend-4.5{k}-ctx4096.json").read_text()) for k in ("", "-qtcq")]
    assert runs[0]["meta"]["date"] <= runs[1]["meta"]["date"]
    assert choice["ctx"] == 4096 and choice["spec"] == runs[1]["winner"] != runs[0]["winner"]
    assert choice["source"] == "docs/results/long-context/select/qwen2.5-1.5b/recommend-4.5-qtcq-ctx4096.json"


def test_at_the_same_context_the_later_run_ships():
    # smollm2-135m's walshkv:4.5 was selected at 4k four times: the tcq re-selection (docs/trellis.md) replaced the
    # first, the norm=8 re-selection the tcq one, the table-set-2 re-selection the norm=8 one
    choice = model_presets()["smollm2-135m"]["presets"]["walshkv:4.5"]
    folder = ROOT / "docs/results/long-context/select/smollm2-135m"
    runs = [json.loads((folder / f"recommend-4.5{k}-ctx4096.json").read_text()) for k in ("", "-tcq", "-n8", "-t2")]
    assert [r["meta"]["date"] for r in runs] == sorted(r["meta"]["date"] for r in runs)
    assert choice["spec"] == runs[3]["winner"] not in [r["winner"] for r in runs[:3]]
    assert choice["source"] == "docs/results/long-context/select/smollm2-135m/recommend-4.5-t2-ctx4096.json"


def test_known_model_resolves_to_its_shipped_spec():
    shipped = json.loads((ROOT / "src" / "walshkv" / "model_presets.json").read_text())
    want = shipped["models"]["smollm2-135m"]["presets"]["walshkv:3.5"]["spec"]
    for model in ("smollm2-135m", _Loaded("smollm2-135m", SMOLLM2), SMOLLM2):
        p = resolve_preset("walshkv:3.5", model=model)
        assert p.spec == want and p.source == "shipped:smollm2-135m" and not p.note
        assert p.provenance["selected_on"] == "python-docs[select]"
    named = name_specs(["walshkv:3.5", "q4_0"], model="smollm2-135m")
    assert [(n.text, n.label, n.source) for n in named] == [
        (want, "walshkv:3.5", "shipped:smollm2-135m"),
        ("q4_0", None, None),
    ]
    again = name_specs(named, model="smollm2-135m")  # resolved again to the same spec: the parsed object is kept
    assert again[0].spec is named[0].spec and again[1] is named[1]


def test_unknown_model_keeps_the_builtin_spec_and_is_told_about_recommend(tiny_llama):
    model = tiny_llama
    assert known_model(model) is None
    p = resolve_preset("walshkv:3", model=model)
    assert p.spec == BUILTIN["walshkv:3"] and p.source == "built-in"
    assert "walshkv recommend" in p.note and "--bits 3" in p.note
    # a known name with another model's shape is not that model
    assert known_model(_Loaded("smollm2-135m", ModelShape("llama", 2, 4, 2, 16, 1000))) is None
    # no model given: the built-in spec, silently (the old behaviour)
    assert resolve_preset("walshkv:3").note == ""


def test_from_preset_warns_for_an_unknown_model(tiny_llama):
    model = tiny_llama
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(ValueError):  # no calibration given: refused after resolution, after the note
            CompressedCache.from_preset(model, "walshkv:3")
    assert any("walshkv recommend" in str(w.message) for w in caught)


def test_calibration_file_for_the_preset_still_wins():
    class _File:
        def __init__(self) -> None:
            self.meta = {Keys.Preset.NAME: "walshkv:3.5", Keys.Preset.SPEC: "center+tq:4/tq:2.5"}
            self.source = "my.gguf"

    p = resolve_preset("walshkv:3.5", _File(), model="smollm2-135m")
    assert p.spec == "center+tq:4/tq:2.5" and p.source == "my.gguf"


@pytest.mark.parametrize("name", ["walshkv:2", "walshkv"])
def test_unknown_preset_name_lists_the_presets(name):
    with pytest.raises(ValueError, match=re.escape("walshkv:3, walshkv:3.5, walshkv:4.5")):
        resolve_preset(name, model="smollm2-135m")


@pytest.mark.model
def test_calibrate_preset_on_smollm2_writes_the_shipped_spec(tmp_path, capsys):
    """`walshkv calibrate --preset walshkv:3.5 --model smollm2-135m` uses the model's measured winner."""
    from walshkv.cli import main
    from walshkv.export import read_kv_mean_center

    out = tmp_path / "p.gguf"
    args = ["calibrate", "--preset", "walshkv:3.5", "--model", "smollm2-135m", "--ctx", "64", "--tokens", "128"]
    assert main([*args, "--quiet", "-o", str(out)]) == 0
    want = model_presets()["smollm2-135m"]["presets"]["walshkv:3.5"]["spec"]
    assert read_kv_mean_center(out).meta[Keys.Preset.SPEC] == want
    assert "shipped:smollm2-135m" in capsys.readouterr().err


def test_fast_presets_ship_with_files_whose_keys_the_kernel_maps_fast():
    # smollm2-135m's walshkv:B-fast (recommend --fast at 4k): shipped, no dense per-key map, and the calibration
    # walshkv ships for it (walshkv/calibrations) binds to the fast Walsh-Hadamard key map of the CPU kernel
    from walshkv.attention.blockframe import block_frame_plan
    from walshkv.attention.cpu import prerope_key_map
    from walshkv.export import read_kv_mean_center
    from walshkv.shipped import shipped_file

    for name in ("walshkv:3-fast", "walshkv:3.5-fast", "walshkv:4.5-fast"):
        p = resolve_preset(name, model="smollm2-135m")
        assert p.source == "shipped:smollm2-135m" and p.provenance["ctx"] == 4096 and not dense_key_map(p.spec)
        plain = resolve_preset(name.removesuffix("-fast"), model="smollm2-135m")
        assert dense_key_map(plain.spec)  # what the fast preset is for
        cal = read_kv_mean_center(shipped_file("smollm2-135m", name).path)
        assert resolve_preset(name, cal, model="smollm2-135m").spec == p.spec  # the file names no other spec
        bound = parse_cache_spec(p.spec).bind(3, cal)
        # no per-key map: eqd+'s fast Walsh-Hadamard one, or (the block frame) none, the query turned per block
        assert prerope_key_map(bound.k, bound.v, 64, 3) in ("hadamard", None), name
        assert block_frame_plan(bound.k, bound.v, 64, 0.125) is not None or prerope_key_map(bound.k, bound.v, 64, 3)


@pytest.mark.parametrize("model", sorted(model_presets()))
def test_the_naming_rule_names_each_kind_and_no_fast_or_renamed_preset_maps_keys_densely(model):
    """Issue 35's acceptance: no preset of the byte-speed kind applies a dense per-key map in decode. ``walshkv:B-fast``
    never does; ``walshkv:B`` does not where the naming rule gave it the block frame (``names``); ``walshkv:B-max`` is
    the preset with the per-key map allowed. The rule's evidence is recorded for every budget, and a plain name moves
    exactly where both of its conditions hold (docs/presets.md, "Which kind the plain name means")."""
    entry = model_presets()[model]
    names, evidence = entry["names"], entry["naming"]
    for plain in (k for k in entry["presets"] if not k.endswith("-fast")):
        fast = resolve_preset(f"{plain}-fast", model=model).spec
        assert not dense_key_map(fast), (model, plain)
        assert resolve_preset(f"{plain}-max", model=model).spec == entry["presets"][plain]["spec"]
        rule = evidence[plain]
        for s in rule["speed"]:  # judged on builds for the CPU they ran on, never a WALSHKV_CPU_MARCH stand-in
            machine = json.loads((ROOT / "docs" / "results" / s["block"] / "bench.json").read_text())["meta"]["machine"]
            assert machine.get("kernel_march", "native") == "native", s["block"]
        assert rule["plain_name_is_fast"] == (rule["speed_met"] and rule["selection_met"]) == (plain in names)
        if plain in names:
            assert resolve_preset(plain, model=model).spec == fast and not dense_key_map(fast)
            assert all(s["x_vs_fastest_sdpa"] >= 2.5 for s in rule["speed"]) and rule["selection_kld_ratio"] <= 1.10
        else:
            assert resolve_preset(plain, model=model).spec == entry["presets"][plain]["spec"]


def test_an_engine_gets_the_models_own_preset_or_a_refusal_never_the_builtin_spec(monkeypatch):
    """resolve_engine_preset: the shipped spec for a known model; no model or an unknown one is refused by name."""
    p = resolve_engine_preset("walshkv:3.5", engine="test", model="smollm2-135m")
    assert p.spec == model_presets()["smollm2-135m"]["presets"]["walshkv:3.5"]["spec"]
    assert p.source == "shipped:smollm2-135m"
    with pytest.raises(ValueError, match=r"^test: walshkv:3\.5 is chosen per model .*no model is named: NAME IT"):
        resolve_engine_preset("walshkv:3.5", engine="test", how="NAME IT")
    with pytest.raises(ValueError, match=r"'mystery-7b' is not a model walshkv has measured"):
        resolve_engine_preset("walshkv:3.5", engine="test", model="mystery-7b")
    # a known model without a measured entry for a preset (every shipped model has all eight today: one taken out)
    table = copy.deepcopy(model_presets())
    del table["qwen2.5-1.5b"]["presets"]["walshkv:4.5-fast"]
    monkeypatch.setattr(presets_module, "model_presets", lambda: table)
    with pytest.raises(ValueError, match=r"walshkv has no measured walshkv:4\.5-fast for qwen2\.5-1\.5b"):
        resolve_engine_preset("walshkv:4.5-fast", engine="test", model="qwen2.5-1.5b")
    with pytest.raises(ValueError, match=r"walshkv:3, walshkv:3\.5"):  # an unknown preset name lists the valid ones
        resolve_engine_preset("walshkv:7", engine="test", model="smollm2-135m")
