"""``walshkv reconstruct``: K/V rebuilt from a kept fraction of coefficients per basis, and LLL."""

from __future__ import annotations

import argparse
from pathlib import Path

from walshkv import models
from walshkv.cli.common import require_at_least
from walshkv.data import load_text
from walshkv.eval.capture import capture_kv
from walshkv.eval.report import command_line
from walshkv_research.bases import make_basis
from walshkv_research.cli.common import capture_meta, capture_parents
from walshkv_research.reconstruct import SYNTHETIC_KINDS, synthetic_signals
from walshkv_research.reconstruct_report import (
    describe_reconstruct_run,
    format_lll_table,
    format_reconstruct_table,
    write_reconstruct_outputs,
)
from walshkv_research.reconstruct_run import DEFAULT_FRACTIONS, lll_measure, measure_reconstruction, signal_groups

__all__ = ["add_reconstruct_parser"]


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, e.g. 0.25,0.5,1, got {text!r}") from None
    if not values or any(not 0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {text!r}")
    return values


def _cmd_reconstruct(args: argparse.Namespace) -> int:
    bases = [b.strip() for b in args.basis.split(",")] if args.basis else None
    require_at_least(args, vectors=1, synthetic=1, lll_bits=1, lll_rows=1, lll_blocks=1)
    text = load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    d = lm.shape.head_dim
    for b in bases or []:
        make_basis(b, d)  # bad names fail before the capture
    capture = capture_kv(
        lm, text, tokens=args.tokens, ctx=args.ctx, channel_order=args.channel_order, progress=not args.quiet
    )
    signals = {k: signal_groups(x, args.vectors) for k, x in capture.kinds().items()}
    for kind in SYNTHETIC_KINDS:
        signals[kind] = synthetic_signals(kind, args.synthetic, d, seed=args.seed).unsqueeze(0)
    rows = measure_reconstruction(signals, bases=bases, fractions=args.fraction, progress=not args.quiet)
    command = command_line(args)
    meta = capture_meta(lm, text, capture, command)
    meta.update({"vectors_per_head": signals["v"].shape[1], "synthetic_vectors": args.synthetic, "seed": args.seed})
    meta["kept_count"] = "round(f * head_dim) coefficients for every basis (padded bases are not exact at f=1)"
    meta["fixed_positions"] = "per (layer, kv-head), the positions of largest mean energy over the same vectors"
    if args.lll:
        meta["lll"] = {
            kind: lll_measure(signals[kind], bits=args.lll_bits, rows=args.lll_rows, blocks=args.lll_blocks)
            for kind in ("k_post", "k_pre")
        }
    print(describe_reconstruct_run(meta))
    print(format_reconstruct_table(rows, 0.5 if 0.5 in args.fraction else args.fraction[0]))
    if args.lll:
        print(format_lll_table(meta["lll"]))
    written = write_reconstruct_outputs(
        rows, meta, Path(args.out or f"reconstruct-{lm.name.replace('/', '-')}"), not args.no_plot
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_reconstruct_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv reconstruct``."""
    rp = sub.add_parser(
        "reconstruct",
        help="reconstruct K/V (and synthetic signals) from a kept fraction of coefficients: WHT, DCT, Fourier, "
        "Vilenkin, identity",
        description="Capture K (after and before RoPE) and V; for every basis keep the largest coefficients per "
        "vector (topk), the positions of largest mean energy (fixed), or only signs with one amplitude per "
        "vector (signs) or per position (signs+amp); report correlation and relative MSE. Synthetic "
        "prime-harmonic, chirp and white-noise signals run alongside. --lll adds the LLL experiment "
        "(pip install -e 'research[lll]'). See research/README.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: walshkv reconstruct --text ../shared/data/austen_emma.txt --lll",
        parents=capture_parents(out="output folder (default reconstruct-MODEL)"),
    )
    rp.add_argument("--fraction", type=_floats, default=list(DEFAULT_FRACTIONS), help="comma-separated kept fractions")
    rp.add_argument(
        "--basis",
        help="comma-separated bases (walsh, dct, fourier, vilenkin, vilenkin:R1x..xRm, identity); "
        "default: all of them, with the padded 3/5 Vilenkin and the exact radix-4 one",
    )
    rp.add_argument("--vectors", type=int, default=512, help="tokens sampled per (layer, kv-head)")
    rp.add_argument("--synthetic", type=int, default=2048, help="synthetic vectors of each kind")
    rp.add_argument("--seed", type=int, default=0, help="seed of the synthetic signals")
    rp.add_argument("--lll", action="store_true", help="also LLL-reduce blocks of quantized K index vectors")
    rp.add_argument("--lll-bits", type=int, default=4, help="code width of the LLL experiment")
    rp.add_argument("--lll-rows", type=int, default=16, help="tokens per LLL block")
    rp.add_argument("--lll-blocks", type=int, default=64, help="LLL blocks")
    rp.add_argument("--no-plot", action="store_true", help="skip reconstruct.png")
    rp.set_defaults(func=_cmd_reconstruct)
