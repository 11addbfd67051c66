"""Lloyd-Max quantizers: known Gaussian values, symmetry, k-means agreement, the beta density."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.ops.lloyd_max import lloyd_max

# Unit-variance Gaussian Lloyd-Max MSE (Max 1960; Gersho & Gray, table 6.2)
KNOWN_GAUSSIAN_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


@pytest.mark.parametrize("bits", sorted(KNOWN_GAUSSIAN_MSE))
def test_gaussian_mse_matches_the_known_values(bits):
    assert lloyd_max(bits).mse == pytest.approx(KNOWN_GAUSSIAN_MSE[bits], rel=1e-3)


def test_one_bit_closed_form():
    q = lloyd_max(1)
    assert q.levels.tolist() == pytest.approx([-math.sqrt(2 / math.pi), math.sqrt(2 / math.pi)], rel=1e-12)
    assert q.thresholds.tolist() == [0.0]
    assert q.mse == pytest.approx(1 - 2 / math.pi, rel=1e-12)


@pytest.mark.parametrize("bits", range(1, 9))
def test_codebook_is_symmetric_sorted_and_self_consistent(bits):
    q = lloyd_max(bits)
    n = 1 << bits
    assert q.levels.shape == (n,) and q.thresholds.shape == (n - 1,)
    assert torch.equal(q.levels, -q.levels.flip(0))
    assert bool((q.levels.diff() > 0).all())
    assert torch.allclose(q.thresholds, 0.5 * (q.levels[1:] + q.levels[:-1]), rtol=0, atol=0)
    # more bits, less distortion, roughly 6 dB per bit
    if bits > 1:
        ratio = lloyd_max(bits - 1).mse / q.mse
        assert 3.0 < ratio < 4.2


def test_cached():
    assert lloyd_max(3) is lloyd_max(3)
    assert lloyd_max(3, "beta", 64) is lloyd_max(3, "beta", 64)
    assert lloyd_max(3, "beta", 64) is not lloyd_max(3, "beta", 32)


@pytest.mark.parametrize("bits", [2, 3])
def test_matches_brute_force_kmeans_on_samples(bits):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400_000, generator=gen, dtype=torch.float64).sort().values
    n = 1 << bits
    prefix = torch.cat((torch.zeros(1, dtype=torch.float64), x.cumsum(0)))
    centers = torch.linspace(-2.0, 2.0, n, dtype=torch.float64)  # a deliberately different start
    for _ in range(300):  # k-means (Lloyd) on the samples; x is sorted, so clusters are index ranges
        cuts = torch.searchsorted(x, 0.5 * (centers[1:] + centers[:-1]))
        lo = torch.cat((torch.zeros(1, dtype=torch.long), cuts))
        hi = torch.cat((cuts, torch.tensor([x.numel()])))
        centers = (prefix[hi] - prefix[lo]) / (hi - lo)
    q = lloyd_max(bits)
    assert torch.allclose(centers, q.levels, atol=0.02)
    assign = torch.bucketize(x, 0.5 * (centers[1:] + centers[:-1]))
    sample_mse = float((x - centers[assign]).square().mean())
    assert sample_mse == pytest.approx(q.mse, rel=0.02)


def test_quantize_picks_the_nearest_level():
    q = lloyd_max(3)
    x = torch.randn(10_000) * 1.5
    codes = q.quantize(x)
    assert codes.dtype == torch.uint8
    nearest = (x.unsqueeze(-1) - q.levels.float()).abs().argmin(dim=-1)
    assert torch.equal(codes.long(), nearest)
    assert torch.equal(q.dequantize(codes), q.levels.float()[nearest])


def test_beta_dim3_is_uniform_and_gives_the_uniform_quantizer():
    # sqrt(3) u_1 is uniform on [-sqrt 3, sqrt 3] (Archimedes): the optimum is the uniform quantizer
    q = lloyd_max(2, "beta", 3)
    half = math.sqrt(3)
    want = [-half + (2 * i + 1) * half / 4 for i in range(4)]
    assert q.levels.tolist() == pytest.approx(want, abs=1e-6)
    assert q.mse == pytest.approx(1 / 16, rel=1e-4)  # step^2 / 12 with step 2 sqrt(3) / 4


def test_beta_tends_to_the_gaussian_and_is_easier_in_low_dimension():
    for bits in (1, 2, 3, 4):
        g = lloyd_max(bits).mse
        assert lloyd_max(bits, "beta", 4096).mse == pytest.approx(g, rel=2e-3)
        assert lloyd_max(bits, "beta", 16).mse < lloyd_max(bits, "beta", 64).mse < g


def test_beta_mse_matches_random_unit_vectors():
    d, bits = 8, 2
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(200_000, d, generator=gen, dtype=torch.float64)
    t = (u / u.norm(dim=-1, keepdim=True) * math.sqrt(d)).flatten()
    q = lloyd_max(bits, "beta", d)
    err = float((q.dequantize(q.quantize(t), torch.float64) - t).square().mean())
    assert err == pytest.approx(q.mse, rel=0.02)


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"1\.\.8 bits"):
        lloyd_max(0)
    with pytest.raises(ValueError, match=r"1\.\.8 bits"):
        lloyd_max(9)
    with pytest.raises(ValueError, match="unknown density"):
        lloyd_max(2, "laplace")
    with pytest.raises(ValueError, match="dim >= 3"):
        lloyd_max(2, "beta")
    with pytest.raises(ValueError, match="takes no dim"):
        lloyd_max(2, "gaussian", 64)
