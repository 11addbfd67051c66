"""Paste a generated markdown result file into README.md (or another page).

Usage: python scripts/update_readme.py RESULT.md [TARGET.md [NAME]]   (TARGET defaults to README.md)
The text goes between the target's `<!-- results:start -->` and `<!-- results:end -->` markers
(`<!-- results:NAME:start -->` ... with a NAME, for a page with several blocks), so no number in the
docs is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def main(path: str, target: str | None = None, name: str | None = None) -> None:
    readme = Path(target) if target else Path(__file__).resolve().parents[1] / "README.md"
    start, end = (START, END) if not name else (f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->")
    text = readme.read_text()
    body = Path(path).read_text().strip()
    new, n = re.subn(re.escape(start) + r".*?" + re.escape(end), f"{start}\n{body}\n{end}", text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{readme} needs exactly one {start} ... {end} block, found {n}")
    readme.write_text(new)
    print(f"{readme}: results from {path}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, sys.argv[3] if len(sys.argv) > 3 else None)
