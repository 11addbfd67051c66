"""scripts/long_context_report.py: which holdout targets a re-selection adds (the spec a new preset replaced)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from walshkv.presets import BUILTIN, model_presets, public_name

ROOT = Path(__file__).resolve().parents[1]


def _report():
    spec = importlib.util.spec_from_file_location("long_context_report", ROOT / "scripts" / "long_context_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, name: str, preset: str, winner: str, candidates: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    run = {"preset": preset, "winner": winner, "meta": {"ctx": 4096}, "results": [{"codec": c} for c in candidates]}
    (folder / name).write_text(json.dumps(run))


def test_a_reselection_is_judged_against_the_spec_it_replaced(tmp_path: Path) -> None:
    report = _report()
    shipped = model_presets()["smollm2-135m"]["presets"]["walshkv:3"]["spec"]
    old = "sink:1:layers:prerope+center+eq+tcq:3/tcq:2@5,8,12,14;prerope+center+eq+tcq:3/tcq:2.5"
    twin = old.replace("tcq:3/", "tcq:3:norm=8/")
    folder = tmp_path / "select" / "smollm2-135m"
    _run(folder, "recommend-3-n8-ctx4096.json", "walshkv:3", shipped, [shipped, old, twin])
    # a run whose winner is the spec it already had names no target; one with two earlier-kind candidates neither
    _run(folder, "recommend-3.5-n8-ctx4096.json", "walshkv:3.5", old, [old, twin])
    _run(folder, "recommend-4.5-n8-ctx4096.json", "walshkv:4.5", shipped, [shipped, old, old + ";x"])
    assert report._reselection_targets(tmp_path, "smollm2-135m") == [("norm=8 re-selection", "walshkv:3", [old])]
    # the plain 4k-vs-512 targets read only the stage-select files, not the re-selections
    assert report._select_targets(tmp_path, "smollm2-135m") == []


def test_a_table_set_reselection_is_judged_against_the_set_it_replaced(tmp_path: Path) -> None:
    report = _report()
    shipped = model_presets()["smollm2-135m"]["presets"]["walshkv:3"]["spec"]
    assert "tables=2" in shipped  # the table-set-2 selection shipped
    old = shipped.replace(":tables=2", "")
    folder = tmp_path / "select" / "smollm2-135m"
    _run(folder, "recommend-3-t2-ctx4096.json", "walshkv:3", shipped, [old, shipped])
    _run(folder, "recommend-3-fast-t2-ctx4096.json", "walshkv:3-fast", old, [old, shipped])  # kept set 1: none
    assert report._reselection_targets(tmp_path, "smollm2-135m") == [("tables=2 re-selection", "walshkv:3", [old])]


def test_every_tq_preset_replaced_by_tcq_is_judged_against_it() -> None:
    # the committed runs (docs/trellis.md: the qwen2.5-1.5b tcq selection and the last tq presets): each shipped
    # winner is judged on the holdout against the one tq spec it replaced, whatever the file's tag
    report = _report()
    results = ROOT / "docs" / "results" / "long-context"
    for model, presets in (
        ("qwen2.5-1.5b", ["walshkv:3", "walshkv:3.5", "walshkv:4.5"]),
        ("gemma3-270m", ["walshkv:3", "walshkv:3.5"]),
    ):
        judged = {w: old for kind, w, old in report._reselection_targets(results, model) if kind == "tcq re-selection"}
        # labelled by the names users give them: walshkv:B-max where the naming rule gave walshkv:B to the block frame
        assert sorted(judged) == sorted(public_name(model, p) for p in presets), model
        for preset in presets:
            assert "tcq:" in model_presets()[model]["presets"][preset]["spec"]
            old = judged[public_name(model, preset)]
            assert len(old) == 1 and "tcq:" not in old[0], (model, preset)


def test_the_targets_at_4k_are_judged_on_paired_windows(tmp_path: Path) -> None:
    report = _report()
    shipped = model_presets()["smollm2-135m"]["presets"]["walshkv:3"]["spec"]
    rows = tmp_path / "holdout-4k" / "smollm2-135m" / "austen_persuasion" / "rows"
    rows.mkdir(parents=True)
    meta = {"windows": 4, "ctx": 4096, "versions": {"commit": "abc1234"}, "cpu": {"model": "X", "capability": "AVX2"}}
    for name, codec, bits, windows in [
        ("a", shipped, 2.9, [0.040, 0.041, 0.039, 0.042]),  # below the peer in every window: met
        ("b", "rot+iq4_nl", 4.5, [0.050, 0.052, 0.049, 0.051]),
        ("c", "rot+q4_0", 4.5, [0.030, 0.060, 0.020, 0.070]),  # straddles: undecided
    ]:
        result = {
            "codec": codec,
            "bits_per_element": bits,
            "kld_mean": sum(windows) / 4,
            "top1_agreement": 0.9,
            "window_kld_mean": windows,
        }
        (rows / f"{name}.json").write_text(json.dumps({"result": result, "meta": meta}))
    summary: dict = {}
    text = "\n".join(report.holdout_4k_section(tmp_path, summary))
    assert "**smollm2-135m**: 4 windows of 4096 tokens" in text and "| walshkv:3 | 2.900 |" in text
    verdicts = {v["peer"]: v["verdict"] for v in summary["holdout_4k"]["smollm2-135m"]}
    assert verdicts == {"rot+iq4_nl": "met", "rot+q4_0": "undecided"}
    assert report.holdout_4k_section(tmp_path / "none", {}) == []  # no run, no section


def test_a_model_without_selected_presets_labels_the_built_in_specs_by_their_names(monkeypatch) -> None:
    # a listed model with no presets (qwen2.5-0.5b before its selection): walshkv:B resolves to the built-in spec there,
    # so its targets are judged on it
    report = _report()
    presets = {m: e for m, e in model_presets().items() if m != "qwen2.5-0.5b"}
    monkeypatch.setattr(report, "model_presets", lambda: presets)
    names = report._name_of("qwen2.5-0.5b")
    assert names == {spec: name for name, spec in BUILTIN.items()} and names["center+tq:4/tq:2.5"] == "walshkv:3.5"
    monkeypatch.undo()
    # a model with shipped presets: its own specs by their names, and the rows of built-in specs measured before its
    # selection by theirs, marked built-in (qwen2.5-0.5b's holdout keeps both)
    names = report._name_of("qwen2.5-0.5b")
    assert names["center+tq:4/tq:2.5"] == "walshkv:3.5 (built-in)"
    assert names[model_presets()["qwen2.5-0.5b"]["presets"]["walshkv:3.5"]["spec"]] == "walshkv:3.5"
    assert report._name_of("smollm2-135m")["center+tq:4/tq:2.5"] == "walshkv:3.5 (built-in)"
