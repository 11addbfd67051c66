"""Hugging Face's QuantizedCache run as a peer: specs, byte accounting, decode feeding."""

from __future__ import annotations

import pytest
import torch

from walshkv.cache import CompressedCache, context_state, hf_cache_nbytes, make_cache
from walshkv.codecs import HFCacheSpec, parse_cache_spec
from walshkv.codecs.spec import parse_hf_spec
from walshkv.data import Text
from walshkv.eval import evaluate
from walshkv.models import LoadedModel, _describe

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


def test_parse_and_canonical_names():
    assert parse_cache_spec("hf-quanto:4") == HFCacheSpec("quanto", 4, 64, 128)
    assert parse_cache_spec("HF-HQQ:3:g=32:r=16").spec == "hf-hqq:3:g=32:r=16"
    assert parse_cache_spec("hf-fp8").spec == "hf-fp8"
    assert parse_cache_spec("hf-quanto:2:r=128").spec == "hf-quanto:2"
    assert not parse_cache_spec("hf-hqq:4").needs_calibration


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("hf-quanto:3", r"\(2, 4\)"),
        ("hf-hqq:5", r"\(1, 2, 3, 4, 8\)"),
        ("hf-quanto", "needs a width"),
        ("hf-fp8:4", "takes no arguments"),
        ("hf-hqq:4:x=3", "g=GROUP"),
        ("hf-hqq:4:g=0", "at least 1"),
        ("hf-foo:4", "hf-quanto, hf-hqq, hf-fp8"),
    ],
)
def test_parse_errors_list_allowed_values(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_hf_spec(spec)


def test_nominal_bits_follow_the_packing():
    assert parse_hf_spec("hf-quanto:4").bits_per_element(64) == 4 + 32 / 64
    assert parse_hf_spec("hf-quanto:2:g=32").bits_per_element(64) == 2 + 32 / 32
    # HQQ packs ten 3-bit codes per int32: 7 words per 64-element group
    assert parse_hf_spec("hf-hqq:3").bits_per_element(64) == 7 * 32 / 64 + 0.5
    assert parse_hf_spec("hf-fp8").bits_per_element(64) == 8.0


BACKENDS = [
    ("hf-quanto:4", "optimum.quanto"),
    ("hf-quanto:2", "optimum.quanto"),
    ("hf-hqq:4", "hqq"),
    ("hf-hqq:3", "hqq"),
    ("hf-hqq:8", "hqq"),
    ("hf-fp8", None),
]


@pytest.mark.parametrize(("spec", "module"), BACKENDS)
def test_bytes_held_match_the_layout(tiny_llama, spec, module):
    if module:
        pytest.importorskip(module)
    parsed = parse_hf_spec(spec)
    cache = make_cache(parsed, tiny_llama.config)
    k, v = torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16)
    for layer in range(2):
        out_k, _ = cache.update(k, v, layer)
        assert torch.equal(out_k, k)  # transformers returns the first write unquantized
    kb, vb, n = hf_cache_nbytes(cache)
    assert n == 2 * 2 * 128 * 16
    nominal = parsed.bits_per_element(16)
    if parsed.backend == "fp8":  # plus one fp16 scale per tensor
        assert 8 * kb / n == pytest.approx(8.0, abs=0.01) and kb == vb
    else:  # window empty after the first write: held bytes are the layout exactly
        assert 8 * kb / n == nominal and 8 * vb / n == nominal
    # the next token is quantized context for quanto/hqq's window logic: the window fills, then flushes
    cached, window, exact = context_state(cache)
    assert (cached, window) == (128, 0) and exact == (parsed.backend != "fp8")
    out_k, _ = cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert out_k.shape[-2] == 129
    err = (out_k[:, :, :128] - k).abs().mean().item()
    # rounding to the nearest level errs by step/4 on average; min-max over a group of 64 draws of N(0, 1)
    # spans about 4.8, so step = 4.8 / (2^B - 1); fp8 (e4m3, 3 mantissa bits): step/4 relative to |x| in
    # [1, 2) of a binade, about 0.8 x 2^-3 / 6 for E|x| = 0.8. Measured within 10% of each (quanto:4 -3%,
    # quanto:2 -4%, hqq:4 -8%, hqq:3 -7%, hqq:8 -9%, fp8 +10%); neighbouring widths differ by 2x or more.
    expected = 0.8 * 2**-3 / 6 if parsed.backend == "fp8" else 4.8 / (2**parsed.bits - 1) / 4
    assert err == pytest.approx(expected, rel=0.15)


def test_window_is_counted_in_the_bytes(tiny_llama):
    pytest.importorskip("optimum.quanto")
    cache = make_cache("hf-quanto:4:r=8", tiny_llama.config)
    cache.update(torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16), 0)
    for _ in range(5):
        cache.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)
    assert context_state(cache) == (69, 5, True)
    kb, _, _ = hf_cache_nbytes(cache)
    # layer 1 is still empty: 64 quantized tokens at 4.5 bits and 5 fp16 tokens, per (head, channel)
    assert kb == (64 * 2 * 16 * 4.5 + 5 * 2 * 16 * 16) / 8


def test_evaluate_feeds_hf_caches_token_by_token(tiny_lm):
    res = evaluate(tiny_lm, TEXT, ["hf-fp8", "int8"], ctx=32, windows=2, progress=False)
    rows = {r["codec"]: r for r in res.results}
    fp8 = rows["hf-fp8"]
    assert fp8["feed"] == "decode" and fp8["quantize_on_write"] is False
    assert fp8["scored_quantized_context_share"] == 1.0 and fp8["fp_context_mean"] == 0.0
    # 8 bits plus one fp16 scale per (layer, K or V) tensor of 31 tokens x 2 heads x 16 channels
    assert 0 < fp8["kld_mean"] < 0.05 and fp8["bits_per_element"] == pytest.approx(8 + 16 / (31 * 32))
    assert fp8["fp_window"] == 0
    assert rows["int8"]["feed"] == "window" and "fp_context_mean" not in rows["int8"]
    assert res.meta["quantize_on_write"].startswith("per row")


def test_decode_feeding_matches_window_feeding_for_walshkv_codecs(tiny_lm):
    win = evaluate(tiny_lm, TEXT, ["int4", "rot+int3"], ctx=32, windows=2, progress=False).results
    dec = evaluate(tiny_lm, TEXT, ["int4", "rot+int3"], ctx=32, windows=2, feed="decode", progress=False).results
    for a, b in zip(win, dec, strict=True):
        assert b["feed"] == "decode" and b["scored_quantized_context_share"] == 1.0
        assert b["kld_mean"] == pytest.approx(a["kld_mean"], rel=1e-3, abs=1e-6)


def test_hf_cache_errors(tiny_lm, tiny_gemma3, monkeypatch):
    with pytest.raises(ValueError, match="feed='decode'"):
        evaluate(tiny_lm, TEXT, ["hf-fp8"], ctx=32, windows=1, feed="window", progress=False)
    with pytest.raises(ValueError, match="feed must be one of"):
        evaluate(tiny_lm, TEXT, ["int8"], ctx=32, windows=1, feed="stream", progress=False)
    with pytest.raises(ValueError, match="QuantizedCache cannot run this model"):
        make_cache("hf-fp8", tiny_gemma3.config)
    with pytest.raises(ValueError, match="make_cache"):
        CompressedCache("hf-fp8", config=tiny_lm.model.config)
    with pytest.raises(ValueError, match="own window"):
        make_cache("hf-fp8", tiny_lm.model.config, residual=8)
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install 'walshkv\[hf\]'"):
        make_cache("hf-hqq:4", tiny_lm.model.config)


def test_sweep_runs_hf_rows_and_leaves_out_what_cannot_run(tmp_path, tiny_lm, tiny_gemma3, toy_tokenizer, monkeypatch):
    import walshkv.eval.sweep.run
    from walshkv.eval.sweep import SweepConfig, run_sweep

    monkeypatch.setattr(walshkv.eval.sweep.run, "plot_pareto", lambda rows, path, title: None)
    fast = {"ctx": 32, "windows": 1, "progress": False}
    rows = run_sweep(tiny_lm, TEXT, SweepConfig(["int8", "hf-fp8"], **fast), tmp_path / "a")
    assert {r["codec"]: r["feed"] for r in rows} == {"int8": "window", "hf-fp8": "decode"}
    md = (tmp_path / "a" / "results.md").read_text()
    assert "hf-fp8 †" in md and "† fed as in generation" in md

    gemma = LoadedModel(tiny_gemma3, toy_tokenizer, "tiny-gemma3", "test", _describe(tiny_gemma3))
    rows = run_sweep(gemma, TEXT, SweepConfig(["int8", "hf-fp8", "kivi2"], **fast), tmp_path / "b")
    assert [r["codec"] for r in rows] == ["int8", "kivi2"]  # KIVI holds gemma3's sliding layers
    md = (tmp_path / "b" / "results.md").read_text()
    assert "Left out: `hf-fp8` (hf-fp8 cannot hold this model's 'sliding_attention' layers (2 of 3)" in md
    assert "`kivi2` (" not in md
    with pytest.raises(ValueError, match="no runnable cache specs"):
        run_sweep(gemma, TEXT, SweepConfig(["hf-fp8"], **fast), tmp_path / "c")


def test_decode_chunks_report_the_extra_full_precision_context(tiny_lm):
    pytest.importorskip("optimum.quanto")
    specs = ["hf-quanto:4:g=32:r=6", "int4"]
    one = evaluate(tiny_lm, TEXT, specs, ctx=32, windows=1, progress=False).results
    four = evaluate(tiny_lm, TEXT, specs, ctx=32, windows=1, feed="decode", decode_chunk=4, progress=False).results
    # 16 prefix tokens quantized at once; the window flushes when it would reach 6 tokens
    assert one[0]["decode_chunk"] == 1 and four[0]["decode_chunk"] == 4
    assert four[0]["fp_context_mean"] > one[0]["fp_context_mean"] > 0
    assert four[0]["scored_quantized_context_share"] < one[0]["scored_quantized_context_share"]
    # KIVI's window holds the newest tokens in fp16: context_state says so
    kivi = CompressedCache("kivi2", config=tiny_lm.model.config)
    kivi.update(torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16), 0)
    cached, window, exact = context_state(kivi)
    assert cached == 40 and 32 <= window < 64 and exact
    # walshkv quantizes on write: chunking changes nothing
    assert four[1]["kld_mean"] == pytest.approx(one[1]["kld_mean"], rel=1e-3, abs=1e-6)
    assert four[1]["fp_context_mean"] == 0.0
    with pytest.raises(ValueError, match="decode_chunk"):
        evaluate(tiny_lm, TEXT, ["int4"], ctx=32, windows=1, decode_chunk=0, progress=False)
