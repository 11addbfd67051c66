"""The trials of ``walshkv needle``: haystacks of whole sentences, seeded needles, prompts.

Every trial is a pure function of ``(seed, task, sample, length, depth)``, the text and the tokenizer
(:func:`make_trials`): the same command builds the same prompts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

__all__ = [
    "DEFAULT_DEPTHS",
    "DEFAULT_LENGTHS",
    "DEFAULT_SAMPLES",
    "NEEDLE_PATTERN",
    "PROMPTS",
    "TASKS",
    "Needle",
    "PromptStyle",
    "Task",
    "Trial",
    "default_new_tokens",
    "haystack_sentences",
    "make_trials",
    "parse_depths",
    "parse_lengths",
    "prompt_style",
]

Task = Literal["single", "multikey", "multivalue"]
PromptStyle = Literal["auto", "chat", "plain"]

#: The tasks (RULER's niah_single, niah_multikey, niah_multivalue).
TASKS: tuple[Task, ...] = get_args(Task)
#: How the prompt is written: the model's chat template (``auto``: where its tokenizer has one) or plain text.
PROMPTS: tuple[PromptStyle, ...] = get_args(PromptStyle)
DEFAULT_LENGTHS: tuple[int, ...] = (1024, 2048, 4096)
DEFAULT_DEPTHS: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
#: Trials per (task, length, depth) cell: at least 5 for a grid that is published (5 right of 5 still has a
#: Wilson interval reaching down to 57%; 1 of 1, down to 21%).
DEFAULT_SAMPLES = 5
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
#: The queried needle's sentence as a result's meta records it.
NEEDLE_PATTERN = _NEEDLE["one"].format(key="{key}", value="{7 digits}")
#: Sentences longer than this (characters) are left out of haystacks (code listings run together, tables).
_MAX_SENTENCE_CHARS = 600
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


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
