"""Every row of a ``walshkv eval`` result against one baseline row: mean KLD and the paired per-window difference.

    python research/scripts/paired_table.py RESULT.json --baseline SPEC --markdown OUT.md [--note TEXT]

The difference is the mean over windows of ``row - baseline`` with its bootstrap 95% interval
(:func:`walshkv.eval.metrics.paired_difference`, the protocol of the presets' verdicts): an interval above zero
says the row is worse than the baseline on those windows, below zero better, across zero undecided. The table
names the result file, its command, code commit and CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from walshkv.eval.metrics import paired_difference
from walshkv.fileio import write_text_atomic


def paired_markdown(result: dict, baseline: str, note: str = "", source: str = "") -> str:
    """The markdown table of every row of ``result`` against the row ``baseline``.

    Raises:
        ValueError: ``baseline`` is not a row of ``result`` (the message lists the rows).
    """
    rows = {r["codec"]: r for r in result["results"]}
    if baseline not in rows:
        raise ValueError(f"no row {baseline!r} in the result; rows: {', '.join(rows)}")
    meta = result["meta"]
    base = rows[baseline]
    commit = meta.get("versions", {}).get("commit", "?")
    cpu = (meta.get("cpu") or {}).get("model", "?")
    lines = [
        f"{source or 'result'}: `{meta.get('command', '?')}` (code {commit}, CPU {cpu}). "
        f"Paired per-window bootstrap of the mean KLD difference against `{baseline}`"
        f"{', ' + note if note else ''}.",
        "",
        "| codec | bits/el | mean KLD | 95% CI | minus baseline | 95% CI of the difference | verdict |",
        "|---|---|---|---|---|---|---|",
    ]
    for codec, r in rows.items():
        lo, hi = r.get("kld_mean_ci95") or [float("nan"), float("nan")]
        if codec == baseline:
            diff, verdict = "—", "baseline"
            ci = "—"
        else:
            paired = paired_difference(r.get("window_kld_mean"), base.get("window_kld_mean"))
            if paired is None:
                diff, ci, verdict = "—", "—", "no paired windows"
            else:
                mean, (a, b) = paired
                diff, ci = f"{mean:+.4f}", f"[{a:+.4f}, {b:+.4f}]"
                verdict = "worse" if a > 0 else "better" if b < 0 else "within the interval"
        lines.append(
            f"| `{codec}` | {r['bits_per_element']:.3f} | {r['kld_mean']:.4f} | [{lo:.4f}, {hi:.4f}] | {diff} | {ci} | "
            f"{verdict} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("result", help="a walshkv eval --json file")
    ap.add_argument("--baseline", required=True, help="the codec of the row every other row is compared with")
    ap.add_argument("--markdown", required=True, help="output file")
    ap.add_argument("--note", default="", help="a phrase appended to the table's caption")
    args = ap.parse_args(argv)
    result = json.loads(Path(args.result).read_text())
    try:
        text = paired_markdown(result, args.baseline, args.note, source=args.result)
    except ValueError as err:
        raise SystemExit(f"paired_table.py: error: {err}") from None
    write_text_atomic(args.markdown, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
