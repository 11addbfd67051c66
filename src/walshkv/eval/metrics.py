"""KL divergence, perplexity and top-1 agreement against a reference, in float64; and the 95% intervals the
reports give their numbers.

Intervals: :func:`bootstrap_ci95` (a mean over windows) and :func:`paired_difference` (two rows on the same
windows) for continuous per-window numbers; :func:`wilson_ci95` (a share of successes, e.g. exact-match accuracy),
:func:`paired_proportion_difference` (two success rates on the same trials: Newcombe's paired score interval) and
:func:`mcnemar_exact_p` (whether the discordant pairs lean one way) for right/wrong outcomes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist

import torch

from walshkv.eval.rows import MetricSummary

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "HeadLogits",
    "ReferenceRows",
    "TokenMetrics",
    "bootstrap_ci95",
    "compare_logits",
    "is_finite_number",
    "mcnemar_exact_p",
    "paired_difference",
    "paired_proportion_difference",
    "wilson_ci95",
]

#: Resamples of the per-window bootstrap intervals (seeded: the same windows give the same interval).
BOOTSTRAP_RESAMPLES = 2000
#: The standard normal quantile of a two-sided 95% interval (1.959964...).
Z95 = NormalDist().inv_cdf(0.975)


def bootstrap_ci95(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the mean of ``values`` (one number per window), ``[low, high]``.

    Windows, not tokens, are resampled: tokens within a window are correlated, windows far apart are close to
    independent. With one window the interval is ``[nan, nan]`` (nothing to resample). For a paired
    comparison of two codecs, pass the per-window differences.
    """
    x = torch.tensor(list(values), dtype=torch.float64)
    if x.numel() < 2:
        return [math.nan, math.nan]
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, x.numel(), (resamples, x.numel()), generator=gen)
    means = x[idx].mean(dim=1)
    return [float(torch.quantile(means, 0.025)), float(torch.quantile(means, 0.975))]


def paired_difference(
    a: Sequence[float] | None, b: Sequence[float] | None, min_windows: int = 1
) -> tuple[float, list[float]] | None:
    """Mean and :func:`bootstrap_ci95` of the per-window differences ``a - b`` of two rows on the same windows.

    Args:
        a, b: one number per window (e.g. a result row's ``window_kld_mean``), in the same window order.
        min_windows: fewer paired windows than this give ``None``.

    Returns:
        ``(mean, [low, high])``, or ``None`` when either side is missing, the lengths differ or there are too
        few windows.
    """
    if not a or not b or len(a) != len(b) or len(a) < min_windows:
        return None
    diff = [x - y for x, y in zip(a, b, strict=True)]
    return sum(diff) / len(diff), bootstrap_ci95(diff)


def wilson_ci95(successes: int, trials: int) -> list[float]:
    """95% Wilson score interval of a share of successes, ``[low, high]`` (within ``[0, 1]``).

    Unlike the normal-approximation (Wald) interval it stays inside ``[0, 1]`` and keeps a width at 0 or all
    successes, where a few trials say least: 0 of 10 gives ``[0, 0.278]``, 10 of 10 ``[0.722, 1]``, 5 of 10
    ``[0.237, 0.763]``. The trials are taken as independent, each a success with the same probability.

    Args:
        successes: how many trials succeeded, ``0 <= successes <= trials``.
        trials: how many there were; none gives ``[nan, nan]`` (nothing measured).

    Raises:
        ValueError: ``successes`` outside ``[0, trials]``.
    """
    if not 0 <= successes <= trials:
        raise ValueError(f"successes must be in [0, trials = {trials}], got {successes}")
    if trials == 0:
        return [math.nan, math.nan]
    z2 = Z95 * Z95
    center = (successes + z2 / 2) / (trials + z2)
    half = Z95 * math.sqrt(successes * (trials - successes) / trials + z2 / 4) / (trials + z2)
    low = 0.0 if successes == 0 else max(0.0, center - half)
    high = 1.0 if successes == trials else min(1.0, center + half)
    return [low, high]


def paired_proportion_difference(both: int, only_a: int, only_b: int, neither: int) -> tuple[float, list[float]]:
    """The difference of two success rates measured on the same trials, with its 95% interval.

    Each trial is a pair of outcomes (``a`` right or wrong, ``b`` right or wrong); the four arguments are the
    counts of the paired 2x2 table. The difference is ``p_a - p_b = (only_a - only_b) / n``. Its interval is
    Newcombe's score interval for paired data (method 10 of Newcombe, Statistics in Medicine 17:2635-2650, 1998;
    the "square-and-add" interval of Fagerland, Lydersen and Laake, Statistical Analysis of Contingency Tables,
    2017): the :func:`wilson_ci95` limits ``[l_a, u_a]`` and ``[l_b, u_b]`` of each rate, combined as

        low  = d - sqrt((p_a - l_a)^2 - 2 phi (p_a - l_a)(u_b - p_b) + (u_b - p_b)^2)
        high = d + sqrt((u_a - p_a)^2 - 2 phi (u_a - p_a)(p_b - l_b) + (p_b - l_b)^2)

    where ``phi`` is the correlation of the pairs, ``(both * neither - only_a * only_b) / sqrt(product of the
    margins)``, with Newcombe's correction: a positive numerator is lowered by ``n / 2`` (and floored at 0), and
    ``phi`` is 0 where a margin is empty. The more the two agree trial by trial, the narrower the interval
    against two independent samples of the same sizes; it stays within ``[-1, 1]``, and unlike a Wald interval it
    has a width when no pair disagrees.

    Args:
        both: trials both got right.
        only_a: trials only ``a`` got right.
        only_b: trials only ``b`` got right.
        neither: trials both got wrong.

    Returns:
        ``(difference, [low, high])``; ``(nan, [nan, nan])`` for no trials.

    Raises:
        ValueError: a negative count.
    """
    counts = (both, only_a, only_b, neither)
    if min(counts) < 0:
        raise ValueError(f"the paired counts must be at least 0, got {counts}")
    n = sum(counts)
    if n == 0:
        return math.nan, [math.nan, math.nan]
    a_right, b_right = both + only_a, both + only_b
    p_a, p_b = a_right / n, b_right / n
    (l_a, u_a), (l_b, u_b) = wilson_ci95(a_right, n), wilson_ci95(b_right, n)
    margins = a_right * (n - a_right) * b_right * (n - b_right)
    agree = both * neither - only_a * only_b
    if margins == 0:
        phi = 0.0
    elif agree > n / 2:
        phi = (agree - n / 2) / math.sqrt(margins)
    elif agree >= 0:
        phi = 0.0
    else:
        phi = agree / math.sqrt(margins)
    d = p_a - p_b
    below = (p_a - l_a) ** 2 - 2 * phi * (p_a - l_a) * (u_b - p_b) + (u_b - p_b) ** 2
    above = (u_a - p_a) ** 2 - 2 * phi * (u_a - p_a) * (p_b - l_b) + (p_b - l_b) ** 2
    return d, [max(-1.0, d - math.sqrt(max(below, 0.0))), min(1.0, d + math.sqrt(max(above, 0.0)))]


def mcnemar_exact_p(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value: whether the discordant pairs of two paired outcomes lean one way.

    Only the trials where the two disagree count: under the hypothesis that ``a`` and ``b`` succeed equally
    often, each of those ``only_a + only_b`` disagreements goes either way with probability 1/2, so ``only_a`` is
    Binomial(``only_a + only_b``, 1/2). The p-value is twice the smaller tail, at most 1 (1 when none disagree):
    1 against 7 disagreements gives 18/256 = 0.070. Computed exactly with integers.

    Raises:
        ValueError: a negative count.
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"the discordant counts must be at least 0, got {only_a} and {only_b}")
    n = only_a + only_b
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1))
    return min(1.0, 2 * tail / 2**n)


def is_finite_number(x: object) -> bool:
    """Whether ``x`` is an int or float and finite (not NaN, not infinite); ``None`` and strings are not."""
    return isinstance(x, int | float) and math.isfinite(x)


@dataclass
class TokenMetrics:
    """Per-token statistics accumulated over windows for one codec."""

    kl: list[torch.Tensor] = field(default_factory=list)
    nll: list[torch.Tensor] = field(default_factory=list)
    nll_ref: list[torch.Tensor] = field(default_factory=list)
    same_top1: list[torch.Tensor] = field(default_factory=list)

    def add(self, kl: torch.Tensor, nll: torch.Tensor, nll_ref: torch.Tensor, same: torch.Tensor) -> None:
        self.kl.append(kl)
        self.nll.append(nll)
        self.nll_ref.append(nll_ref)
        self.same_top1.append(same)

    def summary(self) -> MetricSummary:
        """``kld_mean``, ``kld_p99``, ``kld_median``, ``top1_agreement``, ``ppl``, ``ppl_ref``, ``ppl_ratio``,
        ``ppl_ratio_ci95``, ``scored_tokens``, and per window (one :meth:`add` each): ``window_kld_mean``,
        ``window_top1``, with their bootstrap intervals ``kld_mean_ci95`` and ``top1_ci95``."""
        kl = torch.cat(self.kl)
        nll = torch.cat(self.nll)
        nll_ref = torch.cat(self.nll_ref)
        ppl = math.exp(float(nll.mean()))
        ppl_ref = math.exp(float(nll_ref.mean()))
        diff = (nll - nll_ref).double()  # paired per-token log perplexity ratio
        win_kl = [float(k.double().mean()) for k in self.kl]
        win_top1 = [float(t.double().mean()) for t in self.same_top1]
        half = 1.96 * float(diff.std()) / math.sqrt(diff.numel()) if diff.numel() > 1 else math.inf
        return {
            "kld_mean": float(kl.mean()),
            "kld_p99": float(torch.quantile(kl, 0.99)),
            "kld_median": float(kl.median()),
            "top1_agreement": float(torch.cat(self.same_top1).double().mean()),
            "ppl": ppl,
            "ppl_ref": ppl_ref,
            "ppl_ratio": ppl / ppl_ref,
            # 95% interval of the ratio from the paired per-token differences (normal approximation;
            # tokens within a window are correlated, so read it as a lower bound on the uncertainty)
            "ppl_ratio_ci95": [math.exp(float(diff.mean()) - half), math.exp(float(diff.mean()) + half)],
            "scored_tokens": int(kl.numel()),
            "kld_mean_ci95": bootstrap_ci95(win_kl),
            "top1_ci95": bootstrap_ci95(win_top1),
            "window_kld_mean": win_kl,
            "window_top1": win_top1,
        }


class HeadLogits:
    """Logits ``[positions, vocab]`` held as the model's final hidden states ``[positions, hidden]``, made a few
    rows at a time by the output head (:func:`walshkv.eval.harness.forward_scored`).

    At 32k tokens of context the scored half's float32 logits over a 152k-token vocabulary take about 10 GB
    per forward; the hidden states take a hundredth of that. Slicing (``x[a:b]``) slices the hidden states;
    :meth:`rows` applies the head.

    Args:
        hidden: ``[positions, hidden]`` final hidden states (after the final norm).
        head: maps ``[n, hidden]`` to ``[n, vocab]`` logits exactly as the model's forward does (softcap included).
        vocab: the head's output size.
    """

    def __init__(self, hidden: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor], vocab: int) -> None:
        if hidden.dim() != 2:
            raise ValueError(f"HeadLogits needs hidden states [positions, hidden], got {tuple(hidden.shape)}")
        self.hidden, self.head, self.vocab = hidden, head, int(vocab)

    @property
    def shape(self) -> torch.Size:
        return torch.Size([self.hidden.shape[0], self.vocab])

    def dim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.hidden.shape[0]

    def __getitem__(self, index: slice) -> HeadLogits:
        if not isinstance(index, slice):
            raise TypeError("HeadLogits takes a slice of positions (x[a:b]); use rows(a, b) for logits")
        return HeadLogits(self.hidden[index], self.head, self.vocab)

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Logits ``[stop - start, vocab]`` of positions ``start..stop-1`` (no autograd: scoring only)."""
        with torch.inference_mode():
            return self.head(self.hidden[start:stop])

    @staticmethod
    def cat(parts: Sequence[torch.Tensor | HeadLogits]) -> torch.Tensor | HeadLogits:
        """Parts along positions: one :class:`HeadLogits` when every part is one (same head), else a tensor."""
        if parts and all(isinstance(p, HeadLogits) for p in parts):
            first = parts[0]
            assert isinstance(first, HeadLogits)
            return HeadLogits(torch.cat([p.hidden for p in parts]), first.head, first.vocab)  # type: ignore[union-attr]
        return torch.cat([p.rows(0, len(p)) if isinstance(p, HeadLogits) else p for p in parts])


def _logit_rows(x: torch.Tensor | HeadLogits, start: int, stop: int) -> torch.Tensor:
    return x.rows(start, stop) if isinstance(x, HeadLogits) else x[start:stop]


#: What :class:`ReferenceRows` keeps at most (float64 log-probabilities and probabilities of the scored positions):
#: 512-token windows of a 152k-token vocabulary fit; 32k-token ones are made again per comparison instead.
REFERENCE_KEEP_BYTES = 1 << 30


class ReferenceRows:
    """The reference's side of :func:`compare_logits`, made once and shared by every codec compared with it.

    Per ``rows`` positions: the float64 log-probabilities, their ``exp`` and the argmax, exactly as
    :func:`compare_logits` makes them from plain logits (the same operations on the same tensors, so every number
    it returns is the same). They are kept while their size stays within ``keep_bytes`` (a 512-token window's scored
    half: about 200 MB at a 49k vocabulary); beyond it each comparison makes them again, as with plain logits.

    Args:
        logits: ``[positions, vocab]`` reference logits (a tensor or :class:`HeadLogits`).
        keep_bytes: the most to keep.
    """

    def __init__(self, logits: torch.Tensor | HeadLogits, keep_bytes: int = REFERENCE_KEEP_BYTES) -> None:
        self.logits = logits
        positions, vocab = logits.shape
        self.keep = 2 * 8 * positions * vocab <= keep_bytes
        self._made: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    def dim(self) -> int:
        return 2

    def part(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(log-probabilities, probabilities, argmax)`` of positions ``start..stop-1`` (float64, float64, long)."""
        made = self._made.get((start, stop))
        if made is None:
            r = _logit_rows(self.logits, start, stop)
            lp_ref = torch.log_softmax(r.to(torch.float64), dim=-1)
            made = (lp_ref, lp_ref.exp(), r.argmax(dim=-1))
            if self.keep:
                self._made[(start, stop)] = made
        return made


def compare_logits(
    ref_logits: torch.Tensor | HeadLogits | ReferenceRows,
    logits: torch.Tensor | HeadLogits,
    targets: torch.Tensor,
    rows: int = 256,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position KL(ref || test), NLL of targets under test and ref, and top-1 agreement.

    Positions are compared ``rows`` at a time in float64 over the full vocabulary, so the extra memory is a few
    ``[rows, vocab]`` float64 tensors however many positions are scored (at 16k tokens of context a 152k-token
    vocabulary would otherwise need tens of GB); every position's numbers are the same as in one pass.

    Args:
        ref_logits: ``[positions, vocab]`` logits of the reference model (a tensor, or :class:`HeadLogits`, whose
            rows are made ``rows`` at a time), or :class:`ReferenceRows` of them, made once for several comparisons.
        logits: ``[positions, vocab]`` logits with the compressed cache (likewise).
        targets: ``[positions]`` next-token ids.
        rows: positions per float64 pass (at least 1).

    Returns:
        ``(kl, nll, nll_ref, same_top1)``, each ``[positions]`` (float64 / bool).

    Raises:
        ValueError: the shapes disagree or ``rows`` is below 1.
    """
    if ref_logits.shape != logits.shape or ref_logits.dim() != 2 or targets.shape != ref_logits.shape[:1]:
        raise ValueError(
            f"compare_logits needs ref_logits and logits [positions, vocab] and targets [positions]; got "
            f"{tuple(ref_logits.shape)}, {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if rows < 1:
        raise ValueError(f"rows must be at least 1, got {rows}")
    reference = ref_logits if isinstance(ref_logits, ReferenceRows) else ReferenceRows(ref_logits, keep_bytes=0)
    parts = []
    for a in range(0, ref_logits.shape[0], rows):
        lp_ref, p_ref, top_ref = reference.part(a, a + rows)
        t = _logit_rows(logits, a, a + rows)
        lp = torch.log_softmax(t.to(torch.float64), dim=-1)
        kl = (p_ref * (lp_ref - lp)).sum(dim=-1).clamp_min_(0.0)
        idx = targets[a : a + rows].view(-1, 1)
        nll = -lp.gather(1, idx).squeeze(1)
        nll_ref = -lp_ref.gather(1, idx).squeeze(1)
        parts.append((kl, nll, nll_ref, top_ref == t.argmax(dim=-1)))
    if not parts:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty.clone(), empty.clone(), torch.zeros(0, dtype=torch.bool)
    kl, nll, nll_ref, same = (torch.cat(x) for x in zip(*parts, strict=True))
    return kl, nll, nll_ref, same
