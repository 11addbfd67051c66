"""``walshkv sweep``: a grid of cache specs through the eval protocol (:mod:`walshkv.eval.sweep`)."""

from __future__ import annotations

import argparse
import contextlib
import json
import textwrap
from dataclasses import replace
from pathlib import Path
from typing import get_args

from walshkv import data, models
from walshkv.cli.common import (
    MODEL_HELP,
    SHOW_DEFAULT,
    TEXT_HELP,
    calibration_from_args,
    calibration_parent,
    model_parent,
    output_parent,
    print_presets,
    windows_parent,
)
from walshkv.codecs import parse_cache_spec
from walshkv.constants import Score
from walshkv.eval.calibrated import only_centering
from walshkv.eval.report import command_line, format_table
from walshkv.eval.sweep import (
    PRESETS,
    Executor,
    SweepConfig,
    canonical_specs,
    grid_files_hint,
    load_grid,
    needs_calibration,
    pareto_front,
    run_sweep,
    slug,
    substitute_head_dim,
)
from walshkv.integrations.ray import RayExecutor, require_ray
from walshkv.presets import name_specs

__all__ = ["add_parsers", "executor_from_args", "ray_parent"]


def ray_parent(what: str) -> argparse.ArgumentParser:
    """``--ray ADDRESS|auto|local`` and ``--ray-cpus N`` (``what``: how the command splits its work)."""
    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(
        'Ray cluster (pip install "walshkv[ray]")',
        f"Spread the evaluations over a Ray cluster: {what} Each worker process loads the model once, by "
        "name or path (every node needs walshkv, the same version, and the model: a registry name downloads "
        "it there, a path must exist there); the metrics are the numbers a run without --ray gives at the "
        "same torch thread count.",
    )
    group.add_argument(
        "--ray",
        metavar="ADDRESS|auto|local",
        help="local: start a Ray cluster on this machine (--ray-cpus CPUs, default all) and stop it at the end; "
        "auto: join the cluster `ray start --head` started on this machine (or RAY_ADDRESS); HOST:PORT: join "
        "the head node at that address (port 6379 unless changed); ray://HOST:10001: Ray Client",
    )
    group.add_argument(
        "--ray-cpus", type=int, metavar="N", help="CPUs of the --ray local cluster (default: every CPU here)"
    )
    return parent


def executor_from_args(args: argparse.Namespace) -> contextlib.AbstractContextManager[Executor | None]:
    """The executor ``--ray`` asks for, as a context manager (``None``: in process, as without Ray).

    Raises:
        ValueError: ``--ray-cpus`` without ``--ray local``, or below 1.
        ImportError: ``--ray`` without Ray installed (naming the install line).
    """
    address, cpus = getattr(args, "ray", None), getattr(args, "ray_cpus", None)
    if cpus is not None and address != "local":
        raise ValueError(f"--ray-cpus sizes a cluster started here: add --ray local (got --ray {address})")
    if cpus is not None and cpus < 1:
        raise ValueError(f"--ray-cpus must be at least 1, got {cpus}")
    if address is None:
        return contextlib.nullcontext()
    require_ray()  # before any model is loaded
    return RayExecutor(address, cpus=cpus)


def _head_dim_hint(model: str) -> int | None:
    """head_dim from the registry or a local config.json, without loading weights (``None`` if unknown)."""
    if model in models.MODELS:
        return models.MODELS[model].head_dim
    cfg_path = Path(model).expanduser() / "config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError):
        return None
    cfg = cfg.get("text_config", cfg)
    if cfg.get("head_dim"):
        return int(cfg["head_dim"])
    if cfg.get("hidden_size") and cfg.get("num_attention_heads"):
        return int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return None


def _list_grids() -> str:
    lines = []
    for name, (description, specs) in PRESETS.items():
        lines.append(f"{name}  ({len(specs)} rows)")
        lines.extend(textwrap.wrap(description, width=100, initial_indent="    ", subsequent_indent="    "))
        lines.extend(
            textwrap.wrap(" ".join(specs), width=100, initial_indent="    specs: ", subsequent_indent="      ")
        )
    lines.append("or --grid FILE.yaml|FILE.json with  codecs: [spec, ...]  (and an optional description)")
    return "\n".join(lines)


def _cmd_sweep(args: argparse.Namespace) -> int:
    if args.list_grids:
        print(_list_grids())
        return 0
    if not args.grid:
        raise ValueError(f"give --grid PRESET|FILE (see walshkv sweep --list-grids); {grid_files_hint()}")

    name, description, raw_specs = load_grid(args.grid)
    hint = _head_dim_hint(args.model)
    # fail before loading anything: the grammar always, head_dim fit when the head_dim is known, every setting
    early = canonical_specs([substitute_head_dim(s, hint or 64) for s in raw_specs], hint)
    config = SweepConfig(
        early,
        ctx=args.ctx,
        windows=2 if args.ci else args.windows,
        score=args.score,
        residual=args.residual,
        chunk=args.chunk,
        decode_chunk=args.decode_chunk,
        reuse_rows=args.reuse_rows,
        title=name,
        description=description,
        command=command_line(args),
        progress=not args.quiet,
    )
    calibrated = [s for s in early if needs_calibration(s)]
    bias_is_enough = bool(getattr(args, "kv_mean_center", None)) and all(
        only_centering(parse_cache_spec(s)) for s in calibrated
    )
    if calibrated and not args.calib_text and not bias_is_enough:
        raise ValueError(
            f"{', '.join(calibrated)} need calibration (center+, vht2 order=variance or auto@BITS): add "
            "--calib-text TEXT (any text other than the evaluation text), or --kv-mean-center FILE for center+"
        )

    executor = executor_from_args(args)  # --ray errors before loading anything
    text = data.load_text(args.text)
    if calibrated and args.calib_text and data.load_text(args.calib_text).content == text.content:
        raise ValueError("--calib-text is the evaluation text; calibrate on different text")
    lm = models.load_model(args.model, progress=not args.quiet)
    head_dim = lm.shape.head_dim
    specs = [substitute_head_dim(s, head_dim) for s in raw_specs]
    calibration = calibration_from_args(lm, specs, args, text)
    named = name_specs(specs, calibration, model=lm)  # a preset file or the model may choose
    print_presets(named, quiet=args.quiet)
    # a sweep's rows are files keyed by the canonical text (resumable, and sent to Ray workers as such)
    config = replace(config, codecs=[n.text for n in named], calibration=calibration)
    out = Path(args.out or f"sweep-{slug(name)}-{slug(lm.name)}")
    with executor as runner:
        rows = run_sweep(lm, text, config, out, executor=runner)
    print(format_table(rows))
    print("Pareto front: " + ", ".join(r["codec"] for r in pareto_front(rows)))
    written = ["results.csv", "results.md"]
    if (out / "pareto.png").is_file():
        written.append("pareto.png")
    print(f"wrote {out}/{{{','.join(written)}}} and {len(rows)} row files in {out}/rows/")
    return 0


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv sweep``."""
    sw = sub.add_parser(
        "sweep",
        help="run a grid of cache specs through the eval protocol (resumable; CSV, markdown, Pareto plot)",
        description="Run every cache spec of a grid preset or file through the same protocol as "
        "'walshkv eval'. One JSON per finished row is kept under --out and reused on the next run when "
        "its settings match, so an interrupted sweep resumes. Writes results.csv, results.md and "
        "pareto.png (mean KLD against bits per element, Pareto front marked; needs matplotlib).",
        epilog="presets: " + ", ".join(PRESETS) + " (details: walshkv sweep --list-grids)\n"
        "examples:\n"
        "  walshkv sweep --grid baseline --ci\n"
        "  walshkv sweep --grid vht2-bits --model qwen2.5-1.5b --out sweeps/bits-qwen\n"
        "  walshkv sweep --grid my-grid.yaml --windows 4\n"
        "  walshkv sweep --grid vht2-bits --ray local --chunk 2          # a Ray cluster on this machine\n"
        "  walshkv sweep --grid peers --ray HEAD:6379 --chunk 1          # rows on every node of a cluster",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[
            model_parent(MODEL_HELP + SHOW_DEFAULT, TEXT_HELP + SHOW_DEFAULT),
            windows_parent(
                "tokens per window" + SHOW_DEFAULT, "number of windows, 0: every full window" + SHOW_DEFAULT
            ),
            calibration_parent(),
            output_parent("no progress bars or per-chunk lines", out="output folder (default sweep-GRID-MODEL)"),
            ray_parent(
                "each chunk of --chunk pending rows is one task, and each row's file is written here as soon "
                "as its task comes back, so an interrupted run resumes as without --ray."
            ),
        ],
    )
    sw.add_argument("--grid", metavar="PRESET|FILE", help="a preset name or a .yaml/.json file with codecs: [...]")
    sw.add_argument("--list-grids", action="store_true", help="list the presets with descriptions and row counts")
    sw.add_argument(
        "--ci", "--quick", action="store_true", dest="ci", help="CI-sized run: 2 windows (overrides --windows)"
    )
    sw.add_argument(
        "--score", choices=get_args(Score), default="half", help="score the second half of each window or all"
    )
    sw.add_argument(
        "--residual", type=int, default=0, help="keep this many recent tokens in full precision (default 0)"
    )
    sw.add_argument(
        "--reuse-rows",
        action="store_true",
        help="keep finished rows another commit of walshkv measured (same settings otherwise) instead of re-running "
        "them, for a long run resumed across commits that do not change what is measured; each row keeps the commit "
        "that measured it (default: such rows are re-run)",
    )
    sw.add_argument(
        "--chunk", type=int, default=4, help="specs per evaluation pass, sharing one reference (default %(default)s)"
    )
    sw.add_argument(
        "--decode-chunk",
        type=int,
        default=1,
        metavar="N",
        help="hf-* rows are fed as in generation: N scored tokens per forward (default %(default)s, exactly "
        "as in generation; larger is faster and the extra full-precision context is reported)",
    )
    sw.set_defaults(func=_cmd_sweep)
