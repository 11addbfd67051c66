"""What the capture commands (``walshkv spectrum``, ``walshkv reconstruct``) share: options and run meta."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from walshkv.cli.common import model_parent, output_parent, windows_parent
from walshkv.eval.report import run_meta

if TYPE_CHECKING:
    from walshkv.data import Text
    from walshkv.eval.capture import KVCapture
    from walshkv.models import LoadedModel

__all__ = ["capture_meta", "capture_parents"]


def capture_parents(out: str) -> list[argparse.ArgumentParser]:
    """Parent parsers of a capture command.

    ``--model``, ``--text``, ``--ctx``, ``--quiet`` and ``--out`` (help ``out``) from :mod:`walshkv.cli.common`,
    with ``--tokens`` and ``--channel-order`` in a ``capture`` group.
    """
    capture = argparse.ArgumentParser(add_help=False)
    group = capture.add_argument_group("capture")
    group.add_argument("--tokens", type=int, default=2048, help="tokens to capture (whole windows of --ctx)")
    group.add_argument(
        "--channel-order",
        choices=["hf", "llamacpp"],
        default="hf",
        help="K channel order before the transform: hf (rotary pairs i, i+d/2; what walshkv's codecs see) or "
        "llamacpp (adjacent pairs for llama-architecture models; what a WHT inside llama.cpp sees)",
    )
    return [model_parent(), windows_parent(windows_help=None), capture, output_parent(out=out)]


def capture_meta(lm: LoadedModel, text: Text, capture: KVCapture, command: str) -> dict[str, Any]:
    """The ``meta`` every capture result file carries (:func:`walshkv.eval.report.run_meta` with the capture)."""
    return run_meta(
        lm,
        text,
        windows=capture.windows,
        ctx=capture.ctx,
        window_starts=[w * capture.ctx for w in range(capture.windows)],
        tokens=capture.windows * capture.ctx,
        k_pre_rope="post-RoPE keys rotated back by their own angle (exact; see walshkv.eval.capture)",
        channel_order=capture.channel_order,
        command=command,
    )
