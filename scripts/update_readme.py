"""Paste a generated markdown result file into README.md (or another page), or check that every pasted block
still equals a result file.

Usage:
    python scripts/update_readme.py RESULT.md [TARGET.md [NAME]]   # paste (TARGET defaults to README.md)
    python scripts/update_readme.py --check [PAGE.md ...]          # every block equals a docs/results file

The text goes between the target's `<!-- results:start -->` and `<!-- results:end -->` markers
(`<!-- results:NAME:start -->` ... with a NAME, for a page with several blocks), so no number in the
docs is typed by hand. `--check` (run by the test suite) fails on a block that no file under
docs/results/ holds, word for word: a block edited by hand, or a result file regenerated without pasting.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- results:start -->", "<!-- results:end -->"
BLOCK = re.compile(
    r"<!-- results(?::(?P<name>[\w.-]+))?:start -->\n(?P<body>.*?)\n<!-- results(?::[\w.-]+)?:end -->", re.S
)
#: The pages with pasted result blocks (paths relative to the repository root).
PAGES = ("README.md", "research/README.md", "docs/*.md")


def main(path: str, target: str | None = None, name: str | None = None) -> None:
    readme = Path(target) if target else ROOT / "README.md"
    start, end = (START, END) if not name else (f"<!-- results:{name}:start -->", f"<!-- results:{name}:end -->")
    text = readme.read_text()
    body = Path(path).read_text().strip()
    new, n = re.subn(re.escape(start) + r".*?" + re.escape(end), f"{start}\n{body}\n{end}", text, flags=re.S)
    if n != 1:
        raise SystemExit(f"{readme} needs exactly one {start} ... {end} block, found {n}")
    readme.write_text(new)
    print(f"{readme}: results from {path}")


def stale_blocks(pages: list[Path] | None = None, results: Path = ROOT / "docs" / "results") -> list[str]:
    """One line per pasted block that equals no markdown file under ``results`` (empty: all in step)."""
    if pages is None:
        pages = [p for pattern in PAGES for p in sorted(ROOT.glob(pattern))]
    held = {f.read_text().strip() for f in results.rglob("*.md")}
    bad = []
    for page in pages:
        for m in BLOCK.finditer(page.read_text()):
            if m["body"].strip() not in held:
                line = page.read_text()[: m.start()].count("\n") + 1
                bad.append(f"{page}:{line}: results block {m['name'] or '(default)'} equals no file under {results}")
    return bad


if __name__ == "__main__":
    if sys.argv[1:2] == ["--check"]:
        problems = stale_blocks([Path(p) for p in sys.argv[2:]] or None)
        print("\n".join(problems) or "every results block equals its result file")
        raise SystemExit(1 if problems else 0)
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None, sys.argv[3] if len(sys.argv) > 3 else None)
