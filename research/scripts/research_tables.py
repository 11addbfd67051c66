"""Tables and verdicts of research/README.md, computed from the result files of research/reproduce.sh.

Usage (from the repository root):
       python research/scripts/research_tables.py [RESULTS_DIR] > docs/results/research/summary.md
       python scripts/update_readme.py docs/results/research/summary.md research/README.md
Models whose result folders are missing are left out (and said so).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tabulate import tabulate

MODELS = ("smollm2-135m", "qwen2.5-1.5b")
LABELS = {"k_post": "K after RoPE", "k_pre": "K before RoPE", "v": "V"}
SIGNALS = ("k_post", "k_pre", "v", "prime-harmonic", "chirp", "noise")
MARGIN = 0.002  # a correlation must be higher by more than this to count as "beats"


def _load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _verdict(holds: bool) -> str:
    return "**holds**" if holds else "**does not hold**"


def _md(rows: list[list[str]], headers: list[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True)


def _rope(name: str, res: dict[str, Any]) -> list[str]:
    rows = res["results"]
    meta = res["meta"]
    cols = [(g, c) for c in ("divide", "multiply") for g in ("composite", "prime")]
    cols = [gc for gc in cols if any((r["generator"], r["convention"]) == gc for r in rows)]
    by = {(r["generator"], r["convention"], r["alpha"]): r for r in rows if r["codec"] == "none"}
    ref = by.get(("none", "none", 0.0))
    alphas = sorted({r["alpha"] for r in rows})
    body = []
    for a in alphas:
        cells = []
        for g, c in cols:
            r = ref if a == 0.0 else by.get((g, c, a))
            cells.append(
                "" if r is None else f"{r['ppl_ratio']:.4f} ({r['kld_mean']:.3g}, {100 * r['top1_agreement']:.0f}%)"
            )
        body.append([f"{a:g}", *cells])
    out = [
        f"**{name}**, pairing `{meta['pairing']}`: {meta['windows']} windows x {meta['ctx']} tokens of "
        f"{meta['text']['name']}, {meta['scored_tokens']:,} scored tokens; reference PPL "
        f"{ref['ppl'] if ref else float('nan'):.3f}. Cells: PPL ratio (mean KLD, top-1 agreement) against the "
        f"unmodified model. `{meta['command']}`",
        "",
        _md(body, ["alpha", *[f"{g} / {c}" for g, c in cols]]),
        "",
    ]
    mod = [r for r in rows if r["codec"] == "none" and r["generator"] != "none"]
    mid = [r for r in mod if r["alpha"] in (0.15, 0.2)]
    high = [r for r in mod if r["alpha"] >= 0.5]
    one = [r for r in mod if r["alpha"] == 1.0]
    if mid:
        best = min(mid, key=lambda r: r["ppl_ratio"])
        out.append(
            f'- Claim "alpha 0.15-0.20 improves perplexity with no retraining" (document: 11.03 -> 10.91 at 0.20, '
            f"x0.989): best here {best['generator']}/{best['convention']} at alpha {best['alpha']:g}, PPL x"
            f"{best['ppl_ratio']:.4f}, KLD {best['kld_mean']:.3g}: {_verdict(best['ppl_ratio'] < 1.0)}."
        )
    if mod:
        top = min(mod, key=lambda r: r["ppl_ratio"])
        out.append(
            f"- Lowest perplexity at any alpha: x{top['ppl_ratio']:.4f} ({top['generator']}/{top['convention']} at "
            f"alpha {top['alpha']:g}; KLD {top['kld_mean']:.3g}, top-1 {100 * top['top1_agreement']:.1f}%)"
            + (
                ": below the unmodified model, on this text and these tokens only."
                if top["ppl_ratio"] < 1.0
                else ": never below the unmodified model."
            )
        )
    if high:
        least = min(high, key=lambda r: r["ppl_ratio"])
        out.append(
            f'- Claim "alpha 0.5 and above hurts": the mildest such row is x{least["ppl_ratio"]:.4f} '
            f"({least['generator']}/{least['convention']} at {least['alpha']:g}): {_verdict(least['ppl_ratio'] > 1.0)}."
        )
    if one:
        near = min(one, key=lambda r: abs(r["ppl_ratio"] / (94.8 / 11.03) - 1))
        out.append(
            '- Claim "alpha 1.0 gives PPL 94.8" (x8.6 on the document\'s model): here '
            + ", ".join(f"{r['generator']}/{r['convention']} x{r['ppl_ratio']:.3g}" for r in one)
            + f"; closest to the document's x8.6: {near['generator']}/{near['convention']}"
            + (
                " (within 30% of the document's ratio, on another model: a hint, not a proof, of the "
                "convention its numbers used)."
                if abs(near["ppl_ratio"] / (94.8 / 11.03) - 1) <= 0.3
                else " (not within 30%)."
            )
        )
    return [*out, ""]


def _check(name: str, res: dict[str, Any]) -> list[str]:
    meta = res["meta"]
    body = []
    for r in res["results"]:
        lo, hi = r.get("ppl_ratio_ci95") or (float("nan"), float("nan"))
        body.append(
            [
                r["generator"],
                r["convention"],
                f"{r['alpha']:g}",
                f"{r['ppl_ratio']:.4f}",
                f"{lo:.4f} .. {hi:.4f}",
                f"{r['kld_mean']:.4g}",
                f"{100 * r['top1_agreement']:.1f}%",
            ]
        )
    gains = [r for r in res["results"] if r["generator"] != "none" and (r.get("ppl_ratio_ci95") or [2, 2])[1] < 1.0]
    return [
        f"**{name}** on {meta['text']['name']} ({meta['windows']} windows, {meta['scored_tokens']:,} scored tokens); "
        f"`{meta['command']}`",
        "",
        _md(body, ["generator", "convention", "alpha", "PPL ratio", "95% interval (paired tokens)", "KLD", "top-1"]),
        "",
        "- A perplexity gain whose whole 95% interval lies below 1: "
        + (", ".join(f"alpha {r['alpha']:g}" for r in gains) if gains else "none")
        + ".",
        "",
    ]


def _codec(name: str, res: dict[str, Any]) -> list[str]:
    rows = res["results"]
    codec = res["meta"]["codecs"][0]
    idx = {(r["generator"], r["convention"], r["alpha"], r["codec"]): r for r in rows}
    alone = idx[("none", "none", 0.0, codec)]["kld_mean"]
    body = []
    for r in rows:
        if r["generator"] == "none" or r["codec"] != codec:
            continue
        pe = idx[(r["generator"], r["convention"], r["alpha"], "none")]["kld_mean"]
        body.append(
            [
                r["generator"],
                f"{r['alpha']:g}",
                f"{pe:.4f}",
                f"{alone:.4f}",
                f"{r['kld_mean']:.4f}",
                f"{pe + alone:.4f}",
                f"{r['kld_mean'] / (pe + alone):.2f}",
            ]
        )
    return [
        f"**{name}**, PrimePE ({res['meta']['pairing']} pairing, divide) composed with `{codec}`; "
        f"{res['meta']['windows']} windows; `{res['meta']['command']}`",
        "",
        _md(
            body,
            [
                "generator",
                "alpha",
                "KLD PrimePE alone",
                f"KLD {codec} alone",
                "KLD both",
                "sum of the two",
                "both / sum",
            ],
        ),
        "",
    ]


def _spectrum(name: str, res: dict[str, Any]) -> list[str]:
    rows = res["results"]
    meta = res["meta"]
    bands = rows[0]["bands"]
    body = []
    for r in rows:
        body.append(
            [
                LABELS[r["kind"]],
                r["order"],
                " / ".join(f"{100 * v:.1f}" for v in r["band_share"]),
                f"{r['flatness']:.3f}",
                f"{100 * r['frac90_wht']:.1f}%",
                f"{100 * r['frac90_identity']:.1f}%",
            ]
        )
    get = {(r["kind"], r["order"]): r for r in rows}
    kpost, kpre, v = get[("k_post", "sequency")], get[("k_pre", "sequency")], get[("v", "sequency")]
    flat = 1.0 / bands
    out = [
        f"**{name}**: {meta['windows']} windows x {meta['ctx']} tokens of {meta['text']['name']} "
        f"({meta['tokens']:,} vectors per layer and head), {bands} bands, K channel order {meta['channel_order']}; "
        f"`{meta['command']}`",
        "",
        _md(body, ["vectors", "order", "energy % per band", "flatness", "coeffs for 90% energy: WHT", "channels"]),
        "",
        '- Claim "K\'s WHT energy sits in the first bands": first sequency band holds '
        f"{100 * kpost['first_band_share']:.1f}% "
        f"of K's energy (flat: {100 * flat:.0f}%; threshold for 'holds': twice flat): "
        f"{_verdict(kpost['first_band_share'] >= 2 * flat)}.",
        f'- "... because of RoPE": before RoPE the first band holds {100 * kpre["first_band_share"]:.1f}%, and K is '
        f"{'flatter' if kpost['flatness'] > kpre['flatness'] else 'less flat'} after RoPE "
        f"(flatness {kpre['flatness']:.3f} -> {kpost['flatness']:.3f}): "
        f"{_verdict(kpost['first_band_share'] > kpre['first_band_share'] and kpost['flatness'] < kpre['flatness'])}.",
        f"- \"V's WHT energy is flat\": V's flatness {v['flatness']:.3f}, first band "
        f"{100 * v['first_band_share']:.1f}%: "
        f"{_verdict(v['flatness'] >= 0.9 and abs(v['first_band_share'] - flat) <= 0.2 * flat)}; "
        f"V is {'flatter' if v['flatness'] > kpost['flatness'] else 'less flat'} than K.",
        f'- "43% of the WHT coefficients hold 90% of K\'s energy": here {100 * kpost["frac90_wht"]:.1f}% per vector on '
        f"average (in plain channels: {100 * kpost['frac90_identity']:.1f}%).",
        "",
    ]
    return out


def _reconstruct(name: str, res: dict[str, Any]) -> list[str]:
    rows = res["results"]
    meta = res["meta"]
    idx = {(r["signal"], r["basis"], r["mode"], r["fraction"]): r for r in rows}
    bases = list(dict.fromkeys(r["basis"] for r in rows))
    out = [
        f"**{name}**: {meta['windows']} windows x {meta['ctx']} tokens of {meta['text']['name']}, "
        f"{meta['vectors_per_head']} vectors per (layer, kv-head); synthetic {meta['synthetic_vectors']} vectors "
        f"per kind; `{meta['command']}`. Cells: correlation (relative MSE).",
        "",
    ]
    for f in (0.43, 0.5):
        body = []
        for s in SIGNALS:
            cells = []
            for b in bases:
                r = idx.get((s, b, "topk", f))
                cells.append("" if r is None else f"{r['correlation']:.3f} ({r['relative_mse']:.3f})")
            body.append([LABELS.get(s, s), *cells])
        out += [f"Largest {f:g} of the coefficients per vector (topk):", "", _md(body, ["signal", *bases]), ""]
    body = []
    for s in SIGNALS:
        cells = []
        for m, f in (("fixed", 0.5), ("signs", None), ("signs+amp", None)):
            r = idx.get((s, "walsh", m, f))
            cells.append("" if r is None else f"{r['correlation']:.3f} ({r['relative_mse']:.3f})")
        body.append([LABELS.get(s, s), *cells])
    out += [
        "Walsh-Hadamard basis, other codes:",
        "",
        _md(body, ["signal", "fixed top-energy half", "signs (one amplitude per vector)", "signs + amplitude profile"]),
        "",
    ]
    w = idx.get(("k_post", "walsh", "topk", 0.43))
    fo = idx.get(("k_post", "fourier", "topk", 0.43))
    best = max(
        (idx[k] for k in idx if k[0] == "k_post" and k[2] == "topk" and k[3] == 0.43), key=lambda r: r["correlation"]
    )
    if w and fo:
        out.append(
            f'- Claim "keeping 43% of K\'s WHT coefficients reconstructs with correlation 0.948, Fourier 0.15": '
            f"WHT {w['correlation']:.3f}, Fourier {fo['correlation']:.3f} (best basis: {best['basis']} "
            f"{best['correlation']:.3f}). WHT's 0.948: {_verdict(abs(w['correlation'] - 0.948) < 0.02)}; "
            f"Fourier far below WHT: {_verdict(fo['correlation'] < w['correlation'] - 0.2)}."
        )
    if w:
        others = [idx[k] for k in idx if k[0] == "k_post" and k[2] == "topk" and k[3] == 0.43 and k[1] != "walsh"]
        beaten_by = [r["basis"] for r in others if r["correlation"] > w["correlation"] + MARGIN]
        out.append(
            '- "K is a Walsh signal" (WHT reconstructs K at 43% better than the other bases): bases better than '
            f"WHT by more than {MARGIN} in correlation: {', '.join(beaten_by) or 'none'}: {_verdict(not beaten_by)}."
        )
    sa, sg = idx.get(("k_post", "walsh", "signs+amp", None)), idx.get(("k_post", "walsh", "signs", None))
    if sa and sg:
        close = abs(sa["correlation"] - 0.692) < 0.05 and abs(sg["correlation"] - 0.521) < 0.05
        out.append(
            '- Claim "sign pattern + amplitudes 0.692, pure signs 0.521": here '
            f"{sa['correlation']:.3f} and {sg['correlation']:.3f} (K after RoPE, WHT; amplitudes read as a "
            f"per-position profile). Amplitudes help: {_verdict(sa['correlation'] > sg['correlation'])}; the "
            f"values (within 0.05): {_verdict(close)}."
        )
    pad = next((b for b in bases if b.startswith("vilenkin:") and any(p in b for p in ("3", "5"))), None)

    def beats(s: str, basis: str) -> bool:
        return idx[(s, basis, "topk", 0.5)]["correlation"] > idx[(s, "walsh", "topk", 0.5)]["correlation"] + MARGIN

    if pad:
        wins = [s for s in SIGNALS if (s, pad, "topk", 0.5) in idx and beats(s, pad)]
        out.append(
            f'- Claim "a Vilenkin basis beats Walsh on every signal type" ({pad}, same number of kept coefficients, '
            f"f = 0.5, by more than {MARGIN} in correlation): beats Walsh on "
            f"{', '.join(LABELS.get(s, s) for s in wins) or 'none'}; {_verdict(len(wins) == len(SIGNALS))}."
        )
    r4 = next((b for b in bases if b.startswith("vilenkin:") and b != pad), None)
    if r4:
        wins = [s for s in SIGNALS if beats(s, r4)]
        out.append(
            f"- The exact-length {r4} (no padding) beats Walsh by more than {MARGIN} on: "
            f"{', '.join(LABELS.get(s, s) for s in wins) or 'none'}."
        )
    lll = meta.get("lll")
    if lll:
        body = [
            [
                LABELS[k],
                f"{r['blocks']} x {r['rows']} x {r['head_dim']}, {r['code_bits']}-bit",
                f"{r['norm_ratio_mean']:.3f}",
                f"{r['entry_bits_before']:.2f} -> {r['entry_bits_after']:.2f}",
                f"{r['entry_bits_u']:.2f}",
                f"{r['storage_ratio']:.3f}",
            ]
            for k, r in lll.items()
        ]
        out += [
            "",
            "LLL (fpylll, delta 0.99) on blocks of quantized WHT index vectors of K:",
            "",
            _md(
                body,
                [
                    "vectors",
                    "blocks x rows x dim",
                    "row norm after/before",
                    "entry bits",
                    "U entry bits",
                    "storage after (with U) / before",
                ],
            ),
        ]
    return [*out, ""]


def main(root: str = "docs/results/research") -> None:
    base = Path(root)
    parts: list[str] = ["<!-- generated by research/scripts/research_tables.py; do not edit by hand -->", ""]
    missing = []
    sections = (
        ("### PrimePE: alpha sweep", lambda m: [(_rope, f"rope-{m}-published/rope.json")]),
        (
            "### PrimePE: qwen2.5-1.5b's small-alpha gain, on other text",
            lambda m: [(_check, f"rope-{m}-check/rope.json")] if m == "qwen2.5-1.5b" else [],
        ),
        (
            "### PrimePE: the matched pairing",
            lambda m: [(_rope, f"rope-{m}-matched/rope.json")] if m == MODELS[0] else [],
        ),
        ("### PrimePE with a KV codec", lambda m: [(_codec, f"rope-{m}-codec/rope.json")] if m == MODELS[0] else []),
        ("### K and V spectra in the Walsh basis", lambda m: [(_spectrum, f"spectrum-{m}/spectrum.json")]),
        (
            "### Reconstruction from part of the coefficients",
            lambda m: [(_reconstruct, f"reconstruct-{m}/reconstruct.json")],
        ),
    )
    for title, files in sections:
        body: list[str] = []
        for model in MODELS:
            for fn, rel in files(model):
                res = _load(base / rel)
                if res is None:
                    missing.append(rel)
                    continue
                body += fn(model, res)
        if body:
            parts += [title, "", *body]
    if missing:
        parts += ["Not run yet (no result file): " + ", ".join(f"`{m}`" for m in missing), ""]
    print("\n".join(parts).rstrip() + "\n")


if __name__ == "__main__":
    main(*sys.argv[1:])
