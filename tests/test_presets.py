"""Presets (walshkv:3 / 3.5 / 4.5): budgets, calibration files, ``recommend`` and the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

import walshkv.data
import walshkv.models
from walshkv.cache import CompressedCache
from walshkv.calibration import collect_kv_stats
from walshkv.cli import main
from walshkv.codecs import parse_cache_spec, parse_codec, wrappers
from walshkv.data import Text
from walshkv.eval import evaluate
from walshkv.export import read_kv_mean_center
from walshkv.models import LoadedModel, _describe
from walshkv.preset_file import k_mean_basis, k_pre_rope, write_preset_file
from walshkv.presets import (
    BUILTIN,
    FAST_BUDGETS,
    PRESET_BUDGETS,
    KeyWork,
    dense_key_map,
    is_fast_preset,
    key_work,
    model_presets,
    name_specs,
    preset_name_for_bits,
    resolve_preset,
)
from walshkv.recommend import (
    CANDIDATES,
    allocate_layers,
    block_candidate,
    candidates_for,
    fast_candidate,
    recommend,
    shift_codec,
    shift_width,
    split_text,
)

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000)))


@pytest.fixture
def hd64_lm(tiny_llama_hd64, toy_tokenizer):
    return LoadedModel(tiny_llama_hd64, toy_tokenizer, "tiny-hd64", "test", _describe(tiny_llama_hd64))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_presets_fit_their_budget_at_every_head_dim(head_dim):
    for name, budget in PRESET_BUDGETS.items():
        spec = parse_cache_spec(name)
        assert spec.spec == BUILTIN[name] == resolve_preset(name).spec
        spec.check_head_dim(head_dim)
        assert spec.bits_per_element(head_dim) <= budget, name
        assert spec.needs_calibration  # every preset centers K


def test_candidates_parse_and_fit():
    for budget, specs in CANDIDATES.items():
        for s in specs:
            assert parse_cache_spec(s).bits_per_element(64) <= budget + 1e-9, s
    got = candidates_for(3.5, 64)
    assert BUILTIN["walshkv:3.5"] in got and all(parse_cache_spec(s).bits_per_element(64) <= 3.5 for s in got)
    bits = [parse_cache_spec(s).bits_per_element(64) for s in got]
    assert bits == sorted(bits, reverse=True)
    assert "int2" in candidates_for(3.0, 64, extra=["int2", "int8"])
    assert "int8" not in candidates_for(3.0, 64, extra=["int2", "int8"])
    with pytest.raises(ValueError, match="no candidate"):
        candidates_for(1.0, 64)


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"walshkv:3, walshkv:3\.5, walshkv:4\.5"):
        resolve_preset("walshkv:5")
    with pytest.raises(ValueError, match=r"walshkv:3, walshkv:3\.5"):
        parse_cache_spec("walshkv:2")


def test_k_mean_basis_and_split_text():
    assert k_mean_basis("center+rot+q4_0") == "rot"
    assert k_mean_basis("center+tq:3/tq:2.5") == "plain"
    assert k_mean_basis("int4") == "plain"
    a, b = split_text(TEXT)
    assert a.content + b.content == TEXT.content and a.name == "toy[calib]" and b.name == "toy[select]"


def test_preset_file_round_trip_and_model_check(hd64_lm, tmp_path):
    stats = collect_kv_stats(hd64_lm, TEXT, tokens=128, ctx=64, progress=False)
    preset = resolve_preset("walshkv:4.5")
    path = tmp_path / "p.gguf"
    assert write_preset_file(path, hd64_lm, preset, stats) == k_mean_basis(preset.spec)
    bias = read_kv_mean_center(path, model_arch="llama")
    assert bias.meta["walshkv.preset.name"] == "walshkv:4.5" and bias.meta["walshkv.model"] == "tiny-hd64"
    bias.check_matches(2, 1, 64, "tiny-hd64")
    with pytest.raises(ValueError, match="calibrated on 'tiny-hd64', not 'other-model'"):
        bias.check_matches(2, 1, 64, "other-model")
    # a file that names another spec for the preset chooses it (for its own model)
    other = resolve_preset("walshkv:4.5").__class__("walshkv:4.5", 4.5, "center+rot+int4", "recommend")
    write_preset_file(tmp_path / "q.gguf", hd64_lm, other, stats)
    chosen = read_kv_mean_center(tmp_path / "q.gguf", model_arch="llama")
    assert resolve_preset("walshkv:4.5", chosen).spec == "center+rot+int4"
    assert resolve_preset("walshkv:3.5", chosen).spec == BUILTIN["walshkv:3.5"]  # other names: built-in
    named = name_specs(["int8", "walshkv:4.5"], chosen)
    assert [(n.asked, n.text, n.label) for n in named] == [
        ("int8", "int8", None),
        ("walshkv:4.5", "center+rot+int4", "walshkv:4.5"),
    ]
    assert named[1].source.endswith("q.gguf")
    again = name_specs(named, None)  # the objects again, without the file: the preset's built-in spec
    assert again[0] is named[0] and again[1].text == BUILTIN["walshkv:4.5"]
    cache = CompressedCache.from_preset(hd64_lm.model, "walshkv:4.5", calibration=chosen)
    assert cache.preset.spec == "center+rot+int4" and cache.preset.source.endswith("q.gguf")
    ids = torch.randint(3, 96, (1, 40))
    with torch.inference_mode():
        out = hd64_lm.model(input_ids=ids, cache=cache, use_cache=True)
    assert torch.isfinite(out.logits).all() and cache.bits_per_element() <= 4.5


def test_recommend_ranks_candidates_on_the_second_half(hd64_lm):
    rec = recommend(hd64_lm, TEXT, 4.5, windows=2, ctx=64, calib_tokens=128, progress=False)
    assert rec.meta["text"]["name"] == "toy[select]" and rec.stats.text == "toy[calib]"
    klds = [r["kld_mean"] for r in rec.rows]
    assert klds == sorted(klds) and rec.preset.spec == rec.rows[0]["codec"]
    assert rec.preset.name == "walshkv:4.5" and all(r["bits_per_element"] <= 4.5 for r in rec.rows)


def test_cli_recommend_never_reads_the_evaluation_text(hd64_lm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: hd64_lm)
    loaded: list[str] = []
    real = walshkv.data.load_text

    def recording(name, *a, **kw):
        loaded.append(str(name))
        return real(name, *a, **kw)

    monkeypatch.setattr(walshkv.data, "load_text", recording)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT.content)
    out = tmp_path / "rec.gguf"
    argv = ["recommend", "--text", str(calib), "--bits", "3.5", "--windows", "2", "--ctx", "64"]
    argv += ["--calib-tokens", "128", "-o", str(out), "--json", str(tmp_path / "r.json"), "--quiet", "--per-layer"]
    assert main(argv) == 0
    assert loaded == [str(calib)]
    stdout = capsys.readouterr().out
    assert "winner for walshkv:3.5" in stdout and "mean KLD" in stdout and "per-layer widths from" in stdout
    saved = json.loads((tmp_path / "r.json").read_text())
    assert len(saved["per_layer"]["moves"]) == 4 * hd64_lm.shape.layers
    assert saved["winner"] in {saved["per_layer"]["spec"], saved["per_layer"]["base"], saved["results"][0]["codec"]}
    bias = read_kv_mean_center(out)
    assert bias.meta["walshkv.preset.spec"] == saved["winner"] and bias.meta["walshkv.preset.budget"] == "3.5"


def test_cli_calibrate_preset_then_eval(hd64_lm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: hd64_lm)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT.content)
    evaltext = tmp_path / "eval.txt"
    evaltext.write_text(TEXT.content[::-1])
    out = tmp_path / "p.gguf"
    argv = ["calibrate", "--preset", "walshkv:3.5", "--text", str(calib), "--tokens", "128", "--ctx", "64"]
    assert main([*argv, "-o", str(out), "--quiet"]) == 0
    assert read_kv_mean_center(out).basis == k_mean_basis(BUILTIN["walshkv:3.5"])
    res = tmp_path / "e.json"
    argv = ["eval", "--codec", "walshkv:3.5", "--codec", "int8", "--kv-mean-center", str(out), "--text"]
    assert main([*argv, str(evaltext), "--ctx", "64", "--windows", "2", "--quiet", "--json", str(res)]) == 0
    rows = json.loads(res.read_text())["results"]
    assert rows[0]["codec"] == BUILTIN["walshkv:3.5"] and rows[0]["preset"] == "walshkv:3.5"
    assert rows[0]["bits_per_element"] <= 3.5 and "preset" not in rows[1]
    assert f"walshkv:3.5 = {BUILTIN['walshkv:3.5']}" in capsys.readouterr().err
    assert main(["calibrate", "--preset", "walshkv:9", "--quiet"]) != 0
    assert "unknown preset 'walshkv:9'" in capsys.readouterr().err


def test_shift_width():
    assert shift_width("center+tq:4", 0.5) == "center+tq:4.5"
    assert shift_width("tq:2.5", -0.5) == "tq:2"
    assert shift_width("tq:8", 0.5) is None and shift_width("tq:1", -0.5) is None
    assert shift_width("rot+int4", 0.5) is None


def test_shift_codec_rebuilds_the_chain_from_its_objects():
    """The wrappers keep their own fields (a seed) and the storing tq its seed and codebook; nothing re-parsed."""
    codec = parse_codec("prerope+center+eqd+rrot:7+tq:3:codebook=beta:seed=5")
    moved = shift_codec(codec, 1.5)
    assert moved is not None and moved.spec == "prerope+center+eqd+rrot:7+tq:4.5:codebook=beta:seed=5"
    assert moved == parse_codec(moved.spec)
    assert [type(w) for w in wrappers(moved)] == [type(w) for w in wrappers(codec)]
    assert shift_codec(codec, 0) == codec


def test_layered_spec_runs_in_a_cache_and_counts_bits(hd64_lm):
    layers = hd64_lm.shape.layers
    spec = f"layers:tq:5/tq:4@0;tq:3/tq:2@{layers - 1};tq:4/tq:3"
    cache = CompressedCache(spec, config=hd64_lm.model.config)
    with torch.inference_mode():
        hd64_lm.model(input_ids=torch.randint(3, 96, (1, 20)), cache=cache, use_cache=True)
    assert cache.bits_per_element() == pytest.approx(parse_cache_spec(spec).bits_per_element(64, layers))
    assert cache.nbytes() == cache.layout_nbytes()
    assert spec in candidates_for(4.0, 64, [spec], layers)
    with pytest.raises(ValueError, match="layer count"):
        candidates_for(4.0, 64, [spec])
    with pytest.raises(ValueError, match="names layer 99"):
        CompressedCache("layers:tq:5@99;tq:4", config=hd64_lm.model.config)


def test_allocate_layers_pairs_moves_within_the_budget(hd64_lm):
    calib, select = split_text(TEXT)
    stats = collect_kv_stats(hd64_lm, calib, tokens=128, ctx=64, progress=False)
    base = "center+tq:4/tq:2.5"
    plan = allocate_layers(hd64_lm, select, stats, base, windows=2, ctx=64, progress=False)
    layers = hd64_lm.shape.layers
    assert plan is not None and plan.base == base and len(plan.moves) == 4 * layers
    assert {m["delta"] for m in plan.moves} == {0.5, -0.5}
    ups = [m for m in plan.chosen if m["delta"] > 0]
    downs = [m for m in plan.chosen if m["delta"] < 0]
    assert len(ups) == len(downs)  # paired: the budget is unchanged
    for up, down in zip(ups, downs, strict=True):
        assert -up["kld_change"] > down["kld_change"]
    parsed = parse_cache_spec(plan.spec)
    bits = parsed.bits_per_element(64, layers) if plan.spec.startswith("layers:") else parsed.bits_per_element(64)
    assert bits == pytest.approx(parse_cache_spec(base).bits_per_element(64))
    assert plan.spec in {base, *(r["codec"] for r in plan.rows)}
    assert allocate_layers(hd64_lm, select, stats, "center+rot+int4", windows=1, ctx=64, progress=False) is None


def test_allocate_layers_keeps_the_sink_and_spends_unused_bits(hd64_lm):
    calib, select = split_text(TEXT)
    stats = collect_kv_stats(hd64_lm, calib, tokens=128, ctx=64, progress=False)
    base = "sink:1:center+tq:4/tq:2.5"
    layers = hd64_lm.shape.layers
    one_raise = 0.5 / 2 / layers  # one layer's K or V half a bit wider
    budget = parse_cache_spec(base).bits_at(64, 64, layers) + 1.5 * one_raise
    plan = allocate_layers(hd64_lm, select, stats, base, windows=2, ctx=64, budget=budget, progress=False)
    assert plan is not None and all(m["spec"].startswith("sink:1:") for m in plan.moves)
    ups = [m for m in plan.chosen if m["delta"] > 0]
    downs = [m for m in plan.chosen if m["delta"] < 0]
    paired = {(m["layer"], m["kind"]) for m in plan.chosen[: 2 * len(downs)]}
    free = [m for m in plan.moves if m["delta"] > 0 and m["kld_change"] < 0 and (m["layer"], m["kind"]) not in paired]
    assert len(ups) - len(downs) == (1 if free else 0)  # one raise fits the 1.5 raises' worth left over
    assert all(m["kld_change"] < 0 for m in ups)
    for row in plan.rows:
        assert row["codec"].startswith("sink:1:")
        assert parse_cache_spec(row["codec"]).bits_at(64, 64, layers) <= budget + 1e-9


def test_cli_calibrate_eq_then_eval_from_the_file(hd64_lm, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: hd64_lm)
    calib = tmp_path / "calib.txt"
    calib.write_text(TEXT.content)
    evaltext = tmp_path / "eval.txt"
    evaltext.write_text(TEXT.content[::-1])
    out = tmp_path / "eq.gguf"
    argv = ["calibrate", "--eq", "--text", str(calib), "--tokens", "128", "--ctx", "64", "-o", str(out), "--quiet"]
    assert main(argv) == 0
    assert "eq+ predicted score-error gain" in capsys.readouterr().out
    assert read_kv_mean_center(out).has_k_equalizer
    res = tmp_path / "e.json"
    spec = "sink:1:center+eq+tq:4/tq:2"
    argv = ["eval", "--codec", spec, "--kv-mean-center", str(out), "--text", str(evaltext)]
    assert main([*argv, "--ctx", "64", "--windows", "2", "--quiet", "--json", str(res)]) == 0
    row = json.loads(res.read_text())["results"][0]
    # the CLI's row is the API's on the same file and text, and the file's eq+ matrices changed it
    text = walshkv.data.load_text(str(evaltext))
    plain = "sink:1:center+tq:4/tq:2"
    calibration = read_kv_mean_center(out)
    again = evaluate(hd64_lm, text, [spec, plain], ctx=64, windows=2, calibration=calibration, progress=False)
    assert row["codec"] == spec and row["kld_mean"] == again.results[0]["kld_mean"] > 0
    assert row["kld_mean"] != again.results[1]["kld_mean"]


def test_fast_presets_resolve_and_name_their_budget():
    assert preset_name_for_bits(3.5, fast=True) == "walshkv:3.5-fast" and preset_name_for_bits(3.5) == "walshkv:3.5"
    for name, budget in FAST_BUDGETS.items():
        plain = name.removesuffix("-fast")
        assert is_fast_preset(name) and not is_fast_preset(plain)
        p = resolve_preset(name.upper())
        assert (p.name, p.budget, p.spec) == (name, budget, BUILTIN[plain])
        assert parse_cache_spec(name).spec == BUILTIN[plain]
        assert not dense_key_map(p.spec)
    note = resolve_preset("walshkv:3.5-fast", model="not-a-model").note
    assert "--bits 3.5 --fast" in note and "walshkv-3.5-fast.gguf" in note
    with pytest.raises(ValueError, match=r"walshkv:3\.5-fast"):
        resolve_preset("walshkv:5-fast")


def test_dense_key_map_and_fast_candidates():
    assert dense_key_map("sink:1:prerope+center+eq+rot+iq4_nl/tq:4")
    assert not dense_key_map("sink:1:prerope+center+eqd+rot+iq4_nl/tq:4")
    assert not dense_key_map("center+eq+tq:4/tq:2.5")  # post-RoPE eq+ moves onto the query
    assert not dense_key_map("prerope+center+tq:4/tq:2.5") and not dense_key_map("hf-quanto:4")
    assert fast_candidate("sink:1:prerope+center+eq+tq:3/tq:2.5") == "sink:1:prerope+center+eqd+tq:3/tq:2.5"
    layered = "sink:1:layers:prerope+center+eq+tq:3/tq:2@5,8;prerope+center+eq+tq:3/tq:2.5"
    assert fast_candidate(layered) == layered.replace("eq+", "eqd+")
    assert fast_candidate("center+eq+tq:4/tq:2.5") == "center+eq+tq:4/tq:2.5"
    for budget in CANDIDATES:
        plain, fast = candidates_for(budget, 64), candidates_for(budget, 64, fast=True)
        assert any(dense_key_map(s) for s in plain) and not any(dense_key_map(s) for s in fast)
        assert [s for s in plain if not dense_key_map(s)] == [s for s in fast if s in plain]
        assert len(fast) == len(plain) and all(fast_candidate(s) in fast for s in plain)
    with pytest.raises(ValueError, match=r"write eqd\+ in place of eq\+ .*'prerope\+center\+eqd\+tq:3/tq:2\.5'"):
        candidates_for(3.0, 64, extra=["prerope+center+eq+tq:3/tq:2.5"], fast=True)


def test_fast_candidates_run_the_kernels_fast_key_map(hd64_lm):
    from walshkv.attention.cpu import prerope_key_map

    stats = collect_kv_stats(hd64_lm, TEXT, tokens=128, ctx=64, progress=False)
    kv = hd64_lm.shape.kv_heads
    for budget in CANDIDATES:
        maps = {}
        for fast in (False, True):
            for s in candidates_for(budget, 64, fast=fast):
                spec = parse_cache_spec(s)
                calib = stats.pre_rope() if k_pre_rope(spec) else stats
                k, v = spec.k.bind(1, "k", calib), spec.v.bind(1, "v", calib)
                maps.setdefault(fast, set()).add(prerope_key_map(k, v, 64, kv))
        dense = {"matrix", "matrix-amx"}  # eq+: fp32 multiply-adds, or AMX tiles where the CPU has them
        assert maps[False] & dense and not maps[True] & dense and "hadamard" in maps[True], (budget, maps)


def test_recommend_fast_names_the_fast_preset(hd64_lm):
    rec = recommend(hd64_lm, TEXT, 4.5, windows=1, ctx=64, calib_tokens=128, progress=False, fast=True)
    assert rec.preset.name == "walshkv:4.5-fast" and not any(dense_key_map(r["codec"]) for r in rec.rows)
    assert any("eqd+" in r["codec"] for r in rec.rows)


KEY_WORK = [  # (model, head_dim, group, its walshkv:3.5-max ratio, its walshkv:3.5-fast ratio)
    ("smollm2-135m", 64, 3, 10.6667, 0.6667),
    ("qwen2.5-1.5b", 128, 6, 10.6667, 1.0833),
    ("gemma3-270m", 256, 4, 32.0, 2.125),
]


@pytest.mark.parametrize(("model", "head_dim", "group", "max_ratio", "fast_ratio"), KEY_WORK)
def test_key_work_counts_each_kind_of_k_transform(model, head_dim, group, max_ratio, fast_ratio):
    """The work per key that `recommend --max-key-work` and its help text state, from each shipped preset's wrappers:
    eq+'s dense map d² per key, the block frame's query product shared by a block (group * d² / 64) plus its table
    row (d), nothing after RoPE; the unit is plain attention's 2 * group * d."""
    d, g = head_dim, group
    assert key_work("rot+int4", d, g) == KeyWork(score=2 * g * d, key_map=0.0)
    assert key_work("prerope+center+eqd+tq:3.5/tq:3", d, g).key_map == d * math.log2(d) + 2 * d
    assert key_work(resolve_preset("walshkv:3.5-max", model=model).spec, d, g).ratio == pytest.approx(
        max_ratio, abs=1e-4
    )
    assert key_work(resolve_preset("walshkv:3.5-fast", model=model).spec, d, g).ratio == pytest.approx(
        fast_ratio, abs=1e-4
    )
    layered = "layers:prerope+center+eq+tq:3.5/tq:3@0;ropeblock:16+eqr:16+tq:3/tq:2.5"
    assert key_work(layered, d, g).key_map == max(d * d, g * d * d / 16 + d)  # the costliest part
    with pytest.raises(ValueError, match="group >= 1"):
        key_work("rot+int4", d, 0)


def test_a_key_work_ceiling_keeps_only_candidates_under_it():
    dense = "prerope+center+eq+tq:3/tq:2.5"
    frame = block_candidate(dense)
    got = candidates_for(3.5, 64, [dense, frame], max_key_work=4.0, group=3)
    assert frame in got and dense not in got and all(key_work(s, 64, 3).ratio <= 4.0 for s in got)
    assert dense in candidates_for(3.5, 64, [dense, frame])
    with pytest.raises(ValueError, match=r"within 0\.5x the score work per key"):
        candidates_for(3.5, 64, [dense, frame], max_key_work=0.5, group=3, builtin=False)


def test_block_candidates_store_k_in_the_block_frame():
    assert block_candidate("sink:1:prerope+center+eq+tq:3/tq:2.5") == "sink:1:ropeblock:64+eqr:64+tq:3/tq:2.5"
    assert block_candidate("prerope+center+eqd+tcq:3.5/tcq:3", 16) == "ropeblock:16+eqr:16+tcq:3.5/tcq:3"
    assert block_candidate("prerope+center+tq:4/tq:3") == "ropeblock:64+tq:4/tq:3"
    layered = "sink:1:layers:prerope+center+eq+tq:3.5/tq:3@0;prerope+center+eq+tq:3/tq:2.5"
    twin = block_candidate(layered)
    assert twin.count("ropeblock:64+eqr:64+") == 2 and "prerope" not in twin and not dense_key_map(twin)
    assert block_candidate("center+eq+tq:4/tq:2.5") == "center+eq+tq:4/tq:2.5"
    assert candidates_for(3.5, 64, [twin], num_layers=2, fast=True)  # a fast candidate: no dense key map


def test_no_shipped_fast_preset_maps_keys_by_a_dense_matrix():
    """Every model's walshkv:B-fast decodes without a dense per-key map (eqd+'s fast Walsh-Hadamard map, or K in the
    block frame, whose equalizer folds into one query per block)."""
    shipped = [(m, n, p["spec"]) for m, e in model_presets().items() for n, p in e["presets"].items()]
    fast = [(m, n, spec) for m, n, spec in shipped if n.endswith("-fast")]
    assert fast
    for model, name, spec in fast:
        assert not dense_key_map(spec), (model, name, spec)
