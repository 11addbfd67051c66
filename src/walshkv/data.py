"""Texts and token windows: what every measurement reads, offline by default.

Texts:

* ``python-docs`` (default): Python's own documentation topics
  (``pydoc_data.topics``, ~465k characters of English), shipped with every CPython.
* a path to any UTF-8 text file;
* ``wikitext-2``: the WikiText-2 raw test split through Hugging Face ``datasets``
  (needs the ``datasets`` package and a reachable hub).

Token windows (llama-perplexity's protocol): :func:`make_windows` cuts a text into consecutive
non-overlapping windows of ``ctx`` tokens, :func:`scored_positions` says which logits of each window
are scored.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from walshkv.constants import Score
from walshkv.defaults import DEFAULT_TEXT

__all__ = [
    "DEFAULT_TEXT",
    "SCORE_MODES",
    "TEXTS",
    "Text",
    "TextTooShortError",
    "Windows",
    "describe_scored",
    "load_text",
    "make_windows",
    "scored_positions",
]

TEXTS = {
    "python-docs": "Python's documentation topics (pydoc_data.topics), offline",
    "wikitext-2": "WikiText-2 raw test split via Hugging Face datasets (needs network)",
}


@dataclass(frozen=True)
class Text:
    """A named text: ``name`` is what result files record, ``source`` where it came from."""

    name: str
    source: str
    content: str


def _python_docs() -> Text:
    from pydoc_data import topics

    body = "\n\n".join(topics.topics[key].strip() for key in sorted(topics.topics))
    return Text("python-docs", "pydoc_data.topics (sorted keys, joined by blank lines)", body)


def _wikitext2() -> Text:
    try:
        import datasets
    except ImportError:
        raise ValueError(
            "text 'wikitext-2' needs the 'datasets' package (pip install 'walshkv[hub]') and network "
            "access; offline, use the default 'python-docs' or --text PATH"
        ) from None
    try:
        ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    except Exception as err:
        raise ValueError(
            f"could not fetch wikitext-2 from the Hugging Face hub ({type(err).__name__}); "
            "offline, use the default 'python-docs' or --text PATH"
        ) from err
    return Text("wikitext-2", "wikitext-2-raw-v1 test split", "".join(ds["text"]))


def load_text(name_or_path: str = DEFAULT_TEXT) -> Text:
    """Load a named text or a UTF-8 file.

    Raises:
        ValueError: unknown name, missing/empty/non-UTF-8 file; the message lists the names.
    """
    if name_or_path == "python-docs":
        return _python_docs()
    if name_or_path == "wikitext-2":
        return _wikitext2()
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        raise ValueError(f"text {name_or_path!r} is neither a known name ({', '.join(TEXTS)}) nor an existing file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"text file {path} is not valid UTF-8 ({err.reason} at byte {err.start})") from None
    if not content.strip():
        raise ValueError(f"text file {path} is empty")
    return Text(path.name, str(path.resolve()), content)


# ---------------------------------------------------------------------------------------------------------
# Token windows and scored positions
# ---------------------------------------------------------------------------------------------------------

SCORE_MODES: tuple[Score, ...] = ("half", "all")


@dataclass(frozen=True)
class Windows:
    """Consecutive non-overlapping token windows of one text.

    Attributes:
        ids: ``[windows, ctx]`` token ids.
        bos: whether the first token of each window was replaced by BOS (as
            llama-perplexity does for models whose tokenizer adds one).
        text_tokens: tokens in the whole text.
    """

    ids: torch.Tensor
    bos: bool
    text_tokens: int


def scored_positions(ctx: int, score: Score) -> tuple[int, int]:
    """Logit positions ``[first, last)`` that are scored in each window.

    The logit at position ``j`` predicts token ``j + 1``. ``half`` scores logits
    ``ctx//2 .. ctx-2`` (tokens ``ctx//2+1 .. ctx-1``: 255 per 512-token window, exactly
    llama-perplexity's count); ``all`` scores logits ``0 .. ctx-2`` (tokens ``1 .. ctx-1``).
    """
    if score not in SCORE_MODES:
        raise ValueError(f"--score must be one of {', '.join(SCORE_MODES)}, got {score!r}")
    first = ctx // 2 if score == "half" else 0
    return first, ctx - 1


def describe_scored(first: int, last: int) -> str:
    """The scored positions ``[first, last)`` of :func:`scored_positions` in words, for result files."""
    return (
        f"logits at positions {first}..{last - 1} of each window, predicting tokens "
        f"{first + 1}..{last} ({last - first} per window)"
    )


class TextTooShortError(ValueError):
    """A text too short for the windows asked of it; ``fit`` is how many windows of ``ctx`` tokens it holds."""

    def __init__(self, message: str, *, tokens: int, fit: int, ctx: int) -> None:
        super().__init__(message)
        self.tokens, self.fit, self.ctx = tokens, fit, ctx


def make_windows(tokenizer: Any, text: str, ctx: int, windows: int | None) -> Windows:
    """Tokenize ``text`` and cut ``windows`` consecutive windows of ``ctx`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the text.
        ctx: tokens per window (>= 4).
        windows: number of windows, or ``None`` for as many as fit.

    Raises:
        ValueError: ``ctx`` or ``windows`` out of range.
        TextTooShortError: the text is too short for even one window, or for ``windows``.
    """
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4 tokens, got {ctx}")
    if windows is not None and windows < 1:
        raise ValueError(f"--windows must be at least 1, got {windows}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    fit = len(ids) // ctx
    want = fit if windows is None else windows
    if fit < max(want, 1):
        raise TextTooShortError(
            f"the text has {len(ids)} tokens, enough for {fit} window(s) of {ctx}, but {max(want, 1)} "
            f"were asked for; use fewer --windows, a smaller --ctx, or a longer --text",
            tokens=len(ids),
            fit=fit,
            ctx=ctx,
        )
    tensor = torch.tensor(ids[: want * ctx], dtype=torch.long).view(want, ctx)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]
    if adds_bos:
        tensor[:, 0] = bos_id
    return Windows(tensor, adds_bos, len(ids))
