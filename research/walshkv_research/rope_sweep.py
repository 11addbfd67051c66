"""``walshkv rope``: PrimePE factors (``rope factors``) and the alpha sweep (``rope sweep``).

The sweep cuts the text into windows (as ``walshkv eval`` does), runs every window once through the
unmodified model with an uncompressed cache (the reference), then once per configuration: a generator
(:data:`~walshkv_research.primepe.GENERATORS`), a convention (``multiply``/``divide``), an alpha, and a cache
(uncompressed, or each ``--codec``, compressed on write). Each row has mean/p99 KLD against the
reference, top-1 agreement and the perplexity ratio on the scored positions. The row with alpha 0 and
no codec is the unmodified model itself (KLD 0, PPL ratio 1: a check of the harness); alpha 0 with a
codec is the codec alone, the baseline against which composition is read.

Outputs in ``--out``: ``rope.json`` (meta and rows), ``rope.csv``, ``rope.md``, ``rope.png``.
"""

from __future__ import annotations

import argparse
import math
import textwrap
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from walshkv.eval.harness import _forward, library_versions
from walshkv.eval.metrics import TokenMetrics, compare_logits
from walshkv.eval.outputs import command_line, write_result_files
from walshkv.eval.windows import describe_scored, make_windows, scored_positions
from walshkv_research.primepe import (
    CONVENTIONS,
    GENERATORS,
    PAIRINGS,
    frequency_factors,
    rope_factors_applied,
    rotary_tables,
    write_rope_freqs,
)

__all__ = [
    "DEFAULT_ALPHAS",
    "RopeSweepResult",
    "add_rope_parser",
    "format_rope_table",
    "measure_rope_sweep",
    "plot_rope",
    "write_rope_outputs",
]

DEFAULT_ALPHAS: tuple[float, ...] = (0.0, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)
NONE = "none"


@dataclass
class RopeSweepResult:
    """``meta`` describes the run; ``rows`` has one dict per (generator, convention, alpha, codec)."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.rows}


def _configs(
    alphas: Sequence[float], generators: Sequence[str], conventions: Sequence[str]
) -> list[tuple[str, str, float]]:
    configs = [(NONE, NONE, 0.0)] if 0.0 in alphas else []
    for gen in generators:
        for conv in conventions:
            configs += [(gen, conv, a) for a in alphas if a != 0.0]
    return configs


@torch.inference_mode()
def measure_rope_sweep(
    lm: Any,
    text: Any,
    *,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    generators: Sequence[str] = ("composite", "prime"),
    conventions: Sequence[str] = CONVENTIONS,
    pairing: str = "published",
    codecs: Sequence[str] = (),
    ctx: int = 512,
    windows: int | None = 8,
    score: str = "half",
    calibration: Any = None,
    progress: bool = True,
    command: str = "",
) -> RopeSweepResult:
    """Perplexity and KLD of PrimePE against the unmodified model, with and without KV codecs.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text` to evaluate on.
        alphas: blend weights in ``[0, 1]``; 0 is the unmodified rotary embedding.
        generators: from :data:`~walshkv_research.primepe.GENERATORS`.
        conventions: ``multiply`` and/or ``divide``.
        pairing: ``published`` or ``matched`` (see :mod:`walshkv_research.primepe`).
        codecs: cache specs to compose with (every configuration also runs uncompressed).
        ctx, windows, score: as for ``walshkv eval``.
        calibration: for calibrated codecs (computed on the unmodified model).
        progress: show a progress bar.
        command: the command line, recorded in the result.

    Returns:
        A :class:`RopeSweepResult`.
    """
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from walshkv.cache import make_cache
    from walshkv.codecs import parse_cache_spec

    for a in alphas:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"--alpha values must be in [0, 1], got {a}")
    for g in generators:
        if g not in GENERATORS:
            raise ValueError(f"--generator must be among {', '.join(GENERATORS)}, got {g!r}")
    for c in conventions:
        if c not in CONVENTIONS:
            raise ValueError(f"--convention must be among {', '.join(CONVENTIONS)}, got {c!r}")
    if pairing not in PAIRINGS:
        raise ValueError(f"--pairing must be one of {', '.join(PAIRINGS)}, got {pairing!r}")
    specs = [parse_cache_spec(c) for c in codecs]
    for spec in specs:
        spec.check_head_dim(lm.info["head_dim"])
        make_cache(spec, config=lm.model.config, calibration=calibration)  # fail before any forward
    configs = _configs(alphas, generators, conventions)
    if not configs:
        raise ValueError("nothing to run: give at least one alpha")
    caches = [NONE, *[s.spec for s in specs]]
    model = lm.model
    device = next(model.parameters()).device
    first, last = scored_positions(ctx, score)
    win = make_windows(lm.tokenizer, text.content, ctx, windows)
    n_win = win.ids.shape[0]
    keep = ctx - first
    metrics = {(c, k): TokenMetrics() for c in configs for k in caches}
    factor_range: dict[tuple[str, str, float], tuple[float, float]] = {}
    for gen, _conv, a in configs:
        if gen != NONE:
            fs = [frequency_factors(getattr(m, b), gen, a, pairing) for _, m, b in rotary_tables(model)]
            factor_range[(gen, _conv, a)] = (min(float(f.min()) for f in fs), max(float(f.max()) for f in fs))
    bar = tqdm(total=n_win * (1 + len(configs) * len(caches)), desc="rope sweep", unit="fwd", disable=not progress)
    started = time.perf_counter()
    for w in range(n_win):
        ids = win.ids[w : w + 1].to(device)
        targets = win.ids[w, first + 1 : last + 1].to(device)
        ref = _forward(model, ids, DynamicCache(config=model.config), keep)[: last - first]
        bar.update()
        for gen, conv, a in configs:
            bar.set_postfix_str(f"window {w + 1}/{n_win}: {gen} {conv} alpha={a:g}")
            for cache_name, spec in zip(caches, [None, *specs], strict=True):
                if gen == NONE and cache_name == NONE:
                    logits = ref  # the unmodified, uncompressed model is the reference itself
                else:
                    cache = (
                        DynamicCache(config=model.config)
                        if spec is None
                        else make_cache(spec, config=model.config, calibration=calibration)
                    )
                    if gen == NONE:
                        logits = _forward(model, ids, cache, keep)[: last - first]
                    else:
                        with rope_factors_applied(model, gen, a, conv, pairing):
                            logits = _forward(model, ids, cache, keep)[: last - first]
                metrics[((gen, conv, a), cache_name)].add(*compare_logits(ref, logits, targets))
                bar.update()
    bar.close()
    rows = []
    for cfg in configs:
        for cache_name in caches:
            gen, conv, a = cfg
            row: dict[str, Any] = {"generator": gen, "convention": conv, "alpha": a, "codec": cache_name}
            row.update(metrics[(cfg, cache_name)].summary())
            lo, hi = factor_range.get(cfg, (1.0, 1.0))
            row.update({"factor_min": lo, "factor_max": hi})
            rows.append(row)
    m = lm.info
    meta = {
        "model": {"name": lm.name, "source": lm.source, **m},
        "rotary_tables": [q for q, _, _ in rotary_tables(model)],
        "text": {"name": text.name, "source": text.source, "chars": len(text.content), "tokens": win.text_tokens},
        "ctx": ctx,
        "windows": n_win,
        "window_starts": [w * ctx for w in range(n_win)],
        "score": score,
        "scored_positions": describe_scored(first, last),
        "scored_tokens": n_win * (last - first),
        "bos_first_token": win.bos,
        "pairing": pairing,
        "reference": "the same model, unmodified rotary embedding, uncompressed DynamicCache",
        "codecs": list(caches[1:]),
        "calibration": None if calibration is None else calibration.describe(),
        "quantize_on_write": True,
        "seconds_total": time.perf_counter() - started,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": library_versions(),
        "command": command,
    }
    return RopeSweepResult(meta, rows)


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------

_CSV_KEYS = (
    "generator",
    "convention",
    "alpha",
    "codec",
    "kld_mean",
    "kld_p99",
    "top1_agreement",
    "ppl",
    "ppl_ref",
    "ppl_ratio",
    "ppl_ratio_ci95",
    "factor_min",
    "factor_max",
    "scored_tokens",
)


def format_rope_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """The rows as a table (generator, convention, alpha, codec, KLD, top-1, PPL, factor range)."""
    from tabulate import tabulate

    body = [
        [
            r["generator"],
            r["convention"],
            f"{r['alpha']:g}",
            r["codec"],
            f"{r['kld_mean']:.4g}",
            f"{r['kld_p99']:.4g}",
            f"{100 * r['top1_agreement']:.1f}%",
            f"{r['ppl']:.4g}",
            f"{r['ppl_ratio']:.4f}",
            f"{r['factor_min']:.3g}..{r['factor_max']:.3g}",
        ]
        for r in rows
    ]
    headers = [
        "generator",
        "convention",
        "alpha",
        "cache",
        "KLD mean",
        "KLD p99",
        "top-1",
        "PPL",
        "PPL ratio",
        "factors",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def _describe(meta: dict[str, Any]) -> str:
    m, t = meta["model"], meta["text"]
    return (
        f"Model {m['name']} ({m.get('arch')}, head_dim {m.get('head_dim')}); text {t['name']}; "
        f"{meta['windows']} windows of {meta['ctx']} tokens, {meta['scored_tokens']:,} scored tokens "
        f"({meta['scored_positions']}); pairing {meta['pairing']}; reference: {meta['reference']}."
    )


def plot_rope(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """PPL ratio and mean KLD against alpha, one line per (generator, convention, cache)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {r["codec"]: r for r in rows if r["generator"] == NONE}
    lines: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["generator"] != NONE:
            lines.setdefault((r["generator"], r["convention"], r["codec"]), []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for (gen, conv, cache), rs in sorted(lines.items()):
        pts = ([base[cache]] if cache in base else []) + sorted(rs, key=lambda r: r["alpha"])
        label = f"{gen} / {conv}" + ("" if cache == NONE else f" + {cache}")
        style = "-" if conv == "divide" else "--"
        xs = [r["alpha"] for r in pts]
        axes[0].plot(xs, [r["ppl_ratio"] for r in pts], style, marker="o", ms=3, label=label)
        pos = [r for r in pts if r["kld_mean"] > 0]  # the reference itself (KLD 0) has no place on a log axis
        axes[1].plot([r["alpha"] for r in pos], [r["kld_mean"] for r in pos], style, marker="o", ms=3, label=label)
    axes[0].axhline(1.0, color="grey", lw=0.8)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("alpha")
    axes[0].set_ylabel("PPL / PPL of the unmodified model (log)")
    axes[1].set_yscale("log")
    axes[1].set_xlabel("alpha")
    axes[1].set_ylabel("mean KLD vs the unmodified model (log)")
    axes[1].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def write_rope_outputs(result: RopeSweepResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``rope.json``, ``rope.csv``, ``rope.md`` and (with matplotlib) ``rope.png``; return the paths."""
    lines = [f"# PrimePE sweep: {result.meta['model']['name']} on {result.meta['text']['name']}", ""]
    lines += [_describe(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    lines += [format_rope_table(result.rows, "github"), ""]

    def draw(out: Path) -> list[Path]:
        plot_rope(result.rows, out / "rope.png", _describe(result.meta))
        return [out / "rope.png"]

    return write_result_files(out_dir, "rope", result.to_json(), result.rows, _CSV_KEYS, lines, draw if plot else None)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, e.g. 0,0.1,0.2, got {text!r}") from None
    if not values or any(not math.isfinite(v) or not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"alphas must be numbers in [0, 1], got {text!r}")
    return values


def _names(allowed: Sequence[str]) -> Any:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(allowed)} (comma-separated), got {text!r}")
        return names

    return parse


def _cmd_factors(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from walshkv.models import load_model

    lm = load_model(args.model, progress=not args.quiet)
    tables = rotary_tables(lm.model)
    rows = []
    chosen = None
    for qual, module, buf in tables:
        theta = getattr(module, buf).to(torch.float64)
        f = frequency_factors(theta, args.generator, args.alpha, args.pairing)
        new = theta * f if args.convention == "multiply" else theta / f
        if chosen is None or "full_attention" in qual:
            chosen = (qual, theta, f)
        for i in range(theta.numel()):
            rows.append([qual, i, f"{float(theta[i]):.6g}", f"{float(f[i]):.6g}", f"{float(new[i]):.6g}"])
    print(tabulate(rows, headers=["table", "pair", "theta", "factor", f"theta after ({args.convention})"]))
    if args.output:
        assert chosen is not None
        qual, theta, f = chosen
        meta = {
            "generator": args.generator,
            "alpha": float(args.alpha),
            "pairing": args.pairing,
            "model": lm.name,
            "architecture": lm.info["arch"],
            "head_dim": int(lm.info["head_dim"]),
            "table": qual,
        }
        path = write_rope_freqs(args.output, f, args.convention, meta)
        print(f"wrote {path}: rope_freqs.weight ({f.numel()} values, the divisor llama.cpp applies) from {qual}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    from walshkv.cli import calibrate_if_needed
    from walshkv.codecs import parse_cache_spec
    from walshkv.data import load_text
    from walshkv.models import load_model

    codecs = list(args.codec or [])
    for c in codecs:
        parse_cache_spec(c)  # fail before loading anything
    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    calibration = calibrate_if_needed(lm, codecs, args, text) if codecs else None
    command = command_line(args)
    result = measure_rope_sweep(
        lm,
        text,
        alphas=args.alpha,
        generators=args.generator,
        conventions=args.convention,
        pairing=args.pairing,
        codecs=codecs,
        ctx=args.ctx,
        windows=args.windows,
        calibration=calibration,
        progress=not args.quiet,
        command=command,
    )
    print(_describe(result.meta))
    print(format_rope_table(result.rows))
    out = Path(args.out or f"rope-{lm.name.replace('/', '-')}")
    written = write_rope_outputs(result, out, plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_rope_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv rope factors`` and ``walshkv rope sweep``."""
    from walshkv.cli import add_calibration_args
    from walshkv.data import DEFAULT_TEXT, TEXTS
    from walshkv.models import DEFAULT_MODEL, MODELS

    rope = sub.add_parser(
        "rope",
        help="PrimePE: composite/prime-tiered RoPE frequency factors; print, export (GGUF) or sweep alpha",
        description="PrimePE blends a lattice of composite (or prime) integers, rescaled onto the model's "
        "own rotary frequency range, into its frequencies: b = (1 - alpha) theta + alpha lattice, "
        "factor = b / theta. 'multiply' applies theta * factor (the document's docstring), 'divide' "
        "theta / factor (llama.cpp's rope_freqs divides the angle). See docs/research.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  walshkv rope factors --alpha 0.2 -o primepe.gguf\n"
        "  walshkv rope sweep --text ../shared/data/austen_emma.txt\n"
        "  walshkv rope sweep --alpha 0,0.1,0.2 --codec rot+q4_0",
    )
    rsub = rope.add_subparsers(dest="rope_command", metavar="ACTION", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            default=DEFAULT_MODEL,
            help=f"{', '.join(MODELS)}, a .gguf path or a folder (default %(default)s)",
        )
        p.add_argument(
            "--pairing",
            choices=PAIRINGS,
            default="published",
            help="published: the ascending lattice meets the descending frequencies (as the document's code "
            "does; factors 0.8 .. ~0.2*base at alpha 0.2); matched: both run the same way (default %(default)s)",
        )
        p.add_argument("--quiet", action="store_true", help="no progress bars")

    fa = rsub.add_parser(
        "factors",
        help="print the per-pair factors for a model, optionally write them as a GGUF rope_freqs file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common(fa)
    fa.add_argument("--generator", choices=GENERATORS, default="composite", help="frequency-factor generator")
    fa.add_argument("--alpha", type=float, default=0.2, help="blend weight in [0, 1]")
    fa.add_argument("--convention", choices=CONVENTIONS, default="divide", help="what the factor does to the frequency")
    fa.add_argument(
        "-o",
        "--output",
        metavar="FILE",
        help="write rope_freqs.weight (the angle divisor llama.cpp applies; gemma3: the global table) as GGUF",
    )
    fa.set_defaults(func=_cmd_factors)

    sw = rsub.add_parser(
        "sweep",
        help="perplexity and KLD against the unmodified model over alphas, generators, conventions (and codecs)",
        description="Every window runs once unmodified with an uncompressed cache (the reference), then once "
        "per (generator, convention, alpha) and cache. Writes rope.json, rope.csv, rope.md and rope.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    common(sw)
    sw.add_argument("--text", default=DEFAULT_TEXT, help=f"{', '.join(TEXTS)}, or a path to a UTF-8 file")
    sw.add_argument(
        "--alpha", type=_floats, default=list(DEFAULT_ALPHAS), help="comma-separated blend weights in [0, 1]"
    )
    sw.add_argument(
        "--generator",
        type=_names(GENERATORS),
        default=["composite", "prime"],
        help=f"comma-separated, among {', '.join(GENERATORS)} (geometric is the identity)",
    )
    sw.add_argument(
        "--convention", type=_names(CONVENTIONS), default=list(CONVENTIONS), help="comma-separated conventions"
    )
    sw.add_argument(
        "--codec",
        action="append",
        metavar="SPEC",
        help="also run every configuration with this cache codec (repeatable): do PrimePE and the codec compose?",
    )
    sw.add_argument("--ctx", type=int, default=512, help="tokens per window")
    sw.add_argument("--windows", type=int, default=8, help="windows (0: every full window)")
    add_calibration_args(sw)
    sw.add_argument("--out", metavar="DIR", help="output folder (default rope-MODEL)")
    sw.add_argument("--no-plot", action="store_true", help="skip rope.png")
    sw.set_defaults(func=_cmd_sweep)
