"""``walshkv needle``: needle-in-a-haystack / passkey retrieval with a compressed cache, offline.

What a run measures: can the model still find a fact buried in a long context when that context's K/V went
through the cache under test? KL divergence (``walshkv eval``) says how far a codec moves the next-token
distribution; this says whether a long-range lookup survives it, the failure users see first.

The protocol (RULER's NIAH tasks on local text, https://github.com/NVIDIA/RULER):

1. A haystack: whole sentences of a local text (``python-docs`` or a UTF-8 file such as
   ``../shared/data/austen_emma.txt``), from a seeded start sentence, as many as fit the length.
2. Needles: ``"The special magic number for {key} is: {7 digits}."`` sentences with seeded keys
   (``adjective-noun``) and values, inserted between sentences. The queried needle sits at depth ``d``
   (0: before the first haystack sentence, 1: after the last); other needles at seeded random depths.
   Tasks (:data:`TASKS`): ``single`` (one needle), ``multikey`` (``keys`` needles with different keys, one
   asked for: the others are distractors), ``multivalue`` (``values`` needles with the same key, all asked for).
3. The prompt: an instruction, the haystack, the question, and the start of the answer
   (``"The special magic number for {key} mentioned in the provided text is"``), inside the model's chat
   template (the user turn, then the assistant turn begun with the answer) when its tokenizer has one
   (``prompt="auto"``), else as plain text. A trial of length ``L`` has a prompt of at most
   ``L - new_tokens`` tokens, so prompt and answer fit ``L`` positions.
4. Each cache reads the same prompt: the uncompressed reference first (transformers' ``DynamicCache`` at the
   model's dtype), then each codec (:func:`walshkv.cache.make_cache`: walshkv specs and presets, llama.cpp
   types, KIVI, TurboQuant, Hugging Face's ``hf-*``). The prompt is prefilled ``prefill_chunk`` tokens per
   forward (no ``[ctx, ctx]`` attention tensor), quantize-on-write by default (every token attention reads was
   compressed first, as in ``walshkv eval``; ``prefill="exact"`` is the serving-engine convention); then
   greedy decoding, one token per forward, for up to ``new_tokens`` tokens (stopping at EOS or once the
   numbers asked for are written).
5. Exact match: the first number of the answer must be the value (``single``, ``multikey``); for
   ``multivalue`` every value must be among the numbers written (``score`` is the share found).

Reported: a codec's accuracy only in the cells (task, length, depth) where the reference itself reaches
``min_baseline`` (default 80%), since a loss can only be measured where the model succeeds uncompressed; the
other cells are flagged (hatched in the heatmaps, named under the tables), never hidden from the files.
``retained`` is the share of the trials the reference got right that the codec got right too.

The depths of one (task, length, sample) share their haystack up to the first needle: each cache runs them
deepest needle first and keeps the tokens the previous prompt had in common (``cache.crop``), so a grid costs
about 30% less prefill (``share_prefix``; the codes are the same, every token being compressed on its own).

Every trial is a pure function of ``(seed, task, sample, length, depth)``, the text and the tokenizer
(:func:`make_trials`): the same command builds the same prompts.
"""

from __future__ import annotations

import json
import random
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

import torch
from tabulate import tabulate
from tqdm.auto import tqdm
from transformers import DynamicCache

from walshkv.cache import (
    CompressedCache,
    croppable_to_prefix,
    enable_fused_attention,
    footprint,
    make_cache,
)
from walshkv.codecs.kivi import KiviCodec
from walshkv.codecs.spec import CacheSpec, HFCacheSpec, parse_cache_spec
from walshkv.constants import Prefill
from walshkv.eval.report import agg_figure, calibration_meta, describe_model, run_meta, write_csv
from walshkv.fileio import save_figure_atomic, write_json_atomic, write_text_atomic

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "BASELINE",
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_NEEDLE_CODECS",
    "DEFAULT_SAMPLES",
    "MIN_BASELINE",
    "PROMPTS",
    "TASKS",
    "Needle",
    "NeedleResult",
    "Trial",
    "cell_rows",
    "check_can_add",
    "default_new_tokens",
    "describe_needle",
    "flag_note",
    "format_needle_table",
    "haystack_sentences",
    "load_needle_result",
    "make_trials",
    "measurable_cells",
    "merge_needle_results",
    "needle_markdown",
    "overall_rows",
    "parse_depths",
    "parse_lengths",
    "plot_heatmaps",
    "prompt_style",
    "run_needle",
    "score_answer",
    "summary_rows",
    "write_needle_outputs",
]

Task = Literal["single", "multikey", "multivalue"]
PromptStyle = Literal["auto", "chat", "plain"]

#: The tasks (RULER's niah_single, niah_multikey, niah_multivalue).
TASKS: tuple[Task, ...] = get_args(Task)
#: How the prompt is written: the model's chat template (``auto``: where its tokenizer has one) or plain text.
PROMPTS: tuple[PromptStyle, ...] = get_args(PromptStyle)
#: The name of the reference rows: the same model with transformers' uncompressed ``DynamicCache``.
BASELINE = "uncompressed"
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048, 4096)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
DEFAULT_SAMPLES = 3
DEFAULT_NEEDLE_CODECS: tuple[str, ...] = ("rot+int4", "q4_0")
#: The reference accuracy a (task, length) cell needs for a codec's loss there to be reported.
MIN_BASELINE = 0.8
#: Digits of a needle's value.
_DIGITS = 7

_ADJECTIVES = (
    "amber", "brave", "calm", "dusty", "eager", "fancy", "gentle", "hollow", "icy", "jolly", "keen", "lively",
    "mellow", "noble", "odd", "proud", "quiet", "rapid", "silent", "tidy", "upbeat", "vivid", "witty", "young",
    "zesty", "bitter", "curly", "damp", "early", "fuzzy", "golden", "humble",
)  # fmt: skip
_NOUNS = (
    "anchor", "badger", "candle", "dolphin", "engine", "falcon", "garden", "harbor", "island", "jacket", "kettle",
    "lantern", "meadow", "needle", "orchard", "pebble", "quarry", "river", "saddle", "tunnel", "umbrella", "valley",
    "walrus", "yacht", "zeppelin", "biscuit", "canyon", "drum", "feather", "glacier", "hammer", "igloo",
)  # fmt: skip

_INSTRUCTION = (
    "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the numbers afterwards."
)
_NEEDLE = {
    "one": "The special magic number for {key} is: {value}.",
    "many": "One of the special magic numbers for {key} is: {value}.",
}
_QUESTION = {
    "one": "What is the special magic number for {key} mentioned in the provided text?",
    "many": "What are all the special magic numbers for {key} mentioned in the provided text?",
}
_ANSWER = {
    "one": "The special magic number for {key} mentioned in the provided text is",
    "many": "The special magic numbers for {key} mentioned in the provided text are",
}
#: Sentences longer than this (characters) are left out of haystacks (code listings run together, tables).
_MAX_SENTENCE_CHARS = 600
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


# ---------------------------------------------------------------------------------------------------------
# Trials: haystacks, needles, prompts
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Needle:
    """One inserted fact: ``sentence`` says that ``key``'s number is ``value`` (7 digits)."""

    key: str
    value: str
    sentence: str


@dataclass(frozen=True)
class Trial:
    """One prompt of the benchmark and what a correct answer contains.

    Attributes:
        task: one of :data:`TASKS`.
        length: the context length ``L``: the prompt has at most ``L - new_tokens`` tokens.
        depth: where the queried needle was asked to sit, in ``[0, 1]`` of the haystack.
        sample: the sample index (its seed picks the keys, values and the haystack's start).
        ids: the prompt's token ids.
        key: the key the question asks for.
        answers: the values a correct answer gives (one, or every value for ``multivalue``).
        needles: every inserted needle, in prompt order.
        needle_token: index of the queried needle's first token in ``ids`` (approximately: tokenized as a prefix).
        haystack_tokens: tokens of the haystack sentences (sum of their own counts).
        haystack_start: index of the first haystack sentence in :func:`haystack_sentences` of the text.
        depth_actual: the queried needle's position in the haystack, as a share of its tokens.
        new_tokens: the most tokens generated for the answer.
        prompt: how the prompt was written: ``chat`` (the model's chat template) or ``plain``.
    """

    task: Task
    length: int
    depth: float
    sample: int
    ids: tuple[int, ...] = field(repr=False)
    key: str
    answers: tuple[str, ...]
    needles: tuple[Needle, ...]
    needle_token: int
    haystack_tokens: int
    haystack_start: int
    depth_actual: float
    new_tokens: int
    prompt: Literal["chat", "plain"] = "plain"

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)


def parse_lengths(text: str) -> tuple[int, ...]:
    """``"1024,2048,4k"`` -> ``(1024, 2048, 4096)``: sorted, duplicates dropped (``k`` is 1024).

    Raises:
        ValueError: an entry that is not a positive whole number of tokens.
    """
    out = set()
    for part in (p.strip() for p in text.split(",")):
        m = re.fullmatch(r"(\d+)([kK]?)", part)
        if not m or int(m.group(1)) < 1:
            raise ValueError(
                f"--lengths {text!r}: {part!r} is not a positive number of tokens; give a comma list such as "
                "1024,2048,4096 (a k suffix means 1024: 8k = 8192)"
            )
        out.add(int(m.group(1)) * (1024 if m.group(2) else 1))
    return tuple(sorted(out))


def parse_depths(text: str) -> tuple[float, ...]:
    """``"0,0.5,1"`` -> ``(0.0, 0.5, 1.0)``: sorted, duplicates dropped; each depth in ``[0, 1]``.

    Raises:
        ValueError: an entry that is not a number in ``[0, 1]``.
    """
    out = set()
    for part in (p.strip() for p in text.split(",")):
        try:
            d = float(part)
        except ValueError:
            d = float("nan")
        if not 0.0 <= d <= 1.0:
            raise ValueError(
                f"--depths {text!r}: {part!r} is not a depth in [0, 1] (0: the needle before the haystack, 1: after "
                "it); give a comma list such as 0,0.25,0.5,0.75,1"
            )
        out.add(d)
    return tuple(sorted(out))


def default_new_tokens(task: Task, values: int = 4) -> int:
    """The greedy-decoding budget of a task: 12 tokens per number asked for (7 digits, separators, EOS)."""
    return 12 * (values if task == "multivalue" else 1)


def haystack_sentences(text: str) -> list[str]:
    """The sentences of ``text`` haystacks are built from: whitespace folded, split after ``.``, ``!`` or ``?``.

    Sentences longer than 600 characters (code listings, tables run together) and those without a letter are
    left out.
    """
    out = []
    for s in _SENTENCE_END.split(" ".join(text.split())):
        if s and len(s) <= _MAX_SENTENCE_CHARS and any(c.isalpha() for c in s):
            out.append(s)
    return out


def _has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None)) and hasattr(tokenizer, "apply_chat_template")


def prompt_style(tokenizer: Any, prompt: PromptStyle = "auto") -> Literal["chat", "plain"]:
    """The style a prompt is written in: ``auto`` is ``chat`` where the tokenizer has a chat template, else ``plain``.

    Raises:
        ValueError: an unknown style, or ``chat`` for a tokenizer without a template.
    """
    if prompt not in PROMPTS:
        raise ValueError(f"prompt must be one of {', '.join(PROMPTS)}, got {prompt!r}")
    if prompt == "chat" and not _has_chat_template(tokenizer):
        raise ValueError(
            "--prompt chat: this model's tokenizer has no chat template; use --prompt plain (or auto, which picks "
            "plain for it)"
        )
    if prompt == "auto":
        return "chat" if _has_chat_template(tokenizer) else "plain"
    return prompt


def _wrap(tokenizer: Any, style: Literal["chat", "plain"], body: str, question: str, answer: str) -> str:
    """The prompt text around a haystack ``body``."""
    user = f"{_INSTRUCTION}\n{body}\n{question}"
    if style == "chat":
        head = tokenizer.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        return f"{head}{answer}"
    return f"{user} {answer}"


def _encode(tokenizer: Any, style: Literal["chat", "plain"], text: str) -> list[int]:
    """Token ids of a prompt: a chat template writes its own special tokens; plain text gets the tokenizer's."""
    return list(tokenizer(text, add_special_tokens=style == "plain")["input_ids"])


def _pick_needles(rng: random.Random, task: Task, keys: int, values: int) -> list[Needle]:
    """The needles of one sample, the queried one first: ``keys`` distinct keys (``multikey``), ``values`` values of
    one key (``multivalue``) or one needle; each value a distinct 7-digit number."""
    kind = "many" if task == "multivalue" else "one"
    pairs = rng.sample([(a, n) for a in _ADJECTIVES for n in _NOUNS], keys if task == "multikey" else 1)
    names = [f"{a}-{n}" for a, n in pairs]
    numbers = [
        str(v)
        for v in rng.sample(range(10 ** (_DIGITS - 1), 10**_DIGITS), values if task == "multivalue" else len(names))
    ]
    if task == "multivalue":
        names = names * values
    return [Needle(k, v, _NEEDLE[kind].format(key=k, value=v)) for k, v in zip(names, numbers, strict=True)]


def make_trials(
    tokenizer: Any,
    text: str,
    *,
    task: Task = "single",
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
    samples: int = DEFAULT_SAMPLES,
    seed: int = 0,
    prompt: PromptStyle = "auto",
    new_tokens: int | None = None,
    keys: int = 4,
    values: int = 4,
    max_positions: int | None = None,
) -> list[Trial]:
    """The trials of one task: every (length, depth, sample), lengths outermost.

    A sample's keys, values and haystack start come from ``random.Random(f"walshkv-needle:{seed}:{task}:{sample}")``
    (the same at every length and depth, so a cell differs from its neighbours by length or depth only);
    the other needles' depths from one more seeded generator per (sample, length, depth).

    Args:
        tokenizer: the model's tokenizer (``apply_chat_template`` is used for ``prompt="chat"``).
        text: the haystack's source text (its sentences, :func:`haystack_sentences`, repeat if it is short).
        task: one of :data:`TASKS`.
        lengths: context lengths ``L`` (prompt of at most ``L - new_tokens`` tokens).
        depths: the queried needle's depths, each in ``[0, 1]``.
        samples: trials per (length, depth).
        seed: the base seed.
        prompt: ``auto`` (the chat template where the tokenizer has one), ``chat`` or ``plain``.
        new_tokens: the answer's budget (default :func:`default_new_tokens`).
        keys: needles of a ``multikey`` trial (one asked for, the rest distractors).
        values: needles (values of one key) of a ``multivalue`` trial.
        max_positions: the model's ``max_position_embeddings``: a length above it is refused.

    Returns:
        ``len(lengths) * len(depths) * samples`` trials.

    Raises:
        ValueError: an unknown task or prompt style, a depth outside ``[0, 1]``, a length beyond
            ``max_positions`` or too short for the prompt, fewer than 1 sample, a text without sentences.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}: choose from {', '.join(TASKS)}")
    style = prompt_style(tokenizer, prompt)
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples}")
    if keys < 2 or values < 2:
        raise ValueError(f"--keys and --values must be at least 2 (needles per trial), got {keys} and {values}")
    new_tokens = default_new_tokens(task, values) if new_tokens is None else new_tokens
    if new_tokens < 1:
        raise ValueError(f"--new-tokens must be at least 1, got {new_tokens}")
    if not lengths:
        raise ValueError("give at least one length (--lengths 1024,2048)")
    if not depths:
        raise ValueError("give at least one depth (--depths 0,0.5,1)")
    for d in depths:
        if not 0.0 <= d <= 1.0:
            raise ValueError(f"depth {d} is outside [0, 1] (0: the needle before the haystack, 1: after it)")
    for length in lengths:
        if max_positions is not None and length > max_positions:
            raise ValueError(
                f"length {length} is beyond the model's max_position_embeddings {max_positions} (prompt and answer "
                f"must fit its positions): use --lengths up to {max_positions}"
            )
    sentences = haystack_sentences(text)
    if not sentences:
        raise ValueError("the haystack text has no sentences (need text with letters, cut after . ! or ?)")
    counts: dict[int, int] = {}

    def count(i: int) -> int:  # tokens of sentence i (with its leading space), cached
        j = i % len(sentences)
        if j not in counts:
            counts[j] = len(tokenizer(" " + sentences[j], add_special_tokens=False)["input_ids"])
        return counts[j]

    trials = []
    for length in lengths:
        for depth in depths:
            for sample in range(samples):
                rng = random.Random(f"walshkv-needle:{seed}:{task}:{sample}")
                needles = _pick_needles(rng, task, keys, values)
                start = rng.randrange(len(sentences))
                place = random.Random(f"walshkv-needle:{seed}:{task}:{sample}:{length}:{depth!r}")
                spots = [depth, *(place.random() for _ in needles[1:])]
                trials.append(
                    _trial(tokenizer, style, sentences, count, task, length, sample, start, new_tokens, needles, spots)
                )
    return trials


def _trial(
    tokenizer: Any,
    style: Literal["chat", "plain"],
    sentences: Sequence[str],
    count: Callable[[int], int],
    task: Task,
    length: int,
    sample: int,
    start: int,
    new_tokens: int,
    needles: Sequence[Needle],
    spots: Sequence[float],
) -> Trial:
    """One trial: the haystack from sentence ``start`` on, the needles at depths ``spots`` (the queried one first)."""
    kind = "many" if task == "multivalue" else "one"
    key = needles[0].key
    question, answer = _QUESTION[kind].format(key=key), _ANSWER[kind].format(key=key)
    limit = length - new_tokens
    bare = len(
        _encode(tokenizer, style, _wrap(tokenizer, style, " ".join(n.sentence for n in needles), question, answer))
    )
    budget = limit - bare
    chosen: list[int] = []
    total = 0
    i = start
    while budget > 0:
        c = count(i)
        if total + c > budget:
            break
        chosen.append(c)
        total += c
        i += 1
    while True:
        if not chosen:
            raise ValueError(
                f"length {length} leaves no room for a haystack: the prompt without one takes {bare} tokens and the "
                f"answer {new_tokens} (--new-tokens); use lengths of at least {bare + new_tokens + 64}"
            )
        cum = [0]
        for c in chosen:
            cum.append(cum[-1] + c)
        total = cum[-1]
        # each needle goes to the sentence boundary nearest its depth (ties: the earlier boundary)
        at = [min(range(len(cum)), key=lambda b, d=d: abs(cum[b] - d * total)) for d in spots]
        pieces: list[str] = []
        for b in range(len(chosen) + 1):
            pieces.extend(n.sentence for n, where in zip(needles, at, strict=True) if where == b)
            if b < len(chosen):
                pieces.append(sentences[(start + b) % len(sentences)])
        text = _wrap(tokenizer, style, " ".join(pieces), question, answer)
        ids = _encode(tokenizer, style, text)
        if len(ids) <= limit:
            break
        chosen.pop()  # the joined text took more tokens than its sentences alone: one sentence fewer
    first = text.index(needles[0].sentence)
    order = sorted(range(len(needles)), key=lambda j: (at[j], j))
    return Trial(
        task=task,
        length=length,
        depth=spots[0],
        sample=sample,
        ids=tuple(ids),
        key=key,
        answers=tuple(n.value for n in needles) if task == "multivalue" else (needles[0].value,),
        needles=tuple(needles[j] for j in order),
        needle_token=len(_encode(tokenizer, style, text[:first].rstrip())),
        haystack_tokens=total,
        haystack_start=start % len(sentences),
        depth_actual=cum[at[0]] / total,
        new_tokens=new_tokens,
        prompt=style,
    )


# ---------------------------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------------------------


def _numbers(text: str) -> list[str]:
    """The whole numbers of an answer, in order (thousands separators ``1,234,567`` dropped)."""
    return re.findall(r"\d+", re.sub(r"(?<=\d),(?=\d{3})", "", text))


def score_answer(task: Task, output: str, answers: Sequence[str]) -> tuple[bool, float, list[str]]:
    """Exact match of the generated answer.

    Args:
        task: one of :data:`TASKS`.
        output: the decoded answer (the text after the prompt).
        answers: the expected values.

    Returns:
        ``(correct, score, numbers)``: ``single``/``multikey``: correct when the answer's first number is the
        value (score 1 or 0); ``multivalue``: score is the share of the values among the answer's numbers, correct
        when it is 1. ``numbers`` are the answer's numbers.
    """
    numbers = _numbers(output)
    if task == "multivalue":
        found = len(set(answers) & set(numbers)) / len(answers)
        return found == 1.0, found, numbers
    ok = bool(numbers) and numbers[0] == answers[0]
    return ok, float(ok), numbers


def _complete_numbers(text: str) -> int:
    """Numbers the answer has finished writing (a digit run followed by something else)."""
    return len(re.findall(r"\d(?=[^\d,])|\d,(?!\d)", text))


# ---------------------------------------------------------------------------------------------------------
# Running: prefill in chunks, greedy decoding, every cache on the same prompts
# ---------------------------------------------------------------------------------------------------------


@dataclass
class NeedleResult:
    """``meta`` describes the run; ``trials`` one row per (trial, cache); ``cells`` per (task, cache, length,
    depth); ``summary`` per (task, cache, length); ``overall`` per (task, cache) over the measurable lengths."""

    meta: dict[str, Any]
    trials: list[dict[str, Any]]
    cells: list[dict[str, Any]]
    summary: list[dict[str, Any]]
    overall: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "overall": self.overall,
            "summary": self.summary,
            "cells": self.cells,
            "trials": self.trials,
        }


def _stop_ids(lm: LoadedModel) -> set[int]:
    """End-of-sequence token ids: the tokenizer's and the generation config's."""
    ids: set[int] = set()
    for source in (
        getattr(lm.tokenizer, "eos_token_id", None),
        getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None),
    ):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list | tuple):
            ids.update(int(t) for t in source)
    return ids


def _generate(
    lm: LoadedModel, trial: Trial, cache: Any, chunk: int, stop: set[int], need: int, reuse: int = 0
) -> tuple[list[int], float, float]:
    """Prefill ``trial.ids[reuse:]`` ``chunk`` tokens per forward (the cache holds the first ``reuse``), then decode
    greedily.

    Returns:
        ``(generated ids, prefill seconds, decode seconds)``; decoding stops at an end-of-sequence token,
        after ``trial.new_tokens`` tokens, or once ``need`` numbers are written.
    """
    model = lm.model
    device = next(model.parameters()).device
    ids = torch.tensor([trial.ids], dtype=torch.long, device=device)
    t0 = time.perf_counter()
    out = None
    for s in range(reuse, ids.shape[1], chunk):
        out = model(input_ids=ids[:, s : s + chunk], cache=cache, use_cache=True, logits_to_keep=1)
    assert out is not None
    t1 = time.perf_counter()
    token = out.logits[0, -1].argmax()
    generated: list[int] = []
    while True:
        generated.append(int(token))
        if generated[-1] in stop or len(generated) >= trial.new_tokens:
            break
        if _complete_numbers(lm.tokenizer.decode(generated, skip_special_tokens=True)) >= need:
            break
        out = model(input_ids=token.view(1, 1), cache=cache, use_cache=True)
        token = out.logits[0, -1].argmax()
    return generated, t1 - t0, time.perf_counter() - t1


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _share_groups(trials: Sequence[Trial]) -> list[list[int]]:
    """Trial indices grouped by (task, length, sample), deepest needle first: consecutive prompts then share the
    haystack up to the next needle."""
    groups: dict[tuple[str, int, int], list[int]] = {}
    for i, t in enumerate(trials):
        groups.setdefault((t.task, t.length, t.sample), []).append(i)
    return [sorted(g, key=lambda i: -trials[i].depth) for g in groups.values()]


def _cache_bits(cache: Any, spec: CacheSpec | HFCacheSpec | None, dtype: torch.dtype) -> dict[str, float | int]:
    """Bits per K/V element and bytes a cache held after a trial (the reference: its float dtype)."""
    held = footprint(cache, dtype=dtype if spec is None else None)
    return {"bits_per_element": held.bits_per_element, "kv_bytes": held.kv_bytes}


def _quantize_on_write(spec: CacheSpec | HFCacheSpec | None, prefill: Prefill) -> bool | None:
    """Whether every token attention read was compressed first (``None`` for the reference)."""
    if spec is None:
        return None
    if isinstance(spec, HFCacheSpec) or isinstance(spec.k, KiviCodec):
        return False
    return prefill == "quantized"


@torch.inference_mode()
def run_needle(
    lm: LoadedModel,
    text: Text,
    trials: Sequence[Trial],
    codecs: Sequence[str] = DEFAULT_NEEDLE_CODECS,
    *,
    calibration: CalibrationLike | None = None,
    prefill: Prefill = "quantized",
    residual: int = 0,
    prefill_chunk: int = 1024,
    fused: bool = False,
    share_prefix: bool = True,
    min_baseline: float = MIN_BASELINE,
    presets: Mapping[str, str] | None = None,
    progress: bool = True,
    **meta_fields: Any,
) -> NeedleResult:
    """Run every trial with the uncompressed reference and with each codec; score; summarise.

    Args:
        lm: the loaded model.
        text: the haystack text the trials were made from (recorded in the meta).
        trials: from :func:`make_trials` (one or more tasks).
        codecs: cache specs (presets resolved already: see :func:`walshkv.presets.resolve_specs`); may be empty
            (the reference alone, to check that the model succeeds before measuring codecs).
        calibration: what calibrated specs need (from other text than ``text``).
        prefill: ``"quantized"`` (quantize on write, walshkv's convention) or ``"exact"`` (the prompt's chunks
            attend to their own exact K/V, stored compressed: the serving-engine convention).
        residual: full-precision window of recent tokens for walshkv codecs (0: every token compressed).
        prefill_chunk: prompt tokens per forward.
        fused: attention reads walshkv's packed codes directly (:func:`walshkv.cache.enable_fused_attention`; the
            model's attention implementation is restored afterwards): same quantization, faster decoding.
        share_prefix: the trials of one (task, length, sample) differ only from their first needle on, so each
            cache, run over them deepest needle first, keeps the prompt tokens the previous trial had in common
            (``cache.crop``) and prefills the rest: the same codes (every token is compressed on its own), so the
            same answers up to float rounding, for less work. Caches that cannot be cropped to what a fresh one
            holds (KIVI, ``hf-*``, sliding windows, ``residual``) always start empty. ``reused_tokens`` in the rows.
        min_baseline: the reference accuracy a (task, length) needs for the codecs' numbers there to count.
        presets: ``{spec: preset name}`` for rows of specs that stand for presets.
        progress: show a progress bar.
        **meta_fields: more entries for the meta (the command line, the trials' settings).

    Returns:
        A :class:`NeedleResult`.

    Raises:
        ValueError: a spec that does not parse or fit the model, calibration missing or made on ``text``, bad
            ``prefill``, ``prefill_chunk`` or ``min_baseline``, no trials.
    """
    if not trials:
        raise ValueError("no trials: give at least one task, length, depth and sample")
    if prefill not in get_args(Prefill):
        raise ValueError(f"prefill must be one of {', '.join(get_args(Prefill))}, got {prefill!r}")
    if prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1 token, got {prefill_chunk}")
    if not 0.0 <= min_baseline <= 1.0:
        raise ValueError(f"--min-baseline must be a share in [0, 1] (0.8 = 80%), got {min_baseline}")
    if residual < 0:
        raise ValueError(f"--residual must be at least 0 tokens, got {residual}")
    specs = [parse_cache_spec(c) for c in codecs]
    names = [s.spec for s in specs]
    if len(set(names)) != len(names) or BASELINE in names:
        raise ValueError(f"each --codec once, and not {BASELINE!r} (the reference runs anyway): got {', '.join(names)}")
    model = lm.model
    for spec in specs:
        spec.check_head_dim(lm.shape.head_dim)
        if spec.needs_calibration and calibration is None:
            spec.bind(0, None)  # raises, naming --calib-text / --kv-mean-center
    sources = (calibration, getattr(calibration, "stats", None), getattr(calibration, "bias", None))
    if calibration is not None and text.name in {getattr(c, "text", None) for c in sources if c is not None}:
        raise ValueError(f"calibration text and haystack text are both {text.name!r}; calibrate on other text")
    base_impl = model.config._attn_implementation
    if fused:
        enable_fused_attention(model)

    def build(spec: CacheSpec | HFCacheSpec | None) -> Any:
        if spec is None:
            return DynamicCache(config=model.config)
        if isinstance(spec, HFCacheSpec):
            return make_cache(spec, model.config)
        return CompressedCache(
            spec, config=model.config, residual=residual, calibration=calibration, fused=fused, prefill=prefill
        )

    try:
        for spec in specs:  # bind every codec once now: calibration mismatches fail before any forward
            build(spec)
        stop = _stop_ids(lm)
        dtype = next(model.parameters()).dtype
        caches: list[tuple[str, CacheSpec | HFCacheSpec | None]] = [(BASELINE, None), *zip(names, specs, strict=True)]
        sizes: dict[str, tuple[int, dict[str, float | int]]] = {}
        started = time.perf_counter()
        bar = tqdm(total=len(trials) * len(caches), desc="needle", unit="trial", disable=not progress)
        done: dict[tuple[int, int], dict[str, Any]] = {}
        for group in _share_groups(trials) if share_prefix else [[i] for i in range(len(trials))]:
            for c, (name, spec) in enumerate(caches):
                cache, previous = None, ()
                for i in group:
                    trial = trials[i]
                    bar.set_postfix_str(f"{trial.task} L={trial.length} d={trial.depth:g}: {name}")
                    reuse = 0
                    if cache is not None and croppable_to_prefix(cache, residual):
                        reuse = min(_common_prefix(previous, trial.ids), trial.prompt_tokens - 1)
                    if reuse > 0:
                        cache.crop(reuse - cache.get_seq_length())  # keep the first ``reuse`` tokens
                    else:
                        cache = build(spec)
                    generated, t_prefill, t_decode = _generate(
                        lm, trial, cache, prefill_chunk, stop, len(trial.answers), reuse
                    )
                    previous = trial.ids
                    if name not in sizes or trial.length > sizes[name][0]:
                        sizes[name] = (trial.length, _cache_bits(cache, spec, dtype))
                    output = lm.tokenizer.decode(generated, skip_special_tokens=True)
                    correct, score, numbers = score_answer(trial.task, output, trial.answers)
                    done[(i, c)] = {
                        "task": trial.task,
                        "length": trial.length,
                        "depth": trial.depth,
                        "sample": trial.sample,
                        "codec": name,
                        "preset": (presets or {}).get(name),
                        "correct": correct,
                        "score": score,
                        "answers": " ".join(trial.answers),
                        "numbers": " ".join(numbers),
                        "output": output,
                        "key": trial.key,
                        "prompt_tokens": trial.prompt_tokens,
                        "needle_token": trial.needle_token,
                        "depth_actual": trial.depth_actual,
                        "haystack_tokens": trial.haystack_tokens,
                        "haystack_start": trial.haystack_start,
                        "reused_tokens": reuse,
                        "generated_tokens": len(generated),
                        "prefill_seconds": t_prefill,
                        "decode_seconds": t_decode,
                    }
                    bar.update()
                del cache
        rows = [done[key] for key in sorted(done)]
        bar.close()
        seconds = time.perf_counter() - started
    finally:
        if fused:
            model.set_attn_implementation(base_impl)
    codec_meta = {}
    for name, spec in caches:
        length, bits = sizes[name]
        codec_meta[name] = {
            **bits,
            "measured_at_length": length,
            "quantize_on_write": _quantize_on_write(spec, prefill),
            **({"preset": presets[name]} if presets and name in presets else {}),
        }
    for row in rows:
        row["bits_per_element"] = codec_meta[row["codec"]]["bits_per_element"]
    cells = cell_rows(rows, min_baseline)
    summary = summary_rows(rows, min_baseline)
    overall = overall_rows(rows, min_baseline)
    meta = run_meta(
        lm,
        text,
        **meta_fields,
        tasks=list(dict.fromkeys(t.task for t in trials)),
        lengths=sorted({t.length for t in trials}),
        depths=sorted({t.depth for t in trials}),
        samples=max(t.sample for t in trials) + 1,
        trials=len(trials),
        prompt=" / ".join(dict.fromkeys(t.prompt for t in trials)),
        new_tokens={t.task: t.new_tokens for t in trials},
        needles_per_trial={t.task: len(t.needles) for t in trials},
        needle=_NEEDLE["one"].format(key="{key}", value="{7 digits}"),
        reference=f"{BASELINE}: the same model, transformers' DynamicCache at {dtype!s}",
        min_baseline=min_baseline,
        threshold_note=(
            f"a codec's accuracy counts only in the cells (task, length, depth) where the {BASELINE} model reaches at "
            f"least {min_baseline:.0%}; the others are flagged (measurable = false) and left out of every summary"
        ),
        prefill=prefill,
        prefill_note=(
            "quantized: quantize on write, every prompt token attention reads was compressed first"
            if prefill == "quantized"
            else "exact: each prefill chunk attends to its own exact K/V, stored compressed (serving-engine style)"
        ),
        prefill_chunk=prefill_chunk,
        fused=fused,
        share_prefix=share_prefix,
        residual=residual,
        decoding="greedy, one token per forward; stops at EOS, after new_tokens, or once the numbers asked for are "
        "written",
        scoring="exact match: single/multikey: the answer's first number is the value; multivalue: every value among "
        "the answer's numbers (score: the share found)",
        codecs=codec_meta,
        calibration=calibration_meta(calibration),
        seconds_trials=seconds,
        seconds_per_trial={
            name: sum(r["prefill_seconds"] + r["decode_seconds"] for r in rows if r["codec"] == name) / len(trials)
            for name, _ in caches
        },
    )
    return NeedleResult(meta, rows, cells, summary, overall)


# ---------------------------------------------------------------------------------------------------------
# Aggregates
# ---------------------------------------------------------------------------------------------------------


def _group(rows: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[tuple[Any, ...], list[Mapping[str, Any]]]:
    out: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _trial_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r["task"], r["length"], r["depth"], r["sample"])


def _cell_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r["task"], r["length"], r["depth"])


def measurable_cells(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> dict[tuple, bool]:
    """``{(task, length, depth): the reference's accuracy there is at least min_baseline}``."""
    return {
        key: _mean([float(r["correct"]) for r in group]) >= min_baseline
        for key, group in _group([r for r in rows if r["codec"] == BASELINE], ("task", "length", "depth")).items()
    }


def cell_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec, length, depth), the heatmaps' cells: trials, correct, accuracy, mean score, the reference's
    accuracy and whether the cell is measurable (the reference reaches ``min_baseline`` there)."""
    ok = measurable_cells(rows, min_baseline)
    base = {
        key: _mean([float(r["correct"]) for r in group])
        for key, group in _group([r for r in rows if r["codec"] == BASELINE], ("task", "length", "depth")).items()
    }
    out = []
    for (task, codec, length, depth), group in _group(rows, ("task", "codec", "length", "depth")).items():
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "depth": depth,
                "trials": len(group),
                "correct": sum(bool(r["correct"]) for r in group),
                "accuracy": _mean([float(r["correct"]) for r in group]),
                "score": _mean([r["score"] for r in group]),
                "baseline_accuracy": base.get((task, length, depth), float("nan")),
                "measurable": ok.get((task, length, depth), False),
            }
        )
    return out


def _measured(group: Sequence[Mapping[str, Any]], ok: Mapping[tuple, bool], ref: Mapping[tuple, bool]) -> dict:
    """Accuracy, the reference's, retained, lost and gained over the trials of measurable cells in ``group``."""
    kept = [r for r in group if ok.get(_cell_key(r), False)]
    right = [r for r in kept if ref.get(_trial_key(r))]
    return {
        "measured_trials": len(kept),
        "measured_accuracy": _mean([float(r["correct"]) for r in kept]) if kept else None,
        "measured_baseline_accuracy": _mean([float(ref[_trial_key(r)]) for r in kept]) if kept else None,
        "retained": _mean([float(r["correct"]) for r in right]) if right else None,
        "lost": sum(not r["correct"] for r in right),
        "gained": sum(bool(r["correct"]) and not ref.get(_trial_key(r)) for r in kept),
    }


def summary_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec, length): accuracy over every trial and over the measurable cells only.

    A cell (task, length, depth) is measurable where the reference's accuracy reaches ``min_baseline``; the
    ``measured_*`` keys, ``retained`` (of the trials the reference got right, the share the codec got right too;
    ``None`` when there are none), ``lost`` and ``gained`` (right with the reference and wrong with the codec, and
    the other way round) read measurable cells only. ``flagged_depths``: the depths left out.
    """
    ok = measurable_cells(rows, min_baseline)
    ref = {_trial_key(r): bool(r["correct"]) for r in rows if r["codec"] == BASELINE}
    out = []
    for (task, codec, length), group in _group(rows, ("task", "codec", "length")).items():
        depths = sorted({r["depth"] for r in group})
        out.append(
            {
                "task": task,
                "codec": codec,
                "length": length,
                "trials": len(group),
                "accuracy": _mean([float(r["correct"]) for r in group]),
                "score": _mean([r["score"] for r in group]),
                "baseline_accuracy": _mean([float(ref[_trial_key(r)]) for r in group if _trial_key(r) in ref]),
                **_measured(group, ok, ref),
                "flagged_depths": [d for d in depths if not ok.get((task, length, d), False)],
                "seconds_per_trial": _mean([r["prefill_seconds"] + r["decode_seconds"] for r in group]),
            }
        )
    return out


def overall_rows(rows: Sequence[Mapping[str, Any]], min_baseline: float = MIN_BASELINE) -> list[dict[str, Any]]:
    """Per (task, codec), over the measurable cells of every length: as :func:`summary_rows`' ``measured_*`` keys,
    with ``cells`` and ``flagged_cells`` (how many (length, depth) cells there are, and how many were left out)."""
    ok = measurable_cells(rows, min_baseline)
    ref = {_trial_key(r): bool(r["correct"]) for r in rows if r["codec"] == BASELINE}
    out = []
    for (task, codec), group in _group(rows, ("task", "codec")).items():
        cells = {_cell_key(r) for r in group}
        out.append(
            {
                "task": task,
                "codec": codec,
                "cells": len(cells),
                "flagged_cells": sum(not ok.get(c, False) for c in cells),
                **_measured(group, ok, ref),
            }
        )
    return out


# ---------------------------------------------------------------------------------------------------------
# Adding runs together: a long grid in parts (e.g. the short lengths at every depth, then one long length)
# ---------------------------------------------------------------------------------------------------------

#: Meta entries two runs must share for their trials to form one result: what a trial's answer depends on
#: besides its (task, length, depth, sample), and how cells are judged.
MERGE_KEYS = (
    "seed",
    "prompt",
    "needle",
    "reference",
    "min_baseline",
    "prefill",
    "prefill_chunk",
    "fused",
    "residual",
    "decoding",
    "scoring",
    "calibration",
)
_RESULT_KEYS = ("meta", "overall", "summary", "cells", "trials")


def load_needle_result(path: str | Path) -> NeedleResult:
    """Read a ``walshkv needle --json`` file back.

    Raises:
        ValueError: the file is missing, not JSON, or not a needle result (the message names the file).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file (give the --json file of an earlier walshkv needle run)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(
            f"{path}: not a readable JSON file ({err}); give the --json file of a walshkv needle run"
        ) from None
    if not isinstance(raw, dict) or any(k not in raw for k in _RESULT_KEYS) or "codecs" not in raw.get("meta", {}):
        raise ValueError(
            f"{path}: not a walshkv needle result (it needs the keys {', '.join(_RESULT_KEYS)}); give the --json file "
            "of a walshkv needle run"
        )
    return NeedleResult(raw["meta"], raw["trials"], raw["cells"], raw["summary"], raw["overall"])


def _run_entry(meta: Mapping[str, Any]) -> dict[str, Any]:
    """One run of a merged result: what it covered and what measured it."""
    return {
        "command": meta.get("command"),
        "lengths": meta["lengths"],
        "depths": meta["depths"],
        "samples": meta["samples"],
        "trials": meta["trials"],
        "seconds_trials": meta.get("seconds_trials"),
        "date": meta.get("date"),
        "versions": meta.get("versions"),
        "cpu": meta.get("cpu"),
    }


def check_can_add(
    earlier: NeedleResult,
    *,
    model: str,
    text: str,
    codecs: Sequence[str],
    trials: Sequence[Trial] = (),
    settings: Mapping[str, Any] | None = None,
) -> None:
    """Refuse, before anything runs, a run whose trials cannot be added to ``earlier``'s.

    Args:
        earlier: the result the new run's trials go into.
        model: the new run's model name.
        text: the new run's haystack text name.
        codecs: the new run's cache specs (presets resolved), without the reference.
        trials: the new run's trials; none may repeat one of ``earlier``'s (task, length, depth, sample).
        settings: meta entries of :data:`MERGE_KEYS` known before the run; each must equal ``earlier``'s.

    Raises:
        ValueError: naming what differs and how to run the part that would fit.
    """
    meta = earlier.meta
    fix = "run it into a file of its own (--json elsewhere, no --add-to), or repeat the earlier run's settings"
    if meta["model"]["name"] != model or meta["text"]["name"] != text:
        raise ValueError(
            f"--add-to holds {meta['model']['name']} on {meta['text']['name']}, this run is {model} on {text}: {fix}"
        )
    before = [c for c in meta["codecs"] if c != BASELINE]
    if list(codecs) != before:
        raise ValueError(
            f"--add-to has the caches {', '.join(before) or '(reference only)'}; this run has "
            f"{', '.join(codecs) or '(reference only)'}: give the same --codec list in the same order, or {fix}"
        )
    for key, value in (settings or {}).items():
        if key in MERGE_KEYS and meta.get(key) != value:
            raise ValueError(f"--add-to was run with {key} = {meta.get(key)!r}, this run with {value!r}: {fix}")
    done = {_trial_key(r) for r in earlier.trials}
    again = sorted({k for t in trials if (k := (t.task, t.length, t.depth, t.sample)) in done})
    if again:
        shown = ", ".join(f"{task} L={length} d={depth:g} sample {s}" for task, length, depth, s in again[:4])
        raise ValueError(
            f"--add-to already holds {len(again)} of this run's trials ({shown}{', ...' if len(again) > 4 else ''}): "
            "give only lengths, depths or samples it does not have"
        )


def merge_needle_results(earlier: NeedleResult, later: NeedleResult) -> NeedleResult:
    """One result from two runs with disjoint trials and the same settings: cells and summaries recomputed from
    every trial; ``meta["runs"]`` lists each run (its command, lengths, depths, commit, CPU).

    Raises:
        ValueError: the runs differ in model, text, caches or a :data:`MERGE_KEYS` setting, or share a trial.
    """
    lm = later.meta
    check_can_add(
        earlier,
        model=lm["model"]["name"],
        text=lm["text"]["name"],
        codecs=[c for c in lm["codecs"] if c != BASELINE],
        settings={k: lm.get(k) for k in MERGE_KEYS},
    )
    done = {_trial_key(r) for r in earlier.trials}
    again = {_trial_key(r) for r in later.trials} & done
    if again:
        task, length, depth, sample = sorted(again)[0]
        raise ValueError(
            f"the runs share {len(again)} trial(s), e.g. {task} L={length} d={depth:g} sample {sample}: "
            "give disjoint lengths, depths or samples"
        )
    for task, n in lm["new_tokens"].items():
        if earlier.meta["new_tokens"].get(task, n) != n:
            raise ValueError(
                f"task {task}: new_tokens {earlier.meta['new_tokens'][task]} before, {n} now (--new-tokens)"
            )
    order = {c: i for i, c in enumerate(earlier.meta["codecs"])}
    rows = sorted([*earlier.trials, *later.trials], key=lambda r: (*_trial_key(r), order[r["codec"]]))
    codecs = {}
    for name in earlier.meta["codecs"]:
        a, b = earlier.meta["codecs"][name], lm["codecs"][name]
        codecs[name] = b if b["measured_at_length"] > a["measured_at_length"] else a
    runs = list(earlier.meta.get("runs") or [_run_entry(earlier.meta)]) + list(lm.get("runs") or [_run_entry(lm)])
    keys = {_trial_key(r) for r in rows}
    meta = dict(lm)
    meta.update(
        command=None,
        tasks=list(dict.fromkeys([*earlier.meta["tasks"], *lm["tasks"]])),
        lengths=sorted({*earlier.meta["lengths"], *lm["lengths"]}),
        depths=sorted({*earlier.meta["depths"], *lm["depths"]}),
        samples=max(earlier.meta["samples"], lm["samples"]),
        trials=len(keys),
        new_tokens={**earlier.meta["new_tokens"], **lm["new_tokens"]},
        needles_per_trial={**earlier.meta["needles_per_trial"], **lm["needles_per_trial"]},
        share_prefix=bool(earlier.meta.get("share_prefix")) and bool(lm.get("share_prefix")),
        codecs=codecs,
        seconds_trials=sum(r.get("seconds_trials") or 0.0 for r in runs),
        seconds_per_trial={
            name: sum(r["prefill_seconds"] + r["decode_seconds"] for r in rows if r["codec"] == name) / len(keys)
            for name in codecs
        },
        runs=runs,
    )
    minimum = meta["min_baseline"]
    return NeedleResult(meta, rows, cell_rows(rows, minimum), summary_rows(rows, minimum), overall_rows(rows, minimum))


# ---------------------------------------------------------------------------------------------------------
# Reports: the run in words, tables, markdown, heatmaps, files
# ---------------------------------------------------------------------------------------------------------


def describe_needle(meta: Mapping[str, Any]) -> str:
    """The run of a :class:`NeedleResult` in one paragraph."""

    def grid(m: Mapping[str, Any]) -> str:
        lengths = ", ".join(f"{n:,}" for n in m["lengths"])
        depths = ", ".join(f"{d:g}" for d in m["depths"])
        return f"lengths {lengths} tokens (prompt + answer), depths {depths}, {m['samples']} sample(s) each"

    runs = meta.get("runs") or []
    cover = (
        f"{grid(meta)}: {meta['trials']} trials per cache"
        if not runs
        else f"{len(runs)} runs added together ({'; '.join(grid(r) for r in runs)}): {meta['trials']} trials per cache"
    )
    parts = [
        describe_model(meta["model"]),
        f"haystack text {meta['text']['name']}",
        f"tasks {', '.join(meta['tasks'])} ({meta.get('prompt', '?')} prompt)",
        cover,
        f"reference: {meta['reference']}",
        f"prefill: {meta['prefill_note']}, {meta['prefill_chunk']} tokens per forward"
        + (" (fused attention)" if meta.get("fused") else "")
        + (", the haystack shared by the depths of one length and sample reused" if meta.get("share_prefix") else ""),
        f"full-precision window: {meta['residual']} tokens",
        f"scoring: {meta['scoring']}",
        meta["threshold_note"],
    ]
    return "; ".join(parts) + "."


def _pct(x: float | None) -> str:
    return "—" if x is None or x != x else f"{x:.0%}"


def _caches(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    return list(dict.fromkeys(r["codec"] for r in rows))


def _label(result: NeedleResult, codec: str) -> str:
    """A cache's name in tables and plots: the preset's name where it stands for one (its spec is in the meta)."""
    return result.meta["codecs"].get(codec, {}).get("preset") or codec


def format_needle_table(result: NeedleResult, task: str, fmt: str = "simple") -> str:
    """One task's table: a row per cache (the reference first) with its bits, the accuracy per length over the
    measurable cells, the same over every measurable cell, what it retained and lost, and seconds per trial.

    A length with flagged depths (the reference below the threshold) carries ``⚑N`` in the reference's row (N
    depths left out; :func:`flag_note` names them); a length without measurable cells reads ``n/a``.
    """
    summary = [s for s in result.summary if s["task"] == task]
    lengths = sorted({s["length"] for s in summary})
    by = {(s["codec"], s["length"]): s for s in summary}
    over = {o["codec"]: o for o in result.overall if o["task"] == task}
    headers = ["cache", "bits/el", *(f"L={n:,}" for n in lengths), "all", "retained", "lost", "s/trial"]
    body = []
    for codec in _caches(summary):
        reference = codec == BASELINE
        cells = []
        for n in lengths:
            s = by.get((codec, n))
            if s is None:
                cells.append("")
                continue
            text = "n/a" if s["measured_accuracy"] is None else _pct(s["measured_accuracy"])
            if reference and s["flagged_depths"]:
                text += f" ⚑{len(s['flagged_depths'])}"
            cells.append(text)
        o = over[codec]
        seconds = _mean([s["seconds_per_trial"] for s in summary if s["codec"] == codec])
        body.append(
            [
                _label(result, codec),
                f"{result.meta['codecs'][codec]['bits_per_element']:.3f}",
                *cells,
                _pct(o["measured_accuracy"]),
                "" if reference else _pct(o["retained"]),
                "" if reference else str(o["lost"]),
                f"{seconds:.1f}",
            ]
        )
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def flag_note(result: NeedleResult, task: str) -> str:
    """What the threshold left out of a task's table, and the reference's own accuracy over every depth."""
    ref = [s for s in result.summary if s["task"] == task and s["codec"] == BASELINE]
    cells = {(c["length"], c["depth"]): c for c in result.cells if c["task"] == task and c["codec"] == BASELINE}
    threshold = f"{result.meta['min_baseline']:.0%}"
    own = ", ".join(f"L={s['length']:,} {_pct(s['accuracy'])}" for s in ref)
    flagged = [
        f"L={s['length']:,} at depth "
        + ", ".join(f"{d:g} ({_pct(cells[(s['length'], d)]['accuracy'])})" for d in s["flagged_depths"])
        for s in ref
        if s["flagged_depths"]
    ]
    if not flagged:
        return f"Every cell is measurable: the {BASELINE} model reaches {threshold} at each (over all depths: {own})."
    return (
        f"⚑ left out of every number above, since the {BASELINE} model itself is below {threshold} there: "
        f"{'; '.join(flagged)} (the trials stay in the JSON and CSV). The {BASELINE} model over all depths: {own}."
    )


def needle_markdown(result: NeedleResult) -> str:
    """The markdown report: the run, the command, the threshold, one table per task, the needles lost."""
    meta = result.meta
    lines = [f"# Needle in a haystack: {meta['model']['name']}", "", describe_needle(meta), ""]
    if meta.get("command"):
        lines += [f"Produced by `{meta['command']}`.", ""]
    for i, run in enumerate(meta.get("runs") or [], 1):
        commit = (run.get("versions") or {}).get("commit", "?")
        cpu = (run.get("cpu") or {}).get("model", "?")
        lines += [f"Run {i} (code {commit}, CPU {cpu}): `{run.get('command') or '?'}`.", ""]
    lines += [
        f"Columns: accuracy (exact match) per length over its measurable cells (depths where the {BASELINE} model "
        f"reaches {meta['min_baseline']:.0%}); `all`: over every measurable cell; `retained`: of the trials the "
        f"{BASELINE} model got right there, the share the codec got right too; `lost`: those it got wrong; "
        "`s/trial`: prefill and decoding, seconds per trial (depths after the first of a length and sample reuse "
        "the haystack they share, so they cost less).",
        "",
    ]
    for task in meta["tasks"]:
        lines += [f"## {task}", "", format_needle_table(result, task, "github"), "", flag_note(result, task), ""]
        ok = {_cell_key(c): c["measurable"] for c in result.cells}
        ref = {_trial_key(r): r for r in result.trials if r["codec"] == BASELINE}
        misses = [
            r
            for r in result.trials
            if r["task"] == task
            and r["codec"] != BASELINE
            and ok.get(_cell_key(r))
            and ref[_trial_key(r)]["correct"]
            and not r["correct"]
        ]
        if misses:
            lines += ["Needles the codecs lost (right with the reference, wrong with the codec):", ""]
            lines += ["| cache | length | depth | sample | expected | answer |", "|---|---|---|---|---|---|"]
            for r in misses[:40]:
                answer = " ".join(r["output"].split()).replace("|", "\\|")
                lines.append(
                    f"| {r['codec']} | {r['length']:,} | {r['depth']:g} | {r['sample']} | {r['answers']} | {answer} |"
                )
            if len(misses) > 40:
                lines.append(f"| … {len(misses) - 40} more in the JSON | | | | | |")
            lines.append("")
    return "\n".join(lines)


def plot_heatmaps(result: NeedleResult, path: str | Path) -> Path:
    """Depth x length heatmaps of accuracy: a row of panels per task, a panel per cache (the reference first).

    Cells where the reference is below the threshold are hatched.

    Raises:
        ImportError: matplotlib is missing (the message names ``pip install 'walshkv[plot]'``).
    """
    meta = result.meta
    tasks, caches = meta["tasks"], _caches(result.trials)
    lengths, depths = meta["lengths"], meta["depths"]
    width = max(5.0, 1.6 + len(caches) * (0.8 + 0.55 * len(lengths)))
    fig = agg_figure(figsize=(width, 1.4 + (0.9 + 0.32 * len(depths)) * len(tasks)), layout="constrained")
    axes = fig.subplots(len(tasks), len(caches), squeeze=False)
    cells = {(c["task"], c["codec"], c["length"], c["depth"]): c for c in result.cells}
    image = None
    for i, task in enumerate(tasks):
        for j, codec in enumerate(caches):
            ax = axes[i][j]
            grid = [[cells.get((task, codec, n, d), {}).get("score", float("nan")) for n in lengths] for d in depths]
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
            for y, d in enumerate(depths):
                for x, n in enumerate(lengths):
                    cell = cells.get((task, codec, n, d))
                    if cell is None:
                        continue
                    ax.text(x, y, f"{cell['score']:.0%}", ha="center", va="center", fontsize=7)
                    if not cell["measurable"]:
                        ax.add_patch(_hatch(x - 0.5, y - 0.5))
            ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in lengths])
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths] if j == 0 else [""] * len(depths))
            bits = meta["codecs"][codec]["bits_per_element"]
            ax.set_title(f"{_label(result, codec)}\n{bits:.2f} bits/el", fontsize=8)
            if j == 0:
                ax.set_ylabel(f"{task}: needle depth", fontsize=8)
            if i == len(tasks) - 1:
                ax.set_xlabel("context length", fontsize=8)
            ax.tick_params(labelsize=7)
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="accuracy (exact match)", pad=0.02)
    fig.suptitle(
        f"{meta['model']['name']}: needle in a haystack ({meta['text']['name']})\nhatched: the {BASELINE} model "
        f"is below {meta['min_baseline']:.0%} there (not measurable)",
        fontsize=9,
    )
    return save_figure_atomic(fig, path, dpi=130)


def _hatch(x: float, y: float) -> Any:
    """A hatched unit square at ``(x, y)`` (a flagged cell)."""
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), 1.0, 1.0, fill=False, hatch="///", edgecolor="0.35", linewidth=0)


#: The CSV's columns (the cells, one line per (task, cache, length, depth)).
CSV_KEYS = ("task", "codec", "length", "depth", "trials", "correct", "accuracy", "score", "baseline_accuracy",
            "measurable", "bits_per_element")  # fmt: skip


def write_needle_outputs(
    result: NeedleResult,
    *,
    json: str | Path | None = None,
    csv: str | Path | None = None,
    markdown: str | Path | None = None,
    png: str | Path | None = None,
) -> list[Path]:
    """Write the files asked for: JSON (everything), CSV (the cells), markdown (the report), PNG (heatmaps; skipped
    with a note on stderr where matplotlib is missing).

    Returns:
        The paths written.
    """
    written = []
    if json:
        write_json_atomic(json, result.to_json())
        written.append(Path(json))
    if csv:
        bits = {name: c["bits_per_element"] for name, c in result.meta["codecs"].items()}
        write_csv(
            csv, [{**{k: c[k] for k in CSV_KEYS[:-1]}, "bits_per_element": bits[c["codec"]]} for c in result.cells]
        )
        written.append(Path(csv))
    if markdown:
        write_text_atomic(markdown, needle_markdown(result))
        written.append(Path(markdown))
    if png:
        try:
            written.append(plot_heatmaps(result, png))
        except ImportError as err:  # every other file is written all the same
            print(f"needle heatmaps skipped: {err}", file=sys.stderr)
    return written
