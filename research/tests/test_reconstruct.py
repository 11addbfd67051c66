"""Tests for walshkv_research.reconstruct: kept-fraction reconstruction in orthonormal bases."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from walshkv_research.bases import make_basis
from walshkv_research.reconstruct import (
    MODES,
    SYNTHETIC_KINDS,
    correlation,
    kept_count,
    reconstruct,
    reconstruction_table,
    relative_mse,
    synthetic_signals,
)

SQUARE = [
    ("walsh", 64),
    ("dct", 64),
    ("fourier", 64),
    ("identity", 64),
    ("vilenkin:4x4x4", 64),
    ("vilenkin:2x4x4x4", 128),
    ("dct", 9),
    ("fourier", 9),
    ("vilenkin:3x3", 9),
    ("vilenkin", 9),  # 3x3: the default Vilenkin basis is square at d = 9
]


def _data(vectors: int, d: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(vectors, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_kept_count() -> None:
    assert kept_count(1.0, 64) == 64
    assert kept_count(0.5, 64) == 32
    assert kept_count(0.25, 75) == 19  # 18.75 -> 19
    assert kept_count(0.5, 5) == 3  # halves round up
    assert kept_count(1e-9, 64) == 1
    assert kept_count(0.999, 64) == 64


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.01, math.nan])
def test_kept_count_out_of_range(fraction: float) -> None:
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        kept_count(fraction, 64)


@pytest.mark.parametrize(("name", "d"), SQUARE)
@pytest.mark.parametrize("mode", ["topk", "fixed"])
def test_exact_at_full_fraction_square(name: str, d: int, mode: str) -> None:
    basis = make_basis(name, d)
    assert basis.n == d
    x = _data(6, d)
    x_hat = reconstruct(x, basis, 1.0, mode)
    assert x_hat.shape == x.shape
    assert x_hat.dtype == torch.float64
    assert relative_mse(x, x_hat) < 1e-20
    assert abs(correlation(x, x_hat) - 1.0) < 1e-12


def test_padded_vilenkin_exact_only_with_all_coefficients() -> None:
    basis = make_basis("vilenkin", 64)
    assert (basis.name, basis.n) == ("vilenkin:3x5x5", 75)
    x = _data(6, 64)
    x_back = basis.inverse(basis.forward(x))
    assert relative_mse(x, x_back) < 1e-20
    assert abs(correlation(x, x_back) - 1.0) < 1e-12
    # At f = 1 only d = 64 of the 75 coefficients are kept: the cost of padding.
    assert relative_mse(x, reconstruct(x, basis, 1.0, "topk")) > 1e-6


@pytest.mark.parametrize(("name", "d"), SQUARE[:6])
def test_topk_error_never_increases_with_fraction(name: str, d: int) -> None:
    basis = make_basis(name, d)
    x = _data(8, d, seed=1)
    errors = [relative_mse(x, reconstruct(x, basis, f, "topk")) for f in (0.05, 0.1, 0.25, 0.5, 0.75, 1.0)]
    assert all(b <= a + 1e-15 for a, b in itertools.pairwise(errors))
    assert errors[0] > errors[-1]


@pytest.mark.parametrize(("name", "d"), SQUARE[:6])
@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_topk_beats_fixed(name: str, d: int, fraction: float) -> None:
    basis = make_basis(name, d)
    x = _data(16, d, seed=2)
    topk = reconstruct(x, basis, fraction, "topk")
    fixed = reconstruct(x, basis, fraction, "fixed")
    assert relative_mse(x, topk) <= relative_mse(x, fixed) + 1e-15
    assert correlation(x, topk) >= correlation(x, fixed)


def test_topk_keeps_k_coefficients() -> None:
    basis = make_basis("dct", 64)
    x = _data(4, 64)
    c_hat = basis.forward(reconstruct(x, basis, 0.25, "topk"))
    assert ((c_hat.abs() > 1e-12).sum(dim=1) == 16).all()
    c_fixed = basis.forward(reconstruct(x, basis, 0.25, "fixed"))
    support = c_fixed.abs() > 1e-12
    assert (support == support[0]).all()
    assert int(support[0].sum()) == 16


def test_fixed_picks_largest_mean_energy() -> None:
    basis = make_basis("identity", 4)
    x = torch.tensor([[1.0, 5.0, 0.1, 2.0], [1.0, -5.0, 0.2, -2.0]], dtype=torch.float64)
    x_hat = reconstruct(x, basis, 0.5, "fixed")
    expected = torch.tensor([[0.0, 5.0, 0.0, 2.0], [0.0, -5.0, 0.0, -2.0]], dtype=torch.float64)
    assert torch.equal(x_hat, expected)


@pytest.mark.parametrize("mode", ["signs", "signs+amp"])
@pytest.mark.parametrize("name", ["walsh", "vilenkin"])
def test_sign_modes_shapes(mode: str, name: str) -> None:
    basis = make_basis(name, 64)
    x = _data(5, 64)
    x_hat = reconstruct(x, basis, None, mode)
    assert x_hat.shape == (5, 64)
    assert x_hat.dtype == torch.float64
    assert torch.isfinite(x_hat).all()
    assert torch.equal(x_hat, reconstruct(x, basis, 0.1, mode))  # fraction ignored


def test_signs_mode_keeps_vector_energy() -> None:
    basis = make_basis("dct", 32)
    x = _data(5, 32)
    c_hat = basis.forward(reconstruct(x, basis, None, "signs"))
    assert torch.allclose(c_hat.pow(2).sum(dim=1), x.pow(2).sum(dim=1), atol=1e-10)


def test_signs_identity_exact_on_pm1() -> None:
    basis = make_basis("identity", 16)
    x = (torch.randint(0, 2, (3, 16), generator=torch.Generator().manual_seed(3)) * 2 - 1).double()
    for mode in ("signs", "signs+amp"):
        x_hat = reconstruct(x, basis, None, mode)
        assert torch.equal(x_hat, x)
        assert relative_mse(x, x_hat) == 0.0


def test_signs_amp_profile() -> None:
    basis = make_basis("identity", 3)
    x = torch.tensor([[1.0, -4.0, 0.0], [3.0, 2.0, -2.0]], dtype=torch.float64)
    # amplitudes: mean |c| per position = [2, 3, 1]; sign(0) -> +1
    expected = torch.tensor([[2.0, -3.0, 1.0], [2.0, 3.0, -1.0]], dtype=torch.float64)
    assert torch.equal(reconstruct(x, basis, None, "signs+amp"), expected)


def test_reconstruct_errors() -> None:
    basis = make_basis("dct", 8)
    x = _data(3, 8)
    with pytest.raises(ValueError, match="allowed modes") as info:
        reconstruct(x, basis, 0.5, "best")
    for mode in MODES:
        assert mode in str(info.value)
    bad = x.clone()
    bad[1, 2] = math.nan
    with pytest.raises(ValueError, match="NaN or Inf"):
        reconstruct(bad, basis, 0.5, "topk")
    bad[1, 2] = math.inf
    with pytest.raises(ValueError, match="NaN or Inf"):
        reconstruct(bad, basis, 0.5, "signs")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        reconstruct(x, basis, 1.5, "topk")
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        reconstruct(x, basis, None, "fixed")
    with pytest.raises(ValueError, match="length 8"):
        reconstruct(_data(3, 9), basis, 0.5, "topk")
    with pytest.raises(ValueError, match=r"\[vectors, d\]"):
        reconstruct(x[0], basis, 0.5, "topk")


def test_correlation_and_relative_mse() -> None:
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    x_hat = torch.tensor([[2.0, 4.0, 6.0], [0.0, 5.0, 1.0]], dtype=torch.float64)
    assert correlation(x, x_hat) == pytest.approx(1.0, abs=1e-15)  # constant row skipped
    assert correlation(x, -x_hat) == pytest.approx(-1.0, abs=1e-15)
    assert math.isnan(correlation(x[1:], x_hat[1:]))
    assert relative_mse(x, x_hat) == pytest.approx((1 + 4 + 9 + 1 + 16 + 0) / (14 + 3))
    assert relative_mse(torch.zeros(2, 3), torch.zeros(2, 3)) == 0.0
    with pytest.raises(ValueError, match="same shape"):
        correlation(x, x_hat[:1])


@pytest.mark.parametrize("kind", SYNTHETIC_KINDS)
def test_synthetic_deterministic(kind: str) -> None:
    a = synthetic_signals(kind, 4, 64, seed=5)
    assert a.shape == (4, 64)
    assert a.dtype == torch.float64
    assert torch.isfinite(a).all()
    assert torch.equal(a, synthetic_signals(kind, 4, 64, seed=5))
    assert not torch.equal(a, synthetic_signals(kind, 4, 64, seed=6))
    assert not torch.equal(a[0], a[1])


def test_synthetic_chirp_range() -> None:
    x = synthetic_signals("chirp", 8, 128)
    assert x.abs().max() <= 1.0


def test_prime_harmonic_sparse_in_fourier() -> None:
    d = 64
    primes = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]  # p <= d/2
    x = synthetic_signals("prime-harmonic", 8, d, seed=1)
    basis = make_basis("fourier", d)
    k = 2 * len(primes)
    x_hat = reconstruct(x, basis, k / d, "topk")
    # Each prime occupies exactly its cos/sin pair, so the reconstruction is exact, not just > 0.999.
    assert correlation(x, x_hat) > 1 - 1e-12
    assert relative_mse(x, x_hat) < 1e-20
    # The energy sits exactly on the prime frequencies (rows 2p-1, 2p of the real DFT basis).
    c = basis.forward(x)
    rows = [r for p in primes for r in (2 * p - 1, 2 * p)]
    off = torch.ones(d, dtype=torch.bool)
    off[rows] = False
    assert c[:, off].abs().max() < 1e-12
    # Fewer coefficients than that is not exact.
    assert correlation(x, reconstruct(x, basis, (k - 4) / d, "topk")) < 1 - 1e-6


def test_synthetic_errors() -> None:
    with pytest.raises(ValueError, match="allowed kinds") as info:
        synthetic_signals("square", 2, 8)
    for kind in SYNTHETIC_KINDS:
        assert kind in str(info.value)
    with pytest.raises(ValueError, match="d >= 4"):
        synthetic_signals("prime-harmonic", 2, 3)
    with pytest.raises(ValueError, match="vectors >= 1"):
        synthetic_signals("noise", 0, 8)


def test_reconstruction_table() -> None:
    x = synthetic_signals("noise", 6, 64)
    rows = reconstruction_table(x, ["walsh", "vilenkin"], [0.25, 1.0], list(MODES))
    assert len(rows) == 2 * (2 * 2 + 2)
    assert [r["basis"] for r in rows[:6]] == ["walsh"] * 6
    assert {r["basis"] for r in rows[6:]} == {"vilenkin:3x5x5"}
    keys = {"basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse"}
    assert all(set(r) == keys for r in rows)
    sign_rows = [r for r in rows if r["mode"] in ("signs", "signs+amp")]
    assert len(sign_rows) == 4
    assert all(r["fraction"] is None and r["kept"] is None for r in sign_rows)
    walsh_full = next(r for r in rows if r["basis"] == "walsh" and r["mode"] == "topk" and r["fraction"] == 1.0)
    assert walsh_full["kept"] == 64
    assert walsh_full["coefficients"] == 64
    assert walsh_full["relative_mse"] < 1e-20
    vil = next(r for r in rows if r["basis"] == "vilenkin:3x5x5" and r["mode"] == "fixed" and r["fraction"] == 0.25)
    assert vil["kept"] == 16
    assert vil["coefficients"] == 75
    with pytest.raises(ValueError, match="allowed modes"):
        reconstruction_table(x, ["dct"], [0.5], ["topk", "nope"])
    with pytest.raises(ValueError, match="walsh needs a power-of-two"):
        reconstruction_table(synthetic_signals("noise", 2, 96), ["walsh"], [0.5], ["topk"])
