"""The VHT2 sweep presets end to end in CI-sized form (2 windows) on smollm2-135m."""

from __future__ import annotations

import csv

import pytest

from walshkv.cli import main
from walshkv.eval.sweep import PRESETS, resolve_grid

pytestmark = pytest.mark.model

VHT2_PRESETS = [name for name in PRESETS if name.startswith("vht2")]


@pytest.fixture
def fast_model(monkeypatch, smollm2):
    """Reuse the session's smollm2 instead of reloading it for every preset."""
    import walshkv.models

    monkeypatch.setattr(walshkv.models, "load_model", lambda *a, **k: smollm2)


@pytest.mark.parametrize("grid", VHT2_PRESETS)
def test_vht2_preset_runs_end_to_end(grid, tmp_path, fast_model):
    calib = tmp_path / "calib.txt"
    calib.write_text(" ".join(f"The value {i} is stored in register {i % 7}." for i in range(600)))
    out = tmp_path / grid
    args = [
        "sweep",
        "--grid",
        grid,
        "--ci",
        "--ctx",
        "256",
        "--quiet",
        "--out",
        str(out),
        "--calib-text",
        str(calib),
        "--calib-tokens",
        "512",
    ]
    assert main(args) == 0
    with open(out / "results.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert 0 < len(rows) <= len(resolve_grid(grid, 64))
    assert all(float(r["kld_mean"]) >= 0 for r in rows)
    assert (out / "results.md").is_file() and (out / "pareto.png").is_file()
