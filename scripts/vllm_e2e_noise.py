#!/usr/bin/env python3
"""How far float rounding alone moves walshkv's own logprobs: the yardstick of the vLLM end-to-end tolerances.

plugins/vllm/tests_vllm/test_engine.py compares vLLM (float32 kernels of its own) with walshkv's CompressedCache
(transformers' float32 kernels) on one text. The two differ in the last bits; this script measures what a change
of that size does to walshkv alone. It multiplies every weight of smollm2-135m by ``1 + eps * N(0, 1)`` (a relative
``eps``, default 1e-6: it moves the exact-prefill prompt logprobs about as much as vLLM differs from transformers)
and reruns the test's checks against the unperturbed model, with the test's spec, text and greedy length:

    python scripts/vllm_e2e_noise.py [--eps 1e-6] [--seeds 4]

Per seed: the exact-prefill prompt logprobs' shift, the greedy tokens (same or not) and their logprobs' shift, the
quantize-on-write prompt logprobs' shift token by token, and the codec's mean / mean absolute effect on the prompt
(against the uncompressed model) next to the unperturbed one's. Run it in walshkv's own environment.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins" / "vllm" / "tests_vllm"))

from walshkv_reference import MODEL, NEW_TOKENS, TEXT, _run  # the test's own walshkv side

SPEC = "rot+int4"


def _shift(a: list[float], b: list[float]) -> tuple[float, float]:
    d = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return max(d), sum(d) / len(d)


def _effect(a: list[float], base: list[float]) -> tuple[float, float]:
    e = [x - y for x, y in zip(a, base, strict=True)]
    return sum(e) / len(e), sum(abs(x) for x in e) / len(e)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=float, default=1e-6, help="relative weight perturbation")
    ap.add_argument("--seeds", type=int, default=4)
    args = ap.parse_args()
    from transformers import DynamicCache

    from walshkv.cache import CompressedCache
    from walshkv.models import load_model

    torch.set_num_threads(1)
    lm = load_model(MODEL, progress=False)
    model, config = lm.model, lm.model.config
    ids = torch.tensor([lm.tokenizer(TEXT)["input_ids"]])

    def runs() -> dict[str, dict[str, list]]:
        return {
            p: _run(model, ids, CompressedCache(SPEC, config=config, prefill=p), NEW_TOKENS)
            for p in ("exact", "quantized")
        }

    unc = _run(model, ids, DynamicCache(config=config), NEW_TOKENS)["prompt_logprobs"]
    base = runs()
    base_effect = _effect(base["quantized"]["prompt_logprobs"], unc)
    print(
        f"{MODEL}, {SPEC}, {ids.shape[1]} tokens, weights x (1 + {args.eps:g} N(0,1)); unperturbed quantize-on-write "
        f"effect on the prompt: mean {base_effect[0]:+.4f}, mean |.| {base_effect[1]:.4f}\n"
    )
    print(
        "| seed | exact prompt shift max / mean | greedy same | greedy logprob shift max | quantize-on-write prompt "
        "shift max / mean | effect mean / mean abs. (change) |"
    )
    print("|---|---|---|---|---|---|")
    saved = [p.detach().clone() for p in model.parameters()]
    for seed in range(1, args.seeds + 1):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + args.eps * torch.randn(p.shape, generator=gen))
        r = runs()
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved, strict=True):
                p.copy_(s)
        ex = _shift(r["exact"]["prompt_logprobs"], base["exact"]["prompt_logprobs"])
        same = r["exact"]["tokens"] == base["exact"]["tokens"]
        greedy = _shift(r["exact"]["token_logprobs"], base["exact"]["token_logprobs"])[0] if same else float("nan")
        qw = _shift(r["quantized"]["prompt_logprobs"], base["quantized"]["prompt_logprobs"])
        eff = _effect(r["quantized"]["prompt_logprobs"], unc)
        change = abs(eff[1] - base_effect[1]) / base_effect[1]
        print(
            f"| {seed} | {ex[0]:.1e} / {ex[1]:.1e} | {same} | {greedy:.1e} | {qw[0]:.3f} / {qw[1]:.3f} | "
            f"{eff[0]:+.4f} / {eff[1]:.4f} ({change:.0%}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
