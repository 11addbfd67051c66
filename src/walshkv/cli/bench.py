"""``walshkv bench``: packed-code attention vs torch SDPA, generation vs DynamicCache (:mod:`walshkv.bench`).

``walshkv bench attention`` and ``walshkv bench generation`` run one part with its options (and the shared
calibration and output options); ``walshkv bench`` alone runs both and takes every option. ``--part
attention|generation|all`` still works for one release, with a one-line warning on stderr, and means the same as
the subcommand (or ``walshkv bench`` for ``all``), including its old checks.
"""

from __future__ import annotations

import argparse
import copy
import functools
import sys
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, get_args

import torch

from walshkv import bench
from walshkv.bench.generation import shipped_preset_file
from walshkv.cli.common import calibration_parent
from walshkv.constants import Prefill
from walshkv.defaults import CALIB_TOKENS, DEFAULT_MODEL
from walshkv.eval.report import command_line, write_result_files
from walshkv.export import read_kv_mean_center
from walshkv.presets import is_preset

__all__ = ["PARTS", "add_parsers"]


def _ints(text: str) -> list[int]:
    try:
        values = [int(x.replace("k", "000").replace("K", "000")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts, e.g. 1024,4096, got {text!r}"
        ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"token counts must be positive, got {text!r}")
    return values


def _check(
    args: argparse.Namespace,
) -> tuple[bench.GenerationBenchConfig, list[bench.GenerationCodec], list[str]] | None:
    """Refuse counts below 1, a CUDA device that is not there and generation settings or codecs that cannot run,
    before anything runs.

    Returns:
        Without a generation part ``None``; else its config with the codecs resolved (presets resolved,
        calibration in hand), those codecs, and the notes to print (presets the default table leaves out).
    """
    if args.repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {args.repeats}")
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.part in ("all", "attention") and args.device.startswith("cuda"):
        index = torch.device(args.device).index or 0
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if index >= count:
            seen = f"{count} CUDA device(s) (cuda:0 .. cuda:{count - 1})" if count else "no CUDA device"
            raise ValueError(
                f"--device {args.device}: torch sees {seen} here; use --device cpu or an existing GPU "
                "(a CUDA build of torch: pip install 'walshkv[gpu]')"
            )
    if args.part not in ("all", "generation"):
        given = (
            ("--gen-codec", args.gen_codec),
            ("--calib-text", args.calib_text),
            ("--dynamic-dtype", args.dynamic_dtype),
            ("--prefill", args.prefill != "quantized"),
        )
        for flag, value in given:
            if value:
                raise ValueError(
                    f"{flag} is for the generation part: run `walshkv bench generation` (or `walshkv bench` for both)"
                )
        if args.kv_mean_center and not args.codec:
            raise ValueError(
                "--kv-mean-center with the attention part calibrates the codecs you name: add --codec SPEC "
                "(e.g. --codec walshkv:3.5)"
            )
        return None
    config = _generation_config(args)  # every setting checked before the codecs load anything
    gen_codecs: list[Any] | None = args.gen_codec
    if gen_codecs and not args.kv_mean_center and not args.calib_text:  # presets with their shipped files
        gen_codecs = [(c, f) if (f := _shipped_file(args.model, c)) else c for c in gen_codecs]
    resolved, notes = bench.resolve_generation_codecs(
        config.model,
        gen_codecs,
        kv_mean_center=config.kv_mean_center,
        calib_text=config.calib_text,
        calib_tokens=config.calib_tokens,
        text=config.text,
        progress=config.progress,
    )
    return replace(config, codecs=resolved, kv_mean_center=None, calib_text=None), resolved, notes


def _generation_config(args: argparse.Namespace) -> bench.GenerationBenchConfig:
    """The generation part's settings from the command line (its codecs as given, not resolved yet)."""
    return bench.GenerationBenchConfig(
        args.model,
        args.ctx,
        args.gen_codec,
        kv_mean_center=args.kv_mean_center,
        calib_text=args.calib_text,
        calib_tokens=args.calib_tokens,
        dynamic_dtypes=args.dynamic_dtype or bench.DYNAMIC_DTYPES,
        new_tokens=args.new_tokens,
        prefill_chunk=args.prefill_chunk,
        decoded=args.decoded,
        reserve=not args.no_reserve,
        malloc_mmap_threshold=args.malloc_mmap_threshold,
        prefill=args.prefill,
        runs=args.gen_runs,
        progress=not args.quiet,
    )


def _shipped_file(model: str, codec: str) -> str | None:
    """The calibration file walshkv ships for preset ``codec`` on ``model`` (``walshkv/calibrations/<model>/...``, its
    sha256 checked), or ``None`` (not a preset, or none shipped)."""
    path = shipped_preset_file(model, codec) if is_preset(codec) else None
    return None if path is None else str(path)


def _shipped_calibrations(model: str, codecs: Sequence[str]) -> dict[str, Any]:
    """Without ``--kv-mean-center``: each preset of ``codecs`` with the file walshkv ships for it and ``model``,
    so that presets run side by side with their own files."""
    files = {c: _shipped_file(model, c) for c in codecs}
    return {c: read_kv_mean_center(path) for c, path in files.items() if path is not None}


def _cmd_bench(args: argparse.Namespace) -> int:
    _resolve_part(args)
    generation = _check(args)
    bandwidth = None
    if args.part in ("all", "attention"):
        bandwidth = bench.copy_bandwidth(device=args.device)  # the machine's, on all its threads
        if args.threads is not None:
            torch.set_num_threads(args.threads)  # before the machine line, which records the threads the rows ran with
    meta: dict[str, Any] = {
        "machine": bench.machine_description(),
        "command": command_line(args),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    result: dict[str, Any] = {"meta": meta}
    if args.part in ("all", "attention"):
        meta["device"] = args.device
        if args.device.startswith("cuda") and torch.cuda.is_available():
            meta["machine"]["gpu"] = torch.cuda.get_device_name(torch.device(args.device))
        meta["copy_bandwidth_gb_per_s"] = bandwidth
        calibration = read_kv_mean_center(args.kv_mean_center) if args.kv_mean_center and args.codec else None
        shapes = bench.attention_shapes(args.model)
        meta["attention_model"] = {"model": args.model, **shapes}
        att_config = bench.AttentionBenchConfig(
            kv_lens=args.kv_len,
            codecs=args.codec or bench.DEFAULT_ATTENTION_CODECS,
            **shapes,
            repeats=args.repeats,
            device=args.device,
            calibration=calibration,
            # presets take the files this checkout ships for --model, whose attention shapes these are
            calibrations=None if calibration is not None else _shipped_calibrations(args.model, args.codec or ()),
            layer=args.layer,
            model=args.model,
            progress=not args.quiet,
            cold=args.cold,
        )
        meta["cold"] = args.cold  # caches flushed before every timed call
        att = bench.bench_attention(att_config)
        result["attention"] = att
        print(bench.format_attention_table(att, meta["copy_bandwidth_gb_per_s"]))
    if generation is not None:
        config, gen_codecs, notes = generation
        for line in notes:
            print(line)
        gen = bench.bench_generation(config)
        result["generation"] = gen
        meta["crossover_context"] = {c.name: bench.crossover(gen, "fused", c.spec) for c in gen_codecs}
        meta["notes"] = [*notes, *bench.position_notes(gen)]
        print(bench.format_generation_table(gen))
        print("crossover: " + "; ".join(f"{name}: {ctx}" for name, ctx in meta["crossover_context"].items()))
        for line in bench.position_notes(gen):
            print(line)
    for line in bench.targets(result):
        print(line)
    rows = [*(result.get("attention") or []), *(result.get("generation") or [])]
    keys = sorted({k for r in rows for k in r})
    written = write_result_files(
        args.out,
        "bench",
        result,
        rows,
        keys,
        bench.bench_markdown(result),
        None if args.no_plot else (lambda out: bench.plot_bench(result, out / "bench.png")),
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


#: The parts of the bench, each a subcommand: ``walshkv bench attention``, ``walshkv bench generation``.
PARTS = ("attention", "generation")

_DESCRIPTION = bench.__doc__.split("\n\n", 1)[1] if bench.__doc__ else ""

_ATTENTION_EXAMPLES = """\
  walshkv bench attention --kv-len 1024,16384
  walshkv bench attention --kv-len 16384 --codec walshkv:3.5 --codec walshkv:3.5-fast   # each with its shipped file
  walshkv bench attention --kv-len 16384 --codec walshkv:4.5 --codec rot+int4 --kv-mean-center my-4.5.gguf
  walshkv bench attention --device cuda --kv-len 16384,65536   # the Triton kernel (pip install 'walshkv[gpu]')
"""

_GENERATION_EXAMPLES = """\
  walshkv bench generation --ctx 1024,8192 --new-tokens 16
  walshkv bench generation --ctx 8176 --gen-codec walshkv:3.5 --gen-codec rot+int4   # the shipped calibration
  walshkv bench generation --ctx 8176 --gen-codec walshkv:3.5 --kv-mean-center my-3.5.gguf   # a file of yours
  walshkv bench generation --ctx 8176 --gen-codec walshkv:3.5 --gen-runs 3   # a preset, medians of 3 runs
"""

_BENCH_EPILOG = f"""\
parts:
  `walshkv bench attention` and `walshkv bench generation` run one part and take its options (PART --help lists
  them); `walshkv bench` alone runs both and takes the options of both. Options may come before or after PART;
  one of the other part is refused.
  --part attention|generation|all is deprecated (removed in the next release): it still works, with a warning,
  and means `walshkv bench attention` / `walshkv bench generation` / `walshkv bench`.

examples:
  walshkv bench --kv-len 1024,16384 --ctx 1024,8176 --codec walshkv:3.5 --gen-codec walshkv:3.5   # both parts
{_ATTENTION_EXAMPLES}{_GENERATION_EXAMPLES}"""


def _part_description(part: str) -> str:
    """``walshkv bench PART --help``'s description: the item of :mod:`walshkv.bench`'s docstring on ``part`` and
    the outputs."""
    paragraphs = _DESCRIPTION.split("\n\n")
    own = [p for p in paragraphs if p.lstrip("0123456789. ").startswith(f"**{part.capitalize()}**")]
    return "\n\n".join([*own, *(p for p in paragraphs if p.startswith("Outputs"))])


def _add_options(parser: argparse.ArgumentParser, part: str | None) -> argparse.ArgumentParser:
    """Add the options of ``walshkv bench PART`` (``part`` None: both parts', for ``walshkv bench``) to
    ``parser``, which has the calibration options already unless ``part`` is attention. A subcommand lists its
    part's options as its own; ``walshkv bench`` lists each part's in a group of its own."""
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="model: the generation part runs it; the attention part takes its attention shapes (head_dim, kv and "
        "query heads) and the preset files this checkout ships for it",
    )
    if part in (None, "attention"):
        group = parser.add_argument_group("attention (walshkv bench attention)") if part is None else parser
        group.add_argument("--kv-len", type=_ints, default=list(bench.DEFAULT_KV_LENS), help="cached tokens")
        group.add_argument(
            "--codec",
            action="append",
            metavar="SPEC",
            help="codec (repeatable): a spec, or a preset or calibrated spec with --kv-mean-center FILE (bound to "
            "--layer's calibration; the file's kv heads and head_dim must be --model's); without --kv-mean-center "
            "each preset takes the calibration walshkv ships for --model (walshkv/calibrations/MODEL/)",
        )
        group.add_argument("--layer", type=int, default=3, help="the layer whose calibration a calibrated codec uses")
        group.add_argument("--repeats", type=int, default=7, help="timed repeats per case (median)")
        group.add_argument(
            "--threads",
            type=int,
            default=None,
            metavar="N",
            help="torch threads for SDPA and the kernel alike (default: torch's, one per core); 1 compares both "
            "on one core, which a machine shared with other work disturbs least",
        )
        group.add_argument(
            "--cold",
            action="store_true",
            help="write 256 MiB before every timed call, so each method starts with cold caches, as a layer's "
            "attention does inside a model (the other layers ran in between); default: the methods run in turn, "
            "each after the one before it, and a small cache may still be in the CPU's caches from the last round",
        )
        group.add_argument(
            "--device",
            default="cpu",
            help="cpu (fused C++ kernel) or cuda[:N] (Triton kernel; pip install 'walshkv[gpu]')",
        )
    if part == "attention":
        parser.add_argument_group("calibration").add_argument(
            "--kv-mean-center",
            metavar="FILE",
            help="calibration file from `walshkv calibrate` (or recommend) for the --codec presets and center+/eq+ "
            "specs",
        )
    if part in (None, "generation"):
        group = parser.add_argument_group("generation (walshkv bench generation)") if part is None else parser
        group.add_argument("--ctx", type=_ints, default=list(bench.DEFAULT_CONTEXTS), help="context lengths")
        group.add_argument(
            "--gen-codec",
            action="append",
            metavar="SPEC",
            help="a compressed cache, repeatable: a spec (rot+int4, center+tq:4/tq:2.5) or a preset "
            "(walshkv:3.5; its calibration from --kv-mean-center FILE or --calib-text TEXT, else the file this "
            "checkout ships for --model); default: "
            f"{', '.join(bench.DEFAULT_GENERATION_CODECS)} and the model's shipped presets "
            "(their calibrations shipped with walshkv, walshkv/calibrations/MODEL/)",
        )
        group.add_argument(
            "--dynamic-dtype",
            action="append",
            choices=list(bench.DYNAMIC_DTYPES),
            help="the DynamicCache rows, repeatable (default both; bfloat16 loads the model in bf16)",
        )
        group.add_argument("--new-tokens", type=int, default=16, help="tokens generated per run")
        group.add_argument(
            "--prefill",
            choices=get_args(Prefill),
            default="quantized",
            help="quantized (quantize on write, the default) or exact (the prompt attends to its exact K/V, "
            "stored compressed, as serving engines do)",
        )
        group.add_argument("--prefill-chunk", type=int, default=1024, help="tokens per prefill forward")
        group.add_argument(
            "--gen-runs",
            type=int,
            default=1,
            metavar="N",
            help="runs of every row, each in a fresh process, taking turns; the table reports medians and a second "
            "table the spread (peak memory moves by ~100 MiB between identical runs under glibc's default "
            "allocator: use 3 or 5 to judge a memory target)",
        )
        group.add_argument(
            "--decoded",
            action="store_true",
            help="also run the compressed cache decoding the whole cache every step",
        )
        group.add_argument(
            "--no-reserve",
            action="store_true",
            help="let the compressed cache grow (by 1/8 when full) instead of max_cache_len=ctx+new",
        )
        group.add_argument(
            "--malloc-mmap-threshold",
            type=int,
            default=65536,
            metavar="BYTES",
            help="glibc MALLOC_MMAP_THRESHOLD_ for the runs (default 65536: freed blocks above it go back to the "
            "system instead of fragmenting the heap; 0: glibc's default)",
        )
    output = parser.add_argument_group("output")
    output.add_argument("--out", default="bench", metavar="DIR", help="output folder")
    output.add_argument("--no-plot", action="store_true", help="skip bench.png")
    output.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _calibration(part: str | None) -> list[argparse.ArgumentParser]:
    """The parents of ``walshkv bench PART``: a fresh :func:`calibration_parent` each (its actions become the
    parser's own, so one parser's defaults never change another's), none for attention (``--kv-mean-center``
    alone, added by :func:`_add_options`)."""
    if part == "attention":
        return []
    return [calibration_parent(tokens_help=f"tokens of --calib-text (default {CALIB_TOKENS})")]


@functools.cache
def _defaults(part: str | None) -> dict[str, Any]:
    """Every option of ``walshkv bench PART`` (None: both parts) with its default, parsed as argparse would."""
    parser = argparse.ArgumentParser(add_help=False, parents=_calibration(part))
    return vars(_add_options(parser, part).parse_args([]))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


class _PartAction(argparse._SubParsersAction):
    """``walshkv bench PART``: the part's options parsed into ``walshkv bench``'s own namespace.

    argparse parses a subcommand into a fresh namespace and copies every value over, so the part's defaults would
    overwrite an option given before it (``walshkv bench --repeats 3 attention`` would time 7 repeats). Here an
    option before PART counts as if written after it (after wins; repeatable options collect both), one of the
    other part before PART is refused (after PART argparse refuses it itself), and so is ``--part`` with a PART.
    """

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        name, *rest = values
        subparser = self.choices[name]
        if namespace.part is not None:
            subparser.error(f"--part {namespace.part} and the subcommand {name}: drop --part (deprecated)")
        own = _defaults(name)
        stray = [d for d in _defaults(None) if d not in own and hasattr(namespace, d)]
        if stray:
            other = next(p for p in PARTS if p != name)
            subparser.error(
                f"{_flag(stray[0])} is an option of `walshkv bench {other}`, not of `walshkv bench {name}`; "
                "drop it, or run `walshkv bench` for both parts"
            )
        namespace.part = name
        subparser.parse_args(rest, namespace)


class _DeprecatedPart(argparse.Action):
    """``--part``, deprecated: the value, and one line on stderr saying what to write instead."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        instead = "walshkv bench" if values == "all" else f"walshkv bench {values}"
        print(
            f"walshkv bench: warning: --part is deprecated and goes away in the next release; write `{instead} "
            "...` instead (this run behaves as before)",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, values)


def _resolve_part(args: argparse.Namespace) -> None:
    """Set ``args.part`` (``all`` without a subcommand or ``--part``) and every option left out to its default
    (``walshkv bench`` leaves the options of the parts out of its namespace unless given)."""
    args.part = args.part or "all"
    for dest, value in _defaults(None).items():
        if not hasattr(args, dest):
            setattr(args, dest, copy.deepcopy(value))


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv bench`` and its parts ``walshkv bench attention`` / ``walshkv bench generation``.

    ``walshkv bench`` alone runs both parts and takes every option; each part's subcommand takes its own and the
    shared ones (calibration, output). The options of the parts are left out of ``walshkv bench``'s namespace
    unless given (argparse.SUPPRESS; :func:`_resolve_part` fills them in), so that :class:`_PartAction` sees which
    were given before the subcommand.
    """
    bp = sub.add_parser(
        "bench",
        help="decode attention from packed codes vs torch SDPA, and generation speed/memory vs DynamicCache",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s [PART] [options]",
        epilog=_BENCH_EPILOG,
        parents=_calibration(None),
    )
    bp.add_argument(
        "--part",
        action=_DeprecatedPart,
        choices=["all", *PARTS],
        default=None,
        help="deprecated (removed in the next release): `walshkv bench attention` / `walshkv bench generation`; "
        "all: `walshkv bench`",
    )
    _add_options(bp, None)
    shared = set(_defaults("attention")) & set(_defaults("generation"))
    for action in bp._actions:  # argparse lists a parser's actions nowhere public
        if action.dest in _defaults(None) and action.dest not in shared:
            action.default = argparse.SUPPRESS
    parts = bp.add_subparsers(
        dest="part", metavar="PART", action=_PartAction, prog=bp.prog, help="one part (default: both)"
    )
    for part, help, examples in (
        ("attention", "one decode step from packed codes vs torch SDPA", _ATTENTION_EXAMPLES),
        ("generation", "generation speed and peak memory vs DynamicCache", _GENERATION_EXAMPLES),
    ):
        _add_options(
            parts.add_parser(
                part,
                help=help,
                description=_part_description(part),
                formatter_class=argparse.RawDescriptionHelpFormatter,
                epilog="examples:\n" + examples,
                parents=_calibration(part),
            ),
            part,
        )
    bp.set_defaults(func=_cmd_bench)
