"""``walshkv eval``'s default codec set on every model of ``walshkv models list``.

Every spec of a run is checked against the model before anything runs (walshkv.eval.fit): cheaply for all
four models from their configs, and as real CI-sized runs (one window of 64 tokens, presets calibrated on 256
tokens) on each model: smollm2-135m and gemma3-270m in the default run (CI loads both anyway), the two qwen
models slow-marked (qwen2.5-1.5b takes 7 GB in float32; qwen2.5-0.5b is a 491 MB download).
"""

from __future__ import annotations

import collections
import json
import math
import os

import pytest
from transformers import LlamaConfig
from transformers.cache_utils import get_layer_types_and_kwargs

import walshkv.cli.eval
import walshkv.codecs.spec
import walshkv.models
from walshkv.cli import main
from walshkv.cli.eval import MAIN_CODECS, fit_codecs
from walshkv.codecs import parse_cache_spec
from walshkv.codecs.vllm import is_engine_peer
from walshkv.eval.fit import fit_specs
from walshkv.models import MODELS, layout_config
from walshkv.presets import is_preset, resolve_preset

HEAVY = {"qwen2.5-1.5b", "qwen2.5-0.5b"}


def _layout(config) -> tuple:
    """What a cache reads of a config: type, layers, heads, head size, layer types and their kwargs."""
    cfg = config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    types, kwargs = get_layer_types_and_kwargs(cfg)
    return (
        cfg.model_type,
        cfg.num_hidden_layers,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        head_dim,
        types,
        kwargs,
    )


def _registry_config(name: str, tmp_path, monkeypatch):
    """The config :func:`layout_config` builds from the registry alone (no float copy in an empty home)."""
    with monkeypatch.context() as patch:
        patch.setenv("WALSHKV_HOME", str(tmp_path / "empty-home"))
        return layout_config(name)


@pytest.mark.parametrize("name", list(MODELS))
def test_default_codecs_fit_every_listed_model_before_anything_runs(name, tmp_path, monkeypatch):
    for config in (_registry_config(name, tmp_path, monkeypatch), layout_config(name)):
        kept, left_out = fit_specs(MAIN_CODECS, config, model=name, required=False)
        assert left_out == {} and [n.asked for n in kept] == list(MAIN_CODECS)
        # the model's own presets, parsed once: what the run goes on with
        assert [n.text for n in kept if n.source] == [resolve_preset(c, model=name).spec for c in MAIN_CODECS[1:4]]


def test_registry_layout_of_gemma3_has_its_sliding_layers(tmp_path, monkeypatch):
    _, layers, _, _, head_dim, types, kwargs = _layout(_registry_config("gemma3-270m", tmp_path, monkeypatch))
    assert (layers, head_dim) == (18, 256)
    assert types == (["sliding_attention"] * 5 + ["full_attention"]) * 3  # 5 of 6 layers slide (shared/README)
    assert {k["sliding_window"] for k, t in zip(kwargs, types, strict=True) if t == "sliding_attention"} == {512}


def test_asked_for_spec_the_model_cannot_hold_is_refused_before_loading(monkeypatch, capsys):
    def must_not_run(*args, **kwargs):
        raise AssertionError("the model was loaded before the specs were checked")

    monkeypatch.setattr(walshkv.models, "load_model", must_not_run)
    assert main(["eval", "--model", "gemma3-270m", "--codec", "fp16", "--codec", "hf-fp8", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "hf-fp8 cannot run on this model" in err and "'sliding_attention' layers (15 of 18)" in err
    assert "full_attention layers only" in err and "compare with a walshkv spec on this model instead" in err
    assert "the model was loaded" not in err


def test_default_set_leaves_out_what_a_model_cannot_hold_with_a_note(capsys):
    config = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=80, hidden_size=160
    )
    kept = fit_codecs(list(MAIN_CODECS), config, "phi-like", required=False)
    # the Walsh-Hadamard transform needs a power-of-two head size; vLLM's fp8 keys and uniform values do not, and its
    # int4_per_token_head transforms blocks of 16 (the largest power of two dividing 80)
    assert [n.asked for n in kept] == ["fp16", "kivi4", "kivi2", "vllm:turboquant_k8v4", "vllm:int4_per_token_head"]
    err = capsys.readouterr().err
    assert err.count("is left out of the default set on phi-like") == len(MAIN_CODECS) - 5
    assert "note: rot+q4_0 is left out of the default set on phi-like: the Walsh-Hadamard transform needs" in err
    with pytest.raises(ValueError, match=r"walshkv:4\.5 \(= .*\) cannot run on this model: the Walsh-Hadamard"):
        fit_codecs(["walshkv:4.5"], config, "phi-like", required=True)


@pytest.mark.model
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in HEAVY else n for n in MODELS], ids=list(MODELS)
)
def test_default_eval_runs_on_every_listed_model(name, tmp_path, monkeypatch, capsys):
    if os.environ.get("WALSHKV_SKIP_MODEL_TESTS"):
        pytest.skip("WALSHKV_SKIP_MODEL_TESTS is set")
    checked = []
    real_fit = walshkv.cli.eval.fit_specs
    monkeypatch.setattr(
        walshkv.cli.eval, "fit_specs", lambda *a, **k: checked.append(a[0]) or real_fit(*a, **k)
    )  # the up-front check ran, on every codec
    parsed: collections.Counter[str] = collections.Counter()  # each spec text, as the one parser saw it
    real_parse = walshkv.codecs.spec.parse_cache_spec
    monkeypatch.setattr(
        walshkv.codecs.spec,
        "parse_cache_spec",
        lambda spec: parsed.update([spec] if isinstance(spec, str) else []) or real_parse(spec),
    )
    out = tmp_path / "run.json"
    argv = ["eval", "--model", name, "--windows", "1", "--ctx", "64", "--calib-tokens", "256", "--quiet"]
    assert main([*argv, "--json", str(out)]) == 0, capsys.readouterr().err
    assert [[n.asked for n in codecs] for codecs in checked] == [list(MAIN_CODECS)]
    # parsed once, by the CLI, then kept as objects to the report
    assert {c: parsed[c] for c in MAIN_CODECS} == dict.fromkeys(MAIN_CODECS, 1), parsed
    assert "left out" not in capsys.readouterr().err
    rows = json.loads(out.read_text())["results"]
    expected = [
        resolve_preset(c, model=name).spec if is_preset(c) else parse_cache_spec(c).spec if is_engine_peer(c) else c
        for c in MAIN_CODECS
    ]
    assert [r["codec"] for r in rows] == expected
    assert [r.get("preset") for r in rows] == [c if is_preset(c) or is_engine_peer(c) else None for c in MAIN_CODECS]
    for row in rows:
        assert math.isfinite(row["kld_mean"]) and row["kld_mean"] >= 0, row
        assert 0 < row["bits_per_element"] <= 16, row
    assert rows[0]["kld_mean"] < 1e-4  # fp16: the reference's own rounding only
    # the float copy the run left is the model's real config: the registry's layout (used before any download)
    # must be the same
    assert _layout(layout_config(name)) == _layout(_registry_config(name, tmp_path, monkeypatch))
