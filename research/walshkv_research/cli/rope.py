"""``walshkv rope``: PrimePE factors (``rope factors``) and the alpha sweep (``rope sweep``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from tabulate import tabulate

from walshkv import models
from walshkv.cli.common import (
    MODEL_HELP,
    calibration_from_args,
    calibration_parent,
    model_parent,
    output_parent,
    windows_parent,
)
from walshkv.codecs import parse_cache_spec
from walshkv.data import load_text
from walshkv.defaults import DEFAULT_MODEL
from walshkv.eval.report import command_line
from walshkv_research.primepe import (
    CONVENTIONS,
    GENERATORS,
    PAIRINGS,
    frequency_factors,
    rotary_tables,
    write_rope_freqs,
)
from walshkv_research.rope_report import describe_rope_run, format_rope_table, write_rope_outputs
from walshkv_research.rope_sweep import DEFAULT_ALPHAS, measure_rope_sweep

__all__ = ["add_rope_parser"]


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, e.g. 0,0.1,0.2, got {text!r}") from None
    if not values or any(not math.isfinite(v) or not 0.0 <= v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"alphas must be numbers in [0, 1], got {text!r}")
    return values


def _names(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [x.strip() for x in text.split(",") if x.strip()]
        bad = [n for n in names if n not in allowed]
        if not names or bad:
            raise argparse.ArgumentTypeError(f"choose among {', '.join(allowed)} (comma-separated), got {text!r}")
        return names

    return parse


def _cmd_factors(args: argparse.Namespace) -> int:
    lm = models.load_model(args.model, progress=not args.quiet)
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
        if chosen is None:
            raise ValueError(f"{lm.name} has no rotary frequency table: there are no factors to write to {args.output}")
        qual, theta, f = chosen
        meta = {
            "generator": args.generator,
            "alpha": float(args.alpha),
            "pairing": args.pairing,
            "model": lm.name,
            "architecture": lm.shape.arch,
            "head_dim": int(lm.shape.head_dim),
            "table": qual,
        }
        path = write_rope_freqs(args.output, f, args.convention, meta)
        print(f"wrote {path}: rope_freqs.weight ({f.numel()} values, the divisor llama.cpp applies) from {qual}")
    return 0


def _cmd_sweep(args: argparse.Namespace) -> int:
    codecs = list(args.codec or [])
    for c in codecs:
        parse_cache_spec(c)  # fail before loading anything
    text = load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    calibration = calibration_from_args(lm, codecs, args, text) if codecs else None
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
    print(describe_rope_run(result.meta))
    print(format_rope_table(result.rows))
    out = Path(args.out or f"rope-{lm.name.replace('/', '-')}")
    written = write_rope_outputs(result, out, plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_rope_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv rope factors`` and ``walshkv rope sweep``."""
    rope = sub.add_parser(
        "rope",
        help="PrimePE: composite/prime-tiered RoPE frequency factors; print, export (GGUF) or sweep alpha",
        description="PrimePE blends a lattice of composite (or prime) integers, rescaled onto the model's "
        "own rotary frequency range, into its frequencies: b = (1 - alpha) theta + alpha lattice, "
        "factor = b / theta. 'multiply' applies theta * factor (the document's docstring), 'divide' "
        "theta / factor (llama.cpp's rope_freqs divides the angle). See research/README.md.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  walshkv rope factors --alpha 0.2 -o primepe.gguf\n"
        "  walshkv rope sweep --text ../shared/data/austen_emma.txt\n"
        "  walshkv rope sweep --alpha 0,0.1,0.2 --codec rot+q4_0",
    )
    rsub = rope.add_subparsers(dest="rope_command", metavar="ACTION", required=True)

    pairing = argparse.ArgumentParser(add_help=False)
    pairing.add_argument(
        "--pairing",
        choices=PAIRINGS,
        default="published",
        help="published: the ascending lattice meets the descending frequencies (as the document's code "
        "does; factors 0.8 .. ~0.2*base at alpha 0.2); matched: both run the same way (default %(default)s)",
    )

    fa = rsub.add_parser(
        "factors",
        help="print the per-pair factors for a model, optionally write them as a GGUF rope_freqs file",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        parents=[pairing, output_parent()],
    )
    fa.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
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
        parents=[
            model_parent(),
            pairing,
            windows_parent(),
            calibration_parent(),
            output_parent(out="output folder (default rope-MODEL)"),
        ],
    )
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
    sw.add_argument("--no-plot", action="store_true", help="skip rope.png")
    sw.set_defaults(func=_cmd_sweep)
