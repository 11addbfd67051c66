"""``walshkv rd``: rate-distortion of codecs on the model's real K/V (:mod:`walshkv.eval.rd`)."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import replace
from pathlib import Path

from walshkv import data, models
from walshkv.cli.common import (
    MODEL_HELP,
    SHOW_DEFAULT,
    TEXT_HELP,
    calibration_from_args,
    calibration_parent,
    model_parent,
    output_parent,
    windows_parent,
)
from walshkv.eval import rd
from walshkv.eval.report import command_line

__all__ = ["add_parsers"]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name).strip("-") or "model"


def _cmd_rd(args: argparse.Namespace) -> int:
    explicit = bool(args.codec)
    raw = list(args.codec or rd.DEFAULT_RD_CODECS)
    specs, skipped = rd.resolve_specs(raw, strict=explicit)  # the grammar, before loading anything
    config = rd.RDConfig(  # every setting, before loading anything
        specs, tokens=args.tokens, ctx=args.ctx, command=command_line(args), progress=not args.quiet
    )
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    specs, late = rd.resolve_specs(specs, lm.shape.head_dim, strict=explicit)
    skipped += late
    for s in skipped:
        print(f"rd: skipped {s['codec']}: {s['reason']}", file=sys.stderr)
    calibration = calibration_from_args(lm, specs, args, text)
    config = replace(config, codecs=specs, skipped=skipped, calibration=calibration)
    result = rd.measure_rd(lm, text, config)
    out = Path(args.out or f"rd-{_slug(lm.name)}")
    print(rd.describe_rd(result.meta))
    print(rd.format_rd_table(result.rows))
    written = rd.write_rd_outputs(result, out, plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv rd``."""
    rp = sub.add_parser(
        "rd",
        help="rate-distortion of codecs on the model's real K/V: normalised MSE vs bits, Gaussian bound, plot",
        description="Capture the K (post-RoPE) and V vectors that enter the cache, plus the queries, over "
        "--tokens tokens; encode and decode them with every codec; report per-layer relative MSE "
        "(sum err^2 / sum x^2, averaged over layers) for K and V, the attention-logit error and slope with "
        "the real queries, and the distance to the Gaussian bound 2^(-2R). Writes rd.json, rd.csv, rd.md "
        "and rd.png (needs matplotlib) under --out.",
        epilog="default codecs: "
        + " ".join(rd.DEFAULT_RD_CODECS)
        + " (those that do not parse or fit the head_dim are skipped with a note)\n"
        "example:\n  walshkv rd --model smollm2-135m --text ../shared/data/austen_emma.txt --tokens 2048",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[
            model_parent(MODEL_HELP + SHOW_DEFAULT, TEXT_HELP + SHOW_DEFAULT),
            windows_parent("tokens per forward pass" + SHOW_DEFAULT, windows_help=None),
            calibration_parent(),
            output_parent(out="output folder (default rd-MODEL)"),
        ],
    )
    rp.add_argument("--tokens", type=int, default=4096, help="tokens to capture, whole windows (default %(default)s)")
    rp.add_argument("--codec", action="append", metavar="SPEC", help="cache spec, repeatable (default: the list below)")
    rp.add_argument("--no-plot", action="store_true", help="skip rd.png")
    rp.set_defaults(func=_cmd_rd)
