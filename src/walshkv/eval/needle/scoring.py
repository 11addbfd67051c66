"""Scoring ``walshkv needle``'s answers: exact match of the numbers a greedy answer writes."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from walshkv.eval.needle.trials import Task

__all__ = ["complete_numbers", "score_answer"]


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


def complete_numbers(text: str) -> int:
    """Numbers the answer has finished writing (a digit run followed by something else)."""
    return len(re.findall(r"\d(?=[^\d,])|\d,(?!\d)", text))
