"""The VHT2 sweep presets end to end in CI-sized form (2 windows) on smollm2-135m."""

from __future__ import annotations

import csv
import math

import pytest

from walshkv.cli import main
from walshkv.codecs import parse_cache_spec
from walshkv.eval.sweep import PRESETS, canonical_specs, resolve_grid

pytestmark = pytest.mark.model

VHT2_PRESETS = [name for name in PRESETS if name.startswith("vht2")]
HEAD_DIM = 64  # smollm2-135m's
#: The best row of every grid stays under this KLD (2 windows of 256 tokens): measured 0.0016 (vht2-bits) to
#: 0.11 (vht2-sk, vht2-orders); a grid whose every spec collapsed (KLD 1 to 6 here) fails.
KEPT_KLD = 0.2


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
    codecs = [r["codec"] for r in rows]
    assert sorted(codecs) == sorted(canonical_specs(resolve_grid(grid, HEAD_DIM), HEAD_DIM))  # every spec ran, once
    kld = {r["codec"]: float(r["kld_mean"]) for r in rows}
    bits = {r["codec"]: float(r["bits_per_element"]) for r in rows}
    for r in rows:
        assert 0 < kld[r["codec"]] < math.inf and 0 <= float(r["top1_agreement"]) <= 1, r  # every row is lossy
        spec = parse_cache_spec(r["codec"])
        if not spec.needs_calibration:  # the bits a row reports are what its codecs' layouts store
            layout = 8 * (spec.k.bytes_per_vector(HEAD_DIM) + spec.v.bytes_per_vector(HEAD_DIM)) / (2 * HEAD_DIM)
            assert bits[r["codec"]] == pytest.approx(layout, rel=1e-9), r
    assert min(kld.values()) < KEPT_KLD  # the grid's best spec keeps the model (measured 0.0016-0.11)
    low, high = min(bits.values()), max(bits.values())
    if high > low:  # more bits buy a better best row (measured: at least 1.45x lower KLD)
        best_at = {b: min(kld[c] for c in codecs if bits[c] == b) for b in (low, high)}
        assert best_at[high] < best_at[low], (best_at, kld)
    assert (out / "results.md").is_file() and (out / "pareto.png").is_file()
