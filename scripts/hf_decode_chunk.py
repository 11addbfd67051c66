"""How much feeding N tokens per forward flatters Hugging Face's QuantizedCache (docs/baselines.md).

Usage: python scripts/hf_decode_chunk.py ROWS_DIR CHUNKED.json >> tables.md

ROWS_DIR holds the peers sweep's row files (hf-* rows fed one token per forward); CHUNKED.json is
`walshkv eval --feed decode --decode-chunk N` of the same caches on the same windows.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(rows_dir: str, chunked: str) -> int:
    one = {}
    for path in sorted(Path(rows_dir).glob("hf-*.json")):
        record = json.loads(path.read_text())
        one[record["result"]["codec"]] = record["result"]
    run = json.loads(Path(chunked).read_text())
    many = {r["codec"]: r for r in run["results"]}
    n = next(iter(many.values()))["decode_chunk"]
    meta = run["meta"]
    print(f"### Hugging Face's cache fed 1 against {n} tokens per forward\n")
    print(
        f"{meta['model']['name']} on {meta['text']['name']}, {meta['windows']} windows of {meta['ctx']} tokens, "
        f"{meta['scored_tokens']:,} scored tokens. One token per forward: the peers sweep's rows; {n} per "
        f"forward: `{meta.get('command', '')}`; table by `python scripts/hf_decode_chunk.py`. "
        "'fp context': mean share of the positions a scored token attended to that were full precision; "
        "'only quantized': share of scored tokens whose every earlier position was quantized.\n"
    )
    head = ["codec", "bits/el"]
    for k in (1, n):
        head += [f"mean KLD ({k}/fwd)", f"fp context ({k}/fwd)", f"only quantized ({k}/fwd)"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for codec, r1 in one.items():
        rn = many.get(codec)
        if rn is None:
            continue
        cells = [f"`{codec}`", f"{r1['bits_per_element']:.3f}"]
        for r in (r1, rn):
            share = r["scored_quantized_context_share"]
            cells += [f"{r['kld_mean']:.6f}", f"{r['fp_context_mean']:.1%}", f"{share:.1%}"]
        print("| " + " | ".join(cells) + " |")
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
