"""A preset name in the vLLM plugin is the served model's own preset, never the built-in spec in its place."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig
from walshkv.presets import model_presets

from walshkv_vllm.specs import CALIBRATION_ENV, MODEL_ENV, SPEC_ENV, check_served_model, resolve_spec


def test_a_preset_without_a_model_is_refused() -> None:
    with pytest.raises(ValueError, match=rf"walshkv:3\.5 is chosen per model .*no model is named.*{MODEL_ENV}"):
        resolve_spec("walshkv_spec", {SPEC_ENV: "walshkv:3.5"})
    with pytest.raises(ValueError, match=r"'llama-7b' is not a model walshkv has measured"):
        resolve_spec("walshkv:3.5", {MODEL_ENV: "llama-7b"})


@pytest.mark.parametrize("preset", ["walshkv:3", "walshkv:3.5", "walshkv:4.5", "walshkv:3.5-fast"])
def test_the_models_own_preset_is_resolved_and_the_part_pages_cannot_hold_is_named(preset: str) -> None:
    spec = model_presets()["smollm2-135m"]["presets"][preset]["spec"]
    with pytest.raises(ValueError) as err:
        resolve_spec("walshkv_spec", {SPEC_ENV: preset, MODEL_ENV: "smollm2-135m"})
    msg = str(err.value)
    assert f"{preset} (shipped:smollm2-135m) is {spec!r}, which vLLM pages cannot hold" in msg
    assert "sink:N:" in msg or "layers:" in msg or "prerope+" in msg


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
