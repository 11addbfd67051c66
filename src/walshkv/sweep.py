"""``walshkv sweep``: a grid of cache specs through the ``walshkv eval`` protocol (placeholder)."""

from __future__ import annotations

import argparse

__all__ = ["add_sweep_parser"]


def add_sweep_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``sweep`` subcommand (filled in by the sweep implementation)."""
