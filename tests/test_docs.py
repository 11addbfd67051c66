"""The docs say only what a result file says: every pasted results block equals a file under docs/results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("update_readme", ROOT / "scripts" / "update_readme.py")
assert _spec is not None and _spec.loader is not None
update_readme = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(update_readme)


def test_every_results_block_equals_its_file() -> None:
    assert update_readme.stale_blocks() == []


def test_a_hand_edited_block_is_caught(tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    (results / "r.md").write_text("| a | 1 |\n")
    page = tmp_path / "page.md"
    page.write_text("x\n<!-- results:start -->\n| a | 1 |\n<!-- results:end -->\n")
    assert update_readme.stale_blocks([page], results) == []
    page.write_text("x\n<!-- results:start -->\n| a | 2 |\n<!-- results:end -->\n")
    (problem,) = update_readme.stale_blocks([page], results)
    assert "page.md:2" in problem and "equals no file" in problem
