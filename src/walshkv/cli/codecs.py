"""``walshkv codecs``: the codec specs and their bits per element."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from walshkv.codecs import available_codecs, parse_codec
from walshkv.codecs.spec import HF_BACKENDS, codec_example, parse_hf_spec

__all__ = ["add_parsers"]


def _rows(head_dim: int) -> list[list[str]]:
    """``[spec, bits per element at head_dim, what]`` for every registered codec, wrapper and HF peer."""
    rows = []
    for name, help in available_codecs().items():
        if name.endswith("+"):
            rows.append([name, "(same as inner)", help])
            continue
        example = codec_example(name)
        try:
            bits = f"{parse_codec(example).bits_per_element(head_dim):.4g}"
        except ValueError as err:  # e.g. a head size the codec refuses
            bits = f"n/a ({err})"[:40]
        rows.append([example, bits, help])
    for name, (_, allowed, package) in HF_BACKENDS.items():
        example = name if name == "hf-fp8" else f"{name}:{allowed[-2] if len(allowed) > 1 else allowed[0]}"
        where = "built into transformers" if package is None else f"needs pip install {package} (walshkv[hf])"
        rows.append(
            [
                example,
                f"{parse_hf_spec(example).bits_per_element(head_dim):.4g}" + ("" if name == "hf-fp8" else " + window"),
                f"Hugging Face QuantizedCache peer, {where}; eval feeds it token by token",
            ]
        )
    return rows


def _cmd_codecs(args: argparse.Namespace) -> int:
    if args.head_dim < 1:
        raise ValueError(f"--head-dim must be a positive number of channels (e.g. 64 or 128), got {args.head_dim}")
    print(
        tabulate(
            _rows(args.head_dim),
            headers=["spec", f"bits/el @ head_dim {args.head_dim}", "what"],
            maxcolwidths=[None, None, 70],
        )
    )
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv codecs``."""
    co = sub.add_parser("codecs", help="list codec specs and their bits per element")
    co.add_argument("--head-dim", type=int, default=64, help="head size for the bits column")
    co.set_defaults(func=_cmd_codecs)
