"""The structured trellis tables of research/scripts/trellis_structured.py (docs/trellis.md, "Tables an AVX2 kernel
reads without a gather"): each kind's table is the sum its name says, the int8 kind's values are integer sums of at
most 127 grid steps, and a short training run codes a Gaussian source better than the scalar quantizer."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from walshkv.attention import cpu
from walshkv.ops.lloyd_max import lloyd_max

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "trellis_structured.py"


@pytest.fixture(scope="module")
def ts():
    spec = importlib.util.spec_from_file_location("trellis_structured", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["trellis_structured"] = module
    spec.loader.exec_module(module)
    return module


def test_each_kind_is_the_sum_its_name_says(ts):
    s = torch.arange(256)
    gen = torch.Generator().manual_seed(0)
    p, q = torch.randn(16, generator=gen), torch.randn(16, generator=gen)
    assert torch.allclose(ts._design("44") @ torch.cat([p, q]), p[s & 15] + q[s >> 4])
    a, b, c = torch.randn(8, generator=gen), torch.randn(8, generator=gen), torch.randn(4, generator=gen)
    assert torch.allclose(ts._design("332") @ torch.cat([a, b, c]), a[s & 7] + b[(s >> 3) & 7] + c[s >> 6])
    assert torch.equal(ts._design("full"), torch.eye(256))
    with pytest.raises(ValueError, match="kinds: shipped, full, 44, 332, 44i8"):
        ts._design("55")


def test_the_int8_kind_is_an_integer_sum_within_127_steps(ts):
    gen = torch.Generator().manual_seed(1)
    params = torch.randn(32, generator=gen)
    design = ts._design("44i8")
    tab = ts._int8("44i8", params, design)
    p, q = params[:16], params[16:]
    step = float(p.abs().max() + q.abs().max()) / 127.0
    units = tab / step
    assert torch.allclose(units, torch.round(units), atol=1e-3)  # every value a whole number of grid steps
    assert float(units.abs().max()) <= 127 + 1e-3  # an int8 sum: |P| + |Q| <= 127
    assert float((tab - design @ params).abs().max()) <= step + 1e-6  # each of P and Q rounded by half a step


@pytest.mark.skipif(not cpu.kernel_available(), reason="the script codes with the C++ kernel's trellis search")
def test_a_short_training_run_beats_the_scalar_quantizer(ts):
    tab, history = ts.train("44", 3.0, samples=512, iterations=6, seed=1)
    mse = ts.evaluate(tab, 3.0, samples=1024, seed=7)
    assert len(history) == 6 and mse < lloyd_max(3, "gaussian").mse, (mse, history)
    assert math.isfinite(mse)
