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
``rd.png`` (needs matplotlib): :mod:`walshkv.eval.rd.report`.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from walshkv.cache.recording import RecordingCache
from walshkv.codecs import check_spec_list, parse_cache_spec
from walshkv.data import make_windows
from walshkv.defaults import CTX
from walshkv.eval.rd.report import (
    RDResult,
    describe_rd,
    format_rd_table,
    lloyd_max_points,
    plot_rd,
    shannon_bound,
    write_rd_outputs,
)
from walshkv.eval.report import calibration_meta, run_meta
from walshkv.models import recording_queries

if TYPE_CHECKING:
    from walshkv.codecs.calibration import CalibrationLike
    from walshkv.data import Text
    from walshkv.models import LoadedModel

__all__ = [
    "DEFAULT_RD_CODECS",
    "RDConfig",
    "RDResult",
    "capture_window",
    "describe_rd",
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

# ---------------------------------------------------------------------------------------------------------
# Capture
# ---------------------------------------------------------------------------------------------------------


@torch.inference_mode()
def capture_window(
    lm: LoadedModel, ids: torch.Tensor, queries: bool = True
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor] | None]:
    """Run one window and return per-layer K, V (``[1, kv_heads, T, head_dim]``, float32, post-RoPE K)
    and, when ``queries`` and possible, the queries ``[1, q_heads, T, head_dim]`` (else ``None``)."""
    keys: dict[int, torch.Tensor] = {}
    values: dict[int, torch.Tensor] = {}

    def _record(layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        keys[layer_idx] = key_states.detach().to(torch.float32).cpu()
        values[layer_idx] = value_states.detach().to(torch.float32).cpu()

    device = next(lm.model.parameters()).device
    sink: dict[int, torch.Tensor] = {}
    context = recording_queries(lm.model, sink) if queries else contextlib.nullcontext(False)
    with context as recording:
        lm.model(
            input_ids=ids.view(1, -1).to(device),
            cache=RecordingCache(_record, config=lm.model.config),
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


@dataclass(frozen=True)
class RDConfig:
    """What :func:`measure_rd` measures: the codecs, how many K/V vectors, and what the meta records.

    Attributes:
        codecs: cache specs (``SPEC`` or ``KSPEC/VSPEC``); they must parse (checked here) and fit the model's
            head_dim (checked by :func:`measure_rd`). Kept as a tuple; each canonical spec is measured once.
        tokens: tokens to capture, cut into ``tokens // ctx`` windows of ``ctx`` (at least one).
        ctx: tokens per forward pass.
        calibration: what calibrated specs need (from other text than the measured one), or ``None``.
        skipped: specs the caller dropped already (``{"codec", "reason"}``, :func:`resolve_specs`), recorded in the
            meta. Kept as a tuple.
        command: the command line, recorded in the meta.
        progress: show a progress bar.

    Raises:
        ValueError: ``codecs`` a single string, empty, or with a spec that does not parse; ``ctx`` below 4;
            ``tokens`` below ``ctx``.
    """

    codecs: Sequence[str]
    tokens: int = 4096
    ctx: int = CTX
    calibration: CalibrationLike | None = None
    skipped: Sequence[dict[str, str]] = ()
    command: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        check_spec_list(self.codecs)
        if self.ctx < 4:
            raise ValueError(f"--ctx must be at least 4 tokens, got {self.ctx}")
        if self.tokens < self.ctx:
            raise ValueError(f"--tokens ({self.tokens}) must be at least --ctx ({self.ctx}): rd captures whole windows")
        if not resolve_specs(self.codecs, strict=True)[0]:  # the grammar: raises naming the spec
            raise ValueError("no codec specs to measure")
        object.__setattr__(self, "codecs", tuple(self.codecs))
        object.__setattr__(self, "skipped", tuple(self.skipped))


@torch.inference_mode()
def measure_rd(lm: LoadedModel, text: Text, config: RDConfig) -> RDResult:
    """Rate-distortion rows for ``config.codecs`` on the K/V of ``config.tokens`` tokens of ``text``.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text`.
        config: the codecs and the run's settings (:class:`RDConfig`).

    Returns:
        An :class:`~walshkv.eval.rd.report.RDResult`: the meta and one row per canonical spec, sorted by bits per
        element.

    Raises:
        ValueError: a spec that does not fit the head_dim, a text too short for the windows.
    """
    started = time.perf_counter()
    head_dim = lm.shape.head_dim
    canon, _ = resolve_specs(config.codecs, head_dim, strict=True)
    parsed = {s: parse_cache_spec(s) for s in canon}
    n_win = config.tokens // config.ctx
    win = make_windows(lm.tokenizer, text.content, config.ctx, n_win)
    sums = _measure(lm, win.ids, parsed, config.calibration, desc=f"rd on {text.name}", progress=config.progress)
    rows = sorted(
        (_row(spec, cs, head_dim, sums) for spec, cs in parsed.items()),
        key=lambda r: (r["bits_per_element"], r["codec"]),
    )
    meta = run_meta(
        lm,
        text,
        text_tokens=win.text_tokens,
        text_chars=False,
        ctx=config.ctx,
        windows=n_win,
        tokens_captured=n_win * config.ctx,
        bos_first_token=win.bos,
        what="K (post-RoPE, as Cache.update receives it) and V of every layer; each codec encodes and "
        "decodes them; per-layer values are averaged with equal weight over layers",
        nmse="per layer: sum (x_hat - x)^2 / sum x^2 over the layer's elements (relative distortion)",
        logits=(
            "per layer: real post-RoPE queries, every causal (query, key) pair of a window; logit_rel_mse = "
            "sum (<q,k_hat> - <q,k>)^2 / sum <q,k>^2; logit_slope = sum <q,k_hat><q,k> / sum <q,k>^2"
            if sums.queries_seen
            else "not measured: the queries could not be captured with this transformers version"
        ),
        gap_db="10 log10(nmse / 2^(-2 bits)): dB above the Gaussian distortion-rate bound at the stored bits",
        reference={
            "shannon_gaussian": "D(R) = 2^(-2R), memoryless unit-variance Gaussian source",
            "lloyd_max_gaussian": {str(b): m for b, m in lloyd_max_points(4)},
        },
        skipped=list(config.skipped),
        calibration=calibration_meta(config.calibration),
        command=config.command,
        started=started,
    )
    return RDResult(meta, rows)


@dataclass
class _Sums:
    """What :func:`_measure` adds up over the windows: per codec its errors (:class:`_Acc`), per layer the
    reference's sums of squares (K, V, the attention logits), and whether every window's queries were captured."""

    accs: dict[str, _Acc] = field(default_factory=dict)
    ssq_k: list[float] = field(default_factory=list)
    ssq_v: list[float] = field(default_factory=list)
    ssq_s: list[float] = field(default_factory=list)
    queries_seen: bool = True


def _measure(
    lm: LoadedModel,
    windows: torch.Tensor,
    parsed: dict[str, Any],
    calibration: CalibrationLike | None,
    *,
    desc: str,
    progress: bool,
) -> _Sums:
    """Capture every window's K, V and queries and add up each codec's errors on them (a codec that raises on the
    data keeps its error and is measured no further)."""
    bound: dict[tuple[str, int], Any] = {}
    sums = _Sums()
    n_win = windows.shape[0]
    bar = tqdm(total=n_win * len(parsed), desc=desc, unit="codec", disable=not progress)
    for w in range(n_win):
        ks, vs, qs = capture_window(lm, windows[w])
        layers = len(ks)
        if not sums.accs:
            sums.accs = {s: _Acc(layers) for s in parsed}
            sums.ssq_k, sums.ssq_v, sums.ssq_s = [0.0] * layers, [0.0] * layers, [0.0] * layers
        sums.queries_seen = sums.queries_seen and qs is not None
        t = ks[0].shape[2]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        ref_logits: list[torch.Tensor] = []
        for i in range(layers):
            sums.ssq_k[i] += float(ks[i].double().square().sum())
            sums.ssq_v[i] += float(vs[i].double().square().sum())
            if qs is not None:
                ref_logits.append(_logits(qs[i], ks[i], mask))
                sums.ssq_s[i] += float(ref_logits[i].square().sum())
        for spec, cs in parsed.items():
            acc = sums.accs[spec]
            if acc.error is None:
                try:
                    for i in range(layers):
                        key = (spec, i)
                        if key not in bound:
                            bound[key] = cs.bind(i, calibration)
                        layer = bound[key]
                        k_hat = layer.k.decode(layer.k.encode(ks[i])).to(torch.float32)
                        v_hat = layer.v.decode(layer.v.encode(vs[i])).to(torch.float32)
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
    return sums


def _row(spec: str, cs: Any, head_dim: int, sums: _Sums) -> dict[str, Any]:
    """The result row of ``spec`` (parsed: ``cs``): bits, the means over layers, the per-layer values."""
    acc = sums.accs[spec]
    bits_k, bits_v = cs.k.bits_per_element(head_dim), cs.v.bits_per_element(head_dim)
    row: dict[str, Any] = {
        "codec": spec,
        "bits_k": bits_k,
        "bits_v": bits_v,
        "bits_per_element": (bits_k + bits_v) / 2,
    }
    if acc.error is not None:
        row.update({"nmse_k": float("nan"), "nmse_v": float("nan"), "error": acc.error})
        return row
    nk = [_ratio(a, b) for a, b in zip(acc.sse_k, sums.ssq_k, strict=True)]
    nv = [_ratio(a, b) for a, b in zip(acc.sse_v, sums.ssq_v, strict=True)]
    row.update(
        {
            "nmse_k": _mean(nk),
            "nmse_v": _mean(nv),
            "nmse": (_mean(nk) + _mean(nv)) / 2,
            "gap_db_k": _gap_db(_mean(nk), bits_k),
            "gap_db_v": _gap_db(_mean(nv), bits_v),
        }
    )
    if sums.queries_seen:
        lr = [_ratio(a, b) for a, b in zip(acc.ip_err, sums.ssq_s, strict=True)]
        sl = [_ratio(a, b) for a, b in zip(acc.ip_cross, sums.ssq_s, strict=True)]
        row.update({"logit_rel_mse": _mean(lr), "logit_slope": _mean(sl)})
    row["nmse_k_layers"] = nk
    row["nmse_v_layers"] = nv
    if sums.queries_seen:
        row["logit_rel_mse_layers"] = lr
        row["logit_slope_layers"] = sl
    row["error"] = None
    return row
