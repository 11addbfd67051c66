"""The intervals of ``walshkv needle``: Wilson score intervals of every accuracy, the codecs paired with the
reference on the same trials (Newcombe's interval, exact McNemar), in the rows, tables, CSV and heatmaps, and
recomputed when runs are added together. Synthetic trial rows only: no model runs here."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest

from walshkv.eval import needle
from walshkv.eval.metrics import mcnemar_exact_p, paired_proportion_difference, wilson_ci95
from walshkv.eval.needle import BASELINE, NeedleResult

# ---------------------------------------------------------------------------------------------------------
# The interval functions (walshkv.eval.metrics)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("successes", "trials", "expected"),
    [
        (0, 10, (0.0, 0.2775)),  # textbook values (z = 1.96): the interval keeps a width at 0 of n
        (10, 10, (0.7225, 1.0)),
        (5, 10, (0.2366, 0.7634)),
        (8, 10, (0.4902, 0.9433)),
        (1, 1, (0.2065, 1.0)),
        (5, 5, (0.5655, 1.0)),
        (0, 5, (0.0, 0.4345)),
    ],
)
def test_wilson_matches_the_textbook(successes, trials, expected):
    low, high = wilson_ci95(successes, trials)
    assert (low, high) == (pytest.approx(expected[0], abs=5e-5), pytest.approx(expected[1], abs=5e-5))
    assert 0.0 <= low <= successes / trials <= high <= 1.0


def test_wilson_is_symmetric_and_refuses_impossible_counts():
    for n in (1, 7, 40):
        for k in range(n + 1):
            low, high = wilson_ci95(k, n)
            mirror = wilson_ci95(n - k, n)
            assert low == pytest.approx(1 - mirror[1]) and high == pytest.approx(1 - mirror[0])
    assert all(math.isnan(v) for v in wilson_ci95(0, 0))  # nothing measured
    with pytest.raises(ValueError, match=r"successes must be in \[0, trials = 10\], got 11"):
        wilson_ci95(11, 10)
    with pytest.raises(ValueError, match="got -1"):
        wilson_ci95(-1, 10)


def test_the_paired_interval_matches_published_examples():
    # Fagerland, Lydersen & Laake (2017), chapter 8: complete response before and after consolidation therapy
    # (Cavo et al. 2012), table [[59, 6], [16, 80]]: Newcombe square-and-add -0.0621 (95% CI -0.1186 to -0.0046)
    d, (low, high) = paired_proportion_difference(59, 6, 16, 80)
    assert d == pytest.approx(-10 / 161)
    assert (low, high) == (pytest.approx(-0.1186, abs=5e-5), pytest.approx(-0.0046, abs=5e-5))
    # airway hyper-responsiveness (Bentur et al. 2009), [[1, 1], [7, 12]]: -0.286 (-0.507 to -0.026)
    d, (low, high) = paired_proportion_difference(1, 1, 7, 12)
    assert d == pytest.approx(-6 / 21)
    assert (low, high) == (pytest.approx(-0.507, abs=5e-4), pytest.approx(-0.026, abs=5e-4))
    # swapping the two sides negates the difference and its interval
    d2, (low2, high2) = paired_proportion_difference(1, 7, 1, 12)
    assert (d2, low2, high2) == (pytest.approx(-d), pytest.approx(-high), pytest.approx(-low))


def test_the_paired_interval_by_hand():
    # every pair right on both sides: a margin is empty, so phi = 0 and the half-widths are the two Wilson
    # half-widths of 10 of 10 added in quadrature with one of them zero: +-(1 - 0.7225)
    d, (low, high) = paired_proportion_difference(10, 0, 0, 0)
    w = 1 - wilson_ci95(10, 10)[0]
    assert d == 0.0 and (low, high) == (pytest.approx(-w), pytest.approx(w))
    # 5 pairs: both right 3, only a 1, only b 0, neither 1: p_a = 4/5, p_b = 3/5; ad - bc = 3 exceeds n/2 = 2.5,
    # so phi = (3 - 2.5) / sqrt(4 * 1 * 3 * 2)
    (la, ua), (lb, ub) = wilson_ci95(4, 5), wilson_ci95(3, 5)
    phi = 0.5 / math.sqrt(24)
    below = math.sqrt((0.8 - la) ** 2 - 2 * phi * (0.8 - la) * (ub - 0.6) + (ub - 0.6) ** 2)
    above = math.sqrt((ua - 0.8) ** 2 - 2 * phi * (ua - 0.8) * (0.6 - lb) + (0.6 - lb) ** 2)
    d, (low, high) = paired_proportion_difference(3, 1, 0, 1)
    assert d == pytest.approx(0.2) and low == pytest.approx(0.2 - below) and high == pytest.approx(0.2 + above)
    # agreement at or below n / 2 counts as none (phi = 0): both 2, one each way, neither 1: ad - bc = 1 <= 2.5
    (la, ua) = wilson_ci95(3, 5)
    d, (low, high) = paired_proportion_difference(2, 1, 1, 1)
    assert d == 0.0 and high == pytest.approx(math.hypot(ua - 0.6, 0.6 - la)) and low == pytest.approx(-high)
    # disagreement widens it: both 1, two each way, neither 1: phi = (1 - 4) / sqrt(3 * 3 * 3 * 3) = -1/3
    (la, ua) = wilson_ci95(3, 6)
    d, (low, high) = paired_proportion_difference(1, 2, 2, 1)
    x, y = ua - 0.5, 0.5 - la
    assert d == 0.0 and high == pytest.approx(math.sqrt(x * x + 2 / 3 * x * y + y * y)) and low == pytest.approx(-high)
    # all lost: the whole interval below zero, clipped at -1
    d, (low, high) = paired_proportion_difference(0, 0, 5, 0)
    assert d == -1.0 and low == -1.0 and high < 0
    assert math.isnan(paired_proportion_difference(0, 0, 0, 0)[0])
    with pytest.raises(ValueError, match="at least 0"):
        paired_proportion_difference(1, -1, 0, 0)


def test_mcnemar_exact_p_by_hand():
    assert mcnemar_exact_p(1, 7) == mcnemar_exact_p(7, 1) == pytest.approx(18 / 256)  # 2 (1 + 8) / 2^8
    assert mcnemar_exact_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_exact_p(6, 16) == pytest.approx(2 * 110056 / 2**22)  # Cavo et al.: 0.052
    assert mcnemar_exact_p(0, 0) == mcnemar_exact_p(3, 3) == 1.0  # no disagreement, or an even split
    assert mcnemar_exact_p(0, 2000) < 1e-300 and mcnemar_exact_p(1000, 1000) == 1.0  # exact at any size
    with pytest.raises(ValueError, match="at least 0"):
        mcnemar_exact_p(-1, 2)


# ---------------------------------------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------------------------------------


def _row(codec: str, length: int, depth: float, sample: int, correct: bool, task: str = "single", score=None):
    return {
        "task": task,
        "codec": codec,
        "length": length,
        "depth": depth,
        "sample": sample,
        "correct": correct,
        "score": float(correct) if score is None else score,
        "prefill_seconds": 1.0,
        "decode_seconds": 0.5,
        "output": " 1234567",
        "answers": "1234567",
    }


def _rows(samples: range = range(5)) -> list[dict]:
    """Two lengths x two depths x the samples; the reference misses sample 4 at (1000, 1) (still measurable at
    4 of 5) and all but sample 0 at (2000, 0) (flagged); int2 loses samples 0 and 1 at (1000, 0) and sample 0 at
    (2000, 1), and finds sample 4 at (1000, 1) where the reference did not."""
    rows = []
    for length in (1000, 2000):
        for depth in (0.0, 1.0):
            for s in samples:
                ref = not ((length, depth) == (1000, 1.0) and s == 4) and ((length, depth) != (2000, 0.0) or s == 0)
                codec = {
                    (1000, 0.0): s >= 2,
                    (1000, 1.0): True,
                    (2000, 0.0): False,
                    (2000, 1.0): s != 0,
                }[(length, depth)]
                rows += [_row(BASELINE, length, depth, s, ref), _row("int2", length, depth, s, codec)]
    return rows


def _meta(rows: list[dict], command: str = "test") -> dict:
    """What :func:`run_needle` records, as far as the tables, the report and merging read it."""
    lengths = sorted({r["length"] for r in rows})
    return {
        "model": {"name": "toy"},
        "text": {"name": "toy-prose"},
        "command": command,
        "tasks": list(dict.fromkeys(r["task"] for r in rows)),
        "lengths": lengths,
        "depths": sorted({r["depth"] for r in rows}),
        "samples": max(r["sample"] for r in rows) + 1,
        "trials": len({needle.cells.trial_key(r) for r in rows}),
        "prompt": "plain",
        "new_tokens": {r["task"]: 12 for r in rows},
        "needles_per_trial": {r["task"]: 1 for r in rows},
        "needle": "The special magic number for {key} is: {7 digits}.",
        "reference": f"{BASELINE}: the toy",
        "min_baseline": 0.8,
        "threshold_note": "cells below 80% flagged",
        "prefill": "quantized",
        "prefill_note": "quantized",
        "prefill_chunk": 1024,
        "fused": False,
        "share_prefix": True,
        "residual": 0,
        "decoding": "greedy",
        "scoring": "exact match",
        "intervals": needle.cells.INTERVALS_NOTE,
        "calibration": None,
        "seed": 0,
        "seconds_trials": 1.0,
        "codecs": {
            BASELINE: {"bits_per_element": 32.0, "measured_at_length": lengths[-1]},
            "int2": {"bits_per_element": 2.5, "measured_at_length": lengths[-1]},
        },
        "versions": {"commit": "abc1234"},
        "cpu": {"model": "toy CPU"},
    }


def _result(rows: list[dict], command: str = "test") -> NeedleResult:
    return NeedleResult.from_rows(_meta(rows, command), rows, 0.8)


def _close(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b, strict=True))
    return a == pytest.approx(b, nan_ok=True)


def test_every_accuracy_has_its_wilson_interval():
    res = _result(_rows())
    for c in res.cells:
        assert _close(c["accuracy_ci95"], wilson_ci95(c["correct"], c["trials"]))
        ref = next(x for x in res.cells if x["codec"] == BASELINE and x["length"] == c["length"])
        if ref["depth"] == c["depth"]:
            assert c["baseline_accuracy_ci95"] == ref["accuracy_ci95"]
    cells = {(c["codec"], c["length"], c["depth"]): c for c in res.cells}
    assert cells[(BASELINE, 2000, 0.0)]["accuracy"] == 0.2 and not cells[(BASELINE, 2000, 0.0)]["measurable"]
    assert _close(cells[(BASELINE, 2000, 0.0)]["accuracy_ci95"], wilson_ci95(1, 5))
    low, high = cells[("int2", 1000, 0.0)]["accuracy_ci95"]  # 3 of 5
    assert (low, high) == (pytest.approx(0.2307, abs=5e-5), pytest.approx(0.8824, abs=5e-5))
    for table in (res.cells, res.summary, res.overall):
        for row in table:  # every share lies inside its interval
            for key in ("accuracy", "baseline_accuracy", "measured_accuracy", "measured_baseline_accuracy", "retained"):
                if key in row and row[key] is not None and row[key] == row[key]:
                    low, high = row[f"{key}_ci95"]
                    assert 0.0 <= low <= row[key] <= high <= 1.0, (key, row)
            assert "score_ci95" not in row  # the mean share has no interval


def test_the_codec_is_paired_with_the_reference_on_the_same_trials():
    res = _result(_rows())
    overall = {o["codec"]: o for o in res.overall}
    o = overall["int2"]
    # measurable cells: (1000, 0), (1000, 1), (2000, 1), 15 trials; the reference 14 right, int2 12
    assert o["measured_trials"] == 15 and o["flagged_cells"] == 1
    assert o["measured_accuracy"] == pytest.approx(12 / 15) and o["measured_baseline_accuracy"] == pytest.approx(
        14 / 15
    )
    assert (o["lost"], o["gained"]) == (3, 1)  # the discordant pairs
    assert _close(o["measured_accuracy_ci95"], wilson_ci95(12, 15))
    assert _close(o["measured_baseline_accuracy_ci95"], wilson_ci95(14, 15))
    assert o["retained"] == pytest.approx(11 / 14) and _close(o["retained_ci95"], wilson_ci95(11, 14))
    assert o["difference"] == pytest.approx((1 - 3) / 15) == o["measured_accuracy"] - o["measured_baseline_accuracy"]
    assert _close(o["difference_ci95"], paired_proportion_difference(11, 1, 3, 0)[1])
    assert o["mcnemar_p"] == pytest.approx(10 / 16)  # 2 (1 + 4) / 2^4
    low, high = o["difference_ci95"]
    assert low < o["difference"] < high and low < 0 < high  # 3 lost against 1 gained: not a verdict
    ref = overall[BASELINE]
    assert ref["difference"] is None and ref["difference_ci95"] is None and ref["mcnemar_p"] is None
    assert ref["lost"] == ref["gained"] == 0
    summary = {(s["codec"], s["length"]): s for s in res.summary}
    far = summary[("int2", 2000)]  # depth 0 is flagged: 5 pairs at depth 1, one lost
    assert far["measured_trials"] == 5 and (far["lost"], far["gained"]) == (1, 0)
    assert far["difference"] == pytest.approx(-0.2) and _close(
        far["difference_ci95"], paired_proportion_difference(4, 0, 1, 0)[1]
    )
    assert far["mcnemar_p"] == 1.0 and far["accuracy"] == 0.4  # over every trial: 4 of 10
    assert _close(far["accuracy_ci95"], wilson_ci95(4, 10)) and _close(
        far["baseline_accuracy_ci95"], wilson_ci95(6, 10)
    )
    assert summary[(BASELINE, 2000)]["difference"] is None


def test_a_cell_without_measurable_trials_has_no_intervals():
    rows = [_row(BASELINE, 1000, 0.5, s, False) for s in range(3)] + [
        _row("int2", 1000, 0.5, s, True) for s in range(3)
    ]
    res = _result(rows)
    (o,) = [o for o in res.overall if o["codec"] == "int2"]
    assert o["measured_trials"] == 0 and o["measured_accuracy"] is None and o["measured_accuracy_ci95"] is None
    assert o["retained_ci95"] is None and o["difference"] is None and o["difference_ci95"] is None
    assert o["mcnemar_p"] is None
    assert "n/a" in needle.format_needle_table(res, "single")


def test_multivalue_intervals_count_full_retrieval_per_trial():
    shares = [1.0, 0.75, 1.0, 0.5, 1.0]  # int2 finds every value in 3 of 5 trials
    rows = []
    for s, share in enumerate(shares):
        rows.append(_row(BASELINE, 1000, 0.5, s, True, task="multivalue"))
        rows.append(_row("int2", 1000, 0.5, s, share == 1.0, task="multivalue", score=share))
    res = _result(rows)
    (cell,) = [c for c in res.cells if c["codec"] == "int2"]
    assert cell["accuracy"] == 0.6 and cell["score"] == pytest.approx(0.85)
    assert _close(cell["accuracy_ci95"], wilson_ci95(3, 5)) and "score_ci95" not in cell
    (o,) = [o for o in res.overall if o["codec"] == "int2"]
    assert (o["lost"], o["gained"]) == (2, 0) and o["mcnemar_p"] == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------------
# Tables, CSV, heatmaps
# ---------------------------------------------------------------------------------------------------------


def test_the_table_shows_intervals_compactly():
    res = _result(_rows())
    table = needle.format_needle_table(res, "single")
    lines = table.splitlines()
    headers = ["cache", "bits/el", "L=1,000", "L=2,000", "all", "retained", "lost", "gained", "Δ", "pp", "p", "s/trial"]
    assert lines[0].split() == headers
    (ref,) = [ln for ln in lines if ln.startswith(BASELINE)]
    (low,) = [ln for ln in lines if ln.startswith("int2")]
    assert "93% [70, 99]" in ref and "⚑1" in ref  # 14 of 15 over every measurable cell
    assert "80% [55, 93]" in low  # 12 of 15: Wilson [0.548, 0.930]
    assert "79% [52, 92]" in low  # retained 11 of 14
    assert "-13 [-40, +15]" in low and "0.625" in low  # (1 - 3) / 15, Newcombe [-0.398, 0.147]; McNemar 1 vs 3
    md = needle.needle_markdown(res)
    assert "Wilson score intervals" in md and "Newcombe" in md and "McNemar" in md


def test_the_flag_note_counts_the_trials():
    note = needle.flag_note(_result(_rows()), "single")
    assert "L=2,000 at depth 0 (20%, 1 of 5)" in note and "L=1,000 90% [60, 98]" in note  # 9 of 10


def test_the_csv_carries_the_intervals_as_numbers(tmp_path: Path):
    res = _result(_rows())
    path = tmp_path / "n.csv"
    needle.write_needle_outputs(res, csv=path)
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert list(rows[0]) == list(needle.CSV_KEYS) and len(rows) == len(res.cells)
    for line, cell in zip(rows, res.cells, strict=True):
        assert float(line["accuracy_ci95_low"]) == pytest.approx(cell["accuracy_ci95"][0])
        assert float(line["accuracy_ci95_high"]) == pytest.approx(cell["accuracy_ci95"][1])
        assert float(line["baseline_accuracy_ci95_low"]) == pytest.approx(cell["baseline_accuracy_ci95"][0])
        assert float(line["bits_per_element"]) == res.meta["codecs"][cell["codec"]]["bits_per_element"]


def test_the_heatmap_cells_name_their_trials(tmp_path: Path, monkeypatch):
    pytest.importorskip("matplotlib")
    figures = []

    def keep(fig, path, **kwargs):
        figures.append(fig)
        return Path(path)

    monkeypatch.setattr(needle.report, "save_figure_atomic", keep)
    needle.plot_heatmaps(_result(_rows()), tmp_path / "n.png")
    (fig,) = figures
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert len(texts) == 2 * 2 * 2 and all(t.endswith("\nn=5") for t in texts)
    assert "20%\nn=5" in texts and "n: trials per cell" in fig._suptitle.get_text()


# ---------------------------------------------------------------------------------------------------------
# Runs added together
# ---------------------------------------------------------------------------------------------------------


def test_merged_runs_recompute_their_intervals_from_every_trial(tmp_path: Path):
    rows = _rows()
    first = _result([r for r in rows if r["sample"] < 2], "run 1")
    second = _result([r for r in rows if r["sample"] >= 2], "run 2")
    merged = needle.merge_needle_results(first, second)
    whole = _result(rows)
    for key in ("cells", "summary", "overall"):
        strip = [{k: v for k, v in r.items() if k != "seconds_per_trial"} for r in getattr(merged, key)]
        assert _close(
            [sorted(r.items()) for r in strip],
            [sorted({k: v for k, v in r.items() if k != "seconds_per_trial"}.items()) for r in getattr(whole, key)],
        ), key
    # not an average of the parts: the interval of 5 trials is narrower than either part's
    o = {r["codec"]: r for r in merged.overall}["int2"]
    parts = [{r["codec"]: r for r in p.overall}["int2"] for p in (first, second)]
    assert all(o["measured_accuracy_ci95"][1] - o["measured_accuracy_ci95"][0] < p["measured_accuracy_ci95"][1]
               - p["measured_accuracy_ci95"][0] for p in parts)  # fmt: skip
    # a file written before the intervals (rows without them) is read back and merged with them
    old = first.to_json()
    for key in ("cells", "summary", "overall"):
        for row in old[key]:
            for field in [k for k in row if k.endswith("_ci95") or k in ("difference", "mcnemar_p")]:
                del row[field]
    del old["meta"]["intervals"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    again = needle.merge_needle_results(needle.load_needle_result(path), second)
    assert _close([sorted(r.items()) for r in again.overall], [sorted(r.items()) for r in merged.overall])
    assert again.meta["intervals"] == needle.cells.INTERVALS_NOTE
