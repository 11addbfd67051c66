"""``walshkv bench``: packed-code attention vs torch SDPA, generation vs DynamicCache (:mod:`walshkv.bench`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, get_args

import torch

from walshkv import bench
from walshkv.bench.generation import shipped_preset_file
from walshkv.cli.common import SHOW_DEFAULT, calibration_parent
from walshkv.constants import Prefill
from walshkv.defaults import DEFAULT_MODEL
from walshkv.eval.report import command_line, write_result_files
from walshkv.export import read_kv_mean_center
from walshkv.presets import is_preset

__all__ = ["add_parsers"]


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


def _check(args: argparse.Namespace) -> tuple[list[bench.GenerationCodec], list[str]] | None:
    """Refuse counts below 1, a CUDA device that is not there and generation codecs that cannot run, before
    anything runs.

    Returns:
        The resolved generation codecs (presets resolved, calibration in hand) and the notes to print (presets the
        default table leaves out); ``None`` without a generation part.
    """
    for flag, value in (("--repeats", args.repeats), ("--new-tokens", args.new_tokens), ("--gen-runs", args.gen_runs)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be at least 1 token, got {args.prefill_chunk}")
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
                raise ValueError(f"{flag} is for the generation part: add --part generation (or --part all)")
        if args.kv_mean_center and not args.codec:
            raise ValueError(
                "--kv-mean-center with --part attention calibrates the codecs you name: add --codec SPEC "
                "(e.g. --codec walshkv:3.5)"
            )
        return None
    gen_codecs: list[Any] | None = args.gen_codec
    if gen_codecs and not args.kv_mean_center and not args.calib_text:  # presets with this checkout's files
        gen_codecs = [(c, f) if (f := _shipped_file(args.model, c)) else c for c in gen_codecs]
    return bench.resolve_generation_codecs(
        args.model,
        gen_codecs,
        kv_mean_center=args.kv_mean_center,
        calib_text=args.calib_text,
        calib_tokens=args.calib_tokens,
        progress=not args.quiet,
    )


def _shipped_file(model: str, codec: str) -> str | None:
    """The file this checkout ships for preset ``codec`` on ``model`` (``docs/results/presets/<model>/walshkv-B.gguf``),
    or ``None`` (not a preset, or no such file)."""
    path = shipped_preset_file(model, codec) if is_preset(codec) else None
    return None if path is None else str(path)


def _shipped_calibrations(model: str, codecs: Sequence[str]) -> dict[str, Any]:
    """Without ``--kv-mean-center``: each preset of ``codecs`` with the file this checkout ships for it and ``model``,
    so that presets run side by side with their own files."""
    files = {c: _shipped_file(model, c) for c in codecs}
    return {c: read_kv_mean_center(path) for c, path in files.items() if path is not None}


def _cmd_bench(args: argparse.Namespace) -> int:
    generation = _check(args)
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
        meta["copy_bandwidth_gb_per_s"] = bench.copy_bandwidth(device=args.device)
        calibration = read_kv_mean_center(args.kv_mean_center) if args.kv_mean_center and args.codec else None
        att = bench.bench_attention(
            args.kv_len,
            args.codec or bench.DEFAULT_ATTENTION_CODECS,
            repeats=args.repeats,
            device=args.device,
            calibration=calibration,
            # the attention bench has smollm2-135m's shapes (3 kv heads, head_dim 64): presets take its files
            calibrations=None if calibration is not None else _shipped_calibrations(DEFAULT_MODEL, args.codec or ()),
            layer=args.layer,
            progress=not args.quiet,
        )
        result["attention"] = att
        print(bench.format_attention_table(att, meta["copy_bandwidth_gb_per_s"]))
    if generation is not None:
        gen_codecs, notes = generation
        for line in notes:
            print(line)
        gen = bench.bench_generation(
            args.model,
            args.ctx,
            gen_codecs,
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


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv bench``."""
    bp = sub.add_parser(
        "bench",
        help="decode attention from packed codes vs torch SDPA, and generation speed/memory vs DynamicCache",
        description=bench.__doc__.split("\n\n", 1)[1] if bench.__doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n  walshkv bench --part attention --kv-len 1024,16384\n"
        "  walshkv bench --part generation --ctx 1024,8192 --new-tokens 16\n"
        "  walshkv bench --part generation --ctx 8176 --gen-codec walshkv:3.5 --gen-codec rot+int4 \\\n"
        "      --kv-mean-center docs/results/presets/smollm2-135m/walshkv-3.5.gguf\n"
        "  walshkv bench --part attention --kv-len 16384 --codec walshkv:3.5 --codec walshkv:3.5-fast   "
        "# each preset with this checkout's file",
        parents=[calibration_parent(tokens_help="generation: tokens of --calib-text" + SHOW_DEFAULT)],
    )
    bp.add_argument("--part", choices=["all", "attention", "generation"], default="all", help="what to measure")
    bp.add_argument("--kv-len", type=_ints, default=list(bench.DEFAULT_KV_LENS), help="attention: cached tokens")
    bp.add_argument(
        "--codec",
        action="append",
        metavar="SPEC",
        help="attention: codec (repeatable): a spec, or a preset or calibrated spec with --kv-mean-center FILE "
        "(bound to --layer's calibration; the file's kv heads and head_dim must be the bench's 3 and 64); without "
        f"--kv-mean-center each preset takes the file this checkout ships for {DEFAULT_MODEL}, whose attention "
        f"shapes these are (docs/results/presets/{DEFAULT_MODEL}/walshkv-B.gguf)",
    )
    bp.add_argument(
        "--layer", type=int, default=3, help="attention: the layer whose calibration a calibrated codec uses"
    )
    bp.add_argument("--repeats", type=int, default=7, help="attention: timed repeats per case (median)")
    bp.add_argument(
        "--device",
        default="cpu",
        help="attention: cpu (fused C++ kernel) or cuda[:N] (Triton kernel; pip install 'walshkv[gpu]')",
    )
    bp.add_argument("--model", default=DEFAULT_MODEL, help="generation: model")
    bp.add_argument("--ctx", type=_ints, default=list(bench.DEFAULT_CONTEXTS), help="generation: context lengths")
    bp.add_argument(
        "--gen-codec",
        action="append",
        metavar="SPEC",
        help="generation: a compressed cache, repeatable: a spec (rot+int4, center+tq:4/tq:2.5) or a preset "
        "(walshkv:3.5; its calibration from --kv-mean-center FILE or --calib-text TEXT, else the file this "
        "checkout ships for --model); default: "
        f"{', '.join(bench.DEFAULT_GENERATION_CODECS)} and the model's shipped presets "
        "(docs/results/presets/MODEL/walshkv-*.gguf)",
    )
    bp.add_argument(
        "--dynamic-dtype",
        action="append",
        choices=list(bench.DYNAMIC_DTYPES),
        help="generation: the DynamicCache rows, repeatable (default both; bfloat16 loads the model in bf16)",
    )
    bp.add_argument("--new-tokens", type=int, default=16, help="generation: tokens generated per run")
    bp.add_argument(
        "--prefill",
        choices=get_args(Prefill),
        default="quantized",
        help="generation: quantized (quantize on write, the default) or exact (the prompt attends to its exact "
        "K/V, stored compressed, as serving engines do)",
    )
    bp.add_argument("--prefill-chunk", type=int, default=1024, help="generation: tokens per prefill forward")
    bp.add_argument(
        "--gen-runs",
        type=int,
        default=1,
        metavar="N",
        help="generation: runs of every row, each in a fresh process, taking turns; the table reports medians "
        "and a second table the spread (peak memory moves by ~100 MiB between identical runs under glibc's "
        "default allocator: use 3 or 5 to judge a memory target)",
    )
    bp.add_argument(
        "--decoded",
        action="store_true",
        help="generation: also run the compressed cache decoding the whole cache every step",
    )
    bp.add_argument(
        "--no-reserve",
        action="store_true",
        help="generation: let the compressed cache grow (by 1/8 when full) instead of max_cache_len=ctx+new",
    )
    bp.add_argument(
        "--malloc-mmap-threshold",
        type=int,
        default=65536,
        metavar="BYTES",
        help="generation: glibc MALLOC_MMAP_THRESHOLD_ for the runs (default 65536: freed blocks above it go "
        "back to the system instead of fragmenting the heap; 0: glibc's default)",
    )
    bp.add_argument("--out", default="bench", metavar="DIR", help="output folder")
    bp.add_argument("--no-plot", action="store_true", help="skip bench.png")
    bp.add_argument("--quiet", action="store_true", help="no progress bars")
    bp.set_defaults(func=_cmd_bench)
