"""The research commands as a ``walshkv`` CLI plugin: ``walshkv rope``, ``walshkv spectrum``, ``walshkv reconstruct``.

walshkv's ``build_parser`` loads every entry point of the group ``walshkv.commands``; research/pyproject.toml
declares :func:`add_parsers` there, so installing walshkv_research (``pip install -e research``) adds its
commands and walshkv itself never imports it.
"""

from __future__ import annotations

import argparse

from walshkv_research.cli.reconstruct import add_reconstruct_parser
from walshkv_research.cli.rope import add_rope_parser
from walshkv_research.cli.spectrum import add_spectrum_parser

__all__ = ["add_parsers", "add_reconstruct_parser", "add_rope_parser", "add_spectrum_parser"]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register the research subcommands on walshkv's subparsers (the ``walshkv.commands`` entry point)."""
    add_rope_parser(sub)
    add_spectrum_parser(sub)
    add_reconstruct_parser(sub)
