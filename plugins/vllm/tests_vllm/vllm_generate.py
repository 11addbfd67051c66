"""vLLM's side of the end-to-end check (test_engine.py): one engine, one prompt, in a process of its own.

vLLM keeps global state (its plugins load once per process, the ``WALSHKV_VLLM_*`` variables are read when the
engine starts), so each engine configuration runs in a fresh process, started with the plugin environment's Python:

    python vllm_generate.py '{"model": FOLDER, "kv_cache_dtype": "walshkv_rot_int4", "token_ids": [...],
                              "new_tokens": 8, "slots_out": "/tmp/y.pt"}'

It starts ``vllm.LLM`` on the model folder (float32, eager, a small ``max_model_len``, the engine core in this
process), asks for the prompt's logprobs and a greedy continuation of ``new_tokens`` tokens (EOS ignored), and
prints one line ``RESULT {json}``: the prompt's logprobs (of token ``i`` given the tokens before it), the generated
tokens and their logprobs, and the cache vLLM allocated. ``slots_out`` (walshkv dtypes): where to save what the
backend wrote into its pages for the prompt, read back from the pages through the step's slot mapping
(``uint8 [layers, tokens, kv_heads, slot_bytes]``). The caller sets the environment (``WALSHKV_VLLM_CPU``,
``WALSHKV_VLLM_PREFILL``).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

#: Offline, small and in one process; set before vLLM reads its environment.
ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process: one start-up, and the pages in reach
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # do not pin threads to cores (CI and shared machines)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def _capture_prompt_slots(prompt_len: int) -> dict[str, Any]:
    """Record, per layer, what the walshkv backend's cache update wrote for a whole-prompt step."""
    from walshkv_vllm import vllm_backend

    written: dict[str, Any] = {}
    update = vllm_backend.WalshKVAttentionImpl.do_kv_cache_update

    def recording(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slot_mapping: Any) -> None:
        update(self, layer, key, value, kv_cache, slot_mapping)
        slots = slot_mapping.long()
        if slots.shape[0] == prompt_len and kv_cache.numel() and bool((slots >= 0).all()):
            pages = self._pages(kv_cache)  # [blocks, block_size, kv_heads, slot_bytes]
            written[layer.layer_name] = pages[slots // pages.shape[1], slots % pages.shape[1]].clone()

    vllm_backend.WalshKVAttentionImpl.do_kv_cache_update = recording  # type: ignore[method-assign]
    return written


def main(request: dict[str, Any]) -> dict[str, Any]:
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ids = list(request["token_ids"])
    written = _capture_prompt_slots(len(ids)) if request.get("slots_out") else None
    llm = LLM(
        model=request["model"],
        kv_cache_dtype=request["kv_cache_dtype"],
        dtype="float32",
        enforce_eager=True,
        max_model_len=request.get("max_model_len", 256),
        max_num_seqs=1,
        seed=0,
    )
    params = SamplingParams(
        max_tokens=request["new_tokens"], temperature=0.0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
    assert list(out.prompt_token_ids) == ids, "vLLM changed the prompt's tokens"
    prompt = [out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))]
    gen = out.outputs[0]
    tokens = list(gen.token_ids)
    if written is not None:
        index = {int(re.search(r"\.(\d+)\.", f".{name}.").group(1)): t for name, t in written.items()}  # type: ignore[union-attr]
        torch.save(torch.stack([index[i] for i in sorted(index)]), request["slots_out"])
    cache = llm.llm_engine.vllm_config.cache_config
    return {
        "prompt_logprobs": prompt,
        "tokens": tokens,
        "token_logprobs": [gen.logprobs[i][t].logprob for i, t in enumerate(tokens)],
        "kv_cache_dtype": str(cache.cache_dtype),
        "num_blocks": cache.num_cpu_blocks or cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "layers_written": None if written is None else len(written),
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print("RESULT " + json.dumps(result), flush=True)
