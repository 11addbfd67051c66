"""Where K's and V's energy sits in the Walsh-Hadamard basis, per layer and band.

For each captured kind (K after RoPE, K before RoPE, V; see :mod:`walshkv.eval.capture`) and every
(layer, kv-head), the orthonormal WHT of each token's vector gives coefficients ``c``; the energy of
coefficient ``i`` is ``mean over tokens of c_i^2`` and its share is that over the sum of all shares.
Coefficients are read in ``natural`` (Hadamard) and ``sequency`` (number of sign changes) order, and
cut into ``bands`` equal contiguous bands (band 0 first). Reported per kind and order:

* ``band_share``: each band's share of the energy, averaged over layers and heads (and per layer, in
  the JSON and the heatmap);
* ``first_band_share``: band 0's share (a flat spectrum gives ``1 / bands``);
* ``flatness``: geometric over arithmetic mean of the per-coefficient energies, averaged over layers
  and heads (1: perfectly flat; near 0: concentrated);
* ``frac90``: the mean over vectors of the fraction of coefficients, taken largest first, that holds
  90% of the vector's energy, in the WHT basis and, for comparison, in the identity basis (channels).

The reports are :mod:`walshkv_research.spectrum_report`'s; the command line is
:mod:`walshkv_research.cli.spectrum`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.orders import coefficient_order

if TYPE_CHECKING:
    from walshkv.eval.capture import KVCapture

__all__ = [
    "KINDS",
    "KIND_LABELS",
    "SPECTRUM_ORDERS",
    "SpectrumResult",
    "coefficient_energy",
    "fraction_for_energy",
    "measure_spectrum",
]

KINDS = ("k_post", "k_pre", "v")
KIND_LABELS = {"k_post": "K after RoPE", "k_pre": "K before RoPE", "v": "V"}
SPECTRUM_ORDERS = ("natural", "sequency")


def coefficient_energy(x: torch.Tensor) -> torch.Tensor:
    """Share of energy per WHT coefficient (natural order), per (layer, head).

    Args:
        x: ``[layers, kv_heads, tokens, head_dim]``.

    Returns:
        ``[layers, kv_heads, head_dim]`` float64, summing to 1 over the last dimension.
    """
    c = hadamard_transform(x.to(torch.float64))
    e = (c * c).mean(dim=-2)
    return e / e.sum(dim=-1, keepdim=True).clamp_min(1e-300)


def fraction_for_energy(c: torch.Tensor, share: float = 0.9) -> float:
    """Mean over vectors of the fraction of coefficients (largest first) holding ``share`` of the energy.

    Args:
        c: ``[..., n]`` coefficients (any orthonormal basis).
        share: energy share in ``(0, 1]``.
    """
    e = (c.to(torch.float64) ** 2).flatten(0, -2)
    e = e[e.sum(dim=-1) > 0]
    if e.numel() == 0:
        return float("nan")
    s = e.sort(dim=-1, descending=True).values.cumsum(dim=-1)
    need = (s < share * s[:, -1:] * (1 - 1e-12)).sum(dim=-1) + 1
    return float(need.double().mean() / e.shape[-1])


def _band_shares(share: torch.Tensor, order: torch.Tensor, bands: int) -> torch.Tensor:
    """``[layers, heads, n]`` shares -> ``[layers, heads, bands]`` in the given order."""
    n = share.shape[-1]
    return share[..., order].reshape(*share.shape[:-1], bands, n // bands).sum(dim=-1)


@dataclass
class SpectrumResult:
    """``meta`` describes the run; ``rows`` one dict per (kind, order); ``per_layer`` band shares."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]
    per_layer: dict[str, dict[str, list[list[float]]]]
    coefficients: dict[str, dict[str, list[float]]]

    def to_json(self) -> dict[str, Any]:
        return {
            "meta": self.meta,
            "results": self.rows,
            "per_layer_band_share": self.per_layer,
            "coefficient_share": self.coefficients,
        }


def measure_spectrum(capture: KVCapture, bands: int = 4, meta: dict[str, Any] | None = None) -> SpectrumResult:
    """Band energies of a :class:`~walshkv.eval.capture.KVCapture` (see the module docstring).

    Args:
        capture: the captured K/V.
        bands: number of equal bands (must divide head_dim).
        meta: run description to keep in the result.
    """
    d = capture.v.shape[-1]
    if bands < 1 or d % bands:
        raise ValueError(f"--bands must divide head_dim {d}, got {bands}")
    rows, per_layer, coeffs = [], {}, {}
    for kind, x in capture.kinds().items():
        share = coefficient_energy(x)
        flat = share.clamp_min(1e-300)
        flatness = float((flat.log().mean(dim=-1).exp() / flat.mean(dim=-1)).mean())
        frac_wht = fraction_for_energy(hadamard_transform(x.to(torch.float64)))
        frac_id = fraction_for_energy(x)
        per_layer[kind], coeffs[kind] = {}, {}
        for order_name in SPECTRUM_ORDERS:
            order = coefficient_order(order_name, d)
            bs = _band_shares(share, order, bands)
            per_layer[kind][order_name] = bs.mean(dim=1).tolist()
            coeffs[kind][order_name] = share[..., order].mean(dim=(0, 1)).tolist()
            mean_bs = bs.mean(dim=(0, 1))
            rows.append(
                {
                    "kind": kind,
                    "order": order_name,
                    "bands": bands,
                    "band_share": [float(v) for v in mean_bs],
                    "first_band_share": float(mean_bs[0]),
                    "last_band_share": float(mean_bs[-1]),
                    "flatness": flatness,
                    "frac90_wht": frac_wht,
                    "frac90_identity": frac_id,
                }
            )
    return SpectrumResult(dict(meta or {}), rows, per_layer, coeffs)
