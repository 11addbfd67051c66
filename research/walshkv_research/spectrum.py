"""``walshkv spectrum``: where K's and V's energy sits in the Walsh-Hadamard basis, per layer and band.

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

Outputs in ``--out``: ``spectrum.json``, ``spectrum.csv``, ``spectrum.md``, ``spectrum.png`` (heatmaps,
layer x band, per kind and order) and ``spectrum-coefficients.png`` (share per coefficient).
"""

from __future__ import annotations

import argparse
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from walshkv.eval.harness import library_versions
from walshkv.eval.outputs import command_line, write_result_files
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.orders import coefficient_order

__all__ = [
    "KINDS",
    "SpectrumResult",
    "add_spectrum_parser",
    "coefficient_energy",
    "fraction_for_energy",
    "measure_spectrum",
    "write_spectrum_outputs",
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


def measure_spectrum(capture: Any, bands: int = 4, meta: dict[str, Any] | None = None) -> SpectrumResult:
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


# ---------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------


def format_spectrum_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """One line per (kind, order): band shares, flatness, coefficients for 90% energy."""
    from tabulate import tabulate

    body = [
        [
            KIND_LABELS.get(r["kind"], r["kind"]),
            r["order"],
            " / ".join(f"{100 * v:.1f}" for v in r["band_share"]),
            f"{r['flatness']:.3f}",
            f"{100 * r['frac90_wht']:.1f}%",
            f"{100 * r['frac90_identity']:.1f}%",
        ]
        for r in rows
    ]
    headers = ["vectors", "order", "energy % per band (first..last)", "flatness", "90% energy: WHT", "channels"]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def _describe(meta: dict[str, Any]) -> str:
    m, t = meta.get("model", {}), meta.get("text", {})
    return (
        f"Model {m.get('name')} ({m.get('arch')}, head_dim {m.get('head_dim')}, {m.get('layers')} layers, "
        f"{m.get('kv_heads')} KV heads); text {t.get('name')}; {meta.get('windows')} windows of "
        f"{meta.get('ctx')} tokens ({meta.get('tokens')} vectors per layer and head); K channel order "
        f"{meta.get('channel_order')}."
    )


def plot_spectrum(result: SpectrumResult, out: Path) -> list[Path]:
    """Heatmaps (layer x band, per kind and order) and per-coefficient share curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(result.per_layer)
    fig, axes = plt.subplots(
        len(SPECTRUM_ORDERS), len(kinds), figsize=(4 * len(kinds) + 1, 8), squeeze=False, constrained_layout=True
    )
    vmax = max(max(max(r) for r in result.per_layer[k][o]) for k in kinds for o in SPECTRUM_ORDERS)
    im = None
    for i, order in enumerate(SPECTRUM_ORDERS):
        for j, kind in enumerate(kinds):
            ax = axes[i][j]
            im = ax.imshow(result.per_layer[kind][order], aspect="auto", vmin=0, vmax=vmax, cmap="viridis")
            ax.set_title(f"{KIND_LABELS[kind]}, {order} order", fontsize=9)
            ax.set_xlabel("band")
            ax.set_ylabel("layer")
    assert im is not None
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of energy")
    fig.suptitle(textwrap.fill(_describe(result.meta), 160), fontsize=8)
    heat = out / "spectrum.png"
    fig.savefig(str(heat), dpi=110)
    plt.close(fig)
    fig, axes = plt.subplots(1, len(SPECTRUM_ORDERS), figsize=(12, 4.2))
    for ax, order in zip(axes, SPECTRUM_ORDERS, strict=True):
        for kind in kinds:
            ax.plot(result.coefficients[kind][order], label=KIND_LABELS[kind])
        ax.set_yscale("log")
        ax.set_xlabel(f"WHT coefficient ({order} order)")
        ax.set_ylabel("share of energy (mean over layers, heads)")
        ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(_describe(result.meta), 160), fontsize=8)
    fig.tight_layout()
    curves = out / "spectrum-coefficients.png"
    fig.savefig(str(curves), dpi=110)
    plt.close(fig)
    return [heat, curves]


_CSV_KEYS = (
    "kind",
    "order",
    "bands",
    "first_band_share",
    "last_band_share",
    "flatness",
    "frac90_wht",
    "frac90_identity",
)


def write_spectrum_outputs(result: SpectrumResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``spectrum.json``, ``.csv``, ``.md`` and the two PNGs; return the paths written."""
    bands = [f"band{i}" for i in range(result.rows[0]["bands"])]
    rows = [{**r, **dict(zip(bands, r["band_share"], strict=True))} for r in result.rows]
    lines = [f"# WHT spectrum: {result.meta.get('model', {}).get('name')}", "", _describe(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    lines += [format_spectrum_table(result.rows, "github"), ""]
    return write_result_files(
        out_dir,
        "spectrum",
        result.to_json(),
        rows,
        [*_CSV_KEYS, *bands],
        lines,
        (lambda out: plot_spectrum(result, out)) if plot else None,
    )


def run_meta(lm: Any, text: Any, capture: Any, command: str) -> dict[str, Any]:
    """The description every lab result file carries (model, text, windows, tokens, versions)."""
    return {
        "model": {"name": lm.name, "source": lm.source, **lm.info},
        "text": {"name": text.name, "source": text.source, "chars": len(text.content)},
        "windows": capture.windows,
        "ctx": capture.ctx,
        "window_starts": [w * capture.ctx for w in range(capture.windows)],
        "tokens": capture.windows * capture.ctx,
        "k_pre_rope": "post-RoPE keys rotated back by their own angle (exact; see walshkv.eval.capture)",
        "channel_order": capture.channel_order,
        "command": command,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": library_versions(),
    }


def _cmd_spectrum(args: argparse.Namespace) -> int:
    from walshkv.data import load_text
    from walshkv.eval.capture import capture_kv
    from walshkv.models import load_model

    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    d = lm.info["head_dim"]
    if args.bands < 1 or d % args.bands:
        raise ValueError(f"--bands must divide head_dim {d}, got {args.bands}")
    capture = capture_kv(
        lm, text, tokens=args.tokens, ctx=args.ctx, channel_order=args.channel_order, progress=not args.quiet
    )
    command = command_line(args)
    result = measure_spectrum(capture, args.bands, run_meta(lm, text, capture, command))
    print(_describe(result.meta))
    print(format_spectrum_table(result.rows))
    written = write_spectrum_outputs(
        result, Path(args.out or f"spectrum-{lm.name.replace('/', '-')}"), not args.no_plot
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_lab_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --text, --tokens, --ctx, --quiet (shared by spectrum and reconstruct)."""
    from walshkv.data import DEFAULT_TEXT, TEXTS
    from walshkv.models import DEFAULT_MODEL, MODELS

    p.add_argument("--model", default=DEFAULT_MODEL, help=f"{', '.join(MODELS)}, a .gguf path or a folder")
    p.add_argument("--text", default=DEFAULT_TEXT, help=f"{', '.join(TEXTS)}, or a path to a UTF-8 file")
    p.add_argument("--tokens", type=int, default=2048, help="tokens to capture (whole windows of --ctx)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window")
    p.add_argument(
        "--channel-order",
        choices=["hf", "llamacpp"],
        default="hf",
        help="K channel order before the transform: hf (rotary pairs i, i+d/2; what walshkv's codecs see) or "
        "llamacpp (adjacent pairs for llama-architecture models; what a WHT inside llama.cpp sees)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_spectrum_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv spectrum``."""
    sp = sub.add_parser(
        "spectrum",
        help="WHT energy of K (before/after RoPE) and V per layer and band: table, heatmaps, JSON/CSV",
        description="Capture K after RoPE, K before RoPE (rotated back exactly) and V on real text; report the "
        "share of energy per Walsh-Hadamard band (natural and sequency order), spectral flatness, and how "
        "many coefficients hold 90%% of each vector's energy (WHT against plain channels). See docs/research.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: walshkv spectrum --text ../shared/data/austen_emma.txt --bands 8",
    )
    add_lab_model_args(sp)
    sp.add_argument("--bands", type=int, default=4, help="equal bands over the head_dim coefficients")
    sp.add_argument("--out", metavar="DIR", help="output folder (default spectrum-MODEL)")
    sp.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    sp.set_defaults(func=_cmd_spectrum)
