"""The query-weighted K transform of ``eq+`` (pure torch).

A K codec that adds isotropic noise ``e`` (a rotation + one width per coordinate, as ``tq`` does)
to ``y = A k`` returns ``k + A⁻¹e``, and what attention sees is the score error ``q·A⁻¹e``. Over
calibration queries with second moment ``M = E[q qᵀ]`` and keys with covariance ``C``, the mean
squared score error is proportional to ``tr(A C Aᵀ) · tr(A⁻ᵀ M A⁻¹)`` (the noise power scales with
the transformed keys' energy). With ``P = AᵀA`` that is ``tr(P C) · tr(P⁻¹ M)``, smallest at the
matrix geometric mean ``P = M # C⁻¹ = M^½ (M^½ C M^½)^-½ M^½``; the gain over ``A = I`` is
``tr(C) tr(M) / (tr((M^½ C M^½)^½))²`` (for diagonal ``C`` and ``M``: ``P_cc = sqrt(M_cc / C_cc)``).

``A = P^½`` (symmetric), scaled to determinant 1, its condition number capped so that directions
calibration never saw are not amplified without bound.
"""

from __future__ import annotations

import torch

__all__ = ["k_equalizer", "k_equalizer_diagonal", "predicted_gain_db"]

#: Largest condition number of ``A`` (``P``'s eigenvalues span at most its square).
MAX_COND = 100.0
_EPS = 1e-6


def _sym_pow(m: torch.Tensor, p: float) -> torch.Tensor:
    e, u = torch.linalg.eigh(m)
    return (u * e.clamp_min(0.0).pow(p).unsqueeze(-2)) @ u.transpose(-1, -2)


def _positive(m: torch.Tensor) -> torch.Tensor:
    """``m`` where it is positive definite; elsewhere (per matrix of the batch) its eigenvalues floored at
    ``eps * mean eigenvalue``.

    Moments summed in float32 over long windows (4,096 tokens per sum) can come out slightly indefinite: an
    eigenvalue of ``-1.5e-4`` next to a largest of 9.4 in a pre-RoPE K covariance of qwen2.5-1.5b, which
    ``M^½ C M^½``'s inverse square root turns into NaN. Matrices that are positive definite already are
    returned as they are, bit for bit.
    """
    e, u = torch.linalg.eigh(m)
    bad = (e <= 0).any(-1)
    if not bool(bad.any()):
        return m
    floor = _EPS * e.clamp_min(0.0).mean(-1, keepdim=True).clamp_min(1e-30)
    fixed = (u * torch.maximum(e, floor).unsqueeze(-2)) @ u.transpose(-1, -2)
    fixed = 0.5 * (fixed + fixed.transpose(-1, -2))
    return torch.where(bad[..., None, None], fixed, m)


def _regularize(m: torch.Tensor) -> torch.Tensor:
    """``m + eps * mean eigenvalue * I``: keeps a rank-deficient moment invertible."""
    d = m.shape[-1]
    tr = torch.diagonal(m, dim1=-2, dim2=-1).sum(-1).clamp_min(1e-30) / d
    return m + _EPS * tr[..., None, None] * torch.eye(d, dtype=m.dtype, device=m.device)


def _check_moments(cov: torch.Tensor, qmom: torch.Tensor, max_cond: float) -> None:
    """Refuse mismatched or non-square moments, NaN/Inf, or ``max_cond < 1`` (naming the fix)."""
    if cov.shape != qmom.shape or cov.dim() < 2 or cov.shape[-1] != cov.shape[-2]:
        raise ValueError(
            "cov and qmom must be [..., head_dim, head_dim] of one shape, "
            f"got {tuple(cov.shape)} and {tuple(qmom.shape)}"
        )
    if not (bool(torch.isfinite(cov).all()) and bool(torch.isfinite(qmom).all())):
        raise ValueError("K covariance or query moment has NaN/Inf values; calibrate on finite activations")
    if not max_cond >= 1.0:
        raise ValueError(f"max_cond must be >= 1, got {max_cond}")


def k_equalizer(cov: torch.Tensor, qmom: torch.Tensor, max_cond: float = MAX_COND) -> torch.Tensor:
    """The transform ``A`` that ``eq+`` applies to (centered) K before the inner codec.

    Args:
        cov: ``[..., head_dim, head_dim]`` covariance of K (after centering).
        qmom: ``[..., head_dim, head_dim]`` second moment of the queries that read those keys (the
            heads of a kv-head's group summed).
        max_cond: cap on the condition number of ``A``.

    Returns:
        ``[..., head_dim, head_dim]`` float64, symmetric positive definite, determinant 1.

    Raises:
        ValueError: mismatched or non-square shapes, non-finite values, or ``max_cond < 1``.
    """
    _check_moments(cov, qmom, max_cond)
    c = _regularize(_positive(cov.to(torch.float64)))
    m = _regularize(_positive(qmom.to(torch.float64)))
    m_half = _sym_pow(m, 0.5)
    p = m_half @ _sym_pow(m_half @ c @ m_half, -0.5) @ m_half
    p = 0.5 * (p + p.transpose(-1, -2))
    e, u = torch.linalg.eigh(p)
    e = e.clamp_min(1e-300)
    log_e = e.log()
    log_e = log_e - log_e.mean(-1, keepdim=True)  # determinant 1
    half_span = torch.log(torch.tensor(max_cond, dtype=torch.float64)) / 2  # A = P^½: cond(A) = cond(P)^½
    # cap cond(P) at max_cond² around the geometric mean, then re-centre the log-eigenvalues
    log_e = log_e.clamp(-2 * half_span, 2 * half_span)
    log_e = log_e - log_e.mean(-1, keepdim=True)
    a = (u * (0.5 * log_e).exp().unsqueeze(-2)) @ u.transpose(-1, -2)
    return 0.5 * (a + a.transpose(-1, -2))


def k_equalizer_diagonal(cov: torch.Tensor, qmom: torch.Tensor, max_cond: float = MAX_COND) -> torch.Tensor:
    """The best *diagonal* ``A`` (``eqd+``): per channel ``P_cc = sqrt(M_cc / C_cc)``, ``A = P^½``.

    The same objective as :func:`k_equalizer` restricted to diagonal transforms (for diagonal ``C`` and ``M`` the
    two agree), scaled to determinant 1, its condition number capped the same way. A diagonal ``A`` keeps a
    ``prerope+`` K on the decode kernel's fast Walsh-Hadamard key map (it folds into the column factors of
    :func:`walshkv.attention.keys.hadamard_factors`), where the dense one costs ``d x d`` multiply-adds per key.

    Args:
        cov, qmom: as for :func:`k_equalizer` (only their diagonals are read).
        max_cond: cap on the condition number of ``A``.

    Returns:
        ``[..., head_dim, head_dim]`` float64, diagonal and positive, determinant 1.

    Raises:
        ValueError: as :func:`k_equalizer`.
    """
    _check_moments(cov, qmom, max_cond)
    c = torch.diagonal(cov.to(torch.float64), dim1=-2, dim2=-1)
    m = torch.diagonal(qmom.to(torch.float64), dim1=-2, dim2=-1)
    c = c.clamp_min(_EPS * c.clamp_min(0.0).mean(-1, keepdim=True).clamp_min(1e-30))
    m = m.clamp_min(_EPS * m.clamp_min(0.0).mean(-1, keepdim=True).clamp_min(1e-30))
    log_p = 0.5 * (m.log() - c.log())
    log_p = log_p - log_p.mean(-1, keepdim=True)  # determinant 1
    half_span = torch.log(torch.tensor(max_cond, dtype=torch.float64)) / 2
    log_p = log_p.clamp(-2 * half_span, 2 * half_span)  # cond(P) <= max_cond², so cond(A) <= max_cond
    log_p = log_p - log_p.mean(-1, keepdim=True)
    return torch.diag_embed((0.5 * log_p).exp())


def predicted_gain_db(cov: torch.Tensor, qmom: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """High-rate prediction of the score-error reduction of ``a`` over no transform, in dB.

    Args:
        cov, qmom: as for :func:`k_equalizer`; ``a``: the transform, same shape.

    Returns:
        ``[...]`` float64: ``10 log10(tr(C) tr(M) / (tr(A C Aᵀ) tr(A⁻ᵀ M A⁻¹)))``.
    """
    c, m, a = cov.to(torch.float64), qmom.to(torch.float64), a.to(torch.float64)
    inv = torch.linalg.inv(a)
    tr = lambda x: torch.diagonal(x, dim1=-2, dim2=-1).sum(-1)  # noqa: E731
    base = tr(c) * tr(m)
    new = tr(a @ c @ a.transpose(-1, -2)) * tr(inv.transpose(-1, -2) @ m @ inv)
    return 10 * torch.log10(base / new)
