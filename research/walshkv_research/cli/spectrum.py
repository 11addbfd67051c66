"""``walshkv spectrum``: K/V energy per Walsh-Hadamard band (:mod:`walshkv_research.spectrum`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from walshkv import models
from walshkv.data import load_text
from walshkv.eval.capture import capture_kv
from walshkv.eval.report import command_line
from walshkv_research.cli.common import capture_meta, capture_parents
from walshkv_research.spectrum import measure_spectrum
from walshkv_research.spectrum_report import describe_spectrum_run, format_spectrum_table, write_spectrum_outputs

__all__ = ["add_spectrum_parser"]


def _cmd_spectrum(args: argparse.Namespace) -> int:
    text = load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    d = lm.shape.head_dim
    if args.bands < 1 or d % args.bands:
        raise ValueError(f"--bands must divide head_dim {d}, got {args.bands}")
    capture = capture_kv(
        lm, text, tokens=args.tokens, ctx=args.ctx, channel_order=args.channel_order, progress=not args.quiet
    )
    command = command_line(args)
    result = measure_spectrum(capture, args.bands, capture_meta(lm, text, capture, command))
    print(describe_spectrum_run(result.meta))
    print(format_spectrum_table(result.rows))
    written = write_spectrum_outputs(
        result, Path(args.out or f"spectrum-{lm.name.replace('/', '-')}"), not args.no_plot
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_spectrum_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv spectrum``."""
    sp = sub.add_parser(
        "spectrum",
        help="WHT energy of K (before/after RoPE) and V per layer and band: table, heatmaps, JSON/CSV",
        description="Capture K after RoPE, K before RoPE (rotated back exactly) and V on real text; report the "
        "share of energy per Walsh-Hadamard band (natural and sequency order), spectral flatness, and how "
        "many coefficients hold 90%% of each vector's energy (WHT against plain channels). See research/README.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: walshkv spectrum --text ../shared/data/austen_emma.txt --bands 8",
        parents=capture_parents(out="output folder (default spectrum-MODEL)"),
    )
    sp.add_argument("--bands", type=int, default=4, help="equal bands over the head_dim coefficients")
    sp.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    sp.set_defaults(func=_cmd_spectrum)
