"""The block-frame decode step of research/scripts/blockrope_speed.py: the query folded once per block, every block
scored against its own query by one fused-kernel call as a K stored after RoPE, the mean's term a score bias, equals
attention over the decoded keys turned to their positions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from walshkv.attention.cpu import kernel_available
from walshkv.codecs import parse_codec

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "blockrope_speed.py"


@pytest.fixture(scope="module")
def bs():
    spec = importlib.util.spec_from_file_location("blockrope_speed", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["blockrope_speed"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not kernel_available(), reason="the fused CPU kernel does not build here")
@pytest.mark.parametrize(
    ("kspec", "block", "exact"),
    [
        ("tcq:3.5:norm=8:tables=2", 64, False),
        ("tq:4", 32, False),
        ("rot+int4", 128, False),
        ("tcq:3.5:norm=8:tables=2", 16, True),
        ("rot+int4", 64, True),
    ],
)
def test_block_step_is_attention_over_the_keys_turned_to_their_positions(bs, kspec, block, exact):
    gen = torch.Generator().manual_seed(0)
    h, g, d, n = 2, 3, 64, 250  # not a multiple of the blocks: the last one is short
    kc, vc = parse_codec(kspec).bind(0, "k"), parse_codec("tq:3").bind(0, "v")
    a = torch.eye(d) + 0.3 * torch.randn(h, d, d, generator=gen) / d**0.5
    mu = torch.randn(h, d, generator=gen)
    pk = kc.encode(torch.randn(1, h, n, d, generator=gen))
    pv = vc.encode(torch.randn(1, h, n, d, generator=gen))
    q = torch.randn(1, h * g, 1, d, generator=gen)
    ainv = torch.linalg.inv(a)
    step = bs.BlockStep(q, pk, pv, kc, vc, ainv, mu, block, d**-0.5, exact=exact)
    want = bs._reference(q, pk, pv, kc, vc, ainv, mu, block, d**-0.5, exact=exact)
    torch.testing.assert_close(step().to(torch.float64), want, atol=2e-5, rtol=0)
