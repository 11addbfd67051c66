"""Decode speed of K stored in the block frame (``blockrope:G+``, research/scripts/ropecenter_probe.py).

A key at position ``p`` is stored as ``A (R(p0)ᵀ k - mu_G)`` (``p0 = G floor(p / G)``, ``A``: a dense ``eq+``-class
transform, ``mu_G``: the mean of a block). The score of query ``q`` (after RoPE) is

    q · k  =  (A⁻ᵀ R(p0)ᵀ q) · codes  +  (R(p0)ᵀ q) · mu_G

so a decode step turns the query back once per block and maps it once per block (``d x d`` multiply-adds per query
head per block, ``d²/G`` per key), then scores the block's codes exactly as a K stored after RoPE is scored: no
per-key map. ``blockropec:G+`` subtracts the mean turned to each key's offset ``j`` in its block instead,
``A (R(p0)ᵀ k - R(j) mu)``: its score term ``(R(p0)ᵀ q) · R(j) mu`` is one more product per key, made in
the kernel by adding ``A R(j) mu`` (row ``j`` of a ``G x d`` table, in the codes' basis) to each decoded key before it
is scored: ``d`` adds per key and kv head, shared by its query heads, no tensor the length of the cache
(``fused_decode_cpu``'s ``key_table``).

This script times that step on the fused CPU kernel (one call: every block scored against its own folded query,
``fused_decode_cpu``'s ``query_block``, each decoded key plus its offset's row of the table, its ``key_table``)
against
torch SDPA over fp32 and bf16 caches and the same codecs read with one query (``post-RoPE``: the step without the
per-block fold, its upper bound), in interleaved rounds as ``walshkv bench attention`` times them. Each blockrope
row is checked against attention over the codec's decoded keys turned to their positions (``max_abs_err``).

    python research/scripts/blockrope_speed.py --model smollm2-135m --kv-len 16384,65536 \\
        --frames blockrope:64,blockropec:16,blockropec:64,blockropec:256 \\
        --json docs/results/long-context/frame-blockrope/speed.json \\
        --markdown docs/results/long-context/frame-blockrope/speed.md

The output records the code commit and the CPU (as every walshkv result does).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch

from walshkv.attention.cpu import fused_decode_cpu, kernel_available
from walshkv.attention.cpu_formats import cpu_plan
from walshkv.attention.decode import decode_attention
from walshkv.bench.attention import attention_shapes
from walshkv.bench.machine import interleaved_seconds
from walshkv.codecs import parse_codec
from walshkv.eval.provenance import code_commit, cpu_meta
from walshkv.fileio import write_json_atomic, write_text_atomic


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``x`` ``[..., n, d]`` turned by RoPE with ``cos``/``sin`` ``[n, d]`` (or back)."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos - rot * sin if inverse else x * cos + rot * sin


def _cos_sin(pos: torch.Tensor, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos.to(torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([f, f], dim=-1)
    return emb.cos().to(torch.float32), emb.sin().to(torch.float32)


class BlockStep:
    """One decode step over a block-frame K cache: the query turned back and mapped once per block, every block
    scored against its own query in one fused-kernel call (``query_block``), each decoded key plus its offset's row of
    the mean's table (``key_table``)."""

    def __init__(self, q, pk, pv, kc, vc, ainv, mu, block, scale, exact=False):  # type: ignore[no-untyped-def]
        _, hq, _, d = q.shape
        h = ainv.shape[0]
        n = pk.seq_len
        self.g = hq // h
        self.q = q.reshape(h, self.g, d)
        self.nb = -(-n // block)
        self.n, self.block, self.d = n, block, d
        p0 = torch.arange(self.nb) * block
        self.cos, self.sin = _cos_sin(p0, d)  # [nb, d]: static for a cache, made once
        # the G x d table of the mean turned to each offset in a block (blockrope: the block's mean in every row),
        # mapped by A into the space the codes live in: u · R(j) mu = (A^-T u) · (A R(j) mu)
        if exact:
            cos_j, sin_j = _cos_sin(torch.arange(block), d)
            mean = _turn(mu[:, None, :].expand(-1, block, -1), cos_j, sin_j, inverse=False)
        else:
            mean = mu[:, None, :].expand(-1, block, -1)
        table = torch.matmul(mean, torch.linalg.inv(ainv).transpose(-1, -2))  # rows R(j) mu @ A^T
        self.pk, self.pv = pk, pv
        plan = cpu_plan(kc, vc, d, scale)
        if plan is None:
            raise ValueError(f"the CPU kernel cannot read {kc.spec} / {vc.spec}")
        fold = ainv
        if plan.q_map is not None and plan.q_map.shape == (d, d):  # the codec's rotations and scale: into the fold
            # (the table goes to the kernel's buffer basis with them: q_map / scale is orthogonal there)
            fold, table = ainv @ plan.q_map, table @ (plan.q_map / scale)
            plan = dataclasses.replace(plan, q_map=None, scale=1.0)
        self.plan, self.fold, self.table = plan, fold.contiguous(), table.contiguous()

    def __call__(self) -> torch.Tensor:
        h, g, d = self.q.shape
        qr = _turn(self.q[:, None], self.cos[:, None, :], self.sin[:, None, :], inverse=True)  # [h, nb, g, d]
        y = torch.bmm(qr.reshape(h, self.nb * g, d), self.fold).reshape(1, h, self.nb, g, -1)  # folded, per block
        res = fused_decode_cpu(y, self.plan, self.pk, self.pv, query_block=self.block, key_table=self.table)
        if res is None:
            raise RuntimeError("the fused CPU kernel is not available")
        _, l_sum, acc = res
        return (acc / l_sum[..., None]).reshape(1, h * g, 1, acc.shape[-1])


def _reference(q, pk, pv, kc, vc, ainv, mu, block, scale, exact=False):  # type: ignore[no-untyped-def]
    """Attention (float64) over the decoded keys turned to their positions."""
    y = kc.decode(pk).to(torch.float64)  # [1, h, n, d]
    n, d = y.shape[2], y.shape[3]
    pos = torch.arange(n)
    p0 = torch.div(pos, block, rounding_mode="floor") * block
    cos, sin = _cos_sin(p0, d)
    mean = mu.to(torch.float64)[None, :, None, :]
    if exact:  # R(j) mu, j the key's offset in its block
        cos_j, sin_j = _cos_sin(pos - p0, d)
        mean = _turn(mean.expand(1, -1, n, -1), cos_j.to(torch.float64), sin_j.to(torch.float64), inverse=False)
    keys = _turn(
        torch.matmul(y, ainv.to(torch.float64).transpose(-1, -2)[None]) + mean,
        cos.to(torch.float64),
        sin.to(torch.float64),
        inverse=False,
    )
    vals = vc.decode(pv).to(torch.float64)
    h = keys.shape[1]
    g = q.shape[1] // h
    qq = q.to(torch.float64).reshape(1, h, g, d)
    s = torch.einsum("bhgd,bhnd->bhgn", qq, keys) * scale
    return torch.einsum("bhgn,bhnd->bhgd", s.softmax(-1), vals).reshape(1, h * g, 1, d)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="attention shapes (head_dim, kv and query heads)")
    ap.add_argument("--kv-len", default="16384,65536", help="cached tokens, comma-separated ")
    ap.add_argument(
        "--frames",
        default="blockrope:64,blockropec:16,blockropec:64,blockropec:256",
        help="block frames, comma-separated: blockrope:G (a block's mean) or blockropec:G (each key's mean, a bias)",
    )
    ap.add_argument("--k-codec", default="tcq:3.5:norm=8:tables=2")
    ap.add_argument("--v-codec", default="tcq:3:norm=8:tables=2")
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument(
        "--march",
        help="build the kernel for this -march instead of the CPU's own (haswell: the AVX2-only code paths, as an "
        "AVX2 machine runs them; the CPU must run that code)",
    )
    ap.add_argument("--json", required=True)
    ap.add_argument("--markdown")
    args = ap.parse_args(argv)
    if not kernel_available():
        raise SystemExit("the fused CPU kernel is not available here (a C++ compiler and Python's headers)")
    if args.march:  # every kernel call of this run (post-RoPE and the block steps) reads this build
        from walshkv.attention import cpu

        module = cpu.build_kernel(["-O3", f"-march={args.march}", "-fopenmp", "-std=c++20"])
        cpu.check_kernel_constants(module)
        cpu._kernel = module
        cpu._KPOST.clear()
    shapes = attention_shapes(args.model)
    d, h, hq = shapes["head_dim"], shapes["kv_heads"], shapes["q_heads"]
    scale = d**-0.5
    kc, vc = parse_codec(args.k_codec).bind(0, "k"), parse_codec(args.v_codec).bind(0, "v")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for n in (int(x) for x in args.kv_len.split(",")):
        k = torch.randn(1, h, n, d, generator=gen)
        v = torch.randn(1, h, n, d, generator=gen)
        q = torch.randn(1, hq, 1, d, generator=gen)
        fns = {
            "sdpa-fp32": lambda q=q, k=k, v=v: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, enable_gqa=True
            ),
        }
        qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
        fns["sdpa-bf16"] = lambda qb=qb, kb=kb, vb=vb: torch.nn.functional.scaled_dot_product_attention(
            qb, kb, vb, enable_gqa=True
        )
        pk, pv = kc.encode(k), vc.encode(v)
        fns["post-RoPE"] = lambda q=q, pk=pk, pv=pv: decode_attention(q, pk, pv, kc, vc)
        nbytes = {
            "sdpa-fp32": 2 * k.numel() * 4,
            "sdpa-bf16": 2 * k.numel() * 2,
            "post-RoPE": pk.nbytes() + pv.nbytes(),
        }
        errors = {}
        for name in args.frames.split(","):
            kind, _, size = name.partition(":")
            if kind not in ("blockrope", "blockropec") or not size.isdigit() or int(size) < 1:
                raise SystemExit(f"--frames: {name!r} is not blockrope:G or blockropec:G (G >= 1)")
            g, exact = int(size), kind == "blockropec"
            a = torch.eye(d) + 0.3 * torch.randn(h, d, d, generator=gen) / d**0.5  # a well-conditioned dense map
            ainv = torch.linalg.inv(a)
            mu = torch.randn(h, d, generator=gen)
            p0 = torch.div(torch.arange(n), g, rounding_mode="floor") * g
            cos, sin = _cos_sin(p0, d)
            kpost = torch.randn(1, h, n, d, generator=gen)
            y = torch.matmul(_turn(kpost, cos, sin, inverse=True) - mu[None, :, None, :], a.transpose(-1, -2)[None])
            pkb = kc.encode(y)
            step = BlockStep(q, pkb, pv, kc, vc, ainv, mu, g, scale, exact=exact)
            fns[name] = step
            nbytes[name] = pkb.nbytes() + pv.nbytes()
            ref = _reference(q, pkb, pv, kc, vc, ainv, mu, g, scale, exact=exact)
            errors[name] = float((step().to(torch.float64) - ref).abs().max())
        times = interleaved_seconds(fns, args.repeats)
        best = [min(times["sdpa-fp32"][i], times["sdpa-bf16"][i]) for i in range(len(times["sdpa-fp32"]))]
        for method, ts in times.items():
            sec = statistics.median(ts)
            rows.append(
                {
                    "kv_len": n,
                    "method": method,
                    "ms": 1e3 * sec,
                    "speedup_vs_best_sdpa": statistics.median(b / t for b, t in zip(best, ts, strict=True)),
                    "cache_bytes": nbytes[method],
                    "gb_per_s": nbytes[method] / sec / 1e9,
                    "max_abs_err": errors.get(method),
                }
            )
            print(
                f"{n:>7} {method:<16} {1e3 * sec:8.3f} ms  x{rows[-1]['speedup_vs_best_sdpa']:.2f} best SDPA"
                + (f"  err {errors[method]:.1e}" if method in errors else "")
            )
    cmd = "python research/scripts/blockrope_speed.py " + " ".join(argv)
    meta = {
        "command": cmd,
        "model": args.model,
        "shapes": shapes,
        "k_codec": args.k_codec,
        "v_codec": args.v_codec,
        "threads": torch.get_num_threads(),
        "march": args.march or "native",
        "code": code_commit(),
        "cpu": cpu_meta(),
    }
    write_json_atomic(args.json, {"meta": meta, "rows": rows})
    if args.markdown:
        lines = [
            f"{args.model} shapes (head_dim {d}, {h} kv heads, {hq} query heads), K `{args.k_codec}`, V "
            f"`{args.v_codec}`, {torch.get_num_threads()} threads; code {code_commit()}; CPU {cpu_meta()['model']}. "
            f"Produced by `{cmd}`.",
            "",
            "| kv_len | method | ms/step | x fastest SDPA | GB/s | max abs err |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            err = "" if r["max_abs_err"] is None else f"{r['max_abs_err']:.1e}"
            lines.append(
                f"| {r['kv_len']:,} | {r['method']} | {r['ms']:.3f} | {r['speedup_vs_best_sdpa']:.2f} | "
                f"{r['gb_per_s']:.1f} | {err} |"
            )
        write_text_atomic(args.markdown, "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
