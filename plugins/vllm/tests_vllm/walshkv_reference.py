"""walshkv's side of the end-to-end check (test_engine.py): run in walshkv's own environment, not vLLM's.

vLLM pins a transformers older than walshkv needs, so the test runs this file with the main environment's Python
(``$WALSHKV_MAIN_PYTHON``, default ``.venv/bin/python`` at the repository root) and reads one JSON object from its
last output line:

    python walshkv_reference.py '{"model": "smollm2-135m", "spec": "rot+int4", "text": "...", "new_tokens": 8,
                                  "slots_out": "/tmp/x.pt"}'

For the text's tokens it returns the model's float copy (the Hugging Face folder vLLM loads), the token ids, and
for each cache (``exact`` and ``quantized``: walshkv's ``CompressedCache`` with that spec and that prefill;
``uncompressed``: transformers' own cache) the prompt's logprobs (of token ``i`` given the tokens before it) and
a greedy continuation of ``new_tokens`` tokens, one forward per token, with each chosen token's logprob and its
margin over the runner-up (nats). float32 throughout, as vLLM runs the model in the test. ``slots_out``: where
to save (``torch.save``) what the ``exact`` cache stores for the prompt, as the plugin's page slots
(``uint8 [layers, tokens, kv_heads, slot_bytes]``, :class:`walshkv_vllm.layout.SlotLayout`; with ``sink:N:`` the
packed positions ``N ..`` only). A preset name as ``spec`` (``walshkv:3.5-fast``) is the model's own preset with the
calibration the package ships (``CompressedCache.from_preset``). ``runs`` (optional): which of the three to run.
"""

from __future__ import annotations

import json
import sys
import warnings
from typing import Any

MODEL = "smollm2-135m"
NEW_TOKENS = 8
#: Prose, then code whose continuation the model is sure of: 142 tokens whose logprobs carry the codec's effect,
#: then 8 greedy tokens with margins of 4+ nats over the runner-up (no near tie that float rounding could flip).
TEXT = (
    "Python is an easy to learn, powerful programming language. It has efficient high-level data structures and a "
    "simple but effective approach to object-oriented programming. A function is defined with the keyword def, "
    "followed by its name and its parameters in parentheses. The two functions below compute Fibonacci numbers and "
    "factorials recursively:\n\n"
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\n"
    'def factorial(n):\n    """Return n factorial."""\n    if n == 0:\n        return 1\n    return n *'
)


def _run(model: Any, ids: Any, cache: Any, new_tokens: int, after_prompt: Any = None) -> dict[str, list]:
    import torch

    with torch.inference_mode():
        out = model(input_ids=ids, cache=cache, use_cache=True)
        if after_prompt is not None:
            after_prompt(cache)
        logp = torch.log_softmax(out.logits[0].double(), dim=-1)
        prompt = [float(logp[i - 1, ids[0, i]]) for i in range(1, ids.shape[1])]
        tokens, token_logprobs, margins = [], [], []
        last = logp[-1]
        for step in range(new_tokens):
            top = torch.topk(last, 2)
            token = int(top.indices[0])
            tokens.append(token)
            token_logprobs.append(float(top.values[0]))
            margins.append(float(top.values[0] - top.values[1]))
            if step + 1 == new_tokens:
                break
            out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
            last = torch.log_softmax(out.logits[0, -1].double(), dim=-1)
    return {"prompt_logprobs": prompt, "tokens": tokens, "token_logprobs": token_logprobs, "margins": margins}


def _slots(cache: Any, tokens: int, head_dim: int) -> Any:
    """What each layer of ``cache`` holds for the first ``tokens`` positions, as page slots ``[L, T, H, S]`` (the
    packed positions: ``T - N`` of them after ``sink:N:``'s fp16 rows)."""
    import torch

    from walshkv_vllm.layout import SlotLayout

    rows = []
    for layer in cache.layers:
        pk, pv = layer.packed_k, layer.packed_v
        layout = SlotLayout.of(layer.spec.k, layer.spec.v, head_dim, pk.num_heads)
        rows.append(layout.to_bytes(pk, pv)[0, :, : tokens - layer.sink].transpose(0, 1).contiguous())
    return torch.stack(rows)


def main(request: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import DynamicCache
    from walshkv.cache import CompressedCache
    from walshkv.models import float_copy, load_model
    from walshkv.presets import is_preset

    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = float_copy(request["model"], progress=False)
        lm = load_model(request["model"], progress=False)
    ids = torch.tensor([lm.tokenizer(request["text"], add_special_tokens=True)["input_ids"]])
    config, spec, n = lm.model.config, request["spec"], request["new_tokens"]

    def save_slots(cache: Any) -> None:
        if request.get("slots_out"):
            torch.save(_slots(cache, ids.shape[1], lm.shape.head_dim), request["slots_out"])

    def cache(prefill: str) -> Any:
        if is_preset(spec):
            return CompressedCache.from_preset(lm.model, spec, prefill=prefill)
        return CompressedCache(spec, config=config, prefill=prefill)

    wanted = request.get("runs", ["exact", "quantized", "uncompressed"])
    runs = {}
    if "exact" in wanted:
        runs["exact"] = _run(lm.model, ids, cache("exact"), n, save_slots)
    if "quantized" in wanted:
        runs["quantized"] = _run(lm.model, ids, cache("quantized"), n)
    if "uncompressed" in wanted:
        runs["uncompressed"] = _run(lm.model, ids, DynamicCache(config=config), n)
    return {"model_dir": str(folder), "token_ids": ids[0].tolist(), "runs": runs}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
