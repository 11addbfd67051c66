"""``walshkv bench``: rows, ratios, crossover, outputs (tiny sizes; timings are not asserted)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from walshkv.bench import (
    AttentionBenchConfig,
    GenerationBenchConfig,
    bench_attention,
    bench_generation,
    copy_bandwidth,
    crossover,
    machine_description,
)
from walshkv.cli import main


def test_attention_rows():
    codecs = ["int4", "rot+int3", "vht2:5,5,4,3", "tq:4/tq:2.5", "vzc"]
    rows = bench_attention(AttentionBenchConfig([64, 100], codecs, repeats=1, progress=False))
    assert len(rows) == 2 * (3 + 5)
    for r in rows:
        assert r["seconds"] > 0 and r["cache_bytes"] > 0 and r["speedup_vs_sdpa_fp16"] > 0
    fp16 = next(r for r in rows if r["kv_len"] == 100 and r["method"] == "sdpa-fp16")
    assert fp16["speedup_vs_sdpa_fp16"] == 1.0 and fp16["cache_bytes"] == 2 * 3 * 100 * 64 * 2
    int4 = next(r for r in rows if r["kv_len"] == 100 and r["method"] == "int4")
    assert int4["cache_bytes"] == 2 * 3 * 100 * 34  # 32 code bytes + an fp16 scale per vector, K and V
    assert next(r for r in rows if r["method"] == "vht2:5,5,4,3")["backend"] == "cpu"
    assert next(r for r in rows if r["method"] == "tq:4/tq:2.5")["backend"] == "cpu"
    assert next(r for r in rows if r["method"] == "vzc")["backend"] == "reference"


def test_attention_reference_backend_and_check():
    """What benchmarks/decode_attention.py did besides ``walshkv bench``: the reference backend timed too, and
    every packed result checked against SDPA over the decoded cache."""
    rows = bench_attention(
        AttentionBenchConfig([64], ["int4", "vzc"], repeats=1, reference=True, check=True, progress=False)
    )
    methods = [r["method"] for r in rows]
    assert methods == ["sdpa-fp16", "sdpa-bf16", "sdpa-fp32", "int4", "int4 (reference)", "vzc", "vzc (reference)"]
    by = {r["method"]: r for r in rows}
    assert by["int4"]["backend"] == "cpu" and by["int4 (reference)"]["backend"] == "reference"
    assert by["int4 (reference)"]["cache_bytes"] == by["int4"]["cache_bytes"]
    for m in methods[3:]:
        assert by[m]["max_abs_err_vs_sdpa_on_decoded"] < 1e-4
    assert "encode_ms" in by["int4"] and "encode_ms" not in by["int4 (reference)"]
    plain = bench_attention(AttentionBenchConfig([64], ["int4"], repeats=1, progress=False))
    assert "max_abs_err_vs_sdpa_on_decoded" not in plain[-1] and len(plain) == 4  # off by default


def test_cold_timing_flushes_before_every_call(tmp_path, monkeypatch):
    """``--cold``: a buffer is written before every timed call (each call starts with cold caches), the flush is
    not in the call's time, and the result says how it was timed."""
    from walshkv.bench import machine

    order: list[str] = []
    real_add = torch.Tensor.add_

    def spy_add(self, *a, **k):
        if self.numel() * 4 == 1 << 20:
            order.append("flush")
        return real_add(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "add_", spy_add)
    fns = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    times = machine.interleaved_seconds(fns, 2, warmup=0, budget=0.0, flush_bytes=1 << 20)
    assert order == ["flush", "a", "flush", "b"] * 2 and all(len(t) == 2 for t in times.values())
    order.clear()
    machine.interleaved_seconds(fns, 1, warmup=0, budget=0.0)
    assert order == ["a", "b"]
    monkeypatch.undo()
    out = tmp_path / "cold"
    argv = ["bench", "attention", "--kv-len", "64", "--codec", "int4", "--repeats", "1", "--cold"]
    assert main([*argv, "--out", str(out), "--quiet", "--no-plot"]) == 0
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["cold"] is True and len(data["attention"]) == 4
    assert "Caches flushed before every timed call" in (out / "bench.md").read_text()


def test_crossover():
    def row(ctx, kind, x):
        return {"ctx": ctx, "cache": kind, "speedup_vs_dynamic": x}

    rows = [row(1, "dynamic", 1), row(1, "fused", 0.8), row(8, "fused", 1.1), row(32, "fused", 1.3)]
    assert crossover(rows) == 8
    assert crossover([row(1, "fused", 1.2), row(8, "fused", 0.9)]) is None
    assert crossover([row(1, "fused", 1.0)]) == 1


def test_machine_and_bandwidth():
    m = machine_description()
    assert m["logical_cpus"] >= 1 and m["torch_threads"] >= 1
    assert copy_bandwidth(megabytes=8, repeats=1) > 0


def test_cli_attention(tmp_path, capsys):
    out = tmp_path / "b"
    assert (
        main(
            [
                "bench",
                "attention",
                "--kv-len",
                "64",
                "--codec",
                "int4",
                "--repeats",
                "1",
                "--out",
                str(out),
                "--quiet",
                "--no-plot",
            ]
        )
        == 0
    )
    data = json.loads((out / "bench.json").read_text())
    assert data["meta"]["copy_bandwidth_gb_per_s"] > 0 and len(data["attention"]) == 4
    assert "x vs SDPA fp16" in (out / "bench.md").read_text()
    with pytest.raises(SystemExit):
        main(["bench", "--kv-len", "0"])
    assert "positive" in capsys.readouterr().err


@pytest.mark.model
def test_generation_rows(smollm2):
    config = GenerationBenchConfig(
        "smollm2-135m", [96], ["rot+int4"], dynamic_dtypes=["float32"], new_tokens=2, prefill_chunk=64, progress=False
    )
    rows = bench_generation(config)
    assert [r["cache"] for r in rows] == ["dynamic", "fused"]
    dyn, fused = rows
    assert dyn["speedup_vs_dynamic"] == 1.0 and fused["decode_tokens_per_s"] > 0
    assert dyn["label"] == "DynamicCache fp32" and fused["label"] == "fused rot+int4" and fused["preset"] is None
    assert dyn["update_ms"] > 0 and fused["attn_ms"] > 0 and fused["cpu_capability"]
    assert 0 < fused["cache_bytes"] < dyn["cache_bytes"] / 3  # packed 4-bit codes against an fp32 cache
    assert fused["peak_rss"] >= fused["rss_after_load"] > fused["weights_bytes"]


def test_targets_and_markdown():
    from walshkv.bench import bench_markdown, targets

    att = [
        {
            "kv_len": 16384,
            "method": m,
            "speedup_vs_sdpa_fp16": x,
            "speedup_vs_sdpa_fp32": 1.0,
            "ms": 1.0,
            "cache_bytes": 2**20,
            "gb_per_s": 1.0,
            "backend": "cpu",
        }
        for m, x in (("sdpa-fp16", 1.0), ("rot+int4", 2.6), ("rot+int3", 2.9))
    ]
    gen = [
        {
            "model": "m",
            "ctx": c,
            "cache": k,
            "codec": None if k == "dynamic" else "rot+int4",
            "speedup_vs_dynamic": x,
            "decode_tokens_per_s": 1.0,
            "prefill_seconds": 1.0,
            "cache_bytes": cb,
            "rss_after_load": 100 * 2**20,
            "peak_rss": pk,
            "peak_minus_loaded_minus_cache": 0,
        }
        for c, k, x, cb, pk in (
            (1024, "dynamic", 1.0, 10 * 2**20, 200 * 2**20),
            (1024, "fused", 0.9, 2**20, 150 * 2**20),
            (8192, "dynamic", 1.0, 80 * 2**20, 300 * 2**20),
            (8192, "fused", 1.5, 10 * 2**20, 170 * 2**20),
        )
    ]
    result = {
        "meta": {
            "machine": {"cpu": "cpu", "logical_cpus": 2, "torch": "t", "torch_threads": 2},
            "command": "walshkv bench",
            "copy_bandwidth_gb_per_s": 10.0,
            "crossover_context": 8192,
        },
        "attention": att,
        "generation": gen,
    }
    lines = targets(result)
    assert "x2.60: met" in lines[0] and "x2.90: missed" in lines[1] and "x1.50" in lines[2] and "met" in lines[2]
    assert "limit 160 MiB, peak 170 MiB: missed" in lines[3]  # 100 + 1.15 x 10 + (150 - 100 - 1) = 160.5
    md = "\n".join(bench_markdown(result))
    assert "## Targets" in md and "Crossover" in md and "copy bandwidth 10.0 GB/s" in md


def test_device_errors():
    with pytest.raises(ValueError, match="cpu or cuda"):
        AttentionBenchConfig([16], ["int4"], device="tpu")
    if not __import__("torch").cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA device"):
            bench_attention(AttentionBenchConfig([16], ["int4"], repeats=1, device="cuda", progress=False))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"kv_lens": []}, "non-empty list of token counts"),
        ({"kv_lens": 4096}, "non-empty list of token counts"),
        ({"kv_lens": [64, 0]}, "at least 1"),
        ({"codecs": "int4"}, r"give \['int4'\]"),
        ({"codecs": []}, "name at least one"),
        ({"head_dim": 0}, "head_dim must be a whole number"),
        ({"repeats": 1.5}, "repeats must be a whole number"),
        ({"q_heads": 8, "kv_heads": 3}, "multiple of kv_heads"),
        ({"layer": -1}, "layer index"),
        ({"calibrations": {"walshkv:3.5": {}}}, "not among codecs"),
    ],
)
def test_attention_config_refuses_before_any_work(fields, match):
    with pytest.raises(ValueError, match=match):
        AttentionBenchConfig(**fields)


def test_attention_config_keeps_tuples():
    config = AttentionBenchConfig([64, 128], ["int4"])
    assert config.kv_lens == (64, 128) and config.codecs == ("int4",)


def test_prerope_rows_time_their_key_transform_alone():
    # what limits a prerope+ row: mapping every cached key with a d x d matrix; torch's own matmul of the same
    # multiply-adds is timed in the same rounds and bounds what any float32 kernel doing that could reach
    from walshkv.bench.generation import shipped_preset_file
    from walshkv.bench.report import format_attention_table, targets
    from walshkv.export import read_kv_mean_center

    path = shipped_preset_file("smollm2-135m", "walshkv:4.5")
    cal = read_kv_mean_center(path)
    config = AttentionBenchConfig(
        [64, 1000], ["walshkv:4.5", "rot+int4"], calibration=cal, layer=3, model="smollm2-135m", repeats=1
    )
    rows = bench_attention(replace(config, progress=False))
    assert [r["method"] for r in rows[:5]] == ["sdpa-fp16", "sdpa-bf16", "sdpa-fp32", "walshkv:4.5", "rot+int4"]
    pre = [r for r in rows if r["method"] == "walshkv:4.5"]
    assert pre[1]["k_transform_macs"] == 3 * 1000 * 64 * 64  # kv heads x keys x head_dim^2
    for r in pre:
        assert r["k_transform_matmul_ms"] > 0 and r["k_transform_bound_vs_best_sdpa"] > 0
        assert r["k_transform_kernel_gmacs"] == pytest.approx(r["k_transform_macs"] / r["seconds"] / 1e9)
    assert all("k_transform_macs" not in r for r in rows if r["method"] != "walshkv:4.5")
    table = format_attention_table(rows, 10.0, "github")
    assert "K stored before RoPE (`prerope+`)" in table and "bound: x vs fastest SDPA" in table
    result = {"meta": {"copy_bandwidth_gb_per_s": 10.0}, "attention": [r | {"kv_len": 16384} for r in rows]}
    (line,) = [t for t in targets(result) if "the presets' codecs" in t]
    assert "its prerope+ K transform alone, as a torch matmul, allows at most x" in line
    assert format_attention_table(rows[:3], 10.0).count("prerope") == 0


def test_cli_attention_runs_presets_side_by_side_with_their_shipped_files(tmp_path):
    # without --kv-mean-center each preset takes the file this checkout ships for --model, so two presets chosen
    # with different files run in one bench (their ratios paired per round)
    from walshkv.presets import resolve_preset

    out = tmp_path / "b"
    argv = ["bench", "attention", "--kv-len", "64", "--codec", "walshkv:3.5", "--codec", "walshkv:4.5"]
    assert main([*argv, "--repeats", "1", "--out", str(out), "--quiet", "--no-plot"]) == 0
    rows = {r["method"]: r for r in json.loads((out / "bench.json").read_text())["attention"]}
    for name in ("walshkv:3.5", "walshkv:4.5"):
        assert rows[name]["spec"] == resolve_preset(name, model="smollm2-135m").spec, name


@pytest.mark.parametrize("model", ["qwen2.5-1.5b", "gemma3-270m"])
def test_cli_attention_takes_the_models_shapes_and_presets(tmp_path, model):
    # --model sets head_dim, kv and query heads from the model's config (no weights loaded) and the presets take
    # the files this checkout ships for that model: qwen2.5-1.5b's GQA 6 at head_dim 128, gemma3-270m's 256
    from walshkv.bench import attention_shapes
    from walshkv.models import MODELS
    from walshkv.presets import resolve_preset

    info = MODELS[model]
    shapes = attention_shapes(model)
    assert shapes == {"head_dim": info.head_dim, "kv_heads": info.kv_heads, "q_heads": info.q_heads}
    out = tmp_path / "b"
    argv = ["bench", "attention", "--model", model, "--kv-len", "40", "--codec", "walshkv:3.5", "--codec", "int4"]
    assert main([*argv, "--repeats", "1", "--out", str(out), "--quiet", "--no-plot"]) == 0
    result = json.loads((out / "bench.json").read_text())
    assert result["meta"]["attention_model"] == {"model": model, **shapes}
    rows = {r["method"]: r for r in result["attention"]}
    assert rows["walshkv:3.5"]["spec"] == resolve_preset("walshkv:3.5", model=model).spec
    per_token = 2 * shapes["kv_heads"] * shapes["head_dim"] * 2  # K and V in fp16
    assert rows["sdpa-fp16"]["cache_bytes"] == 40 * per_token
    assert f"head_dim {shapes['head_dim']}" in (out / "bench.md").read_text()


def test_attention_shapes_refuses_what_it_cannot_read_without_loading():
    from walshkv.bench import attention_shapes

    with pytest.raises(ValueError, match="registry name"):
        attention_shapes("some/hub-id")


def test_attention_targets_judge_the_presets_with_and_without_a_dense_key_map_apart():
    """Issue 35's target line per group: the presets whose keys take eq+'s dense map before RoPE, the ones with no
    per-key matrix (the block frame, eqd+), and rot+int4/q4_0; each group's worst row is named with its ratio."""
    from walshkv.bench.report import targets

    def row(method, spec, x):
        return {
            "kv_len": 16384,
            "method": method,
            "spec": spec,
            "speedup_vs_best_sdpa": x,
            "speedup_vs_sdpa_fp16": 4 * x,
            "gb_per_s": 3.0,
        }

    rows = [
        row("walshkv:3.5", "sink:1:prerope+center+eq+tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2", 0.5),
        row("walshkv:3.5-fast", "sink:1:ropeblock:64+eqr:64+tcq:3.5:norm=8:tables=2/tcq:3:norm=8:tables=2", 3.1),
        row("walshkv:3-fast", "sink:1:ropeblock:64+eqr:64+tcq:3:norm=8:tables=2/tcq:2.5:norm=8:tables=2", 2.7),
        row("rot+int4", None, 4.0),
    ]
    lines = [t for t in targets({"meta": {"copy_bandwidth_gb_per_s": 10.0}, "attention": rows}) if "SDPA of" in t]
    dense, fast, ints = lines
    assert "with a dense per-key map" in dense and "worst walshkv:3.5 at 16,384: x0.50: missed" in dense
    assert "with no dense per-key map" in fast and "worst walshkv:3-fast at 16,384: x2.70: met" in fast
    assert "rot+int4 and q4_0" in ints and "x4.00: met" in ints and "30% of the copy bandwidth" in ints
