"""Paste a markdown result file (written by `walshkv eval --markdown`) into README.md.

Usage: python scripts/update_readme.py docs/results/smollm2-prideprejudice.md
The table goes between the README's `<!-- results:start -->` and `<!-- results:end -->` markers,
so no number in the README is typed by hand.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

START, END = "<!-- results:start -->", "<!-- results:end -->"


def main(path: str) -> None:
    readme = Path(__file__).resolve().parents[1] / "README.md"
    text = readme.read_text()
    body = Path(path).read_text().strip()
    new, n = re.subn(re.escape(START) + r".*?" + re.escape(END), f"{START}\n{body}\n{END}", text, flags=re.S)
    if n != 1:
        raise SystemExit(f"README.md needs exactly one {START} ... {END} block, found {n}")
    readme.write_text(new)
    print(f"README.md: results table from {path}")


if __name__ == "__main__":
    main(sys.argv[1])
