"""Token windows and scored positions (llama-perplexity's protocol)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Windows", "describe_scored", "make_windows", "scored_positions"]

SCORE_MODES = ("half", "all")


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


def scored_positions(ctx: int, score: str) -> tuple[int, int]:
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


def make_windows(tokenizer: Any, text: str, ctx: int, windows: int | None) -> Windows:
    """Tokenize ``text`` and cut ``windows`` consecutive windows of ``ctx`` tokens.

    Args:
        tokenizer: a Hugging Face tokenizer.
        text: the text.
        ctx: tokens per window (>= 4).
        windows: number of windows, or ``None`` for as many as fit.

    Raises:
        ValueError: if the text is too short for even one window, or for ``windows``.
    """
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4 tokens, got {ctx}")
    if windows is not None and windows < 1:
        raise ValueError(f"--windows must be at least 1, got {windows}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    fit = len(ids) // ctx
    want = fit if windows is None else windows
    if fit < max(want, 1):
        raise ValueError(
            f"the text has {len(ids)} tokens, enough for {fit} window(s) of {ctx}, but {max(want, 1)} "
            f"were asked for; use fewer --windows, a smaller --ctx, or a longer --text"
        )
    tensor = torch.tensor(ids[: want * ctx], dtype=torch.long).view(want, ctx)
    bos_id = getattr(tokenizer, "bos_token_id", None)
    adds_bos = bos_id is not None and tokenizer("a")["input_ids"][:1] == [bos_id]
    if adds_bos:
        tensor[:, 0] = bos_id
    return Windows(tensor, adds_bos, len(ids))
