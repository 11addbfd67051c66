"""A preset name in the vLLM plugin is the served model's own preset, never the built-in spec in its place."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig
from walshkv.presets import model_presets, preset_key

from walshkv_vllm.specs import (
    CALIBRATION_ENV,
    MODEL_ENV,
    SPEC_ENV,
    calibration_path,
    check_served_model,
    resolve_spec,
)


def test_a_preset_without_a_model_is_refused() -> None:
    with pytest.raises(ValueError, match=rf"walshkv:3\.5 is chosen per model .*no model is named.*{MODEL_ENV}"):
        resolve_spec("walshkv_spec", {SPEC_ENV: "walshkv:3.5"})
    with pytest.raises(ValueError, match=r"'llama-7b' is not a model walshkv has measured"):
        resolve_spec("walshkv:3.5", {MODEL_ENV: "llama-7b"})


@pytest.mark.parametrize("preset", sorted(model_presets()["smollm2-135m"]["presets"]))
def test_every_smollm2_preset_is_its_own_spec_with_its_shipped_file(preset: str) -> None:
    """The pages hold every preset of smollm2-135m as shipped (sink, K frame, equalizer and trellis codes), and the
    calibration read is the file the package ships for it."""
    from walshkv.shipped import shipped_file

    env = {SPEC_ENV: preset, MODEL_ENV: "smollm2-135m"}
    spec = resolve_spec("walshkv_spec", env)
    assert spec.spec == model_presets()["smollm2-135m"]["presets"][preset]["spec"]
    assert calibration_path("walshkv_spec", env) == str(shipped_file("smollm2-135m", preset).path)
    assert calibration_path("walshkv_spec", env | {CALIBRATION_ENV: "/x/own.gguf"}) == "/x/own.gguf"


def test_a_preset_the_pages_cannot_hold_is_refused_by_its_part() -> None:
    """qwen2.5-1.5b's walshkv:3.5 gives some layers other widths (layers:): pages of one size cannot hold it."""
    spec = model_presets()["qwen2.5-1.5b"]["presets"][preset_key("qwen2.5-1.5b", "walshkv:3.5")]["spec"]
    with pytest.raises(ValueError) as err:
        resolve_spec("walshkv_spec", {SPEC_ENV: "walshkv:3.5", MODEL_ENV: "qwen2.5-1.5b"})
    msg = str(err.value)
    assert f"walshkv:3.5 (shipped:qwen2.5-1.5b) is {spec!r}, which vLLM pages cannot hold" in msg
    assert "layers:" in msg


def test_a_preset_file_chooses_its_spec(tmp_path) -> None:
    """The file `walshkv calibrate --preset` writes records the spec; a fixed-size one is what the pages store."""
    import torch
    from walshkv.constants import Keys
    from walshkv.export import write_kv_mean_center

    path = tmp_path / "p.gguf"
    write_kv_mean_center(
        path,
        torch.zeros(2, 2, 64),
        arch="llama",
        basis="plain",
        model="tiny",
        extra={Keys.Preset.NAME: "walshkv:3.5", Keys.Preset.SPEC: "center+tq:4/tq:3"},
    )
    spec = resolve_spec("walshkv_spec", {SPEC_ENV: "walshkv:3.5", CALIBRATION_ENV: str(path)})
    assert spec.spec == "center+tq:4/tq:3"


def test_the_named_model_must_be_the_served_one() -> None:
    smol = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576)
    check_served_model("smollm2-135m", smol)
    other = LlamaConfig(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=1152)
    with pytest.raises(ValueError, match=rf"{MODEL_ENV}='smollm2-135m' .* is not the model vLLM serves"):
        check_served_model("smollm2-135m", other)


@pytest.mark.parametrize("model", sorted(model_presets()))
def test_the_naming_rule_moves_a_plain_name_only_where_the_pages_hold_both_kinds(model: str) -> None:
    """The naming rule's third condition (docs/presets.md): ``walshkv:B`` names the block frame only where the vLLM
    plugin holds it wherever it holds the preset with the per-key map (both held, or both refused)."""
    for plain in model_presets()[model].get("names", {}):
        held = []
        for name in (f"{plain}-fast", f"{plain}-max"):
            try:
                resolve_spec("walshkv_spec", {SPEC_ENV: name, MODEL_ENV: model})
                held.append(True)
            except ValueError:
                held.append(False)
        assert held[0] or not held[1], f"{model} {plain}: the pages hold the -max preset but not the block frame"
        if held[0]:  # the plain name is the block frame's spec
            env = {MODEL_ENV: model}
            got = resolve_spec("walshkv_spec", env | {SPEC_ENV: plain}).spec
            assert got == resolve_spec("walshkv_spec", env | {SPEC_ENV: f"{plain}-fast"}).spec
