"""``walshkv calibrate``: a K mean-centering bias file (GGUF) for center+ codecs and llama.cpp forks."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, get_args

import torch

from walshkv import calibration, data, models
from walshkv.cli.common import (
    CALIB_MODEL_HELP,
    CALIB_TEXT_HELP,
    model_parent,
    output_parent,
    require_at_least,
    windows_parent,
)
from walshkv.constants import Basis
from walshkv.defaults import CALIB_TOKENS
from walshkv.export import write_kv_mean_center
from walshkv.identity import identity_config
from walshkv.ops.equalize import predicted_gain_db
from walshkv.preset_file import k_pre_rope, write_preset_file
from walshkv.presets import resolve_preset

if TYPE_CHECKING:
    from walshkv.calibration import KVStats

__all__ = ["add_parsers"]


def _print_eq_gains(stats: KVStats, eq: torch.Tensor, v_eq: torch.Tensor | None) -> None:
    """The predicted (high-rate) error gains of the eq+ transforms ``[layers, kv_heads, head_dim, head_dim]``."""
    gains = torch.stack(
        [predicted_gain_db(stats.k_covariance(i), stats.query_moment(i), eq[i]) for i in range(stats.num_layers)]
    )
    print(
        f"eq+ predicted score-error gain (high-rate, on the calibration text): K mean {float(gains.mean()):.2f} dB "
        f"over layers and kv-heads (min {float(gains.min()):.2f}, max {float(gains.max()):.2f})"
    )
    if v_eq is not None:
        v_gains = torch.stack(
            [predicted_gain_db(stats.v_covariance(i), stats.output_metric(i), v_eq[i]) for i in range(stats.num_layers)]
        )
        print(
            f"eq+ predicted output-error gain: V mean {float(v_gains.mean()):.2f} dB "
            f"(min {float(v_gains.min()):.2f}, max {float(v_gains.max()):.2f})"
        )


def _cmd_calibrate(args: argparse.Namespace) -> int:
    if args.basis not in get_args(Basis):
        raise ValueError(f"--basis must be plain or rot, got {args.basis!r}")
    require_at_least(args, ctx=4, tokens=1)
    # an unknown preset name fails before anything is loaded
    preset = resolve_preset(args.preset) if args.preset else None
    text = data.load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    if preset is not None:
        preset = resolve_preset(args.preset, model=lm)  # a known model's shipped spec
        print(f"{preset.name} = {preset.spec} ({preset.source})", file=sys.stderr, flush=True)
        if preset.note:
            print(f"note: {preset.note}", file=sys.stderr, flush=True)
    stats = calibration.collect_kv_stats(lm, text, tokens=args.tokens, ctx=args.ctx, progress=not args.quiet)
    if preset is not None:
        basis = write_preset_file(args.output, lm, preset, stats)
        before = ", K before RoPE" if k_pre_rope(preset.spec) else ""
        print(
            f"wrote {args.output}: preset {preset.name} = {preset.spec} for {lm.name}; K mean of "
            f"{stats.tokens:,} tokens of {text.name} in the {basis} basis{before}. Use it with "
            f"`walshkv eval --model {lm.name} --codec {preset.name} --kv-mean-center {args.output}` "
            "on other text."
        )
        return 0
    mean = torch.stack([stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    eq = stats.equalizers("k") if args.eq else None
    v_eq = stats.equalizers("v") if args.eq and stats.o_metric is not None else None
    write_kv_mean_center(
        args.output,
        mean,
        arch=lm.shape.arch,
        basis=args.basis,
        tokens=stats.tokens,
        text=text.name,
        model=lm.name,
        model_config=identity_config(lm.model.config),
        k_equalizer=eq,
        v_equalizer=v_eq,
    )
    print(
        f"wrote {args.output}: {stats.num_layers} tensors kv_bar.blk.0.k .. kv_bar.blk.{stats.num_layers - 1}.k of "
        f"{stats.head_dim} x {stats.num_kv_heads} values, basis {args.basis}, {stats.tokens:,} tokens of {text.name}"
        + (
            f"; eq+ transforms walshkv.k_eq.blk.<il>{' and walshkv.v_eq.blk.<il>' if v_eq is not None else ''} "
            f"({stats.num_kv_heads} x {stats.head_dim}^2 each)"
            if args.eq
            else ""
        )
    )
    if eq is not None:
        _print_eq_gains(stats, eq, v_eq)
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv calibrate``."""
    ca = sub.add_parser(
        "calibrate",
        help="write a K mean-centering bias file (GGUF) for center+ codecs and llama.cpp forks",
        description="Run the model over calibration text and average each layer's post-RoPE K (what enters "
        "the cache) per (kv-head, channel). Writes kv_bar.blk.<il>.k tensors in llama.cpp's channel order and "
        "kv_mean_center.k_rot. Use it with `walshkv eval --codec center+rot+int4 --kv-mean-center FILE` "
        "(evaluate on different text) or a llama.cpp fork's --kv-mean-center FILE.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        parents=[
            model_parent(CALIB_MODEL_HELP, CALIB_TEXT_HELP),
            windows_parent("tokens per forward pass", windows_help=None),
            output_parent(),
        ],
    )
    ca.add_argument("--tokens", type=int, default=CALIB_TOKENS, help="calibration tokens (whole windows of --ctx)")
    ca.add_argument(
        "--basis",
        choices=get_args(Basis),
        default="plain",
        help="plain: for center+SPEC; rot: Hadamard-rotated, for center+rot+SPEC and llama.cpp's rotation",
    )
    ca.add_argument(
        "--eq",
        action="store_true",
        help="also write the eq+ transforms (per layer and kv-head: K's from the K covariance and the queries' "
        "second moment, V's from the V covariance and the output projection) for specs such as "
        "center+eq+tq:3.5/eq+tq:3",
    )
    ca.add_argument(
        "--preset",
        metavar="NAME",
        help="write everything the preset (walshkv:3, walshkv:3.5, walshkv:4.5; walshkv:B-fast, the spec the fused "
        "kernels decode fastest; walshkv:B-max, the per-key map allowed) needs for this model: the K mean "
        "in the basis of its spec (and its eq+ transforms), with the preset's name and spec (--basis and --eq are "
        "then ignored)",
    )
    ca.add_argument("-o", "--output", default="kv-mean-center.gguf", help="output GGUF file")
    ca.set_defaults(func=_cmd_calibrate)
