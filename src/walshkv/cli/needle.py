"""``walshkv needle``: needle-in-a-haystack / passkey retrieval with compressed caches (:mod:`walshkv.eval.needle`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import get_args

from walshkv import data, models
from walshkv.cli.common import (
    MODEL_HELP,
    SHOW_DEFAULT,
    TEXT_HELP,
    calibration_from_args,
    calibration_parent,
    model_parent,
    output_parent,
    print_presets,
)
from walshkv.codecs import name_spec
from walshkv.constants import Prefill
from walshkv.eval import needle
from walshkv.eval.report import calibration_meta, command_line
from walshkv.fileio import check_output_path
from walshkv.presets import name_specs

__all__ = ["add_parsers"]

_EXAMPLES = """\
examples:
  walshkv needle --codec rot+q4_0 --codec q4_0 --lengths 1024,2048 --depths 0,0.5,1 --samples 2   # a quick look
  walshkv needle --text ../shared/data/austen_emma.txt --lengths 1024,2048,4096,8192 --task single \\
      --task multikey --codec walshkv:3.5 --kv-mean-center smollm2-3.5.gguf \\
      --codec rot+q4_0 --codec kivi2 --json n.json --csv n.csv --markdown n.md --png n.png
  walshkv needle --codec none --lengths 1024,4096         # the uncompressed model alone: where does it succeed?
"""


def _int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number of at least ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _max_positions(lm: models.LoadedModel) -> int | None:
    cfg = lm.model.config.get_text_config(decoder=True)
    value = getattr(cfg, "max_position_embeddings", None)
    return int(value) if value else None


def _cmd_needle(args: argparse.Namespace) -> int:
    lengths = needle.parse_lengths(args.lengths)  # every argument checked before loading anything
    depths = needle.parse_depths(args.depths)
    if not 0.0 <= args.min_baseline <= 1.0:
        raise ValueError(f"--min-baseline must be a share in [0, 1] (0.8 = 80%), got {args.min_baseline}")
    if args.png:
        check_output_path(args.png, what="--png")
    raw = args.codec or list(needle.DEFAULT_NEEDLE_CODECS)
    codecs = [] if raw == ["none"] else raw
    codecs = [name_spec(c) for c in codecs]  # parsed once, before loading anything
    tasks = list(dict.fromkeys(args.task or ["single"]))
    earlier = needle.load_needle_result(args.add_to) if args.add_to else None  # a bad file fails before any work
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    trials = []
    for task in tasks:
        trials += needle.make_trials(
            lm.tokenizer,
            text.content,
            task=task,
            lengths=lengths,
            depths=depths,
            samples=args.samples,
            seed=args.seed,
            prompt=args.prompt,
            new_tokens=args.new_tokens,
            keys=args.keys,
            values=args.values,
            max_positions=_max_positions(lm),
        )
    calibration = calibration_from_args(lm, codecs, args, text)
    codecs = name_specs(codecs, calibration, model=lm)  # a known model's shipped specs, or the file's
    print_presets(codecs)
    if earlier is not None:  # refused here, before the first trial, rather than after hours of them
        needle.check_can_add(
            earlier,
            model=lm.name,
            text=text.name,
            codecs=[c.text for c in codecs],
            trials=trials,
            settings={
                "seed": args.seed,
                "prompt": " / ".join(dict.fromkeys(t.prompt for t in trials)),
                "min_baseline": args.min_baseline,
                "prefill": args.prefill,
                "prefill_chunk": args.prefill_chunk,
                "fused": args.fused,
                "residual": args.residual,
                "calibration": calibration_meta(calibration),
            },
        )
    config = needle.NeedleConfig(
        codecs,
        calibration=calibration,
        prefill=args.prefill,
        residual=args.residual,
        prefill_chunk=args.prefill_chunk,
        fused=args.fused,
        share_prefix=not args.no_share_prefix,
        min_baseline=args.min_baseline,
        progress=not args.quiet,
    )
    result = needle.run_needle(lm, text, trials, config, command=command_line(args), seed=args.seed)
    if earlier is not None:
        result = needle.merge_needle_results(earlier, result)
    print(needle.describe_needle(result.meta))
    for task in result.meta["tasks"]:
        print(f"\n{task}:")
        print(needle.format_needle_table(result, task))
    written = needle.write_needle_outputs(result, json=args.json, csv=args.csv, markdown=args.markdown, png=args.png)
    for path in written:
        print(f"wrote {path}")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv needle``."""
    np_ = sub.add_parser(
        "needle",
        help="needle-in-a-haystack / passkey retrieval: exact-match accuracy per depth and length, per codec",
        description="Hide 7-digit 'special magic numbers' in a haystack of whole sentences of --text at each depth "
        "and length (RULER's NIAH tasks: single, multikey, multivalue; seeded), ask for them at the end (in the "
        "model's chat template when it has one), decode greedily with the uncompressed cache first, then with "
        "each --codec (quantize on write: the prompt's K/V compressed before attention reads it; prefilled in "
        "chunks), and score by exact match. A codec's accuracy is reported only in the cells (task, length, depth) "
        "where the uncompressed model itself reaches --min-baseline; the rest is flagged. Every accuracy comes with "
        "its 95% Wilson interval (the trial as the unit), and each codec with its paired difference from the "
        "uncompressed model on the same trials (Newcombe's interval, exact McNemar p). Lengths count the prompt and "
        "the answer.",
        epilog=_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[
            model_parent(MODEL_HELP + SHOW_DEFAULT, TEXT_HELP + SHOW_DEFAULT),
            calibration_parent(),
            output_parent(
                json="write everything (meta, summaries, cells, every trial's answer) as JSON",
                csv="write the cells (task, cache, length, depth: accuracy and its interval) as CSV",
                markdown="write the report (the run, a table per task, the needles lost) as markdown",
            ),
        ],
    )
    np_.add_argument(
        "--codec",
        action="append",
        metavar="SPEC",
        help="cache spec or preset, repeatable, as for eval (default: "
        f"{' '.join(needle.DEFAULT_NEEDLE_CODECS)}; 'none': the uncompressed reference alone)",
    )
    np_.add_argument(
        "--task",
        action="append",
        choices=needle.TASKS,
        help="repeatable (default single): single needle; multikey (distractor needles with other keys); "
        "multivalue (several numbers of one key, all asked for)",
    )
    np_.add_argument(
        "--lengths",
        default=",".join(map(str, needle.DEFAULT_LENGTHS)),
        help="context lengths in tokens, prompt + answer (comma list; 8k = 8192) (default %(default)s)",
    )
    np_.add_argument(
        "--depths",
        default=",".join(f"{d:g}" for d in needle.DEFAULT_DEPTHS),
        help="needle depths in [0, 1] (0: before the haystack, 1: right before the question) (default %(default)s)",
    )
    np_.add_argument(
        "--samples",
        type=_int_at_least(1),
        default=needle.DEFAULT_SAMPLES,
        help="trials per (task, length, depth), each with its own needle and haystack start; every accuracy comes "
        "with its 95%% Wilson interval, so use at least 5 for numbers you publish (default %(default)s)",
    )
    np_.add_argument("--seed", type=int, default=0, help="base seed of needles and haystacks (default %(default)s)")
    np_.add_argument(
        "--prompt",
        choices=needle.PROMPTS,
        default="auto",
        help="chat: the model's chat template; plain: completion text; auto: chat where the tokenizer has a "
        "template (default %(default)s)",
    )
    np_.add_argument(
        "--new-tokens",
        type=_int_at_least(1),
        metavar="N",
        help="most tokens generated per answer (default 12 per number asked for)",
    )
    np_.add_argument(
        "--keys", type=_int_at_least(2), default=4, help="multikey: needles per trial (default %(default)s)"
    )
    np_.add_argument(
        "--values", type=_int_at_least(2), default=4, help="multivalue: numbers per key (default %(default)s)"
    )
    np_.add_argument(
        "--min-baseline",
        type=float,
        default=needle.MIN_BASELINE,
        metavar="SHARE",
        help="the uncompressed accuracy a cell (task, length, depth) needs for codec losses there to be reported; "
        "the others are flagged (default %(default)s)",
    )
    np_.add_argument(
        "--prefill",
        choices=get_args(Prefill),
        default="quantized",
        help="quantized: quantize on write (walshkv's convention); exact: each prefill chunk attends to its own exact "
        "K/V, stored compressed (serving engines') (default %(default)s)",
    )
    np_.add_argument(
        "--prefill-chunk",
        type=_int_at_least(1),
        default=1024,
        metavar="N",
        help="prompt tokens per forward (default %(default)s)",
    )
    np_.add_argument(
        "--residual",
        type=_int_at_least(0),
        default=0,
        help="keep this many recent tokens in full precision, walshkv codecs (default %(default)s)",
    )
    np_.add_argument(
        "--fused",
        action="store_true",
        help="attention reads walshkv's packed codes directly (same quantization, faster decoding)",
    )
    np_.add_argument(
        "--no-share-prefix",
        action="store_true",
        help="prefill every trial from an empty cache (default: the depths of one length and sample reuse the "
        "haystack they share, cropped back to the first token that differs: same codes, less work)",
    )
    np_.add_argument(
        "--add-to",
        metavar="JSON",
        help="the --json file of an earlier run with the same model, text, --codec list and settings: this run's "
        "trials (other lengths, depths or samples) are added to its trials, and every output holds both, with each "
        "run's command, commit and CPU (a long grid in parts; the file itself is only rewritten if --json names it)",
    )
    np_.add_argument(
        "--png", metavar="PATH", help="write the depth x length heatmaps, a panel per cache (needs matplotlib)"
    )
    np_.set_defaults(func=_cmd_needle)
