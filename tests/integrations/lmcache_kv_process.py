"""One process of the LMCache integration test (tests/integrations/test_lmcache.py): ``store`` or ``load``.

Both build the same tiny random llama (conftest's ``_tiny_llama``, head_dim 64, one KV head) in bfloat16 and an
LMCache ``StorageManager`` whose L2 adapter (JSON in ``--adapter``) names the walshkv serde.

* ``store``: prefills the prompt, writes its K/V as LMCache chunks ``[2, layers, tokens, hidden]`` through the
  storage manager (L1, then the store controller, the serde and the L2 adapter), waits until L2 reports every
  chunk stored, and continues generation from the prompt K/V as walshkv's own cache decodes it
  (``CompressedCache``, checked against the codecs' ``encode``/``decode``), and from the exact K/V.
* ``load``: prefetches the chunks from L2 (adapter load, serde decode) into L1, reads them and continues
  generation from them.

Each writes ``result.pt`` into ``--out``: the continuation's logits (float32) and, for ``store``, the sizes L2
reported. The test compares the two processes' logits.
"""

from __future__ import annotations

import os

os.environ["LMCACHE_TRACK_USAGE"] = "false"  # LMCache's usage telemetry is on by default; before importing it
os.environ["DO_NOT_TRACK"] = "1"

import argparse
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the root conftest's tiny-model builder

from transformers import DynamicCache  # noqa: E402

from conftest import _tiny_llama  # noqa: E402
from walshkv.cache import CompressedCache  # noqa: E402
from walshkv.codecs import find_wrapper  # noqa: E402
from walshkv.codecs.center import Centered  # noqa: E402
from walshkv.integrations.lmcache import load_calibration, register  # noqa: E402

#: The tiny model's K/V shape; the test reads these too.
NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM = 2, 1, 64
CHUNK_TOKENS, NUM_CHUNKS, NEW_TOKENS = 32, 2, 6
MODEL_NAME = "tiny-llama-hd64"


def tiny_model() -> torch.nn.Module:
    """conftest's ``tiny_llama_hd64`` in bfloat16 (the dtype an engine's KV cache has)."""
    return _tiny_llama(3, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64).to(torch.bfloat16)


def prompt_ids() -> torch.Tensor:
    """The chunks' tokens and one more: the engine recomputes the last prompt token, as vLLM does on a full hit."""
    g = torch.Generator().manual_seed(7)
    return torch.randint(3, 96, (1, CHUNK_TOKENS * NUM_CHUNKS + 1), generator=g)


def object_keys(ids: torch.Tensor) -> list:
    from lmcache.v1.distributed.api import ObjectKey

    keys = []
    for c in range(NUM_CHUNKS):
        prefix = ids[0, : (c + 1) * CHUNK_TOKENS].numpy().tobytes()
        keys.append(ObjectKey(chunk_hash=hashlib.sha256(prefix).digest(), model_name=MODEL_NAME, kv_rank=0))
    return keys


def storage_manager(adapter: dict):
    from lmcache.v1.distributed.config import parse_args
    from lmcache.v1.distributed.storage_manager import StorageManager

    register()
    config = parse_args(["--l1-size-gb", "0.05", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(adapter)])
    return StorageManager(config)


def layout():
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    shape = torch.Size([2, NUM_LAYERS, CHUNK_TOKENS, NUM_KV_HEADS * HEAD_DIM])
    return MemoryLayoutDesc(shapes=[shape], dtypes=[torch.bfloat16])


def continue_from(model: torch.nn.Module, kv: list[tuple[torch.Tensor, torch.Tensor]], ids: torch.Tensor):
    """Greedy generation after the prompt from the given prompt K/V (``[1, heads, tokens, head_dim]`` per layer)."""
    cache = DynamicCache()
    for layer, (k, v) in enumerate(kv):
        cache.update(k.clone(), v.clone(), layer)
    token = ids[:, -1:]
    logits = []
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            out = model(input_ids=token, cache=cache).logits[:, -1].float()
            logits.append(out)
            token = out.argmax(-1, keepdim=True)
    return torch.cat(logits)


def chunk_of(kv: list[tuple[torch.Tensor, torch.Tensor]], c: int) -> torch.Tensor:
    """LMCache's chunk ``c``: ``[2, layers, tokens, kv_heads * head_dim]`` (a token's heads side by side)."""
    s = slice(c * CHUNK_TOKENS, (c + 1) * CHUNK_TOKENS)
    sides = zip(*kv, strict=True)  # (all K, all V)
    return torch.stack([torch.stack([t[0, :, s].transpose(0, 1).reshape(CHUNK_TOKENS, -1) for t in x]) for x in sides])


def from_chunks(chunks: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    whole = torch.cat(chunks, dim=2)  # [2, layers, tokens, hidden]
    tokens = whole.shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(tokens, NUM_KV_HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0).contiguous()

    return [(heads(whole[0, layer]), heads(whole[1, layer])) for layer in range(NUM_LAYERS)]


class Stored:
    """An L2 listener: the keys and sizes L2 reports stored."""

    def __init__(self) -> None:
        self.sizes: dict[bytes, int] = {}
        self.event = threading.Event()

    def listener(self, want: int):
        from lmcache.v1.distributed.internal_api import L2AdapterListener

        outer = self

        class Listener(L2AdapterListener):
            def on_l2_keys_stored(self, keys, sizes):
                for key, size in zip(keys, sizes, strict=True):
                    outer.sizes[key.chunk_hash] = int(size)
                if len(outer.sizes) >= want:
                    outer.event.set()

            def on_l2_keys_accessed(self, keys):
                pass

            def on_l2_keys_deleted(self, keys):
                pass

        return Listener()


def reference_kv(model, ids, spec: str, calibration_path: str | None):
    """The prompt K/V as walshkv's cache decodes it (``center+`` K with its mean added back), and the exact K/V."""
    prompt = ids[:, : CHUNK_TOKENS * NUM_CHUNKS]
    exact = DynamicCache()
    with torch.inference_mode():
        model(input_ids=prompt, cache=exact)
    raw = [(layer.keys, layer.values) for layer in exact.layers]
    calibration = load_calibration(calibration_path)[0] if calibration_path else None
    cache = CompressedCache(spec, config=model.config, calibration=calibration, prefill="exact")
    with torch.inference_mode():
        model(input_ids=prompt, cache=cache)
    decoded = []
    for layer, (k_raw, v_raw) in zip(cache.layers, raw, strict=True):
        k, v = layer.decoded()
        codec_k, codec_v = layer.spec.k, layer.spec.v
        if torch.equal(k, codec_k.decode(codec_k.encode(k_raw))) is False:
            raise AssertionError("CompressedCache's K differs from the codec's encode/decode of the exact K")
        if torch.equal(v, codec_v.decode(codec_v.encode(v_raw))) is False:
            raise AssertionError("CompressedCache's V differs from the codec's encode/decode of the exact V")
        centered = find_wrapper(codec_k, Centered)
        if centered is not None:  # an engine puts loaded K beside K it computes: the mean goes back in
            packed = codec_k.encode(k_raw)
            packed.dtype = torch.float32  # decoded in float32, the mean added, then rounded once
            k = (codec_k.decode(packed) + centered.plain_offset()[None, :, None, :]).to(k.dtype)
        decoded.append((k, v))
    return raw, decoded


def store(args: argparse.Namespace) -> dict:
    model, ids = tiny_model(), prompt_ids()
    raw, decoded = reference_kv(model, ids, args.spec, args.calibration)
    sm = storage_manager(json.loads(args.adapter))
    stored = Stored()
    sm.register_l2_listener(stored.listener(NUM_CHUNKS))
    keys = object_keys(ids)
    try:
        objs = sm.reserve_write(keys, layout())
        if len(objs) != len(keys):
            raise RuntimeError(f"L1 reserved {len(objs)} of {len(keys)} chunks")
        for c, key in enumerate(keys):
            objs[key].tensor.copy_(chunk_of(raw, c))
        sm.finish_write(keys)
        if not stored.event.wait(args.timeout):
            raise RuntimeError(f"L2 reported {len(stored.sizes)} of {len(keys)} chunks stored in {args.timeout} s")
    finally:
        sm.close()
    return {
        "logits": continue_from(model, decoded, ids),
        "exact_logits": continue_from(model, raw, ids),
        "sizes": [stored.sizes[k.chunk_hash] for k in keys],
    }


def load(args: argparse.Namespace) -> dict:
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    model, ids = tiny_model(), prompt_ids()
    sm = storage_manager(json.loads(args.adapter))
    keys = object_keys(ids)
    try:
        handle = sm.submit_prefetch_task(
            PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout())])
        )
        if not sm.wait_prefetch_status(handle, args.timeout):
            raise RuntimeError(f"the prefetch did not finish in {args.timeout} s")
        result = sm.query_prefetch_status(handle)
        hits = result.l2_hit_count
        if hits != len(keys):
            raise RuntimeError(f"L2 served {hits} of {len(keys)} chunks (L1 {result.l1_hit_count})")
        with sm.read_prefetched_results(keys, result.l1_owners) as objs:
            if objs is None:
                raise RuntimeError("the prefetched chunks are not readable in L1")
            chunks = [obj.tensor.clone() for obj in objs]
        sm.finish_read_prefetched(keys, 1, result.l1_owners)
    finally:
        sm.close()
    return {"logits": continue_from(model, from_chunks(chunks), ids), "l2_hits": hits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("store", "load"))
    parser.add_argument("--adapter", required=True, help="the L2 adapter's JSON, with its serde block")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--calibration", default=None)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the same kernels (and so the same bits) in both processes
    started = time.monotonic()
    result = (store if args.mode == "store" else load)(args)
    result["seconds"] = time.monotonic() - started
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(result, args.out / "result.pt")


if __name__ == "__main__":
    main()
