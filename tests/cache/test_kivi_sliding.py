"""KIVI on sliding-window layers (gemma3's local layers): :class:`KiviSlidingWindowLayer`.

The layer drops a quantized K group once all its tokens left the window, so it holds a few more tokens than
the window; the attention mask hides them. What the model computes must therefore be exactly what a KIVI
cache that keeps every token computes (the mask then hides the same tokens), while it holds far fewer.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from conftest import logits_in_splits
from walshkv.cache import CompressedCache, KiviLayer, KiviSlidingWindowLayer, check_spec_fits

SPLITS = [9, 10, 17, *range(18, 41)]  # a prefill past the window of 6, then blocks and one-token steps


@pytest.mark.parametrize("spec", ["kivi4:g=2:r=2", "kivi2:g=4:r=1"])
def test_sliding_kivi_matches_kivi_that_keeps_every_token(tiny_gemma3, spec):
    ids = torch.randint(3, 96, (2, SPLITS[-1]), generator=torch.Generator().manual_seed(4))
    sliding = CompressedCache(spec, config=tiny_gemma3.config)
    keep_all = CompressedCache(spec)  # no config: every layer a full KiviLayer, the model's mask slides alone
    assert [type(layer) for layer in sliding.layers] == [KiviSlidingWindowLayer, KiviSlidingWindowLayer, KiviLayer]
    got = logits_in_splits(tiny_gemma3, sliding, ids, SPLITS)
    want = logits_in_splits(tiny_gemma3, keep_all, ids, SPLITS)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the same tokens, a shorter (masked) key list
    window, group = tiny_gemma3.config.sliding_window, sliding.layers[0].group
    total = SPLITS[-1]
    for layer in sliding.layers[:2]:
        held = layer._stored_length()
        assert window - 1 <= held <= window + group - 2  # whole groups leave: up to G - 1 tokens past the window
        assert (total - held) % group == 0 and layer.get_mask_sizes(1) == (held + 1, total - held)
        assert layer.get_seq_length() == total
    assert sliding.layers[2]._stored_length() == total  # the full-attention layer keeps everything
    assert sliding.nbytes() == sliding.layout_nbytes() < keep_all.nbytes()


def test_sliding_kivi_generates_greedily_like_the_keep_all_cache(tiny_gemma3):
    ids = torch.randint(3, 96, (1, 8), generator=torch.Generator().manual_seed(5))
    out = tiny_gemma3.generate(
        ids, cache=CompressedCache("kivi4:g=2:r=2", config=tiny_gemma3.config), max_new_tokens=12, do_sample=False
    )
    ref = tiny_gemma3.generate(ids, cache=CompressedCache("kivi4:g=2:r=2"), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, ref)


def test_kivi_refuses_chunked_layers_naming_the_layer_kind_and_the_fix():
    config = LlamaConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, hidden_size=64)
    config.layer_types, config.attention_chunk_size = ["chunked_attention", "full_attention"], 8
    with pytest.raises(ValueError, match=r"kivi2 cannot hold this model's 'chunked_attention' layers \(1 of 2: 0\)"):
        check_spec_fits("kivi2", config)
    with pytest.raises(ValueError, match="use a spec of another family"):
        CompressedCache("kivi2", config=config)
    check_spec_fits("rot+q4_0", config)  # walshkv's other codecs hold it
