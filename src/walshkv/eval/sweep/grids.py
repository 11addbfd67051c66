"""Sweep grids: the named presets (:data:`PRESETS`) and grid files, and the specs they resolve to.

A grid is a named preset or a ``.yaml``/``.json`` file with ``codecs: [spec, ...]``. Preset specs may contain
the placeholders ``{hd}``, ``{hd/2}``, ``{hd/4}`` (any ``{hd/N}``), replaced by the model's head_dim when the
grid is resolved (:func:`resolve_grid`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from walshkv.cache import check_spec_fits
from walshkv.codecs import parse_cache_spec
from walshkv.eval.harness import DEFAULT_CODECS

if TYPE_CHECKING:
    from walshkv.models import LoadedModel

__all__ = [
    "HF_PEERS",
    "PRESETS",
    "canonical_specs",
    "grid_files_hint",
    "load_grid",
    "needs_calibration",
    "resolve_grid",
    "substitute_head_dim",
    "unrunnable_specs",
]

_BITS_K = ("5,5,4,3", "5,4,4,3", "4,4,4,3", "4,3,3,3", "3,3,3,3", "5,4,4", "8,8,8,8")
_BITS_V = ("3", "4", "5")
_BANDS = ("4", "5,3", "5,4,3", "5,4,4,3", "5,5,4,3,3", "5,5,4,4,4,4,3,3")
_ORDERS = ("natural", "sequency", "squarefree", "squarefree-dc", "variance")
_V_FORMATS = ("vht2:3", "vht2:4", "vht2:5", "vht2:4,3,3,2", "vht2:4,4,3,3", "vht2:5,4,3,2", "vzc")

# Hugging Face's QuantizedCache backends in the peers preset (left out where they cannot run).
HF_PEERS = ("hf-quanto:4", "hf-quanto:2", "hf-hqq:4", "hf-hqq:3", "hf-fp8")

PRESETS: dict[str, tuple[str, list[str]]] = {
    "baseline": (
        "The foundation's default codec list (walshkv.eval.DEFAULT_CODECS: fp16, int8..int2, with and "
        "without the Walsh-Hadamard rotation). Small and fast; handy for CI.",
        list(DEFAULT_CODECS),
    ),
    "rotation-int4": (
        "The rotation+INT4 document's claims: per-vector intB at 8, 4, 3 and 2 bits with and without the "
        "Walsh-Hadamard rotation, next to KIVI-2 (scripts/rotation_int4_claims.py judges them).",
        ["int8", "rot+int8", "int4", "rot+int4", "int3", "rot+int3", "int2", "rot+int2", "kivi2"],
    ),
    "vht2-bits": (
        "VHT2 bit allocation: banded K (per-band bit widths 5,5,4,3 / 5,4,4,3 / 4,4,4,3 / 4,3,3,3 / "
        "3,3,3,3 / 5,4,4 / 8,8,8,8) crossed with flat V of 3, 4 and 5 bits (vht2:K/vht2:V).",
        [f"vht2:{k}/vht2:{v}" for k in _BITS_K for v in _BITS_V],
    ),
    "vht2-bands": (
        "VHT2 number of bands at matched bits: K split into 1, 2, 3, 4, 5 and 8 bands, V flat vht2:4. "
        "'Matched' means the arithmetic mean of the K band bit widths is exactly 4.0 (the flat vht2:4 "
        "row), counted before any scale overhead; the measured bits_per_element column includes scales.",
        [f"vht2:{b}/vht2:4" for b in _BANDS],
    ),
    "vht2-sk": (
        "VHT2 skeleton size: K vht2:5,5,4,3 keeping only the first sk = head_dim (all), head_dim/2 and "
        "head_dim/4 coefficients (the {hd} placeholders are filled in with the model's head_dim), V flat vht2:3.",
        [f"vht2:5,5,4,3:sk={hd}/vht2:3" for hd in ("{hd}", "{hd/2}", "{hd/4}")],
    ),
    "vht2-orders": (
        "VHT2 coefficient order before banding: K vht2:5,5,4,3 with order natural, sequency, squarefree, "
        "squarefree-dc and variance, V flat vht2:3. order=variance is calibrated: give --calib-text.",
        [f"vht2:5,5,4,3:order={o}/vht2:3" for o in _ORDERS],
    ),
    "vht2-v": (
        "VHT2 value formats: K vht2:5,5,4,3:order=squarefree with V flat vht2:3/4/5, banded V at the same "
        "mean band width as a flat one (vht2:4,3,3,2 = 3.0) or between two (vht2:4,4,3,3 and "
        "vht2:5,4,3,2 = 3.5), and the vzc sign-bitmap format.",
        [f"vht2:5,5,4,3:order=squarefree/{v}" for v in _V_FORMATS],
    ),
    "peers": (
        "Every codec users compare against, at the bits they ship: llama.cpp's cache types with and without "
        "the Walsh-Hadamard rotation (q8_0 .. iq4_nl, and q8_0 K with q4_0 V), KIVI (2/4-bit, G=32, R=32), "
        "TurboQuant-class (tq:2..4, 2.5, 3.5; tqprod:3), and walshkv's own: rot+intB, VHT2 5/5/4/3+V3, "
        "and K mean-centering (center+..., needs --kv-mean-center FILE or --calib-text); Hugging Face's "
        "QuantizedCache (hf-quanto:2/4, hf-hqq:3/4, hf-fp8: needs walshkv[hf]; fed token by token; "
        "full-attention models only, left out elsewhere).",
        [
            *(f"{r}{t}" for t in ("q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl") for r in ("", "rot+")),
            "q8_0/q4_0",
            "rot+q8_0/rot+q4_0",
            "kivi2",
            "kivi4",
            "tq:2",
            "tq:2.5",
            "tq:3",
            "tq:3.5",
            "tq:4",
            "tqprod:3",
            "rot+int8/rot+int4",
            "rot+int4",
            "rot+int3",
            "vht2:5,5,4,3/vht2:3",
            "center+rot+q4_0",
            "center+rot+int4",
            "center+rot+int3",
            "center+rot+int4/rot+int3",
            *HF_PEERS,
        ],
    ),
    "long-context": (
        "What issue 20 compares at 2k-32k tokens: walshkv's presets (the model's shipped specs; calibrated with "
        "--calib-text or --kv-mean-center), llama.cpp's types with and without rotation (q8_0, q4_0, iq4_nl, "
        "q8_0 K with q4_0 V), KIVI (2/4-bit, G=32, R=32), TurboQuant-class (tq:3, tq:4) and Hugging Face's "
        "QuantizedCache (hf-quanto:4, fed in --decode-chunk steps), plus fp16 as the sanity row.",
        [
            "fp16",
            "walshkv:3",
            "walshkv:3.5",
            "walshkv:4.5",
            "q8_0",
            "rot+q8_0/rot+q4_0",
            "q4_0",
            "rot+q4_0",
            "iq4_nl",
            "rot+iq4_nl",
            "kivi4",
            "kivi2",
            "tq:4",
            "tq:3",
            "hf-quanto:4",
        ],
    ),
    "vht2-claims": (
        "The VHT2 document's remaining claims, one row each: its pairings (natural and squarefree order); "
        "the 3-bit floor (one 2-bit K band, 2-bit V); whether 5,5,4,3 beats the same widths in other orders "
        "(reversed 3,4,5,5 and shuffled 4,5,5,3) and a flat-ish 4,4,5,4; the foundation's rotated int codecs "
        "bracketing it (rot+int5/rot+int3 has exactly 5/5/4/3+V3's bits at head_dim 64); and measured bit "
        "allocation (vht2:auto@B, calibrated: give --calib-text) at 5/5/4/3+V3's bits for head_dim 64 and 128.",
        [
            "vht2:5,5,4,3/vht2:3",
            "vht2:5,5,4,3:order=squarefree/vht2:3",
            "vht2:5,5,4,2/vht2:3",
            "vht2:3,3,3,2/vht2:3",
            "vht2:5,5,4,3/vht2:2",
            "vht2:3,4,5,5/vht2:3",
            "vht2:4,5,5,3/vht2:3",
            "vht2:4,4,5,4/vht2:3",
            "rot+int5/rot+int3",
            "rot+int4/rot+int3",
            "rot+int4",
            "vht2:auto@5.25/vht2:auto@3.25",
            "vht2:auto@4.75/vht2:auto@3.125",
            "vht2:auto@4.25",
        ],
    ),
}

_PLACEHOLDER = re.compile(r"\{\s*hd\s*(?:/\s*(\d+)\s*)?\}")


def substitute_head_dim(spec: str, head_dim: int) -> str:
    """Replace ``{hd}`` and ``{hd/N}`` in a spec by the head_dim (divided by N).

    Args:
        spec: a cache spec, possibly with placeholders.
        head_dim: the model's head size.

    Returns:
        The spec with every placeholder replaced.

    Raises:
        ValueError: ``head_dim`` is not divisible by N, or an unknown ``{...}`` placeholder remains.
    """

    def repl(m: re.Match[str]) -> str:
        div = int(m.group(1) or 1)
        if div <= 0 or head_dim % div:
            raise ValueError(
                f"placeholder {m.group(0)} in {spec!r} needs a head_dim divisible by {div}, got head_dim "
                f"{head_dim}; write the number instead of the placeholder"
            )
        return str(head_dim // div)

    out = _PLACEHOLDER.sub(repl, spec)
    if "{" in out or "}" in out:
        raise ValueError(
            f"unknown placeholder in spec {spec!r}; the only placeholders are {{hd}} and {{hd/N}} "
            "(the model's head_dim, divided by N)"
        )
    return out


def grid_files_hint() -> str:
    """What ``--grid`` accepts, for error messages."""
    return f"valid presets: {', '.join(PRESETS)}; or a .yaml/.yml/.json file with 'codecs: [spec, ...]'"


def _is_grid_file(grid: str) -> bool:
    return grid.lower().endswith((".yaml", ".yml", ".json")) or Path(grid).expanduser().is_file()


def load_grid(grid: str) -> tuple[str, str, list[str]]:
    """Look up a preset or read a grid file, without substituting placeholders or parsing specs.

    Args:
        grid: a preset name (see :data:`PRESETS`) or a path to a ``.yaml``/``.yml``/``.json`` file
            holding ``{"codecs": [spec, ...], "description": "..."}`` (``description`` optional).

    Returns:
        ``(name, description, specs)``; ``name`` is the preset name or the file's stem.

    Raises:
        ValueError: unknown preset (the message lists the valid ones), missing or malformed file.
    """
    if grid in PRESETS:
        description, specs = PRESETS[grid]
        return grid, description, list(specs)
    if not _is_grid_file(grid):
        raise ValueError(f"unknown grid {grid!r}; {grid_files_hint()}")
    path = Path(grid).expanduser()
    if not path.is_file():
        raise ValueError(f"grid file {path} does not exist; {grid_files_hint()}")
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cannot read grid file {path}: {err}") from None
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(raw)
        except json.JSONDecodeError as err:
            raise ValueError(f'grid file {path} is not valid JSON ({err}); expected {{"codecs": [...]}}') from None
    else:
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"reading {path} needs PyYAML (pip install pyyaml), which walshkv does not require; "
                'or write the grid as JSON: {"codecs": [spec, ...]}'
            ) from None
        try:
            data = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ValueError(f"grid file {path} is not valid YAML: {err}") from None
    if isinstance(data, list):
        data = {"codecs": data}
    if not isinstance(data, dict) or "codecs" not in data:
        raise ValueError(f"grid file {path} must hold a mapping with a 'codecs' list, e.g. codecs: [int4, rot+int4]")
    unknown = set(data) - {"codecs", "description"}
    if unknown:
        raise ValueError(f"grid file {path} has unknown keys {sorted(unknown)}; allowed: codecs, description")
    specs = data["codecs"]
    if not isinstance(specs, list) or not specs:
        raise ValueError(f"grid file {path}: 'codecs' must be a non-empty list of cache specs")
    bad = [s for s in specs if not isinstance(s, str) or not s.strip()]
    if bad:
        raise ValueError(
            f"grid file {path}: every entry of 'codecs' must be a spec string, got {bad!r} "
            "(in YAML, quote specs that could read as numbers or contain ', ' in a [flow, list])"
        )
    description = data.get("description") or f"grid file {path.name}"
    if not isinstance(description, str):
        raise ValueError(f"grid file {path}: 'description' must be a string")
    return path.stem, description, [s.strip() for s in specs]


def resolve_grid(grid: str, head_dim: int) -> list[str]:
    """The cache specs of a preset or grid file, placeholders replaced by ``head_dim``.

    The specs are not parsed here (see :func:`canonical_specs`).

    Args:
        grid: preset name or path to a ``.yaml``/``.yml``/``.json`` grid file.
        head_dim: the model's head size, for ``{hd}`` and ``{hd/N}``.

    Returns:
        The spec strings in grid order.

    Raises:
        ValueError: unknown preset, bad file, or a placeholder that cannot be filled in.
    """
    _, _, specs = load_grid(grid)
    return [substitute_head_dim(s, head_dim) for s in specs]


def canonical_specs(specs: Sequence[str], head_dim: int | None) -> list[str]:
    """Parse every spec, check it against ``head_dim`` and return canonical, de-duplicated specs.

    Args:
        specs: cache specs (placeholders already substituted).
        head_dim: the model's head size, or ``None`` to check the grammar only.

    Returns:
        Canonical spec strings (``CacheSpec.spec``), first occurrence kept, grid order.

    Raises:
        ValueError: the first spec that does not parse or does not fit ``head_dim``, with the parser's hint.
    """
    out: list[str] = []
    for s in specs:
        try:
            parsed = parse_cache_spec(s)
            if head_dim is not None:
                parsed.check_head_dim(head_dim)
        except (ValueError, TypeError) as err:
            raise ValueError(f"grid spec {s!r}: {err}") from None
        if parsed.spec not in out:
            out.append(parsed.spec)
    if not out:
        raise ValueError("the grid has no cache specs")
    return out


def unrunnable_specs(specs: Sequence[str], lm: LoadedModel) -> dict[str, str]:
    """Peer specs this model or environment cannot run, with the reason.

    A sweep leaves them out (and says so in its table) instead of failing: Hugging Face ``hf-*``
    caches without their optional backend, and any spec the model's layers cannot hold
    (:func:`walshkv.cache.check_spec_fits`: ``hf-*`` on a model with sliding-window layers, such as gemma3).
    """
    out = {}
    for spec in specs:
        try:
            check_spec_fits(spec, lm.model.config)
        except (ImportError, ValueError) as err:
            out[spec] = str(err)
    return out


def needs_calibration(spec: str) -> bool:
    """Whether a (parseable) cache spec needs calibration statistics (``order=variance``, ``auto@BITS``)."""
    return bool(getattr(parse_cache_spec(spec), "needs_calibration", False))
