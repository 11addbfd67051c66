"""Paste a generated markdown result file into README.md (or another page).

Usage: python scripts/update_readme.py RESULT.md [TARGET.md]   (TARGET defaults to README.md)
The text goes between the target's `<!-- results:start -->` and `<!-- results:end -->` markers,
so no number in the docs is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def main(path: str, target: str | None = None) -> None:
    readme = Path(target) if target else Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    body = Path(path).read_text().strip()
    new, n = re.subn(re.escape(START) + r".*?" + re.escape(END), f"{START}\n{body}\n{END}", text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{readme} needs exactly one {START} ... {END} block, found {n}")
    readme.write_text(new)
    print(f"{readme}: results from {path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
