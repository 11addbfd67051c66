"""Tables (stdout, markdown), JSON and CSV for evaluation results."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from tabulate import tabulate

__all__ = ["TABLE_COLUMNS", "decode_note", "format_table", "write_csv", "write_json", "write_markdown"]

# (key, header, format)
TABLE_COLUMNS: list[tuple[str, str, str]] = [
    ("codec", "codec", "{}"),
    ("bits_per_element", "bits/el", "{:.3f}"),
    ("compression", "x vs fp16", "{:.2f}"),
    ("kld_mean", "mean KLD", "{:.6f}"),
    ("kld_p99", "KLD p99", "{:.4f}"),
    ("top1_agreement", "same top-1 %", "{:.2%}"),
    ("ppl_ratio", "PPL ratio", "{:.4f}"),
    ("kv_bytes", "KV bytes/window", "{:,}"),
]


def _rows(results: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for r in results:
        row = []
        for key, _, fmt in TABLE_COLUMNS:
            text = fmt.format(r[key])
            if key == "codec" and r.get("feed") == "decode":
                text += " †"
            row.append(text[:-1] if key == "top1_agreement" else text)
        rows.append(row)
    return rows


def format_table(results: list[dict[str, Any]], fmt: str = "simple") -> str:
    """Render results as a table (``fmt``: any tabulate format, e.g. ``github``)."""
    return tabulate(_rows(results), headers=[h for _, h, _ in TABLE_COLUMNS], tablefmt=fmt, disable_numparse=True)


def describe_run(meta: dict[str, Any]) -> str:
    """One paragraph stating model, text, windows and scored positions."""
    m, t = meta["model"], meta["text"]
    return (
        f"Model {m['name']} ({m['arch']}, head_dim {m['head_dim']}, {m['layers']} layers, "
        f"{m['kv_heads']} KV heads); text {t['name']} ({t['tokens']:,} tokens); {meta['windows']} windows of "
        f"{meta['ctx']} tokens, {meta['scored_positions']}; {meta['scored_tokens']:,} scored tokens; "
        f"reference: {meta['reference']}; full-precision window: {meta['residual']} tokens."
    )


def decode_note(results: list[dict[str, Any]]) -> str:
    """A footnote for rows marked † (fed token by token), or ``""`` when there are none."""
    rows = [r for r in results if r.get("feed") == "decode"]
    if not rows:
        return ""
    parts = []
    for r in rows:
        window = f"full-precision window {r['fp_window']} tokens, " if "fp_window" in r else ""
        parts.append(
            f"{r['codec']}: {window}{r['fp_context_mean']:.1%} of attended positions in full precision on average, "
            f"{r['scored_quantized_context_share']:.1%} of scored tokens saw only quantized earlier context"
        )
    return (
        "† fed as in generation: the unscored prefix in one forward, then one forward per scored token "
        "(Hugging Face's QuantizedCache returns its first write unquantized, so one forward per window "
        "would measure nothing). Bits per element are measured from the bytes held after the window, "
        "scales, zero points and the full-precision window counted at 16 bits. " + "; ".join(parts) + "."
    )


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def write_csv(path: str | Path, results: list[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in results:
        keys.extend(k for k in r if k not in keys)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(results)


def write_markdown(path: str | Path, meta: dict[str, Any], results: list[dict[str, Any]], command: str) -> None:
    note = decode_note(results)
    body = f"{describe_run(meta)}\n\nProduced by `{command}`.\n\n{format_table(results, 'github')}\n"
    if note:
        body += f"\n{note}\n"
    Path(path).write_text(body)
