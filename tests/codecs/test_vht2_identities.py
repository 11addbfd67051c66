"""Identities tying VHT2 to the foundation's codecs: same bytes, not just similar numbers."""

from __future__ import annotations

import pytest
import torch

from walshkv import parse_codec


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_one_band_natural_vht2_is_rot_int(bits, head_dim):
    """vht2:B (one band, natural order, all coefficients) stores exactly what rot+intB stores."""
    x = torch.randn(2, 3, 5, head_dim)
    a, b = parse_codec(f"vht2:{bits}"), parse_codec(f"rot+int{bits}")
    pa, pb = a.encode(x), b.encode(x)
    assert torch.equal(pa.tensors["codes"], pb.tensors["codes"])
    assert torch.equal(pa.tensors["scale"], pb.tensors["scale"])
    assert a.bits_per_element(head_dim) == b.bits_per_element(head_dim)
    torch.testing.assert_close(a.decode(pa), b.decode(pb), atol=1e-5, rtol=0)
