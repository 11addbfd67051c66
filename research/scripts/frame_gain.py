"""Predicted gain of K equalizers that a decode kernel can fold into the query, against ``eq+`` before RoPE.

``eq+`` before RoPE (``prerope+center+eq+``) needs a dense ``head_dim x head_dim`` map per cached key at decode
time. A transform after RoPE is applied to the query once per step only if it is the same at every position, and
the only transforms that commute with RoPE scale (and turn) each rotary channel pair as a whole. This script
computes, from calibration moments before RoPE (K covariance ``C``, query moment ``M``, python-docs), the
high-rate score-error gain over no transform (:func:`walshkv.ops.equalize.predicted_gain_db`'s objective,
``tr(P C) tr(P⁻¹ M)`` at its optimum over each family, condition cap left out):

* ``dense``: any ``A`` before RoPE (``eq+``): ``(tr (M^½ C M^½)^½)²``;
* ``diag``: one factor per channel before RoPE (``eqd+``): ``(Σ_c sqrt(C_cc M_cc))²``;
* ``pair``: one factor per channel pair, which commutes with RoPE (``eqr+``'s long-context limit):
  ``(Σ_j sqrt(tr C_j tr M_j))²``;
* ``pair+dense:m``: ``pair`` plus a dense transform on the ``m`` pairs that gain most from one (kept before RoPE,
  so a kernel would turn only ``2m`` channels per key);
* ``block:b``: a dense ``b x b`` transform per block of ``b`` channels before RoPE (block-diagonal; ``b`` multiply-adds
  per element per key, within ``O(head_dim log head_dim)`` for ``b <= log2 head_dim``), channels grouped in their
  natural order; ``pairblock:b``: the same with each block ``b/2`` whole rotary pairs (channels ``j`` and
  ``j + head_dim/2``), so RoPE's partner channels share a block. Optimum: ``(Σ_blocks tr (M_b^½ C_b M_b^½)^½)²``.

    python research/scripts/frame_gain.py --model smollm2-135m --json docs/results/long-context/frame-eqr/gain.json

The output records the code commit and the CPU (as every walshkv result does).
"""

from __future__ import annotations

import argparse
import sys

import torch

from walshkv.calibration import collect_kv_stats
from walshkv.data import load_text
from walshkv.eval.provenance import code_commit, cpu_meta
from walshkv.fileio import write_json_atomic, write_text_atomic
from walshkv.models import load_model

BLOCKS = (4, 8, 16)
FAMILIES = (
    "dense",
    "diag",
    "pair",
    "pair+dense:2",
    "pair+dense:4",
    "pair+dense:8",
    *(f"block:{b}" for b in BLOCKS),
    *(f"pairblock:{b}" for b in BLOCKS),
)


def _root_trace(c: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``tr (M^½ C M^½)^½``."""
    e, u = torch.linalg.eigh(m)
    mh = (u * e.clamp_min(0).sqrt()) @ u.T
    return torch.linalg.eigvalsh(mh @ c @ mh).clamp_min(0).sqrt().sum()


def family_gains_db(c: torch.Tensor, m: torch.Tensor) -> dict[str, float]:
    """The gain in dB of each family's best transform over none, for one kv head's ``C`` and ``M`` ``[d, d]``."""
    d = c.shape[-1]
    h = d // 2
    eye = torch.eye(d, dtype=torch.float64)
    c = c.to(torch.float64) + 1e-6 * c.trace() / d * eye
    m = m.to(torch.float64) + 1e-6 * m.trace() / d * eye
    base = c.trace() * m.trace()
    cd, md = c.diagonal(), m.diagonal()
    pair = ((cd[:h] + cd[h:]) * (md[:h] + md[h:])).sqrt()  # per pair: sqrt(tr C_j tr M_j)
    diag_pair = (cd[:h] * md[:h]).sqrt() + (cd[h:] * md[h:]).sqrt()
    errors = {"dense": _root_trace(c, m) ** 2, "diag": (cd * md).sqrt().sum() ** 2, "pair": pair.sum() ** 2}
    order = (pair - diag_pair).argsort(descending=True)
    for k in (2, 4, 8):
        chosen = order[:k]
        rest = torch.ones(h, dtype=torch.bool)
        rest[chosen] = False
        idx = torch.cat([chosen, chosen + h])
        errors[f"pair+dense:{k}"] = (pair[rest].sum() + _root_trace(c[idx][:, idx], m[idx][:, idx])) ** 2
    for b in BLOCKS:
        natural = [torch.arange(i, i + b) for i in range(0, d, b)]
        pairs = [torch.cat([torch.arange(j, j + b // 2), torch.arange(j, j + b // 2) + h]) for j in range(0, h, b // 2)]
        for name, groups in ((f"block:{b}", natural), (f"pairblock:{b}", pairs)):
            errors[name] = sum(_root_trace(c[g][:, g], m[g][:, g]) for g in groups) ** 2
    return {name: float(10 * torch.log10(base / err)) for name, err in errors.items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib-text", default="python-docs")
    ap.add_argument("--json", required=True, help="result file")
    ap.add_argument("--markdown", help="the summary as a markdown table")
    args = ap.parse_args(argv)
    lm = load_model(args.model)
    stats = collect_kv_stats(lm, load_text(args.calib_text), progress=False).pre_rope()
    per_head = []
    for layer in range(stats.num_layers):
        cov, qmom = stats.k_covariance(layer), stats.query_moment(layer)
        for head in range(stats.num_kv_heads):
            per_head.append({"layer": layer, "head": head, **family_gains_db(cov[head], qmom[head])})
    summary = {f: sum(r[f] for r in per_head) / len(per_head) for f in FAMILIES}
    cmd = "python research/scripts/frame_gain.py " + " ".join(argv)
    write_json_atomic(
        args.json,
        {
            "meta": {
                "command": cmd,
                "model": args.model,
                "calib_text": args.calib_text,
                "code": code_commit(),
                "cpu": cpu_meta(),
            },
            "mean_gain_db": summary,
            "per_head": per_head,
        },
    )
    print(" | ".join(f"{f} {summary[f]:.2f} dB" for f in FAMILIES))
    if args.markdown:
        lo = {f: min(r[f] for r in per_head) for f in FAMILIES}
        hi = {f: max(r[f] for r in per_head) for f in FAMILIES}
        lines = [
            f"{args.model}, moments before RoPE from {args.calib_text}, {len(per_head)} (layer, kv head) pairs; "
            f"code {code_commit()}; CPU {cpu_meta()['model']}. Produced by `{cmd}`.",
            "",
            "| family | folds into the query | mean gain (dB) | min | max |",
            "|---|---|---|---|---|",
        ]
        folds = {"dense": "no (d x d per key)", "diag": "no (per-key map)", "pair": "yes"}
        for f in FAMILIES:
            n = int(f.split(":")[1]) if ":" in f else 0
            if f in folds:
                how = folds[f]
            elif f.startswith("pair+dense"):
                how = f"no ({2 * n} channels turned per key)"
            else:
                how = f"no ({n} multiply-adds per element per key)"
            lines.append(f"| {f} | {how} | {summary[f]:.2f} | {lo[f]:.2f} | {hi[f]:.2f} |")
        write_text_atomic(args.markdown, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
