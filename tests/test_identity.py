"""A model's identity: calibration measured on one model is refused by another of the same shape.

Fault matrix (docs/reliability.md, "another model's calibration"): a calibration file, statistics and merged
calibration, each handed to a model whose shapes (layers, kv heads, head size) agree but whose config does not,
through the plain constructor and through ``from_preset``; files older than the recorded config still load; a
damaged recorded config is refused when the file is read.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import ToyTokenizer
from walshkv import CompressedCache
from walshkv.calibration import MergedCalibration, collect_kv_stats
from walshkv.constants import Keys
from walshkv.data import Text
from walshkv.export import read_kv_mean_center, write_kv_mean_center
from walshkv.identity import config_differences, identity_config, model_identity
from walshkv.models import LoadedModel, _describe

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
SPEC = "center+eq+int4/int4"


@pytest.fixture(scope="module")
def twin():
    """Another 2-layer llama with 2 kv heads of size 16 (the tiny llama's shapes), but other widths and RoPE."""
    torch.manual_seed(5)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_theta=500000.0,
    )
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def stats(tiny_llama):
    lm = LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))
    return collect_kv_stats(lm, TEXT, tokens=64, ctx=64, progress=False)


def _file(path: Path, stats, *, recorded: bool = True, model_config: str | None = None) -> Path:
    mean = torch.stack([stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    write_kv_mean_center(
        path,
        mean,
        arch="llama",
        model="tiny-llama",
        k_equalizer=stats.equalizers("k"),
        model_config=stats.model_config if recorded else None,
        extra={Keys.General.MODEL_CONFIG: model_config} if model_config is not None else None,
    )
    return path


def test_the_identity_is_the_config_without_runtime_keys(tiny_llama, twin) -> None:
    ours = identity_config(tiny_llama.config)
    assert "_attn_implementation" not in ours and "transformers_version" not in ours
    assert config_differences(ours, ours) == []
    assert "hidden_size" in config_differences(ours, identity_config(twin.config))
    # a key that one side lacks (added or renamed by another transformers release) is no difference
    assert config_differences({**ours, "new_key": 1}, ours) == []
    assert model_identity(tiny_llama.config)["config_sha256"] != model_identity(twin.config)["config_sha256"]


def test_statistics_record_their_model(stats, tiny_llama) -> None:
    assert stats.model_config == identity_config(tiny_llama.config)
    assert stats.pre_rope().model_config == stats.model_config


@pytest.mark.parametrize("how", ["constructor", "from_preset"])
@pytest.mark.parametrize("source", ["file", "stats", "merged"])
def test_calibration_of_a_model_with_equal_shapes_is_refused(tmp_path, tiny_llama, twin, stats, how, source) -> None:
    bias = read_kv_mean_center(_file(tmp_path / "cal.gguf", stats), model_arch="llama")
    calibration = {"file": bias, "stats": stats, "merged": MergedCalibration(stats, bias)}[source]
    with pytest.raises(ValueError, match=r"differs from this model's in .*hidden_size.*calibrate this model") as info:
        if how == "constructor":
            CompressedCache(SPEC, config=twin.config, calibration=calibration)
        else:
            CompressedCache.from_preset(twin, "walshkv:4.5", calibration=calibration)
    assert "tiny-llama" in str(info.value)
    # the model it was measured on takes it
    CompressedCache(SPEC, config=tiny_llama.config, calibration=calibration)


def test_a_file_older_than_the_recorded_config_still_loads(tmp_path, tiny_llama, twin, stats) -> None:
    bias = read_kv_mean_center(_file(tmp_path / "old.gguf", stats, recorded=False), model_arch="llama")
    assert bias.model_config is None
    CompressedCache(SPEC, config=twin.config, calibration=bias)  # nothing recorded: the shapes are all it can check


def test_a_damaged_recorded_config_is_refused_on_read(tmp_path, stats) -> None:
    path = _file(tmp_path / "bad.gguf", stats, recorded=False, model_config="{not json")
    with pytest.raises(ValueError, match=rf"{Keys.General.MODEL_CONFIG} is not a JSON object"):
        read_kv_mean_center(path, model_arch="llama")
