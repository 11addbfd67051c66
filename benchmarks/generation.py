"""Greedy generation with CompressedCache vs DynamicCache: cache bytes and tokens per second.

    python benchmarks/generation.py --model smollm2-135m --codec rot+int4 --new-tokens 2000 --json out.json

Reports the compressed cache's measured bytes against an fp16 cache of the same tokens, and the
decode speed of both caches measured in the same run (a ratio, since machines are noisy).
Not imported by the package.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import DynamicCache

from walshkv import CompressedCache
from walshkv.data import load_text
from walshkv.models import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--codec", default="rot+int4")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=2000)
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args()

    lm = load_model(args.model, progress=False)
    ids = lm.tokenizer(load_text().content[:4000], return_tensors="pt").input_ids[:, : args.prompt_tokens]
    gen = {"max_new_tokens": args.new_tokens, "min_new_tokens": args.new_tokens, "do_sample": False}
    out: dict[str, object] = {"model": args.model, "codec": args.codec, "prompt_tokens": ids.shape[1], **gen}
    with torch.inference_mode():
        ref_cache = DynamicCache(config=lm.model.config)
        t0 = time.perf_counter()
        ref = lm.model.generate(ids, cache=ref_cache, **gen)
        t_ref = time.perf_counter() - t0
        cache = CompressedCache(args.codec, config=lm.model.config)
        t0 = time.perf_counter()
        got = lm.model.generate(ids, cache=cache, **gen)
        t_codec = time.perf_counter() - t0
    n_new = got.shape[1] - ids.shape[1]
    same = (ref[0, ids.shape[1] :] == got[0, ids.shape[1] :]).int()
    first_diff = int((same == 0).nonzero()[0]) if (same == 0).any() else n_new
    out.update(
        {
            "cache_tokens": cache.get_seq_length(),
            "nbytes": cache.nbytes(),
            "layout_nbytes": cache.layout_nbytes(),
            "fp16_nbytes": cache.fp16_nbytes(),
            "ratio_vs_fp16": cache.nbytes() / cache.fp16_nbytes(),
            "bits_per_element": cache.bits_per_element(),
            "tokens_per_s_dynamic_fp32": n_new / t_ref,
            "tokens_per_s_compressed": n_new / t_codec,
            "speed_ratio_compressed_vs_dynamic": t_ref / t_codec,
            "tokens_identical_to_uncompressed_before_first_difference": first_diff,
        }
    )
    print(json.dumps(out, indent=2))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)


if __name__ == "__main__":
    main()
