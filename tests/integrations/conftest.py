"""Fixtures shared by the Ray tests (test_ray.py: a cluster this process starts; test_ray_head.py: an external head)."""

from __future__ import annotations

from pathlib import Path

import pytest

from walshkv.data import Text
from walshkv.models import LoadedModel, load_model


@pytest.fixture(scope="module")
def toy_text() -> Text:
    """The toy text the Ray tests evaluate on (characters the model folder's tokenizer knows)."""
    return Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000)))


@pytest.fixture(scope="module")
def model_dir(tiny_llama_hd64, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """conftest's tiny_llama_hd64 (vocabulary 96) with a character tokenizer, saved as a model folder."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("models") / "tiny-ray"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{chr(c): c - 29 for c in range(32, 123)}}  # ids 3..93
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    tiny_llama_hd64.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lm(model_dir: Path) -> LoadedModel:
    return load_model(str(model_dir), progress=False)
