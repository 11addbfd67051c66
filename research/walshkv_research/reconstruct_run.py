"""``walshkv reconstruct``: how well each basis reconstructs real K/V (and synthetic signals) from part
of its coefficients, and the LLL experiment on quantized index vectors.

Signals: K after RoPE, K before RoPE and V captured on real text (:mod:`walshkv.eval.capture`), at most
``vectors`` tokens per (layer, kv-head), and synthetic ``prime-harmonic``, ``chirp`` and ``noise``
vectors of length head_dim (:func:`walshkv_research.reconstruct.synthetic_signals`). Bases:
:func:`walshkv_research.bases.default_bases` (Walsh-Hadamard, DCT-II, real Fourier, a Vilenkin-Chrestenson
basis with head_dim zero-padded to a product of 3s and 5s, the exact-length radix-4 Vilenkin basis,
identity). Modes as in :mod:`walshkv_research.reconstruct`; ``fixed`` positions and the ``signs+amp``
amplitude profile are computed per (layer, kv-head) of the real vectors (on the same vectors: an upper
bound on what a calibrated table would give). Every row: mean Pearson correlation over vectors and
relative MSE (sum of squared errors over sum of squares).

LLL (``--lll``, needs ``pip install 'walshkv[lab]'``, fpylll): for blocks of ``rows`` consecutive tokens
of one (layer, kv-head), the K vectors' WHT coefficients are quantized to ``bits``-bit signed integers
(one absmax scale per vector), stacked as the rows of an integer matrix ``B`` and LLL-reduced,
``B' = U B`` with ``U`` unimodular. Reported: mean row norm after / before, and the bits an entry needs
before (``B``) and after (``B'`` plus ``U``, which recovering the codes requires).
"""

from __future__ import annotations

import argparse
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from walshkv.eval.outputs import command_line, write_result_files
from walshkv_research.bases import default_bases, make_basis
from walshkv_research.reconstruct import (
    MODES,
    SIGN_MODES,
    SYNTHETIC_KINDS,
    correlation,
    kept_count,
    reconstruct,
    relative_mse,
    synthetic_signals,
)

__all__ = [
    "DEFAULT_FRACTIONS",
    "add_reconstruct_parser",
    "format_lll_table",
    "lll_measure",
    "measure_reconstruction",
    "write_reconstruct_outputs",
]

DEFAULT_FRACTIONS: tuple[float, ...] = (0.1, 0.25, 0.43, 0.5, 0.75, 1.0)
SIGNAL_LABELS = {
    "k_post": "K after RoPE",
    "k_pre": "K before RoPE",
    "v": "V",
    "prime-harmonic": "prime-harmonic (synthetic)",
    "chirp": "chirp (synthetic)",
    "noise": "white noise (synthetic)",
}


def _groups(x: torch.Tensor, vectors: int) -> torch.Tensor:
    """``[layers, heads, T, d]`` -> ``[groups, <= vectors, d]`` (tokens evenly spread over T)."""
    t = x.shape[-2]
    if t > vectors:
        idx = torch.linspace(0, t - 1, vectors).round().long()
        x = x[..., idx, :]
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def measure_reconstruction(
    signals: dict[str, torch.Tensor],
    *,
    bases: Sequence[str] | None = None,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    modes: Sequence[str] = MODES,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Reconstruction rows for every signal set, basis, mode and fraction.

    Args:
        signals: ``{name: [groups, vectors, d]}``; ``fixed`` positions and ``signs+amp`` amplitudes are
            computed per group.
        bases: basis names (default :func:`~walshkv_research.bases.default_bases` of ``d``).
        fractions: kept fractions in ``(0, 1]``.
        modes: modes from :data:`~walshkv_research.reconstruct.MODES`.
        progress: show a progress bar.

    Returns:
        Rows ``{"signal", "basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse"}``.
    """
    from tqdm.auto import tqdm

    for m in modes:
        if m not in MODES:
            raise ValueError(f"unknown mode {m!r}; choose among {', '.join(MODES)}")
    for f in fractions:
        kept_count(f, 1)
    dims = {x.shape[-1] for x in signals.values()}
    if len(dims) != 1:
        raise ValueError(f"every signal set must have the same length, got {sorted(dims)}")
    d = dims.pop()
    names = list(bases or default_bases(d))
    built = [make_basis(n, d) for n in names]  # bad names fail before any work
    jobs = [
        (sig, b, m, f)
        for sig in signals
        for b in built
        for m in modes
        for f in ([None] if m in SIGN_MODES else list(fractions))
    ]
    rows = []
    for sig, basis, mode, f in tqdm(jobs, desc="reconstruct", unit="case", disable=not progress):
        x = signals[sig].to(torch.float64)
        x_hat = torch.stack([reconstruct(g, basis, f, mode) for g in x])
        rows.append(
            {
                "signal": sig,
                "basis": basis.name,
                "mode": mode,
                "fraction": f,
                "kept": None if f is None else kept_count(f, d),
                "coefficients": basis.n,
                "correlation": correlation(x.reshape(-1, d), x_hat.reshape(-1, d)),
                "relative_mse": relative_mse(x, x_hat),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------------------
# LLL on quantized index vectors
# ---------------------------------------------------------------------------------------------------------


def _entry_bits(m: torch.Tensor) -> float:
    """Bits a signed integer entry needs to hold every value of ``m`` (two's complement)."""
    top = int(m.abs().max()) if m.numel() else 0
    return float(math.ceil(math.log2(top + 1)) + 1) if top else 1.0


def lll_measure(
    x: torch.Tensor, *, bits: int = 4, rows: int = 16, blocks: int = 32, delta: float = 0.99
) -> dict[str, Any]:
    """LLL-reduce blocks of quantized WHT index vectors and report norms and bits (module docstring).

    Args:
        x: ``[groups, tokens, d]`` real vectors (e.g. K); WHT needs ``d`` a power of two.
        bits: signed code width (codes in ``[-(2^(bits-1) - 1), 2^(bits-1) - 1]``).
        rows: consecutive tokens per block (rows of the lattice basis), at most ``d``.
        blocks: number of blocks, spread evenly over the groups.
        delta: LLL's Lovasz parameter.

    Returns:
        A dict with the mean norm ratio, entry bits before/after, bits of ``U`` and per-block numbers.
    """
    try:
        from fpylll import LLL, IntegerMatrix
    except ImportError as exc:
        raise ImportError("the LLL measurement needs fpylll: pip install 'walshkv[lab]'") from exc
    from walshkv.ops.hadamard import hadamard_transform

    g, t, d = x.shape
    if rows > d or rows < 2 or t < rows:
        raise ValueError(f"--lll-rows must be in [2, head_dim={d}] and at most the tokens per head ({t}), got {rows}")
    qmax = 2 ** (bits - 1) - 1
    c = hadamard_transform(x.to(torch.float64))
    scale = c.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / qmax
    codes = torch.round(c / scale).clamp(-qmax, qmax).to(torch.int64)
    picks = [(i % g, (i // g * rows) % (t - rows + 1)) for i in range(blocks)]
    ratios, before_bits, after_bits, u_bits, ranks = [], [], [], [], []
    for grp, start in picks:
        b = codes[grp, start : start + rows]
        mat = IntegerMatrix.from_matrix(b.tolist())
        u = IntegerMatrix.identity(rows)
        LLL.reduction(mat, u, delta=delta)
        red = torch.tensor([[mat[i, j] for j in range(d)] for i in range(rows)], dtype=torch.int64)
        um = torch.tensor([[u[i, j] for j in range(rows)] for i in range(rows)], dtype=torch.int64)
        nz = red.abs().sum(dim=-1) > 0  # LLL moves dependent rows to zero rows at the front
        ranks.append(int(nz.sum()))
        norm_before = b.double().norm(dim=-1).mean()
        norm_after = red[nz].double().norm(dim=-1).mean() if bool(nz.any()) else torch.tensor(0.0)
        ratios.append(float(norm_after / norm_before))
        before_bits.append(_entry_bits(b))
        after_bits.append(_entry_bits(red))
        u_bits.append(_entry_bits(um))
    n = len(picks)
    mean = lambda xs: sum(xs) / n  # noqa: E731
    bits_before = rows * d * mean(before_bits)
    bits_after = rows * d * mean(after_bits) + rows * rows * mean(u_bits)
    return {
        "code_bits": bits,
        "rows": rows,
        "head_dim": d,
        "blocks": n,
        "delta": delta,
        "rank_mean": mean(ranks),
        "norm_ratio_mean": mean(ratios),
        "norm_ratio_min": min(ratios),
        "norm_ratio_max": max(ratios),
        "entry_bits_before": mean(before_bits),
        "entry_bits_after": mean(after_bits),
        "entry_bits_u": mean(u_bits),
        "block_bits_before": bits_before,
        "block_bits_after_with_u": bits_after,
        "storage_ratio": bits_after / bits_before,
    }


# ---------------------------------------------------------------------------------------------------------
# Reports and CLI
# ---------------------------------------------------------------------------------------------------------

_CSV_KEYS = ("signal", "basis", "mode", "fraction", "kept", "coefficients", "correlation", "relative_mse")


def format_reconstruct_table(rows: Sequence[dict[str, Any]], fraction: float | None = 0.5, fmt: str = "simple") -> str:
    """Correlation (relative MSE) per signal and basis at one fraction for topk/fixed, plus the sign modes."""
    from tabulate import tabulate

    signals = list(dict.fromkeys(r["signal"] for r in rows))
    bases = list(dict.fromkeys(r["basis"] for r in rows))
    cols = [("topk", fraction), ("fixed", fraction), ("signs", None), ("signs+amp", None)]
    cols = [c for c in cols if any(r["mode"] == c[0] and r["fraction"] == c[1] for r in rows)]
    index = {(r["signal"], r["basis"], r["mode"], r["fraction"]): r for r in rows}
    body = []
    for s in signals:
        for b in bases:
            cells = []
            for m, f in cols:
                r = index.get((s, b, m, f))
                cells.append("" if r is None else f"{r['correlation']:.3f} ({r['relative_mse']:.3f})")
            body.append([SIGNAL_LABELS.get(s, s), b, *cells])
    headers = ["signal", "basis", *[m if f is None else f"{m} f={f:g}" for m, f in cols]]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def format_lll_table(lll: dict[str, dict[str, Any]], fmt: str = "simple") -> str:
    """One line per K kind: rank, row norm after/before, entry bits, bits of ``U``, storage after/before."""
    from tabulate import tabulate

    body = [
        [
            SIGNAL_LABELS.get(kind, kind),
            f"{r['blocks']} x {r['rows']} x {r['head_dim']}, {r['code_bits']}-bit",
            f"{r['rank_mean']:.1f}",
            f"{r['norm_ratio_mean']:.3f} ({r['norm_ratio_min']:.3f}..{r['norm_ratio_max']:.3f})",
            f"{r['entry_bits_before']:.2f} -> {r['entry_bits_after']:.2f}",
            f"{r['entry_bits_u']:.2f}",
            f"{r['storage_ratio']:.3f}",
        ]
        for kind, r in lll.items()
    ]
    headers = [
        "vectors",
        "blocks x rows x dim",
        "rank",
        "row norm after/before",
        "entry bits",
        "U entry bits",
        "storage after (with U) / before",
    ]
    return tabulate(body, headers=headers, tablefmt=fmt, disable_numparse=True)


def plot_reconstruction(rows: Sequence[dict[str, Any]], path: Path, title: str) -> None:
    """Correlation against kept fraction (topk), one panel per signal, one line per basis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    signals = list(dict.fromkeys(r["signal"] for r in rows))
    cols = 3
    nrow = math.ceil(len(signals) / cols)
    fig, axes = plt.subplots(nrow, cols, figsize=(13, 3.6 * nrow), squeeze=False)
    for ax, sig in zip([a for row in axes for a in row], signals, strict=False):
        for basis in dict.fromkeys(r["basis"] for r in rows):
            pts = sorted(
                (r for r in rows if r["signal"] == sig and r["basis"] == basis and r["mode"] == "topk"),
                key=lambda r: r["fraction"],
            )
            if pts:
                ax.plot([r["fraction"] for r in pts], [r["correlation"] for r in pts], marker="o", ms=3, label=basis)
        ax.set_title(SIGNAL_LABELS.get(sig, sig), fontsize=9)
        ax.set_xlabel("kept fraction (largest coefficients per vector)")
        ax.set_ylabel("correlation")
        ax.grid(alpha=0.3)
    for ax in [a for row in axes for a in row][len(signals) :]:
        ax.axis("off")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(textwrap.fill(title, 160), fontsize=8)
    fig.tight_layout()
    fig.savefig(str(path), dpi=110)
    plt.close(fig)


def _describe(meta: dict[str, Any]) -> str:
    m, t = meta.get("model", {}), meta.get("text", {})
    return (
        f"Model {m.get('name')} (head_dim {m.get('head_dim')}); text {t.get('name')}; {meta.get('windows')} windows "
        f"of {meta.get('ctx')} tokens, {meta.get('vectors_per_head')} vectors per (layer, kv-head), K channel order "
        f"{meta.get('channel_order')}; synthetic: "
        f"{meta.get('synthetic_vectors')} vectors of each kind (seed {meta.get('seed')})."
    )


def write_reconstruct_outputs(
    rows: Sequence[dict[str, Any]], meta: dict[str, Any], out_dir: str | Path, plot: bool = True
) -> list[Path]:
    """Write ``reconstruct.json``, ``.csv``, ``.md`` (a table per fraction, the LLL table) and ``.png``."""
    lines = [f"# Reconstruction: {meta.get('model', {}).get('name')}", "", _describe(meta), ""]
    if meta.get("command"):
        lines += [f"Produced by `{meta['command']}`.", ""]
    for f in sorted({r["fraction"] for r in rows if r["fraction"] is not None}):
        lines += [
            f"## Kept fraction {f:g}: correlation (relative MSE)",
            "",
            format_reconstruct_table(rows, f, "github"),
        ]
        lines += [""]
    if meta.get("lll"):
        lines += ["## LLL on quantized WHT index vectors of K", "", format_lll_table(meta["lll"], "github"), ""]

    def draw(out: Path) -> list[Path]:
        plot_reconstruction(rows, out / "reconstruct.png", _describe(meta))
        return [out / "reconstruct.png"]

    payload = {"meta": meta, "results": list(rows)}
    return write_result_files(out_dir, "reconstruct", payload, rows, _CSV_KEYS, lines, draw if plot else None)


def _floats(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated fractions, e.g. 0.25,0.5,1, got {text!r}") from None
    if not values or any(not 0.0 < v <= 1.0 for v in values):
        raise argparse.ArgumentTypeError(f"fractions must be in (0, 1], got {text!r}")
    return values


def _cmd_reconstruct(args: argparse.Namespace) -> int:
    from walshkv.data import load_text
    from walshkv.eval.capture import capture_kv
    from walshkv.models import load_model
    from walshkv_research.spectrum import run_meta

    bases = [b.strip() for b in args.basis.split(",")] if args.basis else None
    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    d = lm.info["head_dim"]
    for b in bases or []:
        make_basis(b, d)  # bad names fail before the capture
    capture = capture_kv(
        lm, text, tokens=args.tokens, ctx=args.ctx, channel_order=args.channel_order, progress=not args.quiet
    )
    signals = {k: _groups(x, args.vectors) for k, x in capture.kinds().items()}
    for kind in SYNTHETIC_KINDS:
        signals[kind] = synthetic_signals(kind, args.synthetic, d, seed=args.seed).unsqueeze(0)
    rows = measure_reconstruction(signals, bases=bases, fractions=args.fraction, progress=not args.quiet)
    command = command_line(args)
    meta = run_meta(lm, text, capture, command)
    meta.update({"vectors_per_head": signals["v"].shape[1], "synthetic_vectors": args.synthetic, "seed": args.seed})
    meta["kept_count"] = "round(f * head_dim) coefficients for every basis (padded bases are not exact at f=1)"
    meta["fixed_positions"] = "per (layer, kv-head), the positions of largest mean energy over the same vectors"
    if args.lll:
        meta["lll"] = {
            kind: lll_measure(signals[kind], bits=args.lll_bits, rows=args.lll_rows, blocks=args.lll_blocks)
            for kind in ("k_post", "k_pre")
        }
    print(_describe(meta))
    print(format_reconstruct_table(rows, 0.5 if 0.5 in args.fraction else args.fraction[0]))
    if args.lll:
        print(format_lll_table(meta["lll"]))
    written = write_reconstruct_outputs(
        rows, meta, Path(args.out or f"reconstruct-{lm.name.replace('/', '-')}"), not args.no_plot
    )
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_reconstruct_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``walshkv reconstruct``."""
    from walshkv_research.spectrum import add_lab_model_args

    rp = sub.add_parser(
        "reconstruct",
        help="reconstruct K/V (and synthetic signals) from a kept fraction of coefficients: WHT, DCT, Fourier, "
        "Vilenkin, identity",
        description="Capture K (after and before RoPE) and V; for every basis keep the largest coefficients per "
        "vector (topk), the positions of largest mean energy (fixed), or only signs with one amplitude per "
        "vector (signs) or per position (signs+amp); report correlation and relative MSE. Synthetic "
        "prime-harmonic, chirp and white-noise signals run alongside. --lll adds the LLL experiment "
        "(pip install 'walshkv[lab]'). See docs/research.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="example: walshkv reconstruct --text ../shared/data/austen_emma.txt --lll",
    )
    add_lab_model_args(rp)
    rp.add_argument("--fraction", type=_floats, default=list(DEFAULT_FRACTIONS), help="comma-separated kept fractions")
    rp.add_argument(
        "--basis",
        help="comma-separated bases (walsh, dct, fourier, vilenkin, vilenkin:R1x..xRm, identity); "
        "default: all of them, with the padded 3/5 Vilenkin and the exact radix-4 one",
    )
    rp.add_argument("--vectors", type=int, default=512, help="tokens sampled per (layer, kv-head)")
    rp.add_argument("--synthetic", type=int, default=2048, help="synthetic vectors of each kind")
    rp.add_argument("--seed", type=int, default=0, help="seed of the synthetic signals")
    rp.add_argument("--lll", action="store_true", help="also LLL-reduce blocks of quantized K index vectors")
    rp.add_argument("--lll-bits", type=int, default=4, help="code width of the LLL experiment")
    rp.add_argument("--lll-rows", type=int, default=16, help="tokens per LLL block")
    rp.add_argument("--lll-blocks", type=int, default=64, help="LLL blocks")
    rp.add_argument("--out", metavar="DIR", help="output folder (default reconstruct-MODEL)")
    rp.add_argument("--no-plot", action="store_true", help="skip reconstruct.png")
    rp.set_defaults(func=_cmd_reconstruct)
