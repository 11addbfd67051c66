"""``walshkv recommend``: the best cache spec for a bit budget, written as a preset file."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from walshkv import data, models
from walshkv.cli.common import (
    CALIB_MODEL_HELP,
    CALIB_TEXT_HELP,
    calibration_parent,
    model_parent,
    output_parent,
    require_at_least,
    windows_parent,
)
from walshkv.cli.sweep import executor_from_args, ray_parent
from walshkv.defaults import RECOMMEND_WINDOWS
from walshkv.eval.report import format_table, write_json
from walshkv.fileio import check_output_dir
from walshkv.preset_file import k_pre_rope, write_preset_file
from walshkv.presets import preset_name_for_bits
from walshkv.recommend import candidates_for, recommend

__all__ = ["add_parsers"]


def _cmd_recommend(args: argparse.Namespace) -> int:
    name = preset_name_for_bits(args.bits, args.fast)  # validates the budget before loading anything
    require_at_least(args, ctx=4, windows=1, calib_tokens=1)
    if args.max_key_work is not None and not (args.max_key_work >= 0 and math.isfinite(args.max_key_work)):
        raise ValueError(
            "--max-key-work must be a finite number >= 0 (times plain attention's work per key), "
            f"got {args.max_key_work!r}"
        )
    if args.output is None:  # the default file is named after the model: its folder is checked now
        check_output_dir(Path.cwd(), what="-o (not given: MODEL-walshkv-B.gguf in the current directory)")
    executor = executor_from_args(args)  # --ray errors before loading anything
    if args.only_candidates and not args.candidate:
        raise SystemExit("walshkv recommend: error: --only-candidates ranks the --candidate specs: give at least one")
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    n = len(
        candidates_for(
            args.bits,
            lm.shape.head_dim,
            args.candidate or (),
            lm.shape.layers,
            ctx=args.ctx,
            fast=args.fast,
            builtin=not args.only_candidates,
            max_key_work=args.max_key_work,
            group=lm.shape.q_heads // lm.shape.kv_heads,
        )
    )
    print(
        f"{lm.name}: {n} candidate specs within {args.bits:g} bits per element at head_dim {lm.shape.head_dim}; "
        f"K mean from the first half of {text.name}, ranked on {args.windows or 'all'} windows of {args.ctx} tokens of "
        "its second half",
        file=sys.stderr,
    )
    with executor as runner:
        rec = recommend(
            lm,
            text,
            args.bits,
            windows=args.windows,
            ctx=args.ctx,
            calib_tokens=args.calib_tokens,
            extra=args.candidate or (),
            per_layer=args.per_layer,
            fast=args.fast,
            builtin=not args.only_candidates,
            max_key_work=args.max_key_work,
            progress=not args.quiet,
            executor=runner,
        )
    print(format_table(rec.rows))
    if rec.plan is not None:
        moved = ", ".join(f"{m['kind'].upper()}{m['layer']} {m['delta']:+g}" for m in rec.plan.chosen) or "none"
        print(f"\nper-layer widths from {rec.plan.base}: moves {moved}")
    best = rec.rows[0]
    print(
        f"\nwinner for {name} on {lm.name}: {rec.preset.spec} (mean KLD {best['kld_mean']:.6f}, "
        f"{best['bits_per_element']:.3f} bits per element, top-1 {best['top1_agreement']:.2%})"
    )
    output = args.output or f"{lm.name}-{name.replace(':', '-')}.gguf"
    scored, where = rec.meta["scored_tokens"], rec.meta["text"]["name"]
    note = f"recommend: mean KLD {best['kld_mean']:.6f} on {scored} tokens of {where}"
    basis = write_preset_file(output, lm, rec.preset, rec.stats, note=note)
    before = ", K before RoPE" if k_pre_rope(rec.preset.spec) else ""
    print(
        f"wrote {output} ({basis}-basis K mean{before} + the preset's spec). Evaluate it on other text: "
        f"walshkv eval --model {lm.name} --codec {name} --kv-mean-center {output} --text OTHER"
    )
    if args.json:
        payload: dict[str, Any] = {
            "meta": rec.meta,
            "winner": rec.preset.spec,
            "preset": name,
            "pool": "candidates only" if args.only_candidates else "built-in and candidates",
            "results": rec.rows,
        }
        if rec.plan is not None:
            payload["per_layer"] = {
                "base": rec.plan.base,
                "spec": rec.plan.spec,
                "moves": rec.plan.moves,
                "chosen": rec.plan.chosen,
                "check": rec.plan.rows,
            }
        write_json(args.json, payload)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv recommend``."""
    re_ = sub.add_parser(
        "recommend",
        help="pick the best cache spec for a bit budget on calibration text and write it as a preset file",
        description="Run every candidate spec that fits --bits (bits per element, K and V together, every "
        "overhead counted) on calibration text: the K mean comes from its first half, the candidates are "
        "ranked by mean KLD on windows of its second half. Prints the table and writes the winner with its "
        "K mean as a GGUF preset file for this model. It never reads your evaluation text: evaluate the "
        "file afterwards with `walshkv eval --codec walshkv:B --kv-mean-center FILE --text OTHER`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        parents=[
            model_parent(CALIB_MODEL_HELP, CALIB_TEXT_HELP),
            windows_parent(windows_help="selection windows", windows=RECOMMEND_WINDOWS),
            calibration_parent("tokens for the K mean", inputs=False),
            output_parent(json="write the candidates' results as JSON"),
            ray_parent(
                "the candidates (and, with --per-layer, the single-layer moves) are cut into as many tasks as "
                "the cluster has CPUs, each sharing one reference forward per window. The K mean is collected "
                "here and the winner is chosen here, by the same rule on the same numbers."
            ),
        ],
    )
    re_.add_argument("--bits", type=float, required=True, help="budget in bits per element, e.g. 3, 3.5 or 4.5")
    re_.add_argument("--candidate", action="append", metavar="SPEC", help="an extra candidate spec, repeatable")
    re_.add_argument(
        "--only-candidates",
        action="store_true",
        help="rank only the --candidate specs, not the budget's built-in ones (a re-selection between named specs, "
        "e.g. a shipped preset against its tcq twin)",
    )
    re_.add_argument(
        "--per-layer",
        action="store_true",
        help="then move 0.5-bit widths of K and V between layers at the same budget (4 runs per layer on the "
        "same windows), keeping the result only if it beats the uniform winner",
    )
    re_.add_argument(
        "--fast",
        action="store_true",
        help="choose the fast preset walshkv:B-fast: only specs the fused decode kernels read without a dense "
        "head_dim x head_dim map per cached key (K before RoPE takes eqd+, the best diagonal transform, in place of "
        "eq+); the plain preset may be slower to decode but lower in KLD (docs/presets.md)",
    )
    re_.add_argument(
        "--max-key-work",
        type=float,
        metavar="R",
        help="the decode-work ceiling: keep only specs whose K transforms cost at most R times plain attention's "
        "multiply-adds per cached key at the model's shape (0 after RoPE; the block frame 0.67, 1.08 and 2.1 on "
        "smollm2-135m, qwen2.5-1.5b and gemma3-270m; eq+'s dense map before RoPE 10.7, 10.7 and 32). Each result "
        "row records its own (key_work); walshkv.presets.key_work counts it",
    )
    re_.add_argument("-o", "--output", help="preset file (default MODEL-walshkv-B.gguf)")
    re_.set_defaults(func=_cmd_recommend)
