"""The ``walshkv`` command line.

Run ``walshkv --help`` or ``walshkv COMMAND --help``. One module per command (``eval``, ``calibrate``,
``recommend``, ``models``, ``codecs``, ``sweep``, ``rd``, ``bench``), each with an ``add_parsers(sub)`` that
registers it; :mod:`walshkv.cli.common` holds the parent parsers of the options they share (``--model``,
``--text``, ``--ctx``/``--windows``, the calibration options, the output files, ``--quiet``) and the
calibration inputs (:func:`~walshkv.cli.common.calibration_from_args`).

Command plugins
---------------
Other packages add commands through the entry-point group ``walshkv.commands`` (the lab's
``walshkv rope``, ``walshkv spectrum`` and ``walshkv reconstruct`` come from ``walshkv-research`` that way;
the core never imports it). In the plugin's ``pyproject.toml``::

    [project.entry-points."walshkv.commands"]
    research = "walshkv_research.cli:add_parsers"

The entry point loads a callable ``add_parsers(sub: argparse._SubParsersAction) -> None`` that adds its
subcommands with ``sub.add_parser(NAME, ...)`` (it may use the parents of :mod:`walshkv.cli.common`) and
sets ``func`` on each: ``parser.set_defaults(func=handler)``, where ``handler(args: argparse.Namespace) -> int``
returns the exit status. :func:`main` runs the handler with ``args.argv`` (the command line, for
:func:`walshkv.eval.report.command_line`) and ``--windows 0`` turned into ``None``, after refusing output paths
that cannot be written (:func:`~walshkv.cli.common.check_outputs`: ``--json``, ``--csv``, ``--markdown``,
``-o/--output``, ``--out``). Any error the handler raises (``ValueError``, ``OSError`` such as a full disk or a
missing folder, and any other exception) is printed as ONE line ``walshkv NAME: error: ...`` naming the path
and the fix, with status 2; ``WALSHKV_TRACEBACK=1`` re-raises it instead (for bug reports). Ctrl-C exits 130.
Plugins are added after the core commands, in entry-point name order; a name a command already has is
refused. A plugin that fails to load or to register is skipped with a warning on stderr: the other
commands keep working.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from walshkv.cli import bench, calibrate, codecs, eval, models, needle, rd, recommend, sweep
from walshkv.cli.common import check_outputs
from walshkv.eval.provenance import code_commit

__all__ = ["COMMANDS", "PLUGIN_GROUP", "build_parser", "error_line", "main"]

#: The entry-point group command plugins register in.
PLUGIN_GROUP = "walshkv.commands"

#: The core commands, in the order ``walshkv --help`` lists them.
COMMANDS = (eval, calibrate, recommend, models, codecs, sweep, rd, bench, needle)

_EPILOG = """\
examples:
  walshkv eval                                   # default model, text and codec list
  walshkv eval --codec rot+int4 --codec int8/int4 --windows 4
  walshkv eval --model qwen2.5-1.5b --text ../shared/data/austen_emma.txt --json r.json
  walshkv eval --codec vht2:5,5,4,3:order=squarefree/vht2:3 --text ../shared/data/austen_emma.txt
  walshkv eval --codec vht2:auto@4.25 --calib-text python-docs --text ../shared/data/austen_emma.txt
  walshkv sweep --grid vht2-bits --windows 2
  walshkv calibrate --preset walshkv:4.5 --text python-docs -o p.gguf
  walshkv eval --codec walshkv:4.5 --kv-mean-center p.gguf --text ../shared/data/austen_emma.txt
  walshkv recommend --bits 3.5 --text python-docs -o mine.gguf
  walshkv eval --codec hf-quanto:4 --codec rot+q4_0 --text ../shared/data/austen_emma.txt
  walshkv models list
  walshkv codecs --head-dim 128
  walshkv bench attention --kv-len 1024,16384                 # packed-code attention vs torch SDPA

research commands (with the walshkv-research package: pip install -e research):
  walshkv rope sweep --text ../shared/data/austen_emma.txt      # PrimePE: alpha vs PPL/KLD
  walshkv spectrum --text ../shared/data/austen_emma.txt        # K/V energy per WHT band
  walshkv reconstruct --text ../shared/data/austen_emma.txt     # Walsh vs DCT/Fourier/Vilenkin

cache specs: KSPEC/VSPEC or one SPEC for both; SPEC = [rot+|rrot[:SEED]+]BASE, BASE in
fp16, bf16, fp32, int2..int8, vht2:B1,..,Bn[:order=O][:sk=N], vht2:auto@BITS, vzc, sqfree:B.
Example: rot+int4/int3 (K rotated int4, V int3). `walshkv codecs` lists them all.
Presets: walshkv:2.5, walshkv:3, walshkv:3.5, walshkv:4.5 (each model's choice), walshkv:B-fast (no per-key map
in decode) and walshkv:B-max (the per-key map allowed): docs/presets.md. Peers: q8_0..iq4_nl,
kivi2/4, tq:B, and Hugging Face's QuantizedCache as hf-quanto:B, hf-hqq:B, hf-fp8 (fed token by token).
"""


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    """Add the commands of every ``walshkv.commands`` entry point; warn about (and skip) broken ones."""
    for ep in sorted(entry_points(group=PLUGIN_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as err:  # a broken plugin must not take the core commands down
            print(
                f"walshkv: warning: skipped the command plugin {ep.name!r} ({ep.value}) of the entry-point group "
                f"{PLUGIN_GROUP!r}: {type(err).__name__}: {err}. Its commands are missing; reinstall or fix the "
                "package that provides it (the other commands work).",
                file=sys.stderr,
            )


def build_parser() -> argparse.ArgumentParser:
    """The ``walshkv`` parser: the core commands, then those of the installed command plugins."""
    parser = argparse.ArgumentParser(
        prog="walshkv",
        description="Compress transformer KV caches and measure honestly what it costs "
        "(KL divergence against the same model with an uncompressed cache).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parsers(sub)
    _add_plugins(sub)
    return parser


#: What to do about an OS error, by errno (the message names the path and this fix).
_OS_FIXES = {
    errno.ENOSPC: "the disk is full: free space or write elsewhere (an existing file there is unchanged)",
    errno.EDQUOT: "the disk quota is exceeded: free space or write elsewhere (an existing file there is unchanged)",
    errno.EFBIG: "the file-size limit (ulimit -f) was reached: raise it or write elsewhere (an existing file there "
    "is unchanged)",
    errno.EACCES: "permission denied: fix the permissions or choose another path",
    errno.EPERM: "operation not permitted: fix the permissions or choose another path",
    errno.EROFS: "the file system is read-only: choose another path",
    errno.ENOENT: "no such file or directory: check the path (an output's directory must exist)",
    errno.EISDIR: "it is a directory: give a file path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: choose another path",
    errno.EEXIST: "it exists and is in the way (a file where a folder is needed?): choose another path",
    errno.ENAMETOOLONG: "the name is too long: choose a shorter path",
}


def error_line(err: BaseException) -> str:
    """One line for an error: OS errors as ``PATH: what happened; the fix``, others as their message.

    Args:
        err: The exception a command raised.

    Returns:
        The message, newlines folded, without the ``walshkv NAME: error:`` prefix.
    """
    if isinstance(err, OSError) and err.errno is not None:
        where = " -> ".join(repr(str(f)) for f in (err.filename, err.filename2) if f is not None)
        fix = _OS_FIXES.get(err.errno, f"{err.strerror or type(err).__name__}: check the path")
        text = f"{where}: {fix}" if where else f"{fix} ({err.strerror})"
    elif isinstance(err, ValueError | RuntimeError | TypeError | OSError | LookupError):
        text = str(err) or type(err).__name__
    else:  # an assertion or arithmetic error is walshkv's bug, not the user's
        text = (
            f"internal error {type(err).__name__}: {err} (please report it with the command line; "
            "WALSHKV_TRACEBACK=1 shows where)"
        )
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``walshkv ARGV``; return the exit status (2 for a usage or input error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.argv = argv
    code_commit()  # read now: a result records the code this run loaded, even if the checkout changes meanwhile
    if getattr(args, "windows", None) == 0:
        args.windows = None
    try:
        check_outputs(args)  # refuse first: no output path is found unwritable after the work
        return int(args.func(args))
    except KeyboardInterrupt:
        print(f"walshkv {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as err:
        if os.environ.get("WALSHKV_TRACEBACK"):
            raise
        print(f"walshkv {args.command}: error: {error_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
