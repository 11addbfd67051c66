"""``walshkv eval``: KL divergence / perplexity of cache codecs against the uncompressed cache."""

from __future__ import annotations

import argparse
import sys
from typing import get_args

from walshkv import data, models
from walshkv.cli.common import calibration_from_args, calibration_parent, model_parent, output_parent, windows_parent
from walshkv.codecs import parse_cache_spec
from walshkv.constants import Feed, Prefill, Score
from walshkv.eval import DEFAULT_CODECS, evaluate
from walshkv.eval.report import command_line, describe_run, format_table, write_csv, write_json, write_markdown
from walshkv.presets import resolve_specs

__all__ = ["add_parsers"]


def _cmd_eval(args: argparse.Namespace) -> int:
    codecs = args.codec or list(DEFAULT_CODECS)
    for c in codecs:  # fail before loading anything
        parse_cache_spec(c)
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    calibration = calibration_from_args(lm, codecs, args, text)
    codecs, preset_of = resolve_specs(codecs, calibration)
    for spec, name in preset_of.items():
        print(f"{name} = {spec}", file=sys.stderr)
    result = evaluate(
        lm,
        text,
        codecs,
        ctx=args.ctx,
        windows=args.windows,
        score=args.score,
        residual=args.residual,
        calibration=calibration,
        feed=args.feed,
        decode_chunk=args.decode_chunk,
        prefill=args.prefill,
        progress=not args.quiet,
    )
    command = command_line(args)
    result.meta["command"] = command
    for row in result.results:
        if row["codec"] in preset_of:
            row["preset"] = preset_of[row["codec"]]
    print(describe_run(result.meta))
    print(format_table(result.results))
    if args.json:
        write_json(args.json, result.to_json())
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, result.results)
        print(f"wrote {args.csv}")
    if args.markdown:
        write_markdown(args.markdown, result.meta, result.results, command)
        print(f"wrote {args.markdown}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv eval``."""
    ev = sub.add_parser(
        "eval",
        help="KL divergence / perplexity of cache codecs against the uncompressed cache",
        description="Cut the text into consecutive windows of --ctx tokens; run each window once with an "
        "uncompressed cache (the reference) and once per codec with every token's K/V compressed on "
        "write; compare the scored logits in float64 (mean/p99 KLD, top-1 agreement, PPL ratio).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        parents=[
            model_parent(),
            windows_parent(),
            calibration_parent(),
            output_parent(
                json="write {meta, results} as JSON",
                csv="write the results as CSV",
                markdown="write a markdown table with the run described",
            ),
        ],
    )
    ev.add_argument(
        "--codec", action="append", metavar="SPEC", help=f"cache spec, repeatable (default: {' '.join(DEFAULT_CODECS)})"
    )
    ev.add_argument(
        "--score",
        choices=get_args(Score),
        default="half",
        help="score the second half of each window (llama-perplexity) or all positions",
    )
    ev.add_argument(
        "--residual", type=int, default=0, help="keep this many recent tokens in full precision (counted in the bits)"
    )
    ev.add_argument(
        "--feed",
        choices=get_args(Feed),
        default="auto",
        help="window: one forward per window, every token compressed on write; decode: the unscored prefix "
        "in one forward, then one forward per scored token, as in generation; auto: decode for Hugging "
        "Face caches (hf-quanto:B, hf-hqq:B, hf-fp8), which return their first write unquantized",
    )
    ev.add_argument(
        "--decode-chunk",
        type=int,
        default=1,
        metavar="N",
        help="scored tokens per forward with --feed decode (1: as in generation; larger is faster and "
        "the share of full-precision context it adds is reported)",
    )
    ev.add_argument(
        "--prefill",
        choices=get_args(Prefill),
        default="quantized",
        help="quantized (default): quantize on write, every token attention reads was compressed first; exact: "
        "serving-engine style (vLLM's TurboQuant backend, Hugging Face's QuantizedCache): the unscored prefix "
        "attends to its exact K/V, stored compressed, then the scored tokens are decoded (implies --feed decode); "
        "compare with those engines on their terms, report quantize-on-write numbers as walshkv's own",
    )
    ev.set_defaults(func=_cmd_eval)
