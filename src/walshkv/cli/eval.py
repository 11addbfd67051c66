"""``walshkv eval``: KL divergence / perplexity of cache codecs against the uncompressed cache."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, get_args

from walshkv import data, models
from walshkv.calibration import collect_kv_stats
from walshkv.cli.common import (
    calibration_from_args,
    calibration_parent,
    model_parent,
    output_parent,
    print_presets,
    windows_parent,
)
from walshkv.codecs import NamedSpec, SpecLike, name_spec
from walshkv.constants import Feed, Prefill, Score
from walshkv.data import Text
from walshkv.defaults import CALIB_TOKENS
from walshkv.eval import evaluate
from walshkv.eval.calibrated import shipped_for
from walshkv.eval.fit import fit_specs
from walshkv.eval.report import (
    command_line,
    decode_note,
    describe_run,
    format_table,
    write_csv,
    write_json,
    write_markdown,
)
from walshkv.presets import name_specs
from walshkv.recommend import split_text
from walshkv.shipped import CalibrationSet

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike

__all__ = ["MAIN_CODECS", "add_parsers", "default_calibration", "fit_codecs", "shipped_note"]


#: What ``walshkv eval`` runs with no ``--codec``: the uncompressed reference row, walshkv's presets (the model's
#: shipped specs) and the peers users compare them with at similar bits: llama.cpp's types with the rotation, as
#: upstream now applies it (q8_0 K / q4_0 V at 6.5 bits, q4_0 and iq4_nl at 4.5), KIVI (5 and 3 bits with its
#: fp16 window), TurboQuant-class tq (4.06 and 3.06 bits at head_dim 64), and the quantized caches vLLM 0.32 ships
#: (``--kv-cache-dtype turboquant_*`` and ``int4_per_token_head``, emulated byte for byte: docs/serving.md). All run
#: on the core install and on every model of ``walshkv models list`` (KIVI holds gemma3's sliding-window layers too);
#: on another model, one that does not fit (its head size, its layer types) is left out with a note before anything
#: runs.
MAIN_CODECS = (
    "fp16",
    "walshkv:4.5",
    "walshkv:3.5",
    "walshkv:3",
    "rot+q8_0/rot+q4_0",
    "rot+iq4_nl",
    "rot+q4_0",
    "kivi4",
    "kivi2",
    "tq:4",
    "tq:3",
    "vllm:turboquant_k8v4",
    "vllm:turboquant_4bit_nc",
    "vllm:turboquant_k3v4_nc",
    "vllm:turboquant_3bit_nc",
    "vllm:int4_per_token_head",
)


def default_calibration(text: Text) -> tuple[Text, Text]:
    """``(calibration text, evaluation text)`` for the default run: never the same text.

    The presets need a K mean (and eq+ transforms): python-docs calibrates them, unless python-docs is what is
    evaluated; then its first half calibrates and its second half is evaluated (as ``walshkv recommend`` splits
    its selection text).
    """
    docs = data.load_text("python-docs")
    if text.content != docs.content:
        return docs, text
    calib, rest = split_text(text)
    return calib, Text(f"{text.name}[eval]", rest.source, rest.content)


def shipped_note(calibration: CalibrationSet, text: Text) -> str:
    """The line ``walshkv eval`` prints when the presets read the calibration shipped with walshkv."""
    described = calibration.describe()
    files = "; ".join(
        f"{f['file']} (sha256 {f['sha256'][:16]}..., {', '.join(f['presets'])})" for f in described["files"]
    )
    tokens = described.get("tokens")
    source = f"{tokens:,} tokens of {described.get('text')}" if isinstance(tokens, int) else described.get("text")
    return (
        f"calibration: shipped with walshkv for {described['model']}, sha256 and model identity checked: {files}; "
        f"made from {source}; evaluating on {text.name}; --calib-text or --kv-mean-center choose otherwise"
    )


def fit_codecs(codecs: list[SpecLike], config: Any, model: Any, *, required: bool) -> list[NamedSpec]:
    """The run's codecs checked against the model's config before any calibration or forward
    (:func:`walshkv.eval.fit.fit_specs`): asked-for codecs that do not fit are refused; default ones are left
    out, each with a note on stderr saying why. Returns the kept ones as :class:`~walshkv.codecs.NamedSpec`."""
    kept, left_out = fit_specs(codecs, config, model=model, required=required)
    label = getattr(model, "name", model)
    for codec, why in left_out.items():
        print(f"note: {codec} is left out of the default set on {label}: {why}", file=sys.stderr, flush=True)
    if not kept:
        raise ValueError(f"none of the default codecs fits {label}; choose some with --codec")
    return kept


def _cmd_eval(args: argparse.Namespace) -> int:
    # parsed once, here, before loading anything; from then on the run holds NamedSpec objects, not text
    codecs: list[NamedSpec] = [name_spec(c) for c in args.codec or MAIN_CODECS]
    config = models.layout_config(args.model)  # a registry model's or a folder's: checked before loading
    if config is not None:
        codecs = fit_codecs(codecs, config, args.model, required=bool(args.codec))
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    # only loading told (a .gguf file, a hub id): checked now, still before calibration; else the model's presets
    codecs = fit_codecs(codecs, lm.model.config, lm, required=bool(args.codec)) if config is None else codecs
    # a calibration input given (a file, a text, a token count) wins over the files shipped with walshkv
    inputs = bool(args.calib_text or args.kv_mean_center)
    explicit = inputs or args.calib_tokens != CALIB_TOKENS
    shipped = None if explicit else shipped_for(lm, codecs)  # checked: a bad file stops the run here
    calibration: CalibrationLike | None
    if shipped is not None:
        _, text = default_calibration(text)  # python-docs is evaluated on its second half: the files saw its first
        print(shipped_note(shipped, text), file=sys.stderr, flush=True)
        calibration = shipped
    elif not args.codec and not inputs:  # a model walshkv ships none for, or --calib-tokens: calibrated in the run
        calib, text = default_calibration(text)
        print(
            f"calibrating the presets on {calib.name} ({args.calib_tokens:,} tokens), evaluating on {text.name}; "
            "--calib-text or --kv-mean-center choose otherwise",
            file=sys.stderr,
            flush=True,
        )
        calibration = collect_kv_stats(lm, calib, tokens=args.calib_tokens, progress=not args.quiet)
    else:
        calibration = calibration_from_args(lm, codecs, args, text)
    codecs = name_specs(codecs, calibration, model=lm)  # the presets again, now with the calibration (its file's spec)
    print_presets(codecs)
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
    result.meta["command"] = command_line(args)
    print(describe_run(result.meta))
    print(format_table(result.results))
    if note := decode_note(result.results):
        print(f"\n{note}")
    if args.json:
        write_json(args.json, result.to_json())
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, result.results)
        print(f"wrote {args.csv}")
    if args.markdown:
        write_markdown(args.markdown, result.meta, result.results, result.meta["command"])
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
        "--codec",
        action="append",
        metavar="SPEC",
        help=f"cache spec or preset, repeatable (default: {' '.join(MAIN_CODECS)}). Without --kv-mean-center, "
        "--calib-text or --calib-tokens, presets on a model walshkv ships calibration for read the shipped files "
        "(checked: sha256 and the model's identity); on any other model, or with --calib-tokens N, the default set's "
        "presets are calibrated in the run on python-docs. Either way python-docs as the evaluation text is evaluated "
        "on its second half",
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
