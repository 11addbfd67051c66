"""Protocol defaults, in one place: every function signature and every CLI parser reads them from here.

Changing one changes what ``walshkv eval`` measures by default, so the README table and docs/results
figures must be regenerated with it (scripts/reproduce.sh).
"""

from __future__ import annotations

__all__ = [
    "CALIB_TOKENS",
    "CTX",
    "DEFAULT_MODEL",
    "DEFAULT_TEXT",
    "RECOMMEND_WINDOWS",
    "WINDOWS",
]

#: Tokens per evaluation window (``--ctx``).
CTX: int = 512
#: Evaluation windows (``--windows``; 0 means every full window of the text).
WINDOWS: int = 8
#: Selection windows ``walshkv recommend`` ranks candidates on.
RECOMMEND_WINDOWS: int = 4
#: Calibration tokens for K/V statistics (``--calib-tokens``, ``calibrate --tokens``).
CALIB_TOKENS: int = 8192
#: The model every command uses unless told otherwise.
DEFAULT_MODEL: str = "smollm2-135m"
#: The text every command uses unless told otherwise: Python's own documentation, offline.
DEFAULT_TEXT: str = "python-docs"
