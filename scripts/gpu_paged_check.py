"""GPU check of batched paged decode (issue 36): the Triton kernel over a vLLM-style page tensor, on CUDA.

For each cache spec and context: 8 requests (lengths spread around the context) are written into shuffled pages
with the vLLM plugin's device write (``walshkv_vllm.paged.write_slots``, nothing read back to the host), then

1. one ``decode_attention_paged`` launch against each request read alone by the reference (max abs error);
2. its time (CUDA events, median) against SDPA over a dense bf16 and fp16 cache of the same requests padded to the
   longest (``enable_gqa``), the fastest SDPA of the run the baseline, and the bytes the pages hold;
3. one step (the write of the requests' next tokens, then the decode) captured in a CUDA graph and replayed with new
   queries, K/V and lengths copied into its inputs: the replay must equal the same step run eagerly.

Writes ``OUT/paged_check.json`` (device, commit, rows). Needs torch with CUDA and triton; no vLLM, no network, no
model (random K/V in smollm2-135m's shapes unless ``--head-dim``/``--kv-heads``/``--q-heads`` say otherwise).

Usage: ``PYTHONPATH=plugins/vllm/src python scripts/gpu_paged_check.py --out DIR``
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from walshkv.attention import decode_attention, decode_attention_paged, gather_pages
from walshkv.codecs.registry import parse_codec

SPECS = ("rot+int4", "q4_0", "q8_0/q4_0", "tq:4/tq:3", "rot+int4/rot+int3")
BLOCK = 16


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _time_ms(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def _case(spec: str, ctx: int, args: argparse.Namespace, gen: torch.Generator) -> dict:
    from walshkv_vllm.layout import SlotLayout
    from walshkv_vllm.paged import write_slots

    dev = torch.device(args.device)
    kspec, _, vspec = spec.partition("/")
    kc, vc = parse_codec(kspec), parse_codec(vspec or kspec)
    d, kv, hq, r = args.head_dim, args.kv_heads, args.q_heads, args.requests
    lens = [max(1, ctx - 37 * i) for i in range(r)]
    per = -(-(max(lens) + 1) // BLOCK)  # room for one more token (the graph step)
    blocks = r * per + 5
    table = torch.randperm(blocks, generator=gen)[: r * per].reshape(r, per).to(torch.int32).to(dev)
    layout = SlotLayout.of(kc, vc, d, kv)
    pages = layout.empty_pages(blocks, BLOCK, dev)
    ks = [torch.randn(n, kv, d, generator=gen).to(dev) for n in lens]
    vs = [torch.randn(n, kv, d, generator=gen).to(dev) for n in lens]
    for i, n in enumerate(lens):
        pos = torch.arange(n, device=dev)
        slots = table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK
        write_slots(pages, layout, kc, vc, ks[i], vs[i], slots, on_device=True)
    q = torch.randn(r, hq, 1, d, generator=gen).to(dev)
    seq = torch.tensor(lens, device=dev, dtype=torch.int32)
    pk, pv = layout.page_views(pages, torch.float32)
    row: dict = {"spec": spec, "ctx": ctx, "requests": r, "page_bytes": pages.numel()}

    got = decode_attention_paged(q, pk, pv, kc, vc, table, seq, backend="triton")
    errs = []
    for i, n in enumerate(lens):
        gk, gv = gather_pages(pk, kc, table[i], n), gather_pages(pv, vc, table[i], n)
        want = decode_attention(q[i : i + 1], gk, gv, kc, vc, backend="reference")
        errs.append(float((got[i : i + 1] - want).abs().max()))
    row["max_abs_err_vs_reference"] = max(errs)

    if dev.type != "cuda":  # a smoke run (the Triton interpreter): correctness only
        return row
    paged = lambda: decode_attention_paged(q, pk, pv, kc, vc, table, seq, backend="triton")  # noqa: E731
    row["paged_ms"] = _time_ms(paged, args.repeats)
    for name, dt in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        kd = torch.zeros(r, kv, max(lens), d, device=dev, dtype=dt)
        vd = torch.zeros_like(kd)
        for i, n in enumerate(lens):
            kd[i, :, :n] = ks[i].transpose(0, 1).to(dt)
            vd[i, :, :n] = vs[i].transpose(0, 1).to(dt)
        qd = q.to(dt)
        row[f"sdpa_{name}_ms"] = _time_ms(
            lambda qd=qd, kd=kd, vd=vd: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), args.repeats
        )
        row[f"sdpa_{name}_bytes"] = 2 * kd.numel() * kd.element_size()
    best = min(row["sdpa_bf16_ms"], row["sdpa_fp16_ms"])
    row["speedup_vs_best_sdpa"] = best / row["paged_ms"]

    # one step in a CUDA graph: write each request's next token, then decode with the new lengths
    nk = torch.randn(r, kv, d, device=dev)
    nv = torch.randn(r, kv, d, device=dev)
    nslots = torch.zeros(r, dtype=torch.long, device=dev)
    nseq = seq + 1
    qs = q.clone()

    def step() -> torch.Tensor:
        write_slots(pages, layout, kc, vc, nk, nv, nslots, on_device=True)
        return decode_attention_paged(qs, pk, pv, kc, vc, table, nseq, backend="triton")

    def fill(seed: int) -> None:
        g = torch.Generator(device=dev).manual_seed(seed)
        nk.copy_(torch.randn(r, kv, d, device=dev, generator=g))
        nv.copy_(torch.randn(r, kv, d, device=dev, generator=g))
        qs.copy_(torch.randn(r, hq, 1, d, device=dev, generator=g))
        nseq.copy_(seq + 1)
        pos = seq.long()  # the next position of each request
        nslots.copy_(table[torch.arange(r, device=dev), pos // BLOCK].long() * BLOCK + pos % BLOCK)

    try:
        fill(1)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                step()  # warm: kernels compiled, tables cached
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        fill(2)
        graph.replay()
        replayed = out.clone()
        fill(2)
        eager = step()
        torch.cuda.synchronize()
        row["graph"] = "captured and replayed"
        row["graph_max_abs_diff_vs_eager"] = float((replayed - eager).abs().max())
        row["graph_step_ms"] = _time_ms(graph.replay, args.repeats)
        row["eager_step_ms"] = _time_ms(step, args.repeats)
    except Exception as exc:  # a finding either way
        row["graph"] = f"failed: {type(exc).__name__}: {str(exc)[:400]}"
        row["graph_traceback"] = traceback.format_exc()[-1500:]
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="docs/results/gpu", help="folder for paged_check.json")
    parser.add_argument("--spec", action="append", help=f"cache spec (repeatable; default {', '.join(SPECS)})")
    parser.add_argument("--ctx", default="2048,8192,32768", help="comma-separated contexts (the longest request)")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--q-heads", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--device", default="cuda", help="cuda, or cpu for a smoke run of the correctness part (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: this check runs on a GPU", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    rows = []
    for spec in args.spec or SPECS:
        for ctx in (int(c) for c in args.ctx.split(",")):
            try:
                row = _case(spec, ctx, args, gen)
            except Exception as exc:  # record and go on: every row is a finding
                row = {"spec": spec, "ctx": ctx, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            print(json.dumps({k: v for k, v in row.items() if k != "graph_traceback"}), flush=True)
            rows.append(row)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"{args.device} (smoke run)"
    meta = {"device": name, "commit": _commit(), "torch": torch.__version__}
    (out / "paged_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out / 'paged_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
