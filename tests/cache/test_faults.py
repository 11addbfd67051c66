"""Cache faults that used to pass silently: non-finite window/sink tokens, refusals that left the layers
misaligned, a fused cache read by another attention, and fully masked (left-padded) rows in fused attention."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from walshkv.cache import CompressedCache, enable_fused_attention


def _block(tokens: int, bad_at: int | None = None, bad: float = float("nan"), heads: int = 2, d: int = 16):
    k = torch.randn(1, heads, tokens, d, generator=torch.Generator().manual_seed(tokens))
    if bad_at is not None:
        k[0, 1, bad_at, 3] = bad
    return k


def _lengths(cache: CompressedCache) -> list[tuple[int, int]]:
    return [(layer.get_seq_length(), layer.cumulative_length) for layer in cache.layers]


# ---- 1. window and sink tokens are checked like packed tokens -------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize(("spec", "residual", "bad_at"), [("int4", 8, 2), ("int4", 3, 4), ("sink:4:int4", 2, 1)])
def test_non_finite_window_and_sink_tokens_are_refused(tiny_llama, spec, residual, bad_at, bad):
    cache = CompressedCache(spec, config=tiny_llama.config, residual=residual)
    cache.update(_block(2), _block(2), 0)
    before = _lengths(cache)
    keys = cache.layers[0].keys
    with pytest.raises(ValueError, match=r"layer 0 .*(NaN|Inf)"):
        cache.update(_block(5, bad_at, bad), _block(5), 0)
    assert _lengths(cache) == before and cache.layers[0].keys is keys
    with pytest.raises(ValueError, match=r"(NaN|Inf)"):  # V too
        cache.update(_block(5), _block(5, bad_at, bad), 0)
    assert _lengths(cache) == before


@contextmanager
def _poison(model: torch.nn.Module, layer: int, when: list[bool]) -> Iterator[None]:
    """NaN in the output of ``layer``'s k_proj while ``when[0]`` is true (the model's own forward)."""

    def hook(_module: torch.nn.Module, _inputs: tuple, out: torch.Tensor) -> torch.Tensor:
        if when[0]:
            out = out.clone()
            out[..., -1, 0] = float("nan")
        return out

    handle = model.model.layers[layer].self_attn.k_proj.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def test_generate_with_a_window_refuses_nan(tiny_llama):
    ids = torch.randint(3, 90, (1, 6), generator=torch.Generator().manual_seed(3))
    cache = CompressedCache("int4", config=tiny_llama.config, residual=32)
    with _poison(tiny_llama, 1, [True]), torch.inference_mode(), pytest.raises(ValueError, match="layer 1"):
        tiny_llama.generate(ids, cache=cache, max_new_tokens=5, do_sample=False)


# ---- 2. a refused step is stored in no layer ------------------------------------------------------------

_CASES = [
    ("int4", 0, False),
    ("rot+int4", 5, False),
    ("sink:3:int4", 2, False),
    ("kivi2:g=4:r=4", 0, False),
    ("int8", 0, True),
    ("int4", 4, True),
]


@pytest.mark.parametrize(("spec", "residual", "fused"), _CASES)
@pytest.mark.parametrize("prefill_fails", [False, True])
def test_a_refusal_in_one_layer_rolls_back_the_others(tiny_llama, spec, residual, fused, prefill_fails):
    ids = torch.randint(3, 90, (1, 12), generator=torch.Generator().manual_seed(5))
    tiny_llama.set_attn_implementation("sdpa")
    if fused:
        enable_fused_attention(tiny_llama)

    def fresh() -> CompressedCache:
        return CompressedCache(spec, config=tiny_llama.config, residual=residual, fused=fused)

    try:
        cut = 0 if prefill_fails else 9
        cache, clean = fresh(), fresh()
        on = [False]
        with _poison(tiny_llama, 1, on), torch.inference_mode():
            if cut:
                tiny_llama(input_ids=ids[:, :cut], cache=cache)
                tiny_llama(input_ids=ids[:, :cut], cache=clean)
            before = _lengths(cache)
            on[0] = True
            with pytest.raises(ValueError, match=r"layer 1 .*NaN.*rolled back"):
                tiny_llama(input_ids=ids[:, cut : cut + 3], cache=cache)
            on[0] = False
            assert _lengths(cache) == before
            got = tiny_llama(input_ids=ids[:, cut:], cache=cache).logits
            want = tiny_llama(input_ids=ids[:, cut:], cache=clean).logits
        assert torch.equal(got, want)
        assert _lengths(cache) == _lengths(clean) and cache.nbytes() == clean.nbytes()
    finally:
        tiny_llama.set_attn_implementation("sdpa")


def test_sliding_layers_roll_back_after_they_slid(tiny_gemma3):
    ids = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(6))
    cache, clean = (CompressedCache("int8", config=tiny_gemma3.config) for _ in range(2))
    on = [False]
    with _poison(tiny_gemma3, 2, on), torch.inference_mode():
        tiny_gemma3(input_ids=ids[:, :9], cache=cache)  # past the window of 6: the sliding layers dropped tokens
        tiny_gemma3(input_ids=ids[:, :9], cache=clean)
        before = _lengths(cache)
        on[0] = True
        with pytest.raises(ValueError, match=r"layer 2 .*rolled back"):
            tiny_gemma3(input_ids=ids[:, 9:10], cache=cache)
        on[0] = False
        assert _lengths(cache) == before
        assert torch.equal(
            tiny_gemma3(input_ids=ids[:, 9:], cache=cache).logits, tiny_gemma3(input_ids=ids[:, 9:], cache=clean).logits
        )


# ---- 3. a fused cache is read by the fused attention only -----------------------------------------------


@pytest.mark.parametrize("other", ["sdpa", "eager"])
def test_a_fused_cache_refuses_other_attention(tiny_llama, other):
    ids = torch.randint(3, 90, (1, 8), generator=torch.Generator().manual_seed(7))
    enable_fused_attention(tiny_llama)
    cache = CompressedCache("int8", config=tiny_llama.config, fused=True)
    try:
        with torch.inference_mode():
            tiny_llama(input_ids=ids[:, :5], cache=cache)
            before = _lengths(cache)
            tiny_llama.set_attn_implementation(other)
            with pytest.raises(RuntimeError, match=r"fused=True.*enable_fused_attention"):
                tiny_llama(input_ids=ids[:, 5:], cache=cache)
            assert _lengths(cache) == before  # the refused step is stored in no layer
            enable_fused_attention(tiny_llama)  # read by the fused attention again: it works
            assert bool(torch.isfinite(tiny_llama(input_ids=ids[:, 5:], cache=cache).logits).all())
    finally:
        tiny_llama.set_attn_implementation("sdpa")


# ---- 8. fully masked rows (left padding) give zeros in fused attention, as SDPA does ---------------------


@pytest.mark.parametrize("spec", ["int8", "rot+int4"])
def test_left_padding_fused_equals_unfused(tiny_llama, spec):
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(8))
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # the second row starts with 4 padding tokens: their query rows see no key at all

    def run(fused: bool) -> list[torch.Tensor]:
        tiny_llama.set_attn_implementation("sdpa")
        if fused:
            enable_fused_attention(tiny_llama)
        cache = CompressedCache(spec, config=tiny_llama.config, fused=fused)
        with torch.inference_mode():
            outs = [tiny_llama(input_ids=ids[:, :10], attention_mask=mask[:, :10], cache=cache).logits]
            for t in (10, 11, 12):  # decode steps, still padded
                outs.append(
                    tiny_llama(input_ids=ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
                )
        tiny_llama.set_attn_implementation("sdpa")
        return outs

    ref, got = run(False), run(True)
    assert torch.allclose(ref[0][0], got[0][0], atol=5e-5)  # the row without padding
    assert torch.allclose(ref[0][1, 4:], got[0][1, 4:], atol=5e-5)  # the padded row, past its padding
    for a, b in zip(ref[1:], got[1:], strict=True):
        assert bool(torch.isfinite(b).all()) and torch.allclose(a, b, atol=5e-5)


# ---- 4. the fp16 range in the cache's own fp16 stores ----------------------------------------------------


@pytest.mark.parametrize("spec", ["kivi4", "kivi2:g=4:r=4", "sink:4:int4"])
def test_values_past_the_fp16_range_are_refused_by_fp16_stores(tiny_llama, spec):
    """KIVI's window and sink tokens are fp16: a float32 value they cannot hold is refused, not stored as Inf."""
    cache = CompressedCache(spec, config=tiny_llama.config)
    big = _block(5)
    big[0, 0, 1, 2] = 70000.0
    with pytest.raises(ValueError, match="overflow"):
        cache.update(big, _block(5), 0)
    assert _lengths(cache)[0] == (0, 0)


def _near_fp16_max(peak: float) -> torch.Tensor:
    k = (_block(9) * peak / 2).clamp(-peak, peak).half()
    k[..., 0] = peak
    return k


@pytest.mark.parametrize("spec", ["kivi4", "kivi2:g=4:r=4"])
def test_kivi_near_the_fp16_maximum_is_refused_or_finite(tiny_llama, spec):
    """Near the fp16 maximum, KIVI's quantized groups decode finite (within fp16) where their rounded-up scales
    leave room, and a block they would decode past 65504 is refused whole, the cache left as it was. Both
    outcomes are required, each after groups left the fp16 window (the quantized path, not the window)."""
    room = CompressedCache(spec, config=tiny_llama.config)
    for step in range(8):  # |x| <= 60000: the scales' rounding cannot reach 65504
        out_k, out_v = room.update(_near_fp16_max(60000.0), _near_fp16_max(60000.0), 0)
        assert bool(torch.isfinite(out_k).all() and torch.isfinite(out_v).all()), step
        assert max(out_k.abs().max(), out_v.abs().max()) <= 65504, step
    assert room.layers[0]._packed_tokens() > 0  # groups were quantized and read back
    edge = CompressedCache(spec, config=tiny_llama.config)
    for step in range(8):  # |x| up to 65504: the first quantized group would decode past it
        before = _lengths(edge)
        try:
            out_k, _ = edge.update(_near_fp16_max(65504.0), _near_fp16_max(65504.0), 0)
        except ValueError as err:
            assert "past the float16 maximum 65504" in str(err), err
            assert _lengths(edge) == before and edge.layers[0]._packed_tokens() == 0
            break
        assert bool(torch.isfinite(out_k).all()) and edge.layers[0]._packed_tokens() == 0, step  # the window only
    else:
        pytest.fail(f"{spec} stored values it decodes past the float16 maximum")
