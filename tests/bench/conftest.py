"""Fixtures of the bench tests: a tiny model saved as a folder (the generation runs load it in a subprocess, by
path) and a preset file made for it."""

from __future__ import annotations

from pathlib import Path

import pytest

#: A calibration text (never the bench text, python-docs).
CALIB_TEXT = "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000))
#: The spec the tiny model's preset file chooses for walshkv:3.5: the parts of smollm2-135m's shipped one.
TINY_PRESET_SPEC = "sink:1:layers:prerope+center+eq+tq:3.5/tq:2.5@1;prerope+center+eq+tq:3.5/tq:3"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama (head_dim 64, one KV head, GQA 2) with a character tokenizer, saved as a model folder."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("models") / "tiny-bench"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3, **{chr(c): c - 28 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(4)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_preset_spec() -> str:
    """The spec the tiny model's walshkv:3.5 file chooses."""
    return TINY_PRESET_SPEC


@pytest.fixture(scope="session")
def calib_text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("texts") / "calib.txt"
    path.write_text(CALIB_TEXT)
    return path


@pytest.fixture(scope="session")
def tiny_preset_file(tiny_model_dir: Path, calib_text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The walshkv:3.5 file of the tiny model, as `walshkv recommend` writes it (it chooses TINY_PRESET_SPEC)."""
    from walshkv.calibration import collect_kv_stats
    from walshkv.data import load_text
    from walshkv.models import load_model
    from walshkv.presets import Preset, write_preset_file

    lm = load_model(str(tiny_model_dir), progress=False)
    stats = collect_kv_stats(lm, load_text(str(calib_text_file)), tokens=256, ctx=128, progress=False)
    path = tmp_path_factory.mktemp("presets") / "walshkv-3.5.gguf"
    write_preset_file(path, lm, Preset("walshkv:3.5", 3.5, TINY_PRESET_SPEC), stats)
    return path
