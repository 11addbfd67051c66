"""The evaluation protocol on a tiny model (no download)."""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import walshkv.codecs.spec
import walshkv.models
from walshkv.cache import CompressedCache
from walshkv.cli import main
from walshkv.codecs import NamedSpec, name_spec, parse_cache_spec
from walshkv.data import Text
from walshkv.eval import compare_logits, evaluate, make_windows, scored_positions
from walshkv.eval.metrics import bootstrap_ci95, paired_difference
from walshkv.eval.report import format_table, write_csv, write_json, write_markdown
from walshkv.models import LoadedModel, _describe

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


def test_scored_positions_follow_llama_perplexity():
    assert scored_positions(512, "half") == (256, 511)  # 255 scored tokens per window
    assert scored_positions(512, "all") == (0, 511)
    with pytest.raises(ValueError, match="half, all"):
        scored_positions(512, "middle")


def test_make_windows_and_short_text(toy_tokenizer):
    win = make_windows(toy_tokenizer, TEXT.content, 64, 3)
    assert win.ids.shape == (3, 64)
    assert win.text_tokens == 2000
    assert not win.bos
    assert torch.equal(win.ids[1], torch.tensor(toy_tokenizer(TEXT.content)["input_ids"][64:128]))
    assert make_windows(toy_tokenizer, TEXT.content, 64, None).ids.shape[0] == 2000 // 64
    with pytest.raises(ValueError, match="fewer --windows"):
        make_windows(toy_tokenizer, TEXT.content, 512, 8)
    with pytest.raises(ValueError, match="0 window"):
        make_windows(toy_tokenizer, "", 64, 1)


def test_compare_logits_identical_is_zero():
    logits = torch.randn(5, 11)
    kl, nll, nll_ref, same = compare_logits(logits, logits.clone(), torch.arange(5))
    assert torch.all(kl == 0) and torch.equal(nll, nll_ref) and same.all()
    assert kl.dtype == torch.float64


def test_compare_logits_matches_definition():
    a, b = torch.randn(3, 7), torch.randn(3, 7)
    kl, *_ = compare_logits(a, b, torch.zeros(3, dtype=torch.long))
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    assert torch.allclose(kl, (p * (p / q).log()).sum(-1))


def test_compare_logits_in_row_chunks_equals_one_pass():
    # long contexts compare a few rows at a time (memory); every position's numbers must not change
    a, b = torch.randn(11, 13), torch.randn(11, 13)
    t = torch.randint(0, 13, (11,))
    whole = compare_logits(a, b, t, rows=1000)
    for rows in (1, 3, 11):
        for x, y in zip(whole, compare_logits(a, b, t, rows=rows), strict=True):
            assert torch.equal(x, y)
    empty = compare_logits(a[:0], b[:0], t[:0])
    assert all(x.numel() == 0 for x in empty) and empty[3].dtype == torch.bool
    with pytest.raises(ValueError, match=r"\[positions, vocab\]"):
        compare_logits(a, b[:5], t)
    with pytest.raises(ValueError, match="rows must be at least 1"):
        compare_logits(a, b, t, rows=0)


def test_reference_rows_made_once_give_the_same_numbers():
    """The harness makes the reference's float64 side once per window (ReferenceRows) for every spec: the same
    numbers bit for bit, the reference's head run once, and nothing kept past the memory bound."""
    from walshkv.eval.metrics import HeadLogits, ReferenceRows

    hidden, head_w = torch.randn(11, 6), torch.randn(13, 6)
    calls = []

    def head(h: torch.Tensor) -> torch.Tensor:
        calls.append(h.shape[0])
        return h @ head_w.T

    ref = HeadLogits(hidden, head, 13)
    t = torch.randint(0, 13, (11,))
    shared = ReferenceRows(ref)
    for _ in range(3):
        b = torch.randn(11, 13)
        for x, y in zip(compare_logits(ref, b, t, rows=4), compare_logits(shared, b, t, rows=4), strict=True):
            assert torch.equal(x, y)
    assert calls == [4, 4, 3] * 4  # each plain comparison makes them, the shared ones the first time only
    calls.clear()
    bounded = ReferenceRows(ref, keep_bytes=11 * 13 * 16 - 1)  # one byte short: made again each time
    compare_logits(bounded, b, t, rows=4)
    compare_logits(bounded, b, t, rows=4)
    assert calls == [4, 4, 3, 4, 4, 3] and bounded.shape == ref.shape


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(4)
    cfg = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


@pytest.mark.parametrize("name", ["tiny_llama", "tiny_gemma3", "qwen2"])
def test_scored_hidden_states_give_the_models_own_logits(name, request):
    # the long-context path keeps [positions, hidden] and applies the head by rows (32k tokens of a 152k vocabulary
    # would be 10 GB of logits): it must be the model's own forward, gemma's final softcap included
    from transformers import DynamicCache

    from walshkv.eval.harness import HEAD_LOGITS_MODELS, forward_logits, forward_scored
    from walshkv.eval.metrics import HeadLogits

    model = _tiny_qwen2() if name == "qwen2" else request.getfixturevalue(name)
    if name == "tiny_gemma3":
        model.config.final_logit_softcapping = 3.0  # a cap that bites: random logits go past it
    assert type(model).__name__ in HEAD_LOGITS_MODELS
    ids = torch.randint(3, 90, (1, 40))
    with torch.inference_mode():
        full = forward_logits(model, ids, DynamicCache(config=model.config), 17)
        lazy = forward_scored(model, ids, DynamicCache(config=model.config), 17)
    assert isinstance(lazy, HeadLogits) and lazy.shape == full.shape and len(lazy[:9]) == 9
    torch.testing.assert_close(lazy.rows(0, 17), full, rtol=1e-6, atol=1e-6)
    if name == "tiny_gemma3":
        assert float(full.abs().max()) <= 3.0
    t = ids[0, -17:]
    noisy = full + 0.1 * torch.randn_like(full)
    for rows in (1, 5, 256):
        kl, nll, nll_ref, same = compare_logits(lazy, noisy, t, rows=rows)
        kl0, nll0, nll_ref0, same0 = compare_logits(full, noisy, t)
        torch.testing.assert_close(kl, kl0, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(nll_ref, nll_ref0, rtol=1e-6, atol=1e-9)
        assert torch.equal(nll, nll0) and torch.equal(same, same0)
    both = HeadLogits.cat([lazy[:5], lazy[5:]])
    assert isinstance(both, HeadLogits) and torch.equal(both.hidden, lazy.hidden)
    mixed = HeadLogits.cat([lazy[:5], full[5:]])
    assert isinstance(mixed, torch.Tensor) and mixed.shape == full.shape
    with pytest.raises(TypeError, match="slice of positions"):
        lazy[3]


def test_models_outside_the_list_keep_their_full_logits(tiny_llama):
    from transformers import DynamicCache

    from walshkv.eval.harness import forward_scored, output_head

    class Wrapped(torch.nn.Module):  # an unknown architecture: its forward is the only thing trusted
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, **kw):
            return self.inner(**kw)

    wrapped = Wrapped(tiny_llama)
    assert output_head(wrapped) is None
    with torch.inference_mode():
        out = forward_scored(wrapped, torch.randint(3, 90, (1, 12)), DynamicCache(config=tiny_llama.config), 4)
    assert isinstance(out, torch.Tensor) and out.shape == (4, tiny_llama.config.vocab_size)


def test_paired_difference_of_windows():
    a, b = [0.3, 0.5, 0.4, 0.6], [0.1, 0.2, 0.2, 0.3]
    mean, ci = paired_difference(a, b)
    assert mean == pytest.approx(0.25) and ci == bootstrap_ci95([0.2, 0.3, 0.2, 0.3])
    assert paired_difference(a, b[:3]) is None and paired_difference(None, b) is None
    assert paired_difference(a, b, min_windows=5) is None


def test_evaluate_on_tiny_model(tiny_lm):
    res = evaluate(tiny_lm, TEXT, ["fp32", "int8", "int2", "rot+int4/int3"], ctx=64, windows=3, progress=False)
    rows = {r["codec"]: r for r in res.results}
    assert rows["fp32"]["kld_mean"] == 0.0 and rows["fp32"]["ppl_ratio"] == 1.0
    assert rows["fp32"]["top1_agreement"] == 1.0
    assert 0 < rows["int8"]["kld_mean"] < rows["int2"]["kld_mean"]
    assert rows["int8"]["scored_tokens"] == 3 * 31
    mixed = rows["rot+int4/int3"]
    assert mixed["bits_k"] == 4 + 16 / 16 and mixed["bits_v"] == 3 + 16 / 16
    assert mixed["bits_per_element"] == pytest.approx((mixed["bits_k"] + mixed["bits_v"]) / 2)
    # kv_bytes (the tensors held after one window) is exactly the spec's layout: every row is fixed-size
    elements = 2 * 64 * 2 * 16 * 2  # layers x tokens x kv_heads x head_dim x (K, V)
    for r in res.results:
        assert r["kv_bytes"] == parse_cache_spec(r["codec"]).bits_per_element(16) * elements / 8, r["codec"]
        assert r["kv_bytes"] * 8 == pytest.approx(r["bits_per_element"] * elements, rel=1e-12)
        assert r["kv_bytes_fp16"] == elements * 2
    meta = res.meta
    assert meta["ctx"] == 64 and meta["windows"] == 3 and meta["scored_tokens"] == 93
    assert "32..62" in meta["scored_positions"]
    assert meta["text"]["name"] == "toy" and meta["quantize_on_write"] is True
    assert {"walshkv", "torch", "transformers"} <= set(meta["versions"])


def test_evaluate_score_all_and_residual(tiny_lm):
    res = evaluate(tiny_lm, TEXT, ["int2"], ctx=32, windows=2, score="all", residual=8, progress=False)
    row = res.results[0]
    assert row["scored_tokens"] == 2 * 31
    assert res.meta["residual"] == 8
    # after a window of 32 tokens: 24 packed at int2's 3 bits (2-bit codes, one fp16 scale per 16 values)
    # and the 8 most recent in the model's float32, counted as held
    assert row["bits_per_element"] == (24 * 3 + 8 * 32) / 32
    assert row["kv_bytes"] == 2 * 2 * 2 * (24 * 6 + 8 * 16 * 4)  # layers x kv heads x (K, V) x bytes per row


def test_evaluate_rejects_bad_codec_before_running(tiny_lm):
    with pytest.raises(ValueError, match="unknown codec"):
        evaluate(tiny_lm, TEXT, ["int4", "nope"], ctx=32, windows=1, progress=False)


def test_reports(tmp_path, tiny_lm):
    res = evaluate(tiny_lm, TEXT, ["int8", "int4"], ctx=32, windows=1, progress=False)
    table = format_table(res.results)
    assert "mean KLD" in table and "int4" in table
    write_json(tmp_path / "r.json", res.to_json())
    data = json.loads((tmp_path / "r.json").read_text())
    assert set(data) == {"meta", "results"} and data["results"][0]["codec"] == "int8"
    write_csv(tmp_path / "r.csv", res.results)
    assert (tmp_path / "r.csv").read_text().startswith("codec,")
    write_markdown(tmp_path / "r.md", res.meta, res.results, "walshkv eval --codec int8")
    md = (tmp_path / "r.md").read_text()
    assert "| codec" in md and "walshkv eval --codec int8" in md and "tiny-llama" in md


def test_kivi_rows_carry_their_fp_share(tiny_lm, tmp_path):
    """KIVI keeps its newest tokens in fp16: its rows say so and measure it, like the hf-* rows."""
    res = evaluate(tiny_lm, TEXT, ["kivi4:g=8:r=4", "int8"], ctx=64, windows=2, progress=False)
    kivi, int8 = res.results
    assert kivi["quantize_on_write"] is False and kivi["fp_window"] == 4 and "decode_chunk" not in kivi
    # one forward writes 64 tokens: (64 - 4) // 8 = 7 groups (56 tokens) quantized, 56..63 in fp16; scored
    # positions 32..62 see positions 56..p in full precision, and 32..56 no earlier fp16 one (25 of 31)
    fp = [max(0, p + 1 - 56) / (p + 1) for p in range(32, 63)]
    assert kivi["fp_context_mean"] == pytest.approx(sum(fp) / len(fp), rel=1e-12)
    assert kivi["scored_quantized_context_share"] == 25 / 31
    assert int8["quantize_on_write"] is True and "fp_context_mean" not in int8 and "fp_window" not in int8
    assert res.meta["quantize_on_write"] == "per row (kivi: no, its newest r to r+g-1 tokens stay in fp16)"
    write_markdown(tmp_path / "r.md", res.meta, res.results, "walshkv eval --codec kivi4:g=8:r=4")
    md = (tmp_path / "r.md").read_text()
    assert "| kivi4:g=8:r=4 ‡" in md and "| int8 " in md and "†" not in md
    assert "\n‡ not quantized on write: KIVI" in md and "kivi4:g=8:r=4: full-precision window 4 tokens, " in md


def test_residual_with_kivi_is_refused_naming_its_own_window(tiny_lm, tiny_llama, monkeypatch, capsys, tmp_path):
    message = (
        r"kivi2 keeps its newest tokens in its own fp16 window \(r=32: 32 to 63 tokens\), so residual=8 .*kivi2:r=8"
    )
    with pytest.raises(ValueError, match=message):
        CompressedCache("kivi2", config=tiny_llama.config, residual=8)
    with pytest.raises(ValueError, match=message):  # before any forward
        evaluate(tiny_lm, TEXT, ["int8", "kivi2"], ctx=64, windows=1, residual=8, progress=False)
    assert CompressedCache("kivi2:r=8", config=tiny_llama.config).layers[0].window == 8
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    text = tmp_path / "t.txt"
    text.write_text(TEXT.content)
    argv = ["eval", "--codec", "kivi2", "--residual", "8", "--text", str(text), "--ctx", "64", "--windows", "1"]
    assert main([*argv, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "kivi2:r=8" in err and "no --residual" in err


def test_an_exact_prefill_is_measured_as_serving_engines_run_it(tiny_lm):
    """--prefill exact: the prefix attends exactly, the scored tokens decode compressed; named in rows and meta."""
    q = evaluate(tiny_lm, TEXT, ["int3"], ctx=32, windows=2, feed="decode", progress=False)
    e = evaluate(tiny_lm, TEXT, ["int3"], ctx=32, windows=2, prefill="exact", progress=False)
    qrow, erow = q.results[0], e.results[0]
    assert erow["feed"] == "decode" and erow["prefill"] == "exact" and erow["quantize_on_write"] is False
    assert qrow["prefill"] == "quantized" and qrow["quantize_on_write"] is True
    assert 0 < erow["kld_mean"] < qrow["kld_mean"]  # an exact prompt's K/V carry less error into the scored part
    assert e.meta["quantize_on_write"] == "no: prefill='exact'" and "serving-engine" in e.meta["prefill"]
    with pytest.raises(ValueError, match="feed='decode'"):
        evaluate(tiny_lm, TEXT, ["int3"], ctx=32, windows=1, prefill="exact", feed="window", progress=False)
    with pytest.raises(ValueError, match="quantized, exact"):
        evaluate(tiny_lm, TEXT, ["int3"], ctx=32, windows=1, prefill="fast", progress=False)


def test_specs_travel_as_objects_and_a_repeated_spec_is_measured_once(tiny_lm):
    twice = evaluate(tiny_lm, TEXT, ["int4", parse_cache_spec("int4"), "INT4/int4"], ctx=64, windows=2, progress=False)
    once = evaluate(tiny_lm, TEXT, ["int4"], ctx=64, windows=2, progress=False)
    assert [r["codec"] for r in twice.results] == ["int4"]
    assert twice.results[0]["kld_mean"] == once.results[0]["kld_mean"]  # windows not counted twice
    assert twice.results[0]["scored_tokens"] == once.results[0]["scored_tokens"]


def test_named_specs_are_never_parsed_again_and_rows_carry_their_names(tiny_lm, monkeypatch):
    preset = NamedSpec("walshkv:4.5", parse_cache_spec("int8"), label="walshkv:4.5", source="a file")  # as resolved
    named = [name_spec("int4"), name_spec("vllm:int4_per_token_head"), preset]
    texts = [n.text for n in named]

    def no_text(spec):  # what eval would do if it went back to the text
        if isinstance(spec, str):
            raise AssertionError(f"parsed {spec!r} again")
        return real(spec)

    real = walshkv.codecs.spec.parse_cache_spec
    monkeypatch.setattr(walshkv.codecs.spec, "parse_cache_spec", no_text)
    rows = evaluate(tiny_lm, TEXT, named, ctx=32, windows=1, progress=False).results
    assert [r["codec"] for r in rows] == texts  # the canonical text, the one string form files carry
    assert [r.get("preset") for r in rows] == [None, "vllm:int4_per_token_head", "walshkv:4.5"]


def test_eval_command_and_harness_never_go_back_to_spec_text():
    """The CLI parses each --codec once (:func:`name_spec`) and hands objects on; nothing downstream re-parses."""
    import walshkv.cli.eval
    import walshkv.eval.harness

    for module in (walshkv.cli.eval, walshkv.eval.harness):
        assert "parse_cache_spec" not in inspect.getsource(module), module.__name__


def test_evaluate_runs_the_model_in_inference_mode(tiny_lm):
    """No autograd graph over the windows (and no inference tensor later reused under autograd)."""
    seen: list[bool] = []
    layer = tiny_lm.model.model.layers[0]
    handle = layer.register_forward_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        evaluate(tiny_lm, TEXT, ["int4"], ctx=64, windows=1, progress=False)
    finally:
        handle.remove()
    assert seen and all(seen)
