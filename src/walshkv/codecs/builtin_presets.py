"""The built-in preset table: ``walshkv:3``, ``walshkv:3.5``, ``walshkv:4.5`` and the spec each stands for.

Data only, at the codecs layer so that the spec grammar (:func:`walshkv.codecs.spec.parse_cache_spec`) can
read ``walshkv:B`` names without importing :mod:`walshkv.presets`, which re-exports these names and adds
what needs calibration files (a file written for a preset may choose another spec: see
:func:`walshkv.presets.resolve_preset`).
"""

from __future__ import annotations

__all__ = ["BUILTIN", "PRESET_BUDGETS", "builtin_preset_spec", "check_preset_name"]

#: Bits per element (K and V together, every scale and norm counted) of each built-in preset.
PRESET_BUDGETS: dict[str, float] = {"walshkv:3": 3.0, "walshkv:3.5": 3.5, "walshkv:4.5": 4.5}

# The built-in spec of each preset: the winner on smollm2-135m of `walshkv recommend --text python-docs
# --windows 8 --bits B` (K mean from the first half of python-docs, 8 windows of its second half);
# other models may choose another (a preset file records it). With the default 4 windows, 4.5 bits
# picks center+rot+iq4_nl/rot+iq4_nl by a hair (docs/presets.md shows both on the evaluation text).
BUILTIN: dict[str, str] = {
    "walshkv:3": "center+tq:3.5/tq:2",
    "walshkv:3.5": "center+tq:4/tq:2.5",
    "walshkv:4.5": "center+tq:5/tq:3.5",
}


def check_preset_name(name: str) -> str:
    """The canonical (lower-case, stripped) form of a built-in preset name.

    Raises:
        ValueError: an unknown name; the message lists the presets.
    """
    key = name.strip().lower()
    if key not in PRESET_BUDGETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESET_BUDGETS)}")
    return key


def builtin_preset_spec(name: str) -> str:
    """The built-in cache spec of preset ``name`` (``walshkv:3.5`` -> ``center+tq:4/tq:2.5``)."""
    return BUILTIN[check_preset_name(name)]
