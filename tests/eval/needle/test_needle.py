"""``walshkv needle`` (:mod:`walshkv.eval.needle`) on a tiny random model with a character tokenizer (no download):
the trials (determinism, placement at depth, token counts), the scorer, the summaries and the threshold, a full
run through the command line with every output file, and the refusals."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

import walshkv.models
from walshkv.cli import main
from walshkv.data import Text
from walshkv.eval import needle
from walshkv.eval.needle import (
    BASELINE,
    NeedleConfig,
    make_trials,
    parse_depths,
    parse_lengths,
    run_needle,
    score_answer,
)
from walshkv.models import LoadedModel, _describe

#: A haystack text: short sentences with letters (the tokenizer maps each character to a token).
SENTENCES = [
    "The river bends near the old mill.",
    "A quiet wind moved over the hills!",
    "Why did the baker close so early?",
    "Lanterns glowed along the harbor wall.",
    "Nobody remembered the name of the ship.",
    "Snow fell for three days and nights.",
]
TEXT = Text("toy-prose", "generated", " ".join(SENTENCES[i % 6] for i in range(60)))
CHAT = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"  # noqa: E501


def _tokenizer(chat: bool):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3, **{chr(c): c - 28 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters joined as they are
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])  # BOS first
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    if chat:
        fast.chat_template = CHAT
    return fast


@pytest.fixture(scope="module")
def char_tokenizer():
    return _tokenizer(chat=False)


@pytest.fixture(scope="module")
def chat_tokenizer():
    return _tokenizer(chat=True)


@pytest.fixture(scope="module")
def tiny_lm(chat_tokenizer) -> LoadedModel:
    """A 2-layer llama (head_dim 32: q4_0 fits) over the character vocabulary, 1,024 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        eos_token_id=2,
        bos_token_id=1,
    )
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, chat_tokenizer, "tiny-needle", "test", _describe(model))


def _text(tokenizer, trial) -> str:
    return tokenizer.decode(list(trial.ids))


# ---------------------------------------------------------------------------------------------------------
# Trials
# ---------------------------------------------------------------------------------------------------------


def test_trials_are_deterministic_and_a_sample_keeps_its_needle(char_tokenizer):
    kw = {"lengths": (600, 900), "depths": (0.0, 0.5, 1.0), "samples": 2}
    a = make_trials(char_tokenizer, TEXT.content, **kw)
    b = make_trials(char_tokenizer, TEXT.content, **kw)
    assert a == b and len(a) == 2 * 3 * 2
    assert [(t.length, t.depth, t.sample) for t in a[:3]] == [(600, 0.0, 0), (600, 0.0, 1), (600, 0.5, 0)]
    for s in (0, 1):  # a sample has one needle and haystack start at every length and depth
        mine = [t for t in a if t.sample == s]
        assert len({(t.key, t.answers, t.haystack_start) for t in mine}) == 1
    assert a[0].key != a[1].key and a[0].answers != a[1].answers
    other = make_trials(char_tokenizer, TEXT.content, seed=1, **kw)
    assert [t.answers for t in other] != [t.answers for t in a]
    for t in a:
        assert len(t.answers) == 1 and len(t.answers[0]) == 7 and t.answers[0].isdigit() and t.answers[0][0] != "0"
        assert t.key.count("-") == 1 and t.prompt == "plain"


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_fills_its_length_but_leaves_room_for_the_answer(chat, char_tokenizer, chat_tokenizer):
    tok = chat_tokenizer if chat else char_tokenizer
    longest = max(len(s) + 1 for s in SENTENCES)  # characters = tokens here
    for t in make_trials(tok, TEXT.content, lengths=(500, 777, 1024), depths=(0.3,), samples=2, new_tokens=10):
        assert t.length - 10 - longest < t.prompt_tokens <= t.length - 10
        assert t.prompt == ("chat" if chat else "plain")
        text = _text(tok, t)
        assert text.endswith(f"The special magic number for {t.key} mentioned in the provided text is")
        if chat:
            assert text.startswith("<|user|>Some special magic numbers") and "<|assistant|>The special" in text
        else:
            assert text.startswith("<s>Some special magic numbers")  # plain text gets the tokenizer's BOS


def test_the_needle_sits_at_its_depth(char_tokenizer):
    trials = make_trials(char_tokenizer, TEXT.content, lengths=(1000,), depths=(0.0, 0.25, 0.5, 0.75, 1.0), samples=1)
    longest = max(len(s) + 1 for s in SENTENCES)
    positions = []
    for t in trials:
        text = _text(char_tokenizer, t)
        (needle_sentence,) = (n.sentence for n in t.needles)
        assert needle_sentence == f"The special magic number for {t.key} is: {t.answers[0]}."
        assert text.count(needle_sentence) == 1
        # the recorded token index points at the needle (one token per character, after BOS)
        start = t.needle_token
        assert char_tokenizer.decode(list(t.ids[start : start + 40])).strip().startswith("The special magic number")
        assert abs(t.depth_actual - t.depth) * t.haystack_tokens <= longest / 2 + 1
        positions.append(start)
        if t.depth == 0.0:
            assert "afterwards.\nThe special magic number for" in text
        if t.depth == 1.0:
            assert f"{t.answers[0]}.\nWhat is the special magic number for {t.key}" in text
    assert positions == sorted(positions) and len(set(positions)) == 5


def test_multikey_and_multivalue_trials(char_tokenizer):
    (mk,) = make_trials(char_tokenizer, TEXT.content, task="multikey", lengths=(900,), depths=(0.5,), samples=1, keys=3)
    assert len(mk.needles) == 3 and len({n.key for n in mk.needles}) == 3 and len({n.value for n in mk.needles}) == 3
    asked = next(n for n in mk.needles if n.key == mk.key)
    assert mk.answers == (asked.value,) and mk.new_tokens == 12
    text = _text(char_tokenizer, mk)
    assert all(text.count(n.sentence) == 1 for n in mk.needles)
    (mv,) = make_trials(char_tokenizer, TEXT.content, task="multivalue", lengths=(900,), depths=(0.5,), samples=1)
    assert len(mv.needles) == 4 and {n.key for n in mv.needles} == {mv.key} and len(set(mv.answers)) == 4
    assert mv.new_tokens == 48 and sorted(mv.answers) == sorted(n.value for n in mv.needles)
    text = _text(char_tokenizer, mv)
    assert f"One of the special magic numbers for {mv.key} is: " in text
    assert text.endswith(f"The special magic numbers for {mv.key} mentioned in the provided text are")


def test_score_answer_is_exact_match():
    assert score_answer("single", " 1234567.", ["1234567"]) == (True, 1.0, ["1234567"])
    assert score_answer("single", " 1,234,567", ["1234567"])[0]
    assert score_answer("single", " 12345678", ["1234567"])[:2] == (False, 0.0)  # a longer number is another one
    assert score_answer("multikey", " 7654321, not 1234567", ["1234567"])[:2] == (False, 0.0)  # the first counts
    assert score_answer("single", " unknown", ["1234567"]) == (False, 0.0, [])
    ok, score, numbers = score_answer("multivalue", " 1111111, 2222222 and 3333333", ["3333333", "1111111", "4444444"])
    assert (ok, score, numbers) == (False, pytest.approx(2 / 3), ["1111111", "2222222", "3333333"])
    assert score_answer("multivalue", "2222222 1111111", ["1111111", "2222222"])[:2] == (True, 1.0)


def test_the_decoding_stops_once_the_numbers_are_written():
    assert needle.scoring.complete_numbers(" 1234567") == 0
    assert needle.scoring.complete_numbers(" 1234567.") == 1
    assert needle.scoring.complete_numbers(" 1,234,567 and 7") == 1
    assert needle.scoring.complete_numbers(" 1234567, 7654321.") == 2


def test_bad_arguments_are_refused_with_the_fix(char_tokenizer):
    with pytest.raises(ValueError, match=r"depth 1.5 is outside \[0, 1\]"):
        make_trials(char_tokenizer, TEXT.content, depths=(1.5,), lengths=(600,))
    with pytest.raises(ValueError, match=r"beyond the model's max_position_embeddings 1024.*up to 1024"):
        make_trials(char_tokenizer, TEXT.content, lengths=(600, 2048), max_positions=1024)
    with pytest.raises(ValueError, match="unknown task 'needles': choose from single, multikey, multivalue"):
        make_trials(char_tokenizer, TEXT.content, task="needles")
    with pytest.raises(ValueError, match=r"length 300 leaves no room for a haystack.*at least"):
        make_trials(char_tokenizer, TEXT.content, lengths=(300,))
    with pytest.raises(ValueError, match="--samples must be at least 1"):
        make_trials(char_tokenizer, TEXT.content, samples=0)
    with pytest.raises(ValueError, match="--prompt chat: this model's tokenizer has no chat template"):
        make_trials(char_tokenizer, TEXT.content, prompt="chat")
    with pytest.raises(ValueError, match="no sentences"):
        make_trials(char_tokenizer, "1234 5678 ...", lengths=(600,))
    assert parse_lengths("2048, 1024,8k,1024") == (1024, 2048, 8192)
    assert parse_depths("1,0,0.5") == (0.0, 0.5, 1.0)
    with pytest.raises(ValueError, match="'-5' is not a positive number of tokens"):
        parse_lengths("1024,-5")
    with pytest.raises(ValueError, match=r"'1.2' is not a depth in \[0, 1\]"):
        parse_depths("0,1.2")
    with pytest.raises(ValueError, match=r"'half' is not a depth"):
        parse_depths("half")


# ---------------------------------------------------------------------------------------------------------
# Running and summarising
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"prefill": "lazy"}, "prefill must be one of quantized, exact, got 'lazy'"),
        ({"prefill_chunk": 0}, "--prefill-chunk must be at least 1 token, got 0"),
        ({"min_baseline": 80}, r"--min-baseline must be a share in \[0, 1\]"),
        ({"residual": -1}, "--residual must be at least 0 tokens"),
        ({"codecs": "int4"}, r"codecs is a list of cache specs: give \['int4'\], not 'int4'"),
        ({"codecs": ["int4", "int4"]}, "each --codec once"),
        ({"codecs": ["uncompressed"]}, "unknown codec 'uncompressed'"),
        ({"codecs": ["int9"]}, "unknown codec"),
    ],
)
def test_a_needle_config_refuses_bad_settings_naming_the_allowed_values(settings, message):
    with pytest.raises(ValueError, match=message):
        NeedleConfig(**settings)


def test_a_needle_config_holds_its_specs_parsed():
    config = NeedleConfig(["int4", "q4_0"], prefill_chunk=64)
    assert config.codecs == ("int4", "q4_0") and [s.spec for s in config.specs] == ["int4", "q4_0"]
    assert [name for name, _ in config.caches] == [BASELINE, "int4", "q4_0"] and config.caches[0][1] is None
    assert NeedleConfig().codecs == needle.DEFAULT_NEEDLE_CODECS and NeedleConfig(()).specs == ()


def test_run_needle_refuses_no_trials(tiny_lm):
    with pytest.raises(ValueError, match="no trials"):
        run_needle(tiny_lm, TEXT, [], NeedleConfig(["int4"]))


def test_run_on_a_tiny_model(tiny_lm):
    trials = make_trials(tiny_lm.tokenizer, TEXT.content, lengths=(500, 700), depths=(0.5,), samples=1, new_tokens=4)
    res = run_needle(
        tiny_lm, TEXT, trials, NeedleConfig(["int4", "q4_0"], prefill_chunk=128, progress=False), command="test"
    )
    assert [r["codec"] for r in res.trials[:3]] == [BASELINE, "int4", "q4_0"]  # the reference first, per trial
    assert len(res.trials) == 3 * 2 and len(res.cells) == 3 * 2 and len(res.summary) == 3 * 2
    for r in res.trials:
        assert 1 <= r["generated_tokens"] <= 4 and r["prompt_tokens"] <= r["length"] - 4
        assert r["correct"] is False  # a random model finds nothing
    meta = res.meta
    assert meta["codecs"][BASELINE]["bits_per_element"] == 32.0
    assert meta["codecs"]["int4"]["bits_per_element"] == pytest.approx(4 + 16 / 32)
    assert meta["codecs"]["int4"]["quantize_on_write"] is True and meta["codecs"]["int4"]["measured_at_length"] == 700
    assert meta["prefill"] == "quantized" and meta["prompt"] == "chat" and meta["command"] == "test"
    assert meta["versions"]["commit"] and meta["cpu"]["model"] and "80%" in meta["threshold_note"]
    assert all(not c["measurable"] for c in res.cells)  # the reference fails: nothing is reported
    assert all(s["measured_accuracy"] is None and s["flagged_depths"] == [0.5] for s in res.summary)
    table = needle.format_needle_table(res, "single")
    assert "n/a ⚑1" in table and "n/a" in table
    assert "L=500 at depth 0.5 (0%, 0 of 1)" in needle.flag_note(res, "single")
    exact = run_needle(
        tiny_lm, TEXT, trials[:1], NeedleConfig(["int4"], prefill="exact", prefill_chunk=128, progress=False)
    )
    assert exact.meta["codecs"]["int4"]["quantize_on_write"] is False and "exact" in exact.meta["prefill_note"]


def test_the_same_answers_in_one_chunk_or_many(tiny_lm):
    trials = make_trials(tiny_lm.tokenizer, TEXT.content, lengths=(600,), depths=(0.5,), samples=1, new_tokens=6)
    one = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int8"], prefill_chunk=1024, progress=False))
    many = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int8"], prefill_chunk=100, progress=False))
    assert [r["output"] for r in one.trials] == [r["output"] for r in many.trials]


def test_depths_reuse_the_haystack_they_share(tiny_lm):
    trials = make_trials(
        tiny_lm.tokenizer, TEXT.content, lengths=(600,), depths=(0.0, 0.5, 1.0), samples=1, new_tokens=5
    )
    shared = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int4"], prefill_chunk=64, progress=False))
    fresh = run_needle(
        tiny_lm, TEXT, trials, NeedleConfig(["int4"], prefill_chunk=64, share_prefix=False, progress=False)
    )
    assert [r["output"] for r in shared.trials] == [r["output"] for r in fresh.trials]
    reused = {(r["codec"], r["depth"]): r["reused_tokens"] for r in shared.trials}
    assert reused[(BASELINE, 1.0)] == reused[("int4", 1.0)] == 0  # the deepest needle first, from an empty cache
    # up to the needle (and the space before it) of the trial that comes next
    assert (
        0 < reused[("int4", 0.5)] <= trials[1].needle_token + 1 and reused[("int4", 0.0)] <= trials[0].needle_token + 1
    )
    assert all(r["reused_tokens"] == 0 for r in fresh.trials)
    kivi = run_needle(tiny_lm, TEXT, trials[:2], NeedleConfig(["kivi4:g=8:r=8"], prefill_chunk=64, progress=False))
    assert all(r["reused_tokens"] == 0 for r in kivi.trials if r["codec"] != BASELINE)  # KIVI cannot be cropped


def test_fused_attention_gives_the_same_answers_and_is_undone(tiny_lm):
    trials = make_trials(tiny_lm.tokenizer, TEXT.content, lengths=(600,), depths=(0.0, 1.0), samples=1, new_tokens=5)
    plain = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int4"], prefill_chunk=128, progress=False))
    fused = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int4"], prefill_chunk=128, fused=True, progress=False))
    assert [r["output"] for r in fused.trials] == [r["output"] for r in plain.trials]
    assert fused.meta["fused"] is True and tiny_lm.model.config._attn_implementation == "sdpa"


def _row(codec: str, length: int, depth: float, sample: int, correct: bool) -> dict:
    return {
        "task": "single",
        "codec": codec,
        "length": length,
        "depth": depth,
        "sample": sample,
        "correct": correct,
        "score": float(correct),
        "prefill_seconds": 1.0,
        "decode_seconds": 0.5,
    }


def test_summaries_report_losses_only_where_the_reference_succeeds():
    rows = []
    for s in range(5):  # L=1000: the reference finds every needle at both depths; L=2000: only at depth 1
        for depth in (0.0, 1.0):
            rows.append(_row(BASELINE, 1000, depth, s, True))
            rows.append(_row("int2", 1000, depth, s, not (depth == 0.0 and s < 2)))  # loses 2 at depth 0
            rows.append(_row(BASELINE, 2000, depth, s, depth == 1.0 or s == 0))  # 1 of 5 at depth 0: flagged
            rows.append(_row("int2", 2000, depth, s, depth == 0.0))  # right only where the reference fails
    ok = needle.measurable_cells(rows, 0.8)
    assert ok == {("single", 1000, 0.0): True, ("single", 1000, 1.0): True, ("single", 2000, 0.0): False,
                  ("single", 2000, 1.0): True}  # fmt: skip
    summary = {(r["codec"], r["length"]): r for r in needle.summary_rows(rows, 0.8)}
    low = summary[("int2", 1000)]
    assert low["accuracy"] == low["measured_accuracy"] == 0.8 and low["retained"] == 0.8 and low["lost"] == 2
    assert low["flagged_depths"] == [] and low["seconds_per_trial"] == 1.5 and low["baseline_accuracy"] == 1.0
    far = summary[("int2", 2000)]
    assert far["flagged_depths"] == [0.0] and far["measured_trials"] == 5 and far["measured_accuracy"] == 0.0
    assert far["accuracy"] == 0.5 and far["gained"] == 0 and far["lost"] == 5  # depth 0 is not counted
    assert summary[(BASELINE, 2000)]["baseline_accuracy"] == 0.6 and summary[(BASELINE, 2000)]["measured_accuracy"] == 1
    overall = {o["codec"]: o for o in needle.overall_rows(rows, 0.8)}
    assert overall["int2"]["cells"] == 4 and overall["int2"]["flagged_cells"] == 1
    assert overall["int2"]["measured_trials"] == 15 and overall["int2"]["measured_accuracy"] == pytest.approx(8 / 15)
    assert needle.measurable_cells(rows, 0.1) != ok  # a lower threshold admits L=2000 at depth 0
    cells = {(c["codec"], c["length"], c["depth"]): c for c in needle.cell_rows(rows, 0.8)}
    assert cells[("int2", 2000, 0.0)]["correct"] == 5 and not cells[("int2", 2000, 0.0)]["measurable"]
    assert cells[("int2", 2000, 0.0)]["baseline_accuracy"] == 0.2


# ---------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "prose.txt"
    path.write_text(TEXT.content)
    return path


def test_the_command_writes_every_file(tiny_lm, text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    out = {ext: tmp_path / f"n.{ext}" for ext in ("json", "csv", "md", "png")}
    argv = ["needle", "--text", str(text_file), "--lengths", "500,700", "--depths", "0,1", "--samples", "1"]
    argv += ["--codec", "rot+int4", "--task", "single", "--task", "multikey", "--keys", "2", "--new-tokens", "3"]
    argv += [
        "--json",
        str(out["json"]),
        "--csv",
        str(out["csv"]),
        "--markdown",
        str(out["md"]),
        "--png",
        str(out["png"]),
    ]
    assert main([*argv, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "single:" in printed and "multikey:" in printed and "uncompressed" in printed and "rot+int4" in printed
    payload = json.loads(out["json"].read_text())
    assert set(payload) == {"meta", "overall", "summary", "cells", "trials"}
    assert payload["meta"]["tasks"] == ["single", "multikey"] and payload["meta"]["lengths"] == [500, 700]
    assert payload["meta"]["command"].startswith("walshkv needle --text") and payload["meta"]["seed"] == 0
    assert payload["meta"]["needles_per_trial"] == {"single": 1, "multikey": 2}
    assert all(len(c["accuracy_ci95"]) == 2 for c in payload["cells"]) and "Wilson" in payload["meta"]["intervals"]
    assert all("difference_ci95" in o and "mcnemar_p" in o for o in payload["overall"])
    assert len(payload["trials"]) == 2 * 2 * 2 * 2  # tasks x lengths x depths x (reference + 1 codec)
    with open(out["csv"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * 2 * 2 * 2 and list(rows[0]) == list(needle.CSV_KEYS)
    md = out["md"].read_text()
    assert (
        "## single" in md
        and "## multikey" in md
        and "below 80% there: L=500 at depth 0 (0%, 0 of 1), 1 (0%, 0 of 1)" in md
    )
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--depths", "0,1.5"], "'1.5' is not a depth in [0, 1]"),
        (["--lengths", "1024,4096"], "beyond the model's max_position_embeddings 1024"),
        (["--lengths", "1k,x"], "'x' is not a positive number of tokens"),
        (["--codec", "int9"], "unknown codec"),
        (["--min-baseline", "80"], "--min-baseline must be a share in [0, 1]"),
        (["--codec", "walshkv:3.5"], "--kv-mean-center"),
    ],
)
def test_the_command_refuses_bad_arguments(extra, message, tiny_lm, text_file, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    assert main(["needle", "--text", str(text_file), "--lengths", "600", *extra, "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("walshkv needle: error:") and message in err


def test_an_unknown_task_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["needle", "--task", "haystack"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --task: invalid choice: 'haystack'" in err and "multivalue" in err


# ---------------------------------------------------------------------------------------------------------
# Runs added together (--add-to)
# ---------------------------------------------------------------------------------------------------------


def test_two_runs_added_together_equal_one_run_of_both(tiny_lm):
    trials = make_trials(tiny_lm.tokenizer, TEXT.content, lengths=(500, 700), depths=(0.0, 1.0), samples=1)
    whole = run_needle(tiny_lm, TEXT, trials, NeedleConfig(["int4"], prefill_chunk=128, progress=False))
    short = [t for t in trials if t.length == 500]
    long = [t for t in trials if t.length == 700 and t.depth == 1.0]  # one depth at the longer length
    first = run_needle(tiny_lm, TEXT, short, NeedleConfig(["int4"], prefill_chunk=128, progress=False), command="run 1")
    second = run_needle(tiny_lm, TEXT, long, NeedleConfig(["int4"], prefill_chunk=128, progress=False), command="run 2")
    merged = needle.merge_needle_results(first, second)
    same = {(r["codec"], r["length"], r["depth"]): r["output"] for r in whole.trials}
    assert {(r["codec"], r["length"], r["depth"]): r["output"] for r in merged.trials} == {
        k: v for k, v in same.items() if k[1] == 500 or k[2] == 1.0
    }
    assert [r["codec"] for r in merged.trials[:2]] == [BASELINE, "int4"]  # the reference first, per trial
    meta = merged.meta
    assert meta["lengths"] == [500, 700] and meta["depths"] == [0.0, 1.0] and meta["trials"] == 3
    assert [r["command"] for r in meta["runs"]] == ["run 1", "run 2"] and meta["command"] is None
    assert meta["codecs"]["int4"]["measured_at_length"] == 700
    cells = {(c["length"], c["depth"]) for c in merged.cells if c["codec"] == "int4"}
    assert cells == {(500, 0.0), (500, 1.0), (700, 1.0)}
    assert "2 runs added together" in needle.describe_needle(meta)
    md = needle.needle_markdown(merged)
    assert "Run 1 (code " in md and "`run 2`" in md
    rest = [t for t in trials if t.length == 700 and t.depth == 0.0]
    third = run_needle(tiny_lm, TEXT, rest, NeedleConfig(["int4"], prefill_chunk=128, progress=False))
    again = needle.merge_needle_results(merged, third)
    assert len(again.meta["runs"]) == 3  # runs accumulate


def test_runs_that_do_not_fit_together_are_refused(tiny_lm):
    trials = make_trials(tiny_lm.tokenizer, TEXT.content, lengths=(500,), depths=(0.0, 1.0), samples=1)
    first = run_needle(tiny_lm, TEXT, trials[:1], NeedleConfig(["int4"], prefill_chunk=128, progress=False))
    with pytest.raises(ValueError, match=r"the runs share 1 trial\(s\), e.g. single L=500 d=0 sample 0"):
        needle.merge_needle_results(first, first)
    other = run_needle(tiny_lm, TEXT, trials[1:], NeedleConfig(["int8"], prefill_chunk=128, progress=False))
    with pytest.raises(ValueError, match="same --codec list"):
        needle.merge_needle_results(first, other)
    chunked = run_needle(tiny_lm, TEXT, trials[1:], NeedleConfig(["int4"], prefill_chunk=64, progress=False))
    with pytest.raises(ValueError, match="prefill_chunk = 128"):
        needle.merge_needle_results(first, chunked)
    with pytest.raises(ValueError, match="this run is other-model on"):
        needle.check_can_add(first, model="other-model", text=TEXT.name, codecs=["int4"])


def test_the_command_adds_a_run_to_an_earlier_file(tiny_lm, text_file, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    base = ["needle", "--text", str(text_file), "--samples", "1", "--codec", "int4", "--new-tokens", "3", "--quiet"]
    first, both = tmp_path / "first.json", tmp_path / "both.json"
    assert main([*base, "--lengths", "500", "--depths", "0,1", "--json", str(first)]) == 0
    md, png = tmp_path / "both.md", tmp_path / "both.png"
    argv = [*base, "--lengths", "700", "--depths", "0.5", "--add-to", str(first), "--json", str(both)]
    assert main([*argv, "--markdown", str(md), "--png", str(png)]) == 0
    payload = json.loads(both.read_text())
    assert payload["meta"]["lengths"] == [500, 700] and len(payload["meta"]["runs"]) == 2
    assert len(payload["trials"]) == 3 * 2 and len(json.loads(first.read_text())["trials"]) == 2 * 2  # kept as it was
    assert "2 runs added together" in md.read_text() and png.read_bytes()[:4] == b"\x89PNG"
    capsys.readouterr()
    # refused before any trial runs: a repeated trial, a missing file, another --codec list
    assert main([*base, "--lengths", "500", "--depths", "1", "--add-to", str(first), "--json", str(both)]) == 2
    assert "already holds 1 of this run's trials (single L=500 d=1 sample 0)" in capsys.readouterr().err
    assert main([*base, "--lengths", "700", "--add-to", str(tmp_path / "none.json")]) == 2
    assert "none.json: no such file" in capsys.readouterr().err
    bad = [*base[:5], "--codec", "int8", *base[7:], "--lengths", "700", "--add-to", str(first)]
    assert main(bad) == 2
    assert "same --codec list" in capsys.readouterr().err
