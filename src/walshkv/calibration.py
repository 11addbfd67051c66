"""Calibration statistics of the K/V that enter a model's cache.

``collect_kv_stats`` runs the model over calibration text (never the evaluation text) and
accumulates, per (layer, kv-head, channel), the mean and second moment of K (after RoPE, exactly
what ``Cache.update`` receives) and of V, in the plain basis and in the orthonormal
Walsh-Hadamard basis (natural order). Codecs that need measured statistics (``vht2`` with
``order=variance`` or ``auto@BITS``) read them through :meth:`walshkv.codecs.Codec.bind`.

For ``eq+`` it also keeps, per (layer, kv-head), the full K covariance (the first token of each
window left out: the attention sink is far from every typical key) and the second moment of the
queries that read each kv-head (post-RoPE, the heads of a group summed), from which
:meth:`KVStats.k_equalizer` derives the K transform.

For ``prerope+`` it keeps the same K and query statistics before RoPE (each key and query rotated back
by its own position) and the model's RoPE tables; :meth:`KVStats.pre_rope` is the view those codecs read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from walshkv.cache.recording import RecordingCache
from walshkv.data import TextTooShortError, make_windows
from walshkv.defaults import CALIB_TOKENS, CTX
from walshkv.export import KMeanBias
from walshkv.identity import check_identity, identity_config
from walshkv.models import LoadedModel, recording_queries
from walshkv.ops.equalize import k_equalizer as fit_equalizer
from walshkv.ops.equalize import k_equalizer_diagonal as fit_diagonal_equalizer
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.rope import RopeTable, rope_tables, undo_rope

if TYPE_CHECKING:
    from walshkv.constants import Basis, KBasis, Kind
    from walshkv.data import Text

__all__ = ["KVStats", "MergedCalibration", "collect_kv_stats"]

BASES = ("plain", "wht")
KINDS = ("k", "v")


@dataclass
class KVStats:
    """Per-layer K/V moments: ``sums[(kind, basis)]`` is ``[layers, kv_heads, head_dim]``.

    Satisfies :class:`walshkv.codecs.calibration.Statistics` (every part a codec's ``bind`` may read).

    Attributes:
        model: model name the statistics belong to.
        text: name of the calibration text.
        tokens: calibration tokens seen per layer.
        head_dim, num_kv_heads, num_layers: shapes.
    """

    model: str
    text: str
    tokens: int
    head_dim: int
    num_kv_heads: int
    num_layers: int
    sums: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    sq_sums: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)
    counts: torch.Tensor | None = None  # [layers]
    k_outer: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim], positions >= 1
    k_sum1: torch.Tensor | None = None  # [layers, kv_heads, head_dim], positions >= 1
    count1: torch.Tensor | None = None  # [layers]
    q_outer: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim], group heads summed
    v_outer: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim], positions >= 1
    v_sum1: torch.Tensor | None = None  # [layers, kv_heads, head_dim], positions >= 1
    o_metric: torch.Tensor | None = None  # [layers, kv_heads, head_dim, head_dim]: sum of W_oᵀW_o over a group
    q_count: torch.Tensor | None = None  # [layers]
    k_basis: KBasis = "post-rope"  # "pre-rope": the K and query statistics are before RoPE (pre_rope())
    pre: dict[Any, Any] = field(default_factory=dict)  # K/query statistics before RoPE (see pre_rope)
    rope_inv_freq: torch.Tensor | None = None  # [layers, head_dim / 2]: each layer's RoPE table
    rope_scaling: torch.Tensor | None = None  # [layers]
    model_config: dict[str, Any] | None = None  # the model's identity (walshkv.identity.identity_config)

    def _check(self, kind: Kind, basis: str, layer: int) -> None:
        if kind not in KINDS or basis not in BASES:
            raise ValueError(f"kind must be one of {KINDS} and basis one of {BASES}, got {kind!r}, {basis!r}")
        if not 0 <= layer < self.num_layers:
            raise ValueError(
                f"calibration for {self.model!r} has {self.num_layers} layers; layer {layer} requested "
                "(a calibration made for another model?)"
            )

    def mean(self, kind: Kind, layer: int, basis: str = "plain") -> torch.Tensor:
        """Mean ``[kv_heads, head_dim]`` of K or V in ``basis`` for ``layer``."""
        self._check(kind, basis, layer)
        assert self.counts is not None
        return self.sums[(kind, basis)][layer] / self.counts[layer].clamp_min(1)

    def k_bias(self, layer: int, basis: Basis) -> torch.Tensor:
        """Mean K ``[kv_heads, head_dim]`` for ``center+``: ``plain`` or ``rot`` (WHT) basis."""
        if basis not in ("plain", "rot"):
            raise ValueError(f"basis must be 'plain' or 'rot', got {basis!r}")
        return self.mean("k", layer, "wht" if basis == "rot" else "plain")

    def variance(self, kind: Kind, layer: int, basis: str = "wht") -> torch.Tensor:
        """Variance ``[kv_heads, head_dim]`` of K or V in ``basis`` for ``layer``."""
        self._check(kind, basis, layer)
        assert self.counts is not None
        n = self.counts[layer].clamp_min(1)
        mean = self.sums[(kind, basis)][layer] / n
        return (self.sq_sums[(kind, basis)][layer] / n - mean**2).clamp_min(0.0)

    def covariance(self, kind: Kind, layer: int) -> torch.Tensor:
        """K or V covariance ``[kv_heads, head_dim, head_dim]`` (float64) of ``layer``, first tokens left out."""
        self._check(kind, "plain", layer)
        outer, sums = (self.k_outer, self.k_sum1) if kind == "k" else (self.v_outer, self.v_sum1)
        if outer is None or sums is None or self.count1 is None:
            raise ValueError(f"these statistics hold no {kind.upper()} covariance; collect them with collect_kv_stats")
        n = float(self.count1[layer].clamp_min(1))
        mean = sums[layer] / n
        return outer[layer] / n - mean[:, :, None] * mean[:, None, :]

    def k_covariance(self, layer: int) -> torch.Tensor:
        """K covariance of ``layer`` (:meth:`covariance`)."""
        return self.covariance("k", layer)

    def query_moment(self, layer: int) -> torch.Tensor:
        """Second moment ``E[q qᵀ]`` ``[kv_heads, head_dim, head_dim]`` of the queries of each kv-head's group."""
        self._check("k", "plain", layer)
        if self.q_outer is None or self.q_count is None:
            raise ValueError(
                "these statistics hold no query moments (the installed transformers could not route attention "
                "through walshkv's recorder); eq+ needs them"
            )
        return self.q_outer[layer] / float(self.q_count[layer].clamp_min(1))

    def k_equalizer(self, layer: int) -> torch.Tensor:
        """The ``eq+`` K transform ``[kv_heads, head_dim, head_dim]`` of ``layer`` (float32)."""
        return fit_equalizer(self.k_covariance(layer), self.query_moment(layer)).to(torch.float32)

    def k_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """The ``eqd+`` K transform of ``layer``: the best diagonal one (float32, ``[kv_heads, d, d]``)."""
        return fit_diagonal_equalizer(self.k_covariance(layer), self.query_moment(layer)).to(torch.float32)

    def v_covariance(self, layer: int) -> torch.Tensor:
        """V covariance of ``layer`` (:meth:`covariance`)."""
        return self.covariance("v", layer)

    def output_metric(self, layer: int) -> torch.Tensor:
        """``Σ W_oᵀ W_o`` ``[kv_heads, head_dim, head_dim]`` over the heads of each kv-head's group."""
        self._check("v", "plain", layer)
        if self.o_metric is None:
            raise ValueError(
                "these statistics hold no output-projection metric (the model has no layers.N.self_attn.o_proj); "
                "eq+ on V needs it"
            )
        return self.o_metric[layer]

    def v_equalizer(self, layer: int) -> torch.Tensor:
        """The ``eq+`` V transform ``[kv_heads, head_dim, head_dim]`` of ``layer`` (float32): V's error as
        the output projection sees it, in place of the queries' view of K's."""
        return fit_equalizer(self.v_covariance(layer), self.output_metric(layer)).to(torch.float32)

    def v_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """The ``eqd+`` V transform of ``layer``: the best diagonal one (float32, ``[kv_heads, d, d]``)."""
        return fit_diagonal_equalizer(self.v_covariance(layer), self.output_metric(layer)).to(torch.float32)

    def equalizers(self, kind: Kind, diagonal: bool = False) -> torch.Tensor:
        """Every layer's ``eq+`` transform (``eqd+``'s with ``diagonal``), K (``"k"``) or V (``"v"``):
        ``[layers, kv_heads, d, d]``."""
        if diagonal:
            one = self.k_equalizer_diagonal if kind == "k" else self.v_equalizer_diagonal
        else:
            one = self.k_equalizer if kind == "k" else self.v_equalizer
        return torch.stack([one(i) for i in range(self.num_layers)])

    def rope_table(self, layer: int) -> RopeTable:
        """``layer``'s RoPE table (:class:`walshkv.ops.rope.RopeTable`), as read off the model."""
        self._check("k", "plain", layer)
        if self.rope_inv_freq is None or self.rope_scaling is None:
            raise ValueError("these statistics hold no RoPE tables (a model without RoPE?); prerope+ needs them")
        return RopeTable(self.rope_inv_freq[layer].to(torch.float32), float(self.rope_scaling[layer]))

    def pre_rope(self) -> KVStats:
        """The same statistics with K (and the queries) taken before RoPE: what ``prerope+`` codecs read."""
        if self.k_basis == "pre-rope":
            return self
        if not self.pre:
            raise ValueError(
                "these statistics hold no K before RoPE (the model has no rotary module walshkv can read); "
                "prerope+ cannot be used with this model"
            )
        sums = dict(self.sums)
        sq_sums = dict(self.sq_sums)
        for basis in BASES:
            sums[("k", basis)] = self.pre["sums", basis]
            sq_sums[("k", basis)] = self.pre["sq_sums", basis]
        return replace(
            self,
            sums=sums,
            sq_sums=sq_sums,
            k_outer=self.pre["k_outer"],
            k_sum1=self.pre["k_sum1"],
            q_outer=self.pre.get("q_outer") if self.q_outer is not None else None,
            k_basis="pre-rope",
            pre={},
        )

    def describe(self) -> dict[str, Any]:
        """Provenance for result files."""
        out = {"kind": "kv-stats", "model": self.model, "text": self.text, "tokens": self.tokens}
        if self.k_basis != "post-rope":
            out["k_basis"] = self.k_basis
        return out

    def check_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: str | None = None,
        *,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        """Refuse statistics made for a model of another shape or identity (its config)."""
        want = (num_layers, num_kv_heads, head_dim)
        have = (self.num_layers, self.num_kv_heads, self.head_dim)
        if want != have:
            raise ValueError(
                f"calibration for {self.model!r} has (layers, kv_heads, head_dim) = {have}, but the model"
                f"{' ' + repr(model) if model else ''} has {want}; calibrate on this model"
            )
        check_identity(f"calibration statistics of {self.text!r}", self.model, self.model_config, model_config, model)


class MergedCalibration:
    """Statistics from text (``stats``) with the K bias taken from a file (``bias``).

    Satisfies :class:`walshkv.codecs.calibration.Statistics`: the K mean (and the ``eq+`` transforms the file
    holds) come from the file, everything else from the statistics.
    """

    def __init__(self, stats: KVStats, bias: KMeanBias) -> None:
        self.stats = stats
        self.bias = bias
        self.text = stats.text

    def k_bias(self, layer: int, basis: Basis) -> torch.Tensor:
        """The file's K mean ``[kv_heads, head_dim]`` of ``layer`` in ``basis``."""
        return self.bias.k_bias(layer, basis)

    def mean(self, kind: Kind, layer: int, basis: str = "plain") -> torch.Tensor:
        """The statistics' mean ``[kv_heads, head_dim]`` (:meth:`KVStats.mean`)."""
        return self.stats.mean(kind, layer, basis)

    def variance(self, kind: Kind, layer: int, basis: str = "wht") -> torch.Tensor:
        """The statistics' variance ``[kv_heads, head_dim]`` (:meth:`KVStats.variance`)."""
        return self.stats.variance(kind, layer, basis)

    def k_equalizer(self, layer: int) -> torch.Tensor:
        """The file's ``eq+`` K transform where it holds one, else the one of the statistics."""
        if self.bias.has_k_equalizer:
            return self.bias.k_equalizer(layer)
        return self.stats.k_equalizer(layer)

    def v_equalizer(self, layer: int) -> torch.Tensor:
        """The file's ``eq+`` V transform where it holds one, else the one of the statistics."""
        if self.bias.has_v_equalizer:
            return self.bias.v_equalizer(layer)
        return self.stats.v_equalizer(layer)

    def k_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """The file's K transform where it holds one (``eqd+`` checks that it is diagonal), else the statistics'."""
        if self.bias.has_k_equalizer:
            return self.bias.k_equalizer(layer)
        return self.stats.k_equalizer_diagonal(layer)

    def v_equalizer_diagonal(self, layer: int) -> torch.Tensor:
        """The file's V transform where it holds one (``eqd+`` checks that it is diagonal), else the statistics'."""
        if self.bias.has_v_equalizer:
            return self.bias.v_equalizer(layer)
        return self.stats.v_equalizer_diagonal(layer)

    @property
    def k_basis(self) -> KBasis:
        """The file's: ``pre-rope`` if it was written for a ``prerope+`` spec."""
        return self.bias.k_basis

    def pre_rope(self) -> MergedCalibration:
        """Both halves before RoPE (the file must have been written for a ``prerope+`` spec)."""
        return MergedCalibration(self.stats.pre_rope(), self.bias.pre_rope())

    def rope_table(self, layer: int) -> RopeTable:
        """The statistics' RoPE table of ``layer``."""
        return self.stats.rope_table(layer)

    def check_matches(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        model: str | None = None,
        *,
        model_config: dict[str, Any] | None = None,
    ) -> None:
        """Refuse a model the statistics or the file were not made for."""
        self.stats.check_matches(num_layers, num_kv_heads, head_dim, model, model_config=model_config)
        self.bias.check_matches(num_layers, num_kv_heads, head_dim, model, model_config=model_config)

    def describe(self) -> dict[str, Any]:
        """Provenance for result files: both halves."""
        return {"kind": "merged", "stats": self.stats.describe(), "k_bias": self.bias.describe()}


def _output_metric(model: Any, layers: int, heads: int, head_dim: int) -> torch.Tensor | None:
    """``Σ W_oᵀ W_o`` per (layer, kv-head) from each layer's ``self_attn.o_proj``, or ``None`` if absent."""
    found: dict[int, torch.Tensor] = {}
    for name, module in model.named_modules():
        m = re.search(r"layers\.(\d+)\.self_attn\.o_proj$", name)
        if m is not None and isinstance(getattr(module, "weight", None), torch.Tensor):
            found[int(m.group(1))] = module.weight.detach()
    if sorted(found) != list(range(layers)):
        return None
    metric = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
    for layer, w in found.items():
        w = w.to(torch.float64).cpu()  # [hidden, q_heads * head_dim]
        q_heads = w.shape[1] // head_dim
        per_head = w.reshape(w.shape[0], q_heads, head_dim)
        gram = torch.einsum("nqd,nqe->qde", per_head, per_head)  # [q_heads, d, d]
        metric[layer] = gram.reshape(heads, q_heads // heads, head_dim, head_dim).sum(1)
    return metric


@torch.inference_mode()
def collect_kv_stats(
    lm: LoadedModel, text: Text, *, tokens: int = CALIB_TOKENS, ctx: int = CTX, progress: bool = True
) -> KVStats:
    """Run ``lm`` over the first ``tokens`` tokens of ``text`` and accumulate K/V moments.

    Args:
        lm: a :class:`walshkv.models.LoadedModel`.
        text: a :class:`walshkv.data.Text` (the calibration text).
        tokens: calibration tokens (rounded down to whole windows of ``ctx``; at least one window).
        ctx: tokens per forward pass.
        progress: show a progress bar.
    """
    layers, heads, head_dim = lm.shape.layers, lm.shape.kv_heads, lm.shape.head_dim
    n_win = max(1, tokens // ctx)
    try:
        win = make_windows(lm.tokenizer, text.content, ctx, n_win)
    except TextTooShortError as err:
        raise ValueError(
            f"calibration on {text.name} asked for {tokens:,} tokens ({n_win:,} windows of {ctx}), but the text has "
            f"{err.tokens:,}: calibrate on at most {err.fit * ctx:,} tokens (--tokens), or on a longer --calib-text"
        ) from err
    stats = KVStats(
        lm.name,
        text.name,
        n_win * ctx,
        head_dim,
        heads,
        layers,
        counts=torch.zeros(layers),
        model_config=identity_config(lm.model.config),
    )
    for key in [(k, b) for k in KINDS for b in BASES]:
        stats.sums[key] = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
        stats.sq_sums[key] = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
    stats.k_outer = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
    stats.k_sum1 = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
    stats.count1 = torch.zeros(layers)
    stats.v_outer = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
    stats.v_sum1 = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
    stats.o_metric = _output_metric(lm.model, layers, heads, head_dim)
    q_outer = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
    q_count = torch.zeros(layers)
    tables = rope_tables(lm.model)
    pre: dict[Any, torch.Tensor] = {}
    if tables is not None:  # the same K and query statistics before RoPE, for prerope+
        for basis in BASES:
            pre["sums", basis] = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
            pre["sq_sums", basis] = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
        pre["k_outer"] = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
        pre["k_sum1"] = torch.zeros(layers, heads, head_dim, dtype=torch.float64)
        pre["q_outer"] = torch.zeros(layers, heads, head_dim, head_dim, dtype=torch.float64)
        stats.rope_inv_freq = torch.stack([t.inv_freq for t in tables])
        stats.rope_scaling = torch.tensor([t.scaling for t in tables], dtype=torch.float32)

    def _add_pre_k(layer_idx: int, key_states: torch.Tensor) -> None:
        # every window runs from an empty cache in one pass: key j sits at position j
        assert tables is not None
        k = undo_rope(key_states.detach(), tables[layer_idx]).to(torch.float64)
        for basis, y in (("plain", k), ("wht", hadamard_transform(k))):
            pre["sums", basis][layer_idx] += y.sum(dim=(0, 2)).cpu()
            pre["sq_sums", basis][layer_idx] += (y * y).sum(dim=(0, 2)).cpu()
        k1 = k[:, :, 1:].to(torch.float32)
        pre["k_outer"][layer_idx] += torch.einsum("bhnd,bhne->hde", k1, k1).cpu().to(torch.float64)
        pre["k_sum1"][layer_idx] += k1.sum(dim=(0, 2)).cpu().to(torch.float64)

    def _record(layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for kind, x in (("k", key_states), ("v", value_states)):
            x64 = x.detach().to(torch.float64)
            for basis, y in (("plain", x64), ("wht", hadamard_transform(x64))):
                stats.sums[(kind, basis)][layer_idx] += y.sum(dim=(0, 2)).cpu()
                stats.sq_sums[(kind, basis)][layer_idx] += (y * y).sum(dim=(0, 2)).cpu()
        assert stats.counts is not None and stats.k_outer is not None
        stats.counts[layer_idx] += key_states.shape[0] * key_states.shape[2]
        k1 = key_states[:, :, 1:].detach().to(torch.float32)  # the first token (attention sink) left out
        stats.k_outer[layer_idx] += torch.einsum("bhnd,bhne->hde", k1, k1).cpu().to(torch.float64)
        stats.k_sum1[layer_idx] += k1.sum(dim=(0, 2)).cpu()
        stats.count1[layer_idx] += k1.shape[0] * k1.shape[2]
        v1 = value_states[:, :, 1:].detach().to(torch.float32)
        stats.v_outer[layer_idx] += torch.einsum("bhnd,bhne->hde", v1, v1).cpu().to(torch.float64)
        stats.v_sum1[layer_idx] += v1.sum(dim=(0, 2)).cpu().to(torch.float64)
        if pre:
            _add_pre_k(layer_idx, key_states)

    device = next(lm.model.parameters()).device

    class _QueryMoments(dict):
        """Adds each layer's queries to ``q_outer`` as the recorder hands them over (nothing kept)."""

        def __setitem__(self, layer: int, q: torch.Tensor) -> None:
            b, hq, t, d = q.shape  # q head j reads kv head j // (hq // heads)
            qg = q.reshape(b, heads, hq // heads, t, d)
            q_outer[layer] += torch.einsum("bhgnd,bhgne->hde", qg, qg).cpu().to(torch.float64)
            if pre:
                assert tables is not None
                qp = undo_rope(q.detach(), tables[layer]).reshape(b, heads, hq // heads, t, d)
                pre["q_outer"][layer] += torch.einsum("bhgnd,bhgne->hde", qp, qp).cpu().to(torch.float64)
            q_count[layer] += b * t
            super().__setitem__(layer, True)

    queries = _QueryMoments()
    recorded = True
    with recording_queries(lm.model, queries) as recording:
        for w in tqdm(range(n_win), desc=f"calibrate on {text.name}", unit="window", disable=not progress):
            queries.clear()
            lm.model(
                input_ids=win.ids[w : w + 1].to(device),
                cache=RecordingCache(_record, config=lm.model.config),
                use_cache=True,
                logits_to_keep=1,
            )
            recorded = recorded and recording and sorted(queries) == list(range(layers))
    if recorded:
        stats.q_outer, stats.q_count = q_outer, q_count
    stats.pre = pre
    return stats
