"""The built-in preset table: ``walshkv:2.5``, ``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5`` and their specs.

Each budget also has a *fast* preset, ``walshkv:B-fast``: the best spec among those the fused decode kernels read
without a dense per-key map (no ``prerope+`` with ``eq+``'s dense transform; ``eqd+``'s diagonal one and every
post-RoPE ``eq+`` are allowed). Its built-in spec is the plain preset's (which needs no per-key map). And a *max*
preset, ``walshkv:B-max``: the one chosen with no limit on decode work (the dense per-key map allowed), which is
what ``walshkv:B`` names unless a model's naming rule gives ``walshkv:B`` to its fast preset
(:func:`walshkv.presets.preset_key`, docs/presets.md "Which kind the plain name means").

Data only, at the codecs layer so that the spec grammar (:func:`walshkv.codecs.spec.parse_cache_spec`) can
read ``walshkv:B`` names without importing :mod:`walshkv.presets`, which re-exports these names and adds
what needs calibration files (a file written for a preset may choose another spec: see
:func:`walshkv.presets.resolve_preset`).
"""

from __future__ import annotations

__all__ = [
    "BUILTIN",
    "FAST_BUDGETS",
    "FAST_SUFFIX",
    "MAX_BUDGETS",
    "MAX_SUFFIX",
    "PRESET_BUDGETS",
    "base_preset_name",
    "builtin_preset_spec",
    "check_preset_name",
    "is_fast_preset",
    "is_max_preset",
    "preset_budget",
]

#: Bits per element (K and V together, every scale and norm counted) of each built-in preset.
PRESET_BUDGETS: dict[str, float] = {"walshkv:2.5": 2.5, "walshkv:3": 3.0, "walshkv:3.5": 3.5, "walshkv:4.5": 4.5}

# The built-in spec of each preset: the winner on smollm2-135m of `walshkv recommend --text python-docs
# --windows 8 --bits B` (K mean from the first half of python-docs, 8 windows of its second half);
# other models may choose another (a preset file records it). With the default 4 windows, 4.5 bits
# picks center+rot+iq4_nl/rot+iq4_nl by a hair (docs/presets.md shows both on the evaluation text).
# walshkv:2.5 (the trellis code's preset, issue 37) was set before any run: tcq at the widths that fill 2.5 bits
# at head_dim 64 with K half a bit wider, centred K; models walshkv has measured ship their own (model_presets.json).
BUILTIN: dict[str, str] = {
    "walshkv:2.5": "center+tcq:2.5/tcq:2",
    "walshkv:3": "center+tq:3.5/tq:2",
    "walshkv:3.5": "center+tq:4/tq:2.5",
    "walshkv:4.5": "center+tq:5/tq:3.5",
}


#: Suffix of the fast presets (``walshkv:3.5-fast``): chosen among the specs the kernels map without a dense matrix.
FAST_SUFFIX = "-fast"

#: Bits per element of each fast preset (the same budgets).
FAST_BUDGETS: dict[str, float] = {f"{name}{FAST_SUFFIX}": bits for name, bits in PRESET_BUDGETS.items()}

#: Suffix of the max presets (``walshkv:3.5-max``): chosen with no limit on the decode work per key.
MAX_SUFFIX = "-max"

#: Bits per element of each max preset (the same budgets).
MAX_BUDGETS: dict[str, float] = {f"{name}{MAX_SUFFIX}": bits for name, bits in PRESET_BUDGETS.items()}


def check_preset_name(name: str) -> str:
    """The canonical (lower-case, stripped) form of a built-in preset name (``walshkv:B``, ``walshkv:B-fast`` or
    ``walshkv:B-max``).

    Raises:
        ValueError: an unknown name; the message lists the presets.
    """
    key = name.strip().lower()
    if key not in PRESET_BUDGETS and key not in FAST_BUDGETS and key not in MAX_BUDGETS:
        names = [*PRESET_BUDGETS, *FAST_BUDGETS, *MAX_BUDGETS]
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(names)}")
    return key


def is_fast_preset(name: str) -> bool:
    """Whether ``name`` is a fast preset name (``walshkv:B-fast``, any budget ``B``)."""
    return name.strip().lower().endswith(FAST_SUFFIX)


def is_max_preset(name: str) -> bool:
    """Whether ``name`` is a max preset name (``walshkv:B-max``, any budget ``B``)."""
    return name.strip().lower().endswith(MAX_SUFFIX)


def base_preset_name(name: str) -> str:
    """``walshkv:B`` for ``walshkv:B-fast`` and ``walshkv:B-max`` (and for ``walshkv:B`` itself), lower-case."""
    key = name.strip().lower()
    for suffix in (FAST_SUFFIX, MAX_SUFFIX):
        if key.endswith(suffix):
            return key[: -len(suffix)]
    return key


def preset_budget(name: str) -> float:
    """Bits per element of preset ``name``: a built-in one's table entry, else the number after ``walshkv:``.

    Raises:
        ValueError: not a ``walshkv:B`` or ``walshkv:B-fast`` name with a positive number ``B``.
    """
    key = base_preset_name(name)
    if key in PRESET_BUDGETS:
        return PRESET_BUDGETS[key]
    try:
        bits = float(key.split(":", 1)[1]) if key.startswith("walshkv:") else float("nan")
    except ValueError:
        bits = float("nan")
    if not bits > 0:
        raise ValueError(
            f"{name!r} is not a preset name: write walshkv:B, walshkv:B{FAST_SUFFIX} or walshkv:B{MAX_SUFFIX} "
            "with B > 0"
        )
    return bits


def builtin_preset_spec(name: str) -> str:
    """The built-in cache spec of preset ``name`` (``walshkv:3.5`` -> ``center+tq:4/tq:2.5``; a fast or max preset has
    its plain preset's built-in spec, which the kernels read without a per-key map)."""
    return BUILTIN[base_preset_name(check_preset_name(name))]
