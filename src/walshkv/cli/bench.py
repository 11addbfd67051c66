"""``walshkv bench``: packed-code attention vs torch SDPA, generation vs DynamicCache (:mod:`walshkv.bench`)."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from typing import Any

import torch

from walshkv import bench
from walshkv.defaults import DEFAULT_MODEL
from walshkv.eval.report import command_line, write_result_files

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


def _check(args: argparse.Namespace) -> None:
    """Refuse counts below 1 and a CUDA device that is not there, before anything runs."""
    for flag, value in (("--repeats", args.repeats), ("--new-tokens", args.new_tokens)):
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


def _cmd_bench(args: argparse.Namespace) -> int:
    _check(args)
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
        att = bench.bench_attention(
            args.kv_len,
            args.codec or bench.DEFAULT_ATTENTION_CODECS,
            repeats=args.repeats,
            device=args.device,
            progress=not args.quiet,
        )
        result["attention"] = att
        print(bench.format_attention_table(att, meta["copy_bandwidth_gb_per_s"]))
    if args.part in ("all", "generation"):
        gen = bench.bench_generation(
            args.model,
            args.ctx,
            args.gen_codec,
            new_tokens=args.new_tokens,
            prefill_chunk=args.prefill_chunk,
            decoded=args.decoded,
            reserve=not args.no_reserve,
            malloc_mmap_threshold=args.malloc_mmap_threshold,
            progress=not args.quiet,
        )
        result["generation"] = gen
        meta["crossover_context"] = bench.crossover(gen)
        print(bench.format_generation_table(gen))
        print(f"crossover: {meta['crossover_context']}")
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
        "  walshkv bench --part generation --ctx 1024,8192 --new-tokens 16",
    )
    bp.add_argument("--part", choices=["all", "attention", "generation"], default="all", help="what to measure")
    bp.add_argument("--kv-len", type=_ints, default=list(bench.DEFAULT_KV_LENS), help="attention: cached tokens")
    bp.add_argument("--codec", action="append", metavar="SPEC", help="attention: codec (repeatable)")
    bp.add_argument("--repeats", type=int, default=7, help="attention: timed repeats per case (median)")
    bp.add_argument(
        "--device",
        default="cpu",
        help="attention: cpu (fused C++ kernel) or cuda[:N] (Triton kernel; pip install 'walshkv[gpu]')",
    )
    bp.add_argument("--model", default=DEFAULT_MODEL, help="generation: model")
    bp.add_argument("--ctx", type=_ints, default=list(bench.DEFAULT_CONTEXTS), help="generation: context lengths")
    bp.add_argument("--gen-codec", default="rot+int4", help="generation: the compressed cache's spec")
    bp.add_argument("--new-tokens", type=int, default=16, help="generation: tokens generated per run")
    bp.add_argument("--prefill-chunk", type=int, default=1024, help="generation: tokens per prefill forward")
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
