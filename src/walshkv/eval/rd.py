"""``walshkv rd``: rate-distortion of K/V codecs on the real K and V vectors of a model.

The model runs over ``tokens`` tokens of a text in windows of ``ctx`` tokens (each from an empty
cache). Every K and V block that enters the cache is captured (K after RoPE, exactly what
``Cache.update`` receives, as in :func:`walshkv.calibration.collect_kv_stats`), together with the
post-RoPE queries of the same layer. Each codec then encodes and decodes those vectors, and per layer:

* ``nmse_k`` / ``nmse_v``: ``sum (x_hat - x)^2 / sum x^2`` over all of the layer's K (V) elements, the
  squared error relative to the mean squared value of the original coordinates ("relative distortion");
  the row reports the mean over layers;
* ``logit_rel_mse``: ``sum (<q, k_hat> - <q, k>)^2 / sum <q, k>^2`` over every causal (query, key) pair of
  a window, with the layer's real queries (each query head against its KV head);
* ``logit_slope``: ``sum <q, k_hat><q, k> / sum <q, k>^2``, the least-squares slope of the compressed
  attention logits against the true ones: 1 for an unbiased estimator, below 1 when the codec shrinks
  K (as MSE-optimal quantizers do);
* ``gap_db_k`` / ``gap_db_v``: ``10 log10(nmse / 2^(-2 R))`` at R = the codec's stored bits per element,
  the distance above the Shannon distortion-rate function of a memoryless unit-variance Gaussian source.

Outputs in ``--out``: ``rd.json`` (meta and every row, with per-layer values), ``rd.csv``, ``rd.md`` and
``rd.png`` (needs matplotlib).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from walshkv.eval.harness import library_versions
from walshkv.eval.outputs import command_line, write_result_files

__all__ = [
    "DEFAULT_RD_CODECS",
    "RDResult",
    "add_rd_parser",
    "capture_window",
    "format_rd_table",
    "lloyd_max_points",
    "measure_rd",
    "plot_rd",
    "resolve_specs",
    "shannon_bound",
    "write_rd_outputs",
]

#: The default codec list; specs that do not parse (or do not fit the model's head_dim) are skipped
#: with a note. ``q4_0`` / ``q8_0`` join when the llama.cpp block codecs are registered.
DEFAULT_RD_CODECS: tuple[str, ...] = (
    "int2",
    "int3",
    "int4",
    "int8",
    "rot+int2",
    "rot+int3",
    "rot+int4",
    "tq:2",
    "tq:2.5",
    "tq:3",
    "tq:3.5",
    "tq:4",
    "tqprod:2",
    "tqprod:3",
    "tqprod:4",
    "vht2:3",
    "vht2:4",
    "vht2:5,5,4,3",
    "q4_0",
    "q8_0",
)

_FILES = ("rd.json", "rd.csv", "rd.md", "rd.png")


def shannon_bound(bits: float) -> float:
    """D(R) = 2^(-2R): the distortion-rate function of a memoryless unit-variance Gaussian source."""
    return 2.0 ** (-2.0 * bits)


def lloyd_max_points(max_bits: int = 4) -> list[tuple[int, float]]:
    """``(bits, mse)`` of the unit-Gaussian Lloyd-Max scalar quantizer at 1 .. ``max_bits`` bits."""
    from walshkv.ops.lloyd_max import lloyd_max

    return [(b, lloyd_max(b).mse) for b in range(1, max_bits + 1)]


# ---------------------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def capture_window(
    lm: Any, ids: torch.Tensor, queries: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """Run one window and return per-layer K, V (``[1, kv_heads, T, head_dim]``, float32, post-RoPE K)
    and, when ``queries`` and possible, the queries ``[1, q_heads, T, head_dim]`` (else ``None``)."""
    from transformers import DynamicCache

    from walshkv.models import recording_queries

    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}

    class _Recorder(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            keys[layer_idx] = key_states.detach().to(torch.float32).cpu()
            values[layer_idx] = value_states.detach().to(torch.float32).cpu()
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    device = next(lm.model.parameters()).device
    sink: dict[int, torch.Tensor] = {}
    context = recording_queries(lm.model, sink) if queries else contextlib.nullcontext(False)
    with context as recording:
        lm.model(
            input_ids=ids.view(1, -1).to(device),
            cache=_Recorder(config=lm.model.config),
            use_cache=True,
            logits_to_keep=1,
        )
    layers = sorted(keys)
    ks = [keys[i] for i in layers]
    vs = [values[i] for i in layers]
    qs = None
    if recording and sorted(sink) == layers:
        qs = [sink[i].cpu() for i in layers]
    return ks, vs, qs


# ---------------------------------------------------------------------------------------------------------
# Measurement
# ---------------------------------------------------------------------------------------------------------


@dataclass
class RDResult:
    """``meta`` describes the run; ``rows`` has one dict per codec (see the module docstring)."""

    meta: dict[str, Any]
    rows: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "results": self.rows}


@dataclass
class _Acc:
    layers: int
    error: str | None = None
    sse_k: list[float] = field(default_factory=list)
    sse_v: list[float] = field(default_factory=list)
    ip_err: list[float] = field(default_factory=list)
    ip_cross: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("sse_k", "sse_v", "ip_err", "ip_cross"):
            setattr(self, name, [0.0] * self.layers)


def resolve_specs(
    specs: Sequence[str], head_dim: int | None = None, *, strict: bool = True
) -> tuple[list[str], list[dict[str, str]]]:
    """Canonical, de-duplicated specs and the skipped ones (``{"codec", "reason"}``).

    With ``strict`` a spec that does not parse (or does not fit ``head_dim``) raises ``ValueError``;
    otherwise it is skipped with the reason.
    """
    from walshkv.codecs import parse_cache_spec

    out: list[str] = []
    skipped: list[dict[str, str]] = []
    for raw in specs:
        try:
            cs = parse_cache_spec(raw)
            if head_dim is not None:
                cs.check_head_dim(head_dim)
        except ValueError as err:
            if strict:
                raise ValueError(f"--codec {raw!r}: {err}") from None
            skipped.append({"codec": raw, "reason": str(err)})
            continue
        if cs.spec not in out:
            out.append(cs.spec)
    return out, skipped


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else float("nan")


def _gap_db(nmse: float, bits: float) -> float:
    if not (nmse > 0 and math.isfinite(nmse)):
        return float("nan")
    return 10.0 * math.log10(nmse / shannon_bound(bits))


def _mean(xs: Sequence[float]) -> float:
    finite = [x for x in xs if math.isfinite(x)]
    return sum(finite) / len(finite) if finite else float("nan")


def _logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``<q_i, k_j>`` for causal pairs, each query head against its KV head: flat float64."""
    b, qh, t, d = q.shape
    kvh = k.shape[1]
    groups = qh // kvh
    s = q.reshape(b, kvh, groups, t, d) @ k.unsqueeze(2).transpose(-1, -2)
    return s[..., mask].to(torch.float64)


@torch.inference_mode()
def measure_rd(
    lm: Any,
    text: Any,
    specs: Sequence[str],
    *,
    tokens: int = 4096,
    ctx: int = 512,
    calibration: Any = None,
    progress: bool = True,
    skipped: Sequence[dict[str, str]] = (),
    command: str | None = None,
) -> RDResult:
    """Rate-distortion rows for ``specs`` on the K/V of ``tokens`` tokens of ``text``.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text`.
        specs: cache specs (``SPEC`` or ``KSPEC/VSPEC``); they must parse and fit the head_dim.
        tokens: tokens to capture, cut into ``tokens // ctx`` windows of ``ctx`` (at least one).
        ctx: tokens per forward pass.
        calibration: statistics for calibrated specs (from other text), or ``None``.
        progress: show a progress bar.
        skipped: specs already dropped by the caller, recorded in the meta.
        command: the command line, recorded in the meta.

    Raises:
        ValueError: ``tokens < ctx``, a text too short, a spec that does not parse or fit.
    """
    from tqdm.auto import tqdm

    from walshkv.codecs import parse_cache_spec
    from walshkv.eval.windows import make_windows

    started = time.perf_counter()
    if ctx < 4:
        raise ValueError(f"--ctx must be at least 4 tokens, got {ctx}")
    if tokens < ctx:
        raise ValueError(f"--tokens ({tokens}) must be at least --ctx ({ctx}): rd captures whole windows")
    head_dim = lm.info["head_dim"]
    canon, _ = resolve_specs(specs, head_dim, strict=True)
    if not canon:
        raise ValueError("no codec specs to measure")
    parsed = {s: parse_cache_spec(s) for s in canon}
    n_win = tokens // ctx
    win = make_windows(lm.tokenizer, text.content, ctx, n_win)

    bound: dict[tuple[str, int], Any] = {}
    accs: dict[str, _Acc] = {}
    ssq_k: list[float] = []
    ssq_v: list[float] = []
    ssq_s: list[float] = []
    queries_seen = True
    bar = tqdm(total=n_win * len(canon), desc=f"rd on {text.name}", unit="codec", disable=not progress)
    for w in range(n_win):
        ks, vs, qs = capture_window(lm, win.ids[w])
        layers = len(ks)
        if not accs:
            accs = {s: _Acc(layers) for s in canon}
            ssq_k, ssq_v, ssq_s = [0.0] * layers, [0.0] * layers, [0.0] * layers
        queries_seen = queries_seen and qs is not None
        t = ks[0].shape[2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        ref_logits: list[torch.Tensor] = []
        for i in range(layers):
            ssq_k[i] += float(ks[i].double().square().sum())
            ssq_v[i] += float(vs[i].double().square().sum())
            if qs is not None:
                ref_logits.append(_logits(qs[i], ks[i], mask))
                ssq_s[i] += float(ref_logits[i].square().sum())
        for spec in canon:
            acc = accs[spec]
            if acc.error is None:
                try:
                    for i in range(layers):
                        key = (spec, i)
                        if key not in bound:
                            bound[key] = parsed[spec].bind(i, calibration)
                        cs = bound[key]
                        k_hat = cs.k.decode(cs.k.encode(ks[i])).to(torch.float32)
                        v_hat = cs.v.decode(cs.v.encode(vs[i])).to(torch.float32)
                        acc.sse_k[i] += float((k_hat.double() - ks[i].double()).square().sum())
                        acc.sse_v[i] += float((v_hat.double() - vs[i].double()).square().sum())
                        if qs is not None:
                            s_hat = _logits(qs[i], k_hat, mask)
                            acc.ip_err[i] += float((s_hat - ref_logits[i]).square().sum())
                            acc.ip_cross[i] += float((s_hat * ref_logits[i]).sum())
                except ValueError as err:
                    acc.error = str(err)
                    print(f"rd: {spec} failed on window {w + 1}: {err}", file=sys.stderr)
            bar.update(1)
    bar.close()

    rows = []
    for spec in canon:
        acc, cs = accs[spec], parsed[spec]
        bits_k, bits_v = cs.k.bits_per_element(head_dim), cs.v.bits_per_element(head_dim)
        row: dict[str, Any] = {
            "codec": spec,
            "bits_k": bits_k,
            "bits_v": bits_v,
            "bits_per_element": (bits_k + bits_v) / 2,
        }
        if acc.error is not None:
            row.update({"nmse_k": float("nan"), "nmse_v": float("nan"), "error": acc.error})
            rows.append(row)
            continue
        nk = [_ratio(a, b) for a, b in zip(acc.sse_k, ssq_k, strict=True)]
        nv = [_ratio(a, b) for a, b in zip(acc.sse_v, ssq_v, strict=True)]
        row.update(
            {
                "nmse_k": _mean(nk),
                "nmse_v": _mean(nv),
                "nmse": (_mean(nk) + _mean(nv)) / 2,
                "gap_db_k": _gap_db(_mean(nk), bits_k),
                "gap_db_v": _gap_db(_mean(nv), bits_v),
            }
        )
        if queries_seen:
            lr = [_ratio(a, b) for a, b in zip(acc.ip_err, ssq_s, strict=True)]
            sl = [_ratio(a, b) for a, b in zip(acc.ip_cross, ssq_s, strict=True)]
            row.update({"logit_rel_mse": _mean(lr), "logit_slope": _mean(sl)})
        row["nmse_k_layers"] = nk
        row["nmse_v_layers"] = nv
        if queries_seen:
            row["logit_rel_mse_layers"] = lr
            row["logit_slope_layers"] = sl
        row["error"] = None
        rows.append(row)
    rows.sort(key=lambda r: (r["bits_per_element"], r["codec"]))

    meta = {
        "model": {"name": lm.name, "source": lm.source, **lm.info},
        "text": {"name": text.name, "source": text.source, "tokens": win.text_tokens},
        "ctx": ctx,
        "windows": n_win,
        "tokens_captured": n_win * ctx,
        "bos_first_token": win.bos,
        "what": "K (post-RoPE, as Cache.update receives it) and V of every layer; each codec encodes and "
        "decodes them; per-layer values are averaged with equal weight over layers",
        "nmse": "per layer: sum (x_hat - x)^2 / sum x^2 over the layer's elements (relative distortion)",
        "logits": (
            "per layer: real post-RoPE queries, every causal (query, key) pair of a window; logit_rel_mse = "
            "sum (<q,k_hat> - <q,k>)^2 / sum <q,k>^2; logit_slope = sum <q,k_hat><q,k> / sum <q,k>^2"
            if queries_seen
            else "not measured: the queries could not be captured with this transformers version"
        ),
        "gap_db": "10 log10(nmse / 2^(-2 bits)): dB above the Gaussian distortion-rate bound at the stored bits",
        "reference": {
            "shannon_gaussian": "D(R) = 2^(-2R), memoryless unit-variance Gaussian source",
            "lloyd_max_gaussian": {str(b): m for b, m in lloyd_max_points(4)},
        },
        "skipped": list(skipped),
        "calibration": None if calibration is None else _describe_calibration(calibration),
        "command": command,
        "seconds_total": time.perf_counter() - started,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "versions": library_versions(),
    }
    return RDResult(meta, rows)


def _describe_calibration(calibration: Any) -> Any:
    describe = getattr(calibration, "describe", None)
    if callable(describe):
        return describe()
    return {"text": getattr(calibration, "text", None), "tokens": getattr(calibration, "tokens", None)}


# ---------------------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------------------

_TABLE_COLUMNS = (
    ("codec", "codec", None),
    ("bits_k", "bits K", ".4g"),
    ("bits_v", "bits V", ".4g"),
    ("nmse_k", "nMSE K", ".4g"),
    ("nmse_v", "nMSE V", ".4g"),
    ("gap_db_k", "dB over bound K", ".2f"),
    ("gap_db_v", "dB over bound V", ".2f"),
    ("logit_rel_mse", "logit rel MSE", ".4g"),
    ("logit_slope", "logit slope", ".4f"),
)


def _cell(value: Any, fmt: str | None) -> str:
    if value is None:
        return "-"
    if fmt is None:
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return "n/a"
    return format(value, fmt)


def format_rd_table(rows: Sequence[dict[str, Any]], fmt: str = "simple") -> str:
    """The rows as a text table (``fmt``: a tabulate format, e.g. ``"github"``)."""
    from tabulate import tabulate

    cols = [c for c in _TABLE_COLUMNS if any(c[0] in r for r in rows)]
    body = [[_cell(r.get(key), f) for key, _, f in cols] for r in rows]
    errors = [f"{r['codec']}: {r['error']}" for r in rows if r.get("error")]
    table = tabulate(body, headers=[h for _, h, _ in cols], tablefmt=fmt, disable_numparse=True)
    return table + ("\n\nfailed: " + "; ".join(errors) if errors else "")


def _family(spec: str) -> str:
    if spec.startswith("tqprod"):
        return "tqprod"
    if spec.startswith("tq"):
        return "tq"
    if re.match(r"^(rot|rrot(:\d+)?)\+int\d$", spec):
        return "rot+int"
    if re.match(r"^int\d$", spec):
        return "int"
    if spec.startswith("vht2") or spec in ("vzc",) or spec.startswith("sqfree"):
        return "vht2"
    if re.match(r"^q\d", spec):
        return "llama.cpp"
    return "other"


_COLORS = {
    "int": "tab:gray",
    "rot+int": "tab:blue",
    "tq": "tab:red",
    "tqprod": "tab:purple",
    "vht2": "tab:green",
    "llama.cpp": "tab:orange",
    "other": "tab:brown",
}


def plot_rd(rows: Sequence[dict[str, Any]], path: str | Path, title: str) -> None:
    """Normalised MSE (log) against stored bits per element for K and V, with the Gaussian bound
    ``2^(-2R)`` and the Lloyd-Max scalar points; plus the K logit error and slope where measured.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    good = [r for r in rows if not r.get("error")]
    with_logits = [r for r in good if _finite(r.get("logit_rel_mse"))]
    nrows = 2 if with_logits else 1
    fig = Figure(figsize=(14, 5.6 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, 2, squeeze=False)
    bits_all = [r[k] for r in good for k in ("bits_k", "bits_v") if _finite(r.get(k))] or [1.0, 8.0]
    lo, hi = min(0.75, min(bits_all) - 0.25), max(bits_all) + 0.5
    lm_pts = lloyd_max_points(4)

    def scatter(ax: Any, key_x: str, key_y: str, log: bool) -> None:
        seen: set[str] = set()
        pts = sorted(
            (r for r in good if _finite(r.get(key_x)) and _finite(r.get(key_y)) and (r[key_y] > 0 or not log)),
            key=lambda r: (r[key_x], r[key_y]),
        )
        # codecs that land on the same point (e.g. two names for one quantizer) share one label
        groups: dict[tuple[float, float], list[dict[str, Any]]] = {}
        for r in pts:
            groups.setdefault((round(r[key_x], 9), float(f"{r[key_y]:.9g}")), []).append(r)
        for i, ((x, y), members) in enumerate(groups.items()):
            fam = _family(members[0]["codec"])
            ax.scatter(x, y, s=30, color=_COLORS[fam], zorder=4, label=None if fam in seen else fam)
            seen.add(fam)
            ax.annotate(
                " = ".join(r["codec"] for r in members),
                (x, y),
                xytext=(5, 6 if i % 2 == 0 else -11),
                textcoords="offset points",
                fontsize=7,
                color=_COLORS[fam],
                zorder=5,
            )
        if log:
            ax.set_yscale("log")
        ax.set_xlim(lo, hi)
        ax.grid(True, which="both", alpha=0.25)

    for col, (kind, key_x, key_y) in enumerate((("K", "bits_k", "nmse_k"), ("V", "bits_v", "nmse_v"))):
        ax = axes[0][col]
        xs = [lo + (hi - lo) * i / 200 for i in range(201)]
        ax.plot(xs, [shannon_bound(x) for x in xs], color="black", lw=1.2, label="Gaussian bound 2^(-2R)", zorder=2)
        ax.plot(
            [b for b, _ in lm_pts],
            [m for _, m in lm_pts],
            ls="none",
            marker="x",
            ms=9,
            mew=2,
            color="black",
            label="Lloyd-Max scalar, N(0,1)",
            zorder=3,
        )
        scatter(ax, key_x, key_y, log=True)
        ax.set_xlabel("stored bits per element (codes, scales, norms)")
        ax.set_ylabel(f"normalised MSE of {kind}  (sum err² / sum x², mean over layers)")
        ax.set_title(f"{kind}: distortion against rate")
        ax.legend(fontsize=8, loc="lower left")
    if with_logits:
        ax = axes[1][0]
        scatter(ax, "bits_k", "logit_rel_mse", log=True)
        ax.set_xlabel("K bits per element")
        ax.set_ylabel("attention logits: sum (<q,k̂>-<q,k>)² / sum <q,k>²")
        ax.set_title("K with the model's real queries: logit error")
        ax.legend(fontsize=8, loc="lower left")
        ax = axes[1][1]
        ax.axhline(1.0, color="black", lw=1, label="unbiased (slope 1)")
        scatter(ax, "bits_k", "logit_slope", log=False)
        ax.set_xlabel("K bits per element")
        ax.set_ylabel("slope of <q,k̂> on <q,k> (least squares)")
        ax.set_title("K: logit shrinkage (below 1) or inflation (above 1)")
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=11)
    fig.savefig(str(path), dpi=110)


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


_CSV_KEYS = (
    "codec",
    "bits_k",
    "bits_v",
    "bits_per_element",
    "nmse_k",
    "nmse_v",
    "nmse",
    "gap_db_k",
    "gap_db_v",
    "logit_rel_mse",
    "logit_slope",
    "error",
)


def _describe(meta: dict[str, Any]) -> str:
    m, t = meta["model"], meta["text"]
    return (
        f"Model {m['name']} ({m.get('arch')}, head_dim {m.get('head_dim')}, {m.get('layers')} layers, "
        f"{m.get('kv_heads')} KV heads); text {t['name']}; {meta['windows']} windows of {meta['ctx']} tokens "
        f"({meta['tokens_captured']:,} tokens captured per layer)."
    )


def write_rd_outputs(result: RDResult, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """Write ``rd.json``, ``rd.csv``, ``rd.md`` and (with matplotlib) ``rd.png``; return the paths written."""
    lines = [f"# Rate-distortion: {result.meta['model']['name']} on {result.meta['text']['name']}", ""]
    lines += [_describe(result.meta), ""]
    if result.meta.get("command"):
        lines += [f"Produced by `{result.meta['command']}`.", ""]
    lines += [format_rd_table(result.rows, "github"), ""]
    if result.meta.get("skipped"):
        lines += ["Skipped: " + "; ".join(f"`{s['codec']}` ({s['reason']})" for s in result.meta["skipped"]), ""]
    lines += [
        "Columns: see docs/rd.md in the walshkv repository. Lloyd-Max reference (unit Gaussian, computed): "
        + ", ".join(f"{b} bit: {m:.4g}" for b, m in result.meta["reference"]["lloyd_max_gaussian"].items())
        + ".",
        "",
    ]

    def draw(out: Path) -> list[Path]:
        plot_rd(result.rows, out / "rd.png", _describe(result.meta))
        return [out / "rd.png"]

    return write_result_files(out_dir, "rd", result.to_json(), result.rows, _CSV_KEYS, lines, draw if plot else None)


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(text).name).strip("-") or "model"


def _cmd_rd(args: argparse.Namespace) -> int:
    from walshkv import models
    from walshkv.cli import calibrate_if_needed
    from walshkv.data import load_text

    if args.tokens < 1 or args.ctx < 4:
        raise ValueError(f"--tokens must be positive and --ctx at least 4, got {args.tokens} and {args.ctx}")
    if args.tokens < args.ctx:
        raise ValueError(f"--tokens ({args.tokens}) must be at least --ctx ({args.ctx}): rd captures whole windows")
    explicit = bool(args.codec)
    raw = list(args.codec or DEFAULT_RD_CODECS)
    specs, skipped = resolve_specs(raw, strict=explicit)  # the grammar, before loading anything
    text = load_text(args.text)
    lm = models.load_model(args.model, progress=not args.quiet)
    specs, late = resolve_specs(specs, lm.info["head_dim"], strict=explicit)
    skipped += late
    for s in skipped:
        print(f"rd: skipped {s['codec']}: {s['reason']}", file=sys.stderr)
    calibration = calibrate_if_needed(lm, specs, args, text)
    command = command_line(args)
    result = measure_rd(
        lm,
        text,
        specs,
        tokens=args.tokens,
        ctx=args.ctx,
        calibration=calibration,
        progress=not args.quiet,
        skipped=skipped,
        command=command,
    )
    out = Path(args.out or f"rd-{_slug(lm.name)}")
    print(_describe(result.meta))
    print(format_rd_table(result.rows))
    written = write_rd_outputs(result, out, plot=not args.no_plot)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def add_rd_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``rd`` subcommand on the CLI's subparsers."""
    from walshkv.cli import add_calibration_args
    from walshkv.data import DEFAULT_TEXT, TEXTS
    from walshkv.models import DEFAULT_MODEL, MODELS

    rd = sub.add_parser(
        "rd",
        help="rate-distortion of codecs on the model's real K/V: normalised MSE vs bits, Gaussian bound, plot",
        description="Capture the K (post-RoPE) and V vectors that enter the cache, plus the queries, over "
        "--tokens tokens; encode and decode them with every codec; report per-layer relative MSE "
        "(sum err^2 / sum x^2, averaged over layers) for K and V, the attention-logit error and slope with "
        "the real queries, and the distance to the Gaussian bound 2^(-2R). Writes rd.json, rd.csv, rd.md "
        "and rd.png (needs matplotlib) under --out.",
        epilog="default codecs: "
        + " ".join(DEFAULT_RD_CODECS)
        + " (those that do not parse or fit the head_dim are skipped with a note)\n"
        "example:\n  walshkv rd --model smollm2-135m --text ../shared/data/austen_emma.txt --tokens 2048",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    rd.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"offline model ({', '.join(MODELS)}), a .gguf path, a model folder or a hub id (default %(default)s)",
    )
    rd.add_argument(
        "--text", default=DEFAULT_TEXT, help=f"{', '.join(TEXTS)}, or a path to a UTF-8 file (default %(default)s)"
    )
    rd.add_argument("--tokens", type=int, default=4096, help="tokens to capture, whole windows (default %(default)s)")
    rd.add_argument("--ctx", type=int, default=512, help="tokens per forward pass (default %(default)s)")
    rd.add_argument("--codec", action="append", metavar="SPEC", help="cache spec, repeatable (default: the list below)")
    rd.add_argument("--out", metavar="DIR", help="output folder (default rd-MODEL)")
    rd.add_argument("--no-plot", action="store_true", help="skip rd.png")
    add_calibration_args(rd)
    rd.add_argument("--quiet", action="store_true", help="no progress bars")
    rd.set_defaults(func=_cmd_rd)
