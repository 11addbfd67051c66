"""Tests for walshkv_research.bases: orthonormal real bases (Walsh, DCT, real DFT, Vilenkin, identity)."""

from __future__ import annotations

import math

import pytest
import torch

from walshkv.ops.hadamard import hadamard_matrix
from walshkv_research.bases import (
    BASIS_NAMES,
    Basis,
    default_bases,
    default_vilenkin_radices,
    make_basis,
    real_dft_matrix,
)

CASES = [
    ("walsh", 8),
    ("walsh", 64),
    ("walsh", 128),
    ("dct", 8),
    ("dct", 9),
    ("dct", 64),
    ("fourier", 8),
    ("fourier", 9),
    ("fourier", 64),
    ("identity", 9),
    ("identity", 64),
    ("vilenkin", 8),
    ("vilenkin", 9),
    ("vilenkin", 64),
    ("vilenkin", 128),
    ("vilenkin:4x4x4", 64),
    ("vilenkin:2x4x4x4", 128),
    ("vilenkin:3x5x5", 64),
    ("vilenkin:3x3", 9),
    ("vilenkin:2x2x2", 8),
]


@pytest.mark.parametrize(("name", "d"), CASES)
def test_orthonormal(name: str, d: int) -> None:
    basis = make_basis(name, d)
    m = basis.matrix
    assert m.dtype == torch.float64
    assert m.shape == (basis.n, basis.n)
    assert basis.n >= basis.d == d
    assert (m @ m.T - torch.eye(basis.n, dtype=torch.float64)).abs().max() < 1e-10


@pytest.mark.parametrize(("name", "d"), CASES)
def test_forward_inverse_all_coefficients(name: str, d: int) -> None:
    basis = make_basis(name, d)
    x = torch.randn(5, d, dtype=torch.float32)
    c = basis.forward(x)
    assert c.shape == (5, basis.n)
    assert c.dtype == torch.float64
    x_back = basis.inverse(c)
    assert x_back.shape == (5, d)
    assert (x_back - x.double()).abs().max() < 1e-12


def test_forward_pads_with_zeros() -> None:
    basis = make_basis("vilenkin", 64)
    assert basis.n == 75
    x = torch.randn(3, 64, dtype=torch.float64)
    padded = torch.cat((x, torch.zeros(3, 11, dtype=torch.float64)), dim=1)
    assert (basis.forward(x) - padded @ basis.matrix.T).abs().max() < 1e-12


def test_default_vilenkin_radices_brute_force() -> None:
    assert default_vilenkin_radices(64) == (3, 5, 5)
    assert default_vilenkin_radices(128) == (3, 3, 3, 5)
    assert default_vilenkin_radices(256) == (3, 5, 5, 5)
    for d in range(1, 300):
        radices = default_vilenkin_radices(d)
        n = math.prod(radices)
        assert set(radices) <= {3, 5}
        assert list(radices) == sorted(radices)
        assert n >= d
        # No smaller 3-5-smooth number fits.
        smooth = {3**a * 5**b for a in range(8) for b in range(6)} - {1}
        assert all(m < d or m >= n for m in smooth)


def test_default_vilenkin_name_spells_radices() -> None:
    assert make_basis("vilenkin", 64).name == "vilenkin:3x5x5"
    assert make_basis("vilenkin", 128).name == "vilenkin:3x3x3x5"
    assert make_basis("vilenkin", 128).n == 135
    assert make_basis("vilenkin", 256).name == "vilenkin:3x5x5x5"
    assert make_basis(" Vilenkin:4x4x4 ", 64).name == "vilenkin:4x4x4"


def test_vilenkin_radix2_is_walsh_up_to_order_and_sign() -> None:
    v = make_basis("vilenkin:2x2x2", 8).matrix
    h = hadamard_matrix(8, torch.float64)
    # Every Vilenkin row matches exactly one Walsh row up to sign.
    overlap = (v @ h.T).abs()
    assert torch.allclose(overlap.sum(dim=1), torch.ones(8, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(overlap.max(dim=1).values, torch.ones(8, dtype=torch.float64), atol=1e-12)
    assert sorted(overlap.argmax(dim=1).tolist()) == list(range(8))
    # With the Kronecker order used here it is in fact the Sylvester matrix itself.
    assert (v - h).abs().max() < 1e-12


def test_walsh_is_normalised_sylvester() -> None:
    m = make_basis("walsh", 4).matrix
    expected = torch.tensor([[1, 1, 1, 1], [1, -1, 1, -1], [1, 1, -1, -1], [1, -1, -1, 1]], dtype=torch.float64) / 2
    assert (m - expected).abs().max() < 1e-15


def test_fourier_d4_rows() -> None:
    m = make_basis("fourier", 4).matrix
    s = 1 / math.sqrt(2)
    expected = torch.tensor(
        [
            [0.5, 0.5, 0.5, 0.5],  # constant
            [s, 0.0, -s, 0.0],  # sqrt(2/4) cos(2 pi t / 4)
            [0.0, s, 0.0, -s],  # sqrt(2/4) sin(2 pi t / 4)
            [0.5, -0.5, 0.5, -0.5],  # Nyquist
        ],
        dtype=torch.float64,
    )
    assert (m - expected).abs().max() < 1e-15


def test_fourier_odd_has_no_nyquist_row() -> None:
    m = real_dft_matrix(5)
    t = torch.arange(5, dtype=torch.float64)
    assert (m[-1] - math.sqrt(2 / 5) * torch.sin(4 * math.pi * t / 5)).abs().max() < 1e-15


def test_dct_d2() -> None:
    m = make_basis("dct", 2).matrix
    s = 1 / math.sqrt(2)
    expected = torch.tensor([[s, s], [s, -s]], dtype=torch.float64)
    assert (m - expected).abs().max() < 1e-15


def test_vilenkin_single_radix_is_fourier() -> None:
    assert (make_basis("vilenkin:3", 3).matrix - make_basis("fourier", 3).matrix).abs().max() < 1e-15
    assert (make_basis("vilenkin:2", 2).matrix - make_basis("walsh", 2).matrix).abs().max() < 1e-15


def test_vilenkin_is_kronecker_of_real_dft() -> None:
    expected = torch.kron(real_dft_matrix(3), real_dft_matrix(5))
    assert (make_basis("vilenkin:3x5", 15).matrix - expected).abs().max() < 1e-15


def test_identity() -> None:
    assert torch.equal(make_basis("identity", 7).matrix, torch.eye(7, dtype=torch.float64))


def test_cached() -> None:
    assert make_basis("dct", 16) is make_basis("dct", 16)
    assert make_basis("vilenkin", 64) is make_basis("vilenkin:3x5x5", 64)


def test_default_bases() -> None:
    assert default_bases(64) == ["walsh", "dct", "fourier", "vilenkin", "vilenkin:4x4x4", "identity"]
    assert default_bases(128) == ["walsh", "dct", "fourier", "vilenkin", "vilenkin:2x4x4x4", "identity"]
    assert default_bases(256)[4] == "vilenkin:4x4x4x4"
    assert default_bases(96) == ["dct", "fourier", "vilenkin", "identity"]
    for d in (8, 16, 64, 96, 128):
        for name in default_bases(d):
            assert make_basis(name, d).d == d
    assert set(BASIS_NAMES) == {"walsh", "dct", "fourier", "vilenkin", "identity"}


def test_basis_shape_errors() -> None:
    basis = make_basis("dct", 8)
    with pytest.raises(ValueError, match="length 8"):
        basis.forward(torch.zeros(2, 7))
    with pytest.raises(ValueError, match="8 coefficients"):
        basis.inverse(torch.zeros(2, 9))
    assert isinstance(basis, Basis)


def test_unknown_name_lists_allowed() -> None:
    with pytest.raises(ValueError, match="unknown basis 'haar'") as info:
        make_basis("haar", 8)
    for name in BASIS_NAMES:
        assert name in str(info.value)


def test_walsh_needs_power_of_two() -> None:
    with pytest.raises(ValueError, match="walsh needs a power-of-two length, got 96"):
        make_basis("walsh", 96)


def test_vilenkin_too_small() -> None:
    with pytest.raises(ValueError, match="at least 64") as info:
        make_basis("vilenkin:4x4", 64)
    assert "n = 16" in str(info.value)


@pytest.mark.parametrize("name", ["vilenkin:", "vilenkin:3xa", "vilenkin:1x64", "vilenkin:0x3"])
def test_vilenkin_bad_radices(name: str) -> None:
    with pytest.raises(ValueError, match="walsh"):
        make_basis(name, 3)


@pytest.mark.parametrize("d", [0, -4])
def test_bad_length(d: int) -> None:
    with pytest.raises(ValueError, match=">= 1"):
        make_basis("dct", d)
