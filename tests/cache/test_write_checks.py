"""A write the cache was not built for: refused by name before any layer changes, never an IndexError.

Fault matrix (docs/reliability.md, "cache writes"): a model with more layers than the config the cache was
built from (the model's own forward and a direct ``update``), K/V with another number of kv heads or another
head size, a negative or non-integer layer index, a block that is not 4-D, and a ``max_cache_len`` larger than
the machine can reserve (it used to surface as the allocator's own message, or a MemoryError much later).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from walshkv.cache import CompressedCache


def _kv(heads: int = 2, tokens: int = 3, d: int = 16) -> torch.Tensor:
    return torch.randn(1, heads, tokens, d)


def _fewer_layers(config: LlamaConfig) -> LlamaConfig:
    return LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})


@pytest.mark.parametrize("spec", ["int4", "sink:1:rot+int4/int3", "kivi4"])
def test_a_model_with_more_layers_than_the_config_is_named(tiny_llama, spec) -> None:
    cache = CompressedCache(spec, config=_fewer_layers(tiny_llama.config))
    match = r"layer 1 was written, but this cache was built for a config of 1 layers"
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        tiny_llama(input_ids=torch.tensor([[3, 4, 5]]), cache=cache)
    assert cache.layers[0].get_seq_length() == 0  # the step was rolled back


@pytest.mark.parametrize(
    ("k", "match"),
    [
        (_kv(heads=3), r"has 3 kv heads of size 16, but this cache was built for a config of 2 kv heads of size 16"),
        (_kv(d=32), r"has 2 kv heads of size 32, but .* 2 kv heads of size 16"),
        (torch.randn(2, 3, 16), r"key_states must be \[batch, num_kv_heads, seq_len, head_dim\], got \(2, 3, 16\)"),
    ],
)
def test_k_v_of_another_shape_are_refused(tiny_llama, k, match) -> None:
    cache = CompressedCache("int4", config=tiny_llama.config)
    cache.update(_kv(), _kv(), 0)
    with pytest.raises(ValueError, match=match):
        cache.update(k, k, 0)
    assert cache.layers[0].get_seq_length() == 3


@pytest.mark.parametrize("idx", [2, 99, -1, 1.0, True])
def test_layer_indices_past_the_config_or_not_an_index_are_refused(tiny_llama, idx) -> None:
    cache = CompressedCache("int4", config=tiny_llama.config)
    with pytest.raises(ValueError, match="layer"):
        cache.update(_kv(), _kv(), idx)
    assert all(layer.get_seq_length() == 0 for layer in cache.layers)


def test_a_cache_without_config_still_grows_its_layers() -> None:
    cache = CompressedCache("int4")
    cache.update(_kv(), _kv(), 0)
    cache.update(_kv(heads=3), _kv(heads=3), 5)  # no config: nothing to check the shapes against
    assert len(cache.layers) == 6


def test_a_reservation_past_the_machine_names_max_cache_len(tiny_llama) -> None:
    cache = CompressedCache("int4", config=tiny_llama.config, max_cache_len=10**13)
    with pytest.raises(ValueError, match=r"max_cache_len=10,000,000,000,000 reserves .* GiB .* max_cache_len=None"):
        cache.update(_kv(), _kv(), 0)
    assert cache.layers[0].get_seq_length() == 0
