"""Figures typed in the docs' prose, checked against the result files they come from.

Generated blocks are checked by tests/test_docs.py; a figure that prose quotes from them (a range over the presets,
a row named in a sentence) is listed here with the file and rows it summarizes, so a rerun that moves a figure
fails this test until the sentence is rewritten. Prose is compared with its line breaks folded into spaces.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from walshkv.presets import dense_key_map

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"

Pick = Callable[[dict[str, Any]], bool]


@functools.cache
def _run(folder: str) -> dict[str, Any]:
    return json.loads((RESULTS / folder / "bench.json").read_text())


def _fast(row: dict[str, Any]) -> bool:
    """A preset row whose keys take no dense per-key map (the block frame), whatever name it was asked by."""
    return row["method"].startswith("walshkv:") and not dense_key_map(row["spec"])


def _max(row: dict[str, Any]) -> bool:
    """A preset row whose keys take ``eq+``'s per-key map (``walshkv:B-max``, or the plain name that means it)."""
    return row["method"].startswith("walshkv:") and dense_key_map(row["spec"])


def _named(name: str) -> Pick:
    return lambda row: row["method"] == name


def _starts(prefix: str) -> Pick:
    return lambda row: row["method"].startswith(prefix)


def _speeds(folder: str, pick: Pick, kv_len: int) -> list[float]:
    xs = [r["speedup_vs_best_sdpa"] for r in _run(folder)["attention"] if r["kv_len"] == kv_len and pick(r)]
    assert xs, f"{folder}: no row at kv_len {kv_len} for the claim"
    return xs


def span(folder: str, pick: Pick, kv_len: int | tuple[int, ...], digits: int = 2) -> str:
    """``"lo-hi"`` (or one value) of the picked rows' speed against the fastest SDPA, as the prose writes it."""
    lens = (kv_len,) if isinstance(kv_len, int) else kv_len
    xs = [x for n in lens for x in _speeds(folder, pick, n)]
    lo, hi = f"{min(xs):.{digits}f}", f"{max(xs):.{digits}f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _gen_row(folder: str, name: str) -> dict[str, Any]:
    """The generation row of a preset (``preset``) or codec (``codec``) named ``name``; ``dynamic`` the fp32
    DynamicCache row."""
    rows = _run(folder)["generation"]
    if name == "dynamic":
        rows = [r for r in rows if r["cache"] == "dynamic" and r["dtype"] == "float32"]
    else:
        rows = [r for r in rows if r["cache"] == "fused" and name in (r.get("preset"), r.get("codec"))]
    assert len(rows) == 1, f"{folder}: {len(rows)} generation rows for {name!r}"
    return rows[0]


def _gen_x(folder: str, name: str) -> str:
    """Decode speed of ``name`` against DynamicCache fp32 in the same run, as the bench's table writes it."""
    return f"{_gen_row(folder, 'dynamic')['step_ms'] / _gen_row(folder, name)['step_ms']:.2f}"


def _gen_ms(folder: str, name: str, key: str) -> str:
    return f"{_gen_row(folder, name)[key]:.0f}"


@dataclass(frozen=True)
class Claim:
    doc: str
    text: str  # the sentence's words, {0}, {1}, ... where the figures go
    figures: tuple[Callable[[], str], ...]

    def expected(self) -> str:
        return self.text.format(*(f() for f in self.figures))


def _time_ratios(folder: str, pair: tuple[Pick, Pick]) -> list[float]:
    """Per kv_len, the second picked row's time over the first's (the twin against the shipped spec)."""
    rows = _run(folder)["attention"]
    out = []
    for n in sorted({r["kv_len"] for r in rows}):
        a, b = (next(r for r in rows if r["kv_len"] == n and p(r.get("spec", r["method"]))) for p in pair)
        out.append(b["ms"] / a["ms"])
    return out


def ratio_span(folders: list[str], pair: tuple[Pick, Pick]) -> str:
    """``"lo-hi"`` of the twin's time ratios over every run and kv_len, as the prose writes it."""
    xs = [x for f in folders for x in _time_ratios(f, pair)]
    return f"{min(xs):.2f}-{max(xs):.2f}"


def _spec_has(*parts: str) -> Pick:
    return lambda spec: all(p in spec for p in parts)


@functools.cache
def _cost() -> list[dict[str, Any]]:
    return json.loads((RESULTS / "research" / "blockframe-cost" / "cost.json").read_text())["rows"]


def _cost_rows(models: tuple[str, ...], kv_len: int | None) -> list[dict[str, Any]]:
    rows = [r for r in _cost() if r["model"] in models and kv_len in (None, r["kv_len"])]
    assert rows, f"blockframe-cost: no row of {models} at {kv_len}"
    return rows


def _pct_span(xs: list[float]) -> str:
    lo, hi = f"{100 * min(xs):.0f}", f"{100 * max(xs):.0f}"
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def outside_share(models: tuple[str, ...], kv_len: int) -> str:
    """``(step - kernel) / step`` of the block-frame cost rows, as a percent span."""
    return _pct_span([(r["ms"]["step"] - r["ms"]["kernel"]) / r["ms"]["step"] for r in _cost_rows(models, kv_len)])


def kernel_over_no_frame() -> str:
    """The most the kernel alone takes over the whole no-frame step, over every cost row, as a percent."""
    return f"{100 * max(r['ms']['kernel'] / r['ms']['no frame'] - 1 for r in _cost()):.0f}%"


def no_frame_x(models: tuple[str, ...], kv_len: int) -> str:
    xs = [r["ms"]["sdpa-fp32"] / r["ms"]["no frame"] for r in _cost_rows(models, kv_len)]
    lo, hi = f"{min(xs):.2f}", f"{max(xs):.2f}"
    return lo if lo == hi else f"{lo}-{hi}"


@functools.cache
def _lc_kld() -> dict[str, Any]:
    return json.loads((RESULTS / "long-context" / "summary.json").read_text())["kld"]


def lc_kld(model: str, label: str, ctx: int) -> str:
    """A long-context table's mean KLD (docs/long-context.md), four decimals as the table writes it."""
    return f"{_lc_kld()[model][label][str(ctx)]['kld_mean']:.4f}"


def lc_kld_span(model: str, label: str) -> str:
    xs = [f"{c['kld_mean']:.4f}" for c in _lc_kld()[model][label].values()]
    return f"{min(xs)}-{max(xs)}"


def lc_rise_is_real_at_2k(model: str, label: str) -> bool:
    """The 2k interval lies above the 512-token mean."""
    cells = _lc_kld()[model][label]
    return cells["2048"]["kld_mean_ci95"][0] > cells["512"]["kld_mean"]


SMALL_HEADS = ("smollm2-135m", "qwen2.5-0.5b")
BIG_HEADS = ("qwen2.5-1.5b", "gemma3-270m")


def _tcq_row(table: str) -> Pick:
    return lambda spec: spec.startswith("tcq:3.5") and table in spec


BF16 = [f"trellis/bf16-bench/{m}" for m in ("smollm2-135m", "qwen2.5-1.5b", "gemma3-270m", "qwen2.5-0.5b")]
A2 = "bench-model-{}-avx2"
GEN_A2 = "bench-fast-gen-avx2"
BOTH = (16384, 65536)
Q05 = "qwen2.5-0.5b"
CLAIMS = [
    Claim(
        "docs/long-context.md",
        "From 512 to 8k tokens `walshkv:3` goes from {0} to {1}, `walshkv:3.5` from {2} to {3} and `walshkv:4.5` "
        "from {4} to {5}, while the rotated q8_0 K / q4_0 V pair (6.5 bits) stays within {6}.",
        (
            *(lambda b=b, c=c: lc_kld(Q05, f"walshkv:{b}", c) for b in ("3", "3.5", "4.5") for c in (512, 8192)),
            lambda: lc_kld_span(Q05, "rot+q8_0/rot+q4_0"),
        ),
    ),
    Claim(
        "docs/performance.md",
        "It is {0} of the step at 16k on smollm2-135m and qwen2.5-0.5b and {1} on qwen2.5-1.5b and gemma3-270m",
        (lambda: outside_share(SMALL_HEADS, 16384), lambda: outside_share(BIG_HEADS, 16384)),
    ),
    Claim(
        "docs/performance.md",
        "The kernel alone takes at most {0} longer than the whole `no frame` step",
        (kernel_over_no_frame,),
    ),
    Claim(
        "docs/performance.md",
        "`no frame` reaches only {0}x the fastest SDPA at 16k there",
        (lambda: no_frame_x(SMALL_HEADS, 16384),),
    ),
    Claim(
        "docs/trellis.md",
        "set 4 takes the trellis rows to {0}x set 2's time and the 3.5-bit fast preset's step to {1}x",
        (
            lambda: ratio_span(BF16, (_tcq_row("tables=2"), _tcq_row("tables=4"))),
            lambda: ratio_span(BF16, (_spec_has("ropeblock", "tables=2"), _spec_has("ropeblock", "tables=4"))),
        ),
    ),
    Claim(
        "README.md",
        "not on an AVX2-only one ({0}x and {1}x at 16k)",
        (
            lambda: span(A2.format("qwen2.5-1.5b"), _fast, 16384, 1),
            lambda: span(A2.format("gemma3-270m"), _fast, 16384, 1),
        ),
    ),
    Claim(
        "README.md",
        "block frame reaches {0}x on qwen2.5-1.5b, {1}x on gemma3-270m and {2}x on smollm2-135m",
        tuple(lambda m=m: span(A2.format(m), _fast, BOTH, 1) for m in ("qwen2.5-1.5b", "gemma3-270m", "smollm2-135m")),
    ),
    Claim(
        "docs/performance.md",
        "qwen2.5-1.5b by the least ({0}x at 16k, {1}x at 64k), then gemma3-270m ({2}x, {3}x) "
        "and smollm2-135m ({4}x, {5}x)",
        tuple(
            lambda m=m, n=n: span(A2.format(m), _fast, n)
            for m in ("qwen2.5-1.5b", "gemma3-270m", "smollm2-135m")
            for n in BOTH
        ),
    ),
    Claim(
        "docs/performance.md",
        "with no frame reach only {0}x at 16k against {1}x for the scalar `tq:3.5/tq:3` of the same bytes "
        "(gemma3-270m {2}x against {3}x)",
        (
            lambda: span(A2.format("qwen2.5-1.5b"), _starts("tcq:3.5"), 16384),
            lambda: span(A2.format("qwen2.5-1.5b"), _named("tq:3.5/tq:3"), 16384),
            lambda: span(A2.format("gemma3-270m"), _starts("tcq:3.5"), 16384),
            lambda: span(A2.format("gemma3-270m"), _named("tq:3.5/tq:3"), 16384),
        ),
    ),
    Claim(
        "docs/performance.md",
        "The `-max` presets are the slowest rows ({0}x on smollm2-135m, {1}x on qwen2.5-1.5b, "
        "{2}x on gemma3-270m at 16k)",
        tuple(lambda m=m: span(A2.format(m), _max, 16384) for m in ("smollm2-135m", "qwen2.5-1.5b", "gemma3-270m")),
    ),
    Claim(
        "docs/performance.md",
        "it put qwen2.5-1.5b's block frame higher ({0}x at 16k) and smollm2-135m's much lower ({1}x)",
        (
            lambda: span("bench-model-qwen2.5-1.5b-avx2code", _fast, 16384),
            lambda: span("bench-model-smollm2-135m-avx2code", _fast, 16384),
        ),
    ),
    Claim(
        "docs/performance.md",
        "the block-frame presets decode attention at about SDPA over fp32 at 16k ({0}x) and {1}x at 64k, the `-max` "
        "presets at {2}x and {3}x",
        (
            lambda: span("bench-fast-avx2", _fast, 16384),
            lambda: span("bench-fast-avx2", _fast, 65536),
            lambda: span("bench-fast-avx2", _max, 16384),
            lambda: span("bench-fast-avx2", _max, 65536),
        ),
    ),
    Claim(
        "docs/performance.md",
        "the shipped `walshkv:3.5` (the per-key map) decodes at {0}x DynamicCache fp32 at 8k, `walshkv:3.5-fast` at "
        "{1}x and `rot+int4` at {2}x",
        tuple(lambda c=c: _gen_x(GEN_A2, c) for c in ("walshkv:3.5", "walshkv:3.5-fast", "rot+int4")),
    ),
    Claim(
        "docs/performance.md",
        "({0} and {1} ms of the presets' steps against DynamicCache's {2} ms), and the trellis codes' encode another "
        "part (update {3}-{4} ms a step against `rot+int4`'s {5} ms)",
        (
            lambda: _gen_ms(GEN_A2, "walshkv:3.5", "attn_ms"),
            lambda: _gen_ms(GEN_A2, "walshkv:3.5-fast", "attn_ms"),
            lambda: _gen_ms(GEN_A2, "dynamic", "attn_ms"),
            lambda: _gen_ms(GEN_A2, "walshkv:3.5-fast", "update_ms"),
            lambda: _gen_ms(GEN_A2, "walshkv:3.5", "update_ms"),
            lambda: _gen_ms(GEN_A2, "rot+int4", "update_ms"),
        ),
    ),
]


def _folded(path: str) -> str:
    return " ".join((ROOT / path).read_text().split())


@pytest.mark.parametrize("claim", CLAIMS, ids=lambda c: f"{c.doc}:{c.text[:40]}")
def test_prose_figure_matches_its_result_file(claim: Claim) -> None:
    expected = claim.expected()
    assert expected in _folded(claim.doc), f"{claim.doc} should say: {expected}"


def test_span_formats_like_the_prose() -> None:
    assert (
        span("bench-fast-avx2", _named("rot+int4"), 16384)
        == f"{_speeds('bench-fast-avx2', _named('rot+int4'), 16384)[0]:.2f}"
    )
    with pytest.raises(AssertionError, match="no row"):
        span("bench-fast-avx2", _named("no-such-method"), 16384)


def test_set_4_trellis_codes_outrun_scalar_tq_at_16k_as_trellis_md_says() -> None:
    """trellis.md: "with it the 3.5-bit trellis codes decode faster than the scalar tq:3.5/tq:3 of the same bytes at
    16k on every model"."""
    assert "decode faster than the scalar `tq:3.5/tq:3` of the same bytes at 16k on every model" in _folded(
        "docs/trellis.md"
    )
    for folder in BF16:
        rows = [r for r in _run(folder)["attention"] if r["kv_len"] == 16384]
        tq = next(r for r in rows if r["method"] == "tq:3.5/tq:3")
        t4 = next(r for r in rows if _tcq_row("tables=4")(r.get("spec", r["method"])))
        assert t4["ms"] < tq["ms"], folder


def test_qwen05_rise_at_2k_is_outside_the_interval_as_long_context_md_says() -> None:
    assert "whose intervals exclude the 512-token means of all three" in _folded("docs/long-context.md")
    for b in ("3", "3.5", "4.5"):
        assert lc_rise_is_real_at_2k(Q05, f"walshkv:{b}"), b
    for c in (512, 2048, 8192):
        assert float(lc_kld(Q05, "walshkv:4.5", c)) < float(lc_kld(Q05, "rot+q8_0/rot+q4_0", c))
