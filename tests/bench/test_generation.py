"""``walshkv bench generation`` with presets: calibration inputs, refusals, the DynamicCache fp32/bf16
rows, the per-step split and the ISA (tiny model; timings are not asserted)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import walshkv.bench.generation
from walshkv.bench import (
    GenerationBenchConfig,
    GenerationCodec,
    bench_generation,
    bench_markdown,
    combine_runs,
    crossover,
    default_generation_codecs,
    format_generation_table,
    format_run_spread,
    position_notes,
    resolve_generation_codecs,
    targets,
)
from walshkv.bench.generation import shipped_preset_file
from walshkv.calibration import KVStats
from walshkv.cli import main
from walshkv.codecs.builtin_presets import BUILTIN
from walshkv.export import KMeanBias

# Fixtures: a tiny model saved as a folder (the generation runs load it in a subprocess, by path) and a
# preset file made for it. (Here, not in a tests/bench/conftest.py: a second module named conftest would
# shadow the root one that other tests import helpers from.)
#: A calibration text (never the bench text, python-docs).
CALIB_TEXT = "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(3000))
#: The spec the tiny model's preset file chooses for walshkv:3.5: the parts of smollm2-135m's shipped one.
TINY_PRESET_SPEC = "sink:1:layers:prerope+center+eq+tq:3.5/tq:2.5@1;prerope+center+eq+tq:3.5/tq:3"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer llama (head_dim 64, one KV head, GQA 2) with a character tokenizer, saved as a model folder."""
    import torch
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("models") / "tiny-bench"
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "\n": 3, **{chr(c): c - 28 for c in range(32, 127)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(4)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_preset_spec() -> str:
    """The spec the tiny model's walshkv:3.5 file chooses."""
    return TINY_PRESET_SPEC


@pytest.fixture(scope="session")
def calib_text_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("texts") / "calib.txt"
    path.write_text(CALIB_TEXT)
    return path


@pytest.fixture(scope="session")
def tiny_preset_file(tiny_model_dir: Path, calib_text_file: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The walshkv:3.5 file of the tiny model, as `walshkv recommend` writes it (it chooses TINY_PRESET_SPEC)."""
    from walshkv.calibration import collect_kv_stats
    from walshkv.data import load_text
    from walshkv.models import load_model
    from walshkv.preset_file import write_preset_file
    from walshkv.presets import Preset

    lm = load_model(str(tiny_model_dir), progress=False)
    stats = collect_kv_stats(lm, load_text(str(calib_text_file)), tokens=256, ctx=128, progress=False)
    path = tmp_path_factory.mktemp("presets") / "walshkv-3.5.gguf"
    write_preset_file(path, lm, Preset("walshkv:3.5", 3.5, TINY_PRESET_SPEC), stats)
    return path


SMOLLM2_FILE = shipped_preset_file("smollm2-135m", "walshkv:3.5")  # shipped with the package
NEW_COLUMNS = ("update_ms", "attn_ms", "other_ms", "step_ms", "cpu", "cpu_capability", "cpu_flags")


def test_preset_rows_end_to_end(tiny_model_dir, tiny_preset_file, tiny_preset_spec, tmp_path, capsys):
    """A preset with its file, next to DynamicCache bf16 (the fp32 row: tests/bench/test_bench.py): every row in
    JSON, CSV and markdown. Two subprocesses (most of their time is importing transformers)."""
    out = tmp_path / "b"
    argv = ["bench", "generation", "--model", str(tiny_model_dir), "--ctx", "40", "--new-tokens", "2"]
    argv += ["--prefill-chunk", "32", "--gen-codec", "walshkv:3.5", "--kv-mean-center", str(tiny_preset_file)]
    assert main([*argv, "--dynamic-dtype", "bfloat16", "--out", str(out), "--quiet", "--no-plot"]) == 0
    printed = capsys.readouterr().out
    assert f"fused walshkv:3.5 = {tiny_preset_spec}" in printed and "update ms" in printed
    data = json.loads((out / "bench.json").read_text())
    rows = data["generation"]
    assert [(r["cache"], r["dtype"]) for r in rows] == [("dynamic", "bfloat16"), ("fused", "float32")]
    bf16, preset = rows
    assert preset["codec"] == tiny_preset_spec and preset["preset"] == "walshkv:3.5"  # the file chose the spec
    assert preset["calibration"].endswith("walshkv-3.5.gguf") and "calibration_file" not in preset
    assert bf16["label"] == "DynamicCache bf16 (model in bf16)" and bf16["weights_bytes"] * 2 == preset["weights_bytes"]
    assert bf16["speedup_vs_dynamic_bf16"] == 1.0 and preset["speedup_vs_dynamic_bf16"] > 0
    assert preset["speedup_vs_dynamic"] is None  # no fp32 row in this run
    for r in rows:
        assert all(k in r for k in NEW_COLUMNS), r
        assert r["update_ms"] > 0 and r["attn_ms"] > 0 and r["update_ms"] + r["attn_ms"] < 2 * r["step_ms"]
        assert r["cpu_capability"] and r["peak_rss"] >= r["rss_after_load"] > 0
    assert isinstance(preset["cpu_kernel"], bool) and bf16["cpu_kernel"] is None
    assert preset["cache_bytes"] < bf16["cache_bytes"] / 3  # 3.5-bit codes against a bf16 cache
    assert preset["prefill_update_seconds"] > 0 and preset["prefill_attn_seconds"] > 0
    assert list(data["meta"]["crossover_context"]) == [f"walshkv:3.5 = {tiny_preset_spec}"]
    with (out / "bench.csv").open() as fh:
        header = next(csv.reader(fh))
    assert {*NEW_COLUMNS, "speedup_vs_dynamic_bf16", "prefill_vs_dynamic", "preset", "dtype"} <= set(header)
    md = (out / "bench.md").read_text()
    assert "| update ms" in md and "x vs Dynamic bf16" in md and f"ISA {preset['cpu_capability']}" in md
    assert f"Calibration: walshkv:3.5: {preset['calibration']}" in md


def test_a_preset_without_calibration_names_the_fix():
    with pytest.raises(ValueError, match=r"--gen-codec walshkv:3\.5 needs its calibration") as err:
        resolve_generation_codecs("smollm2-135m", ["walshkv:3.5"])  # refused before the model loads
    msg = str(err.value)
    assert "--kv-mean-center FILE" in msg and "walshkv calibrate --preset walshkv:3.5 --model smollm2-135m" in msg
    assert "--calib-text TEXT" in msg
    assert SMOLLM2_FILE is not None and SMOLLM2_FILE.is_file()  # walshkv ships it, so the message names it
    assert f"(walshkv ships walshkv/calibrations/smollm2-135m/{SMOLLM2_FILE.name})" in msg
    with pytest.raises(ValueError, match=r"center\+, eq\+.*--kv-mean-center FILE"):
        resolve_generation_codecs("smollm2-135m", ["rot+int4", "center+tq:4/tq:2.5"])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"codecs": ["walshkv:9"]},
            "unknown preset 'walshkv:9'; presets: walshkv:2.5, walshkv:3, walshkv:3.5, walshkv:4.5",
        ),
        ({"codecs": ["walshkv:3.5"], "kv_mean_center": "missing.gguf"}, "missing.gguf: no such file"),
        ({"codecs": None, "kv_mean_center": "x.gguf"}, "add --gen-codec SPEC"),
        ({"codecs": None, "calib_text": "t.txt"}, "add --gen-codec SPEC"),
        ({"codecs": []}, "no generation codec"),
        ({"codecs": ["walshkv:3.5"], "calib_text": "t.txt", "calib_tokens": 0}, "--calib-tokens must be at least 1"),
    ],
)
def test_argument_errors_before_loading(kwargs, words):
    with pytest.raises(ValueError) as err:
        resolve_generation_codecs("smollm2-135m", **kwargs)
    assert words in str(err.value)


def test_cli_generation_flags_need_the_generation_part(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--gen-codec", "rot+int4", "--quiet"])
    assert "unrecognized arguments: --gen-codec rot+int4" in capsys.readouterr().err
    # the deprecated --part takes every option and refuses these in one line, as before it was deprecated
    assert main(["bench", "--part", "attention", "--gen-codec", "rot+int4", "--quiet"]) == 2
    assert "--gen-codec is for the generation part: run `walshkv bench generation`" in capsys.readouterr().err
    assert main(["bench", "generation", "--gen-codec", "center+tq:4/tq:2.5", "--quiet"]) == 2
    assert "add --kv-mean-center FILE" in capsys.readouterr().err


def test_cli_generation_presets_take_the_checkouts_files(monkeypatch):
    # without --kv-mean-center / --calib-text a preset takes the file this checkout ships for --model (what the
    # attention part does too); a spec without a file is passed on as it is
    import walshkv.bench as bench

    seen = {}

    def capture(model, codecs, **kw):
        seen.update(model=model, codecs=codecs, kw=kw)
        raise ValueError("stop here")

    monkeypatch.setattr(bench, "resolve_generation_codecs", capture)
    assert main(["bench", "generation", "--gen-codec", "walshkv:3.5", "--gen-codec", "rot+int4"]) == 2
    shipped = shipped_preset_file("smollm2-135m", "walshkv:3.5")
    assert shipped is not None and seen["codecs"] == [("walshkv:3.5", str(shipped)), "rot+int4"]
    assert seen["kw"]["kv_mean_center"] is None
    with pytest.raises(ValueError, match=r"dynamic dtype 'float16' \(--dynamic-dtype\): choose from float32, bfloat16"):
        GenerationBenchConfig("smollm2-135m", [8], ["rot+int4"], dynamic_dtypes=["float16"], progress=False)


def test_file_for_another_model_or_preset_and_calib_text_on_the_bench_text(tiny_model_dir, tiny_preset_file):
    assert SMOLLM2_FILE is not None and SMOLLM2_FILE.is_file(), "walshkv ships smollm2-135m's calibration"
    with pytest.raises(ValueError, match="calibrated on 'smollm2-135m', not 'tiny-bench'"):
        resolve_generation_codecs(str(tiny_model_dir), ["walshkv:3.5"], kv_mean_center=SMOLLM2_FILE)
    with pytest.raises(ValueError, match=r"was written for walshkv:3\.5, not walshkv:3: give each preset its own"):
        resolve_generation_codecs(str(tiny_model_dir), ["walshkv:3"], kv_mean_center=tiny_preset_file)
    with pytest.raises(ValueError, match="--calib-text is the evaluation text"):
        resolve_generation_codecs(str(tiny_model_dir), ["walshkv:3.5"], calib_text="python-docs", progress=False)


def test_calibration_inputs_resolve_as_in_eval(tiny_model_dir, tiny_preset_file, tiny_preset_spec, calib_text_file):
    """A file chooses its preset's spec; a calibration text gives the built-in spec; specs that need nothing get
    no calibration."""
    (preset, plain), notes = resolve_generation_codecs(
        str(tiny_model_dir), ["walshkv:3.5", "rot+int4"], kv_mean_center=tiny_preset_file
    )
    assert notes == []
    assert (preset.spec, preset.preset, preset.name) == (
        tiny_preset_spec,
        "walshkv:3.5",
        f"walshkv:3.5 = {tiny_preset_spec}",
    )
    assert isinstance(preset.calibration, KMeanBias) and preset.calibration_source.endswith("walshkv-3.5.gguf")
    assert (plain.spec, plain.preset, plain.calibration, plain.calibration_source) == ("rot+int4", None, None, None)
    (text_preset,), _ = resolve_generation_codecs(
        str(tiny_model_dir), ["walshkv:3.5"], calib_text=str(calib_text_file), calib_tokens=128, progress=False
    )
    assert text_preset.spec == BUILTIN["walshkv:3.5"] and isinstance(text_preset.calibration, KVStats)
    assert text_preset.calibration_source == f"{calib_text_file} (128 tokens)"
    # per-codec files (what the default table passes) and specs without calibration load no model
    (spec,), _ = resolve_generation_codecs("not-a-model", ["q4_0"])
    assert spec.spec == "q4_0" and spec.calibration is None


def test_default_table_has_the_shipped_presets(tmp_path, monkeypatch):
    """walshkv ships the calibration of every preset of smollm2-135m (each becomes a row; the four plain presets
    read one file, the four fast ones another); a model whose presets lack some leaves those rows out with a note
    naming the fix."""
    plain = ["walshkv:2.5", "walshkv:3", "walshkv:3.5", "walshkv:4.5"]
    names = [*plain, *(f"{n}-fast" for n in plain)]
    files = [shipped_preset_file("smollm2-135m", name) for name in names]
    assert all(f is not None and f.is_file() for f in files), "walshkv ships smollm2-135m's eight presets' files"
    assert len(set(files)) == 2
    requests, notes = default_generation_codecs("smollm2-135m")
    assert requests == ["rot+int4", "q4_0", *((n, str(f)) for n, f in zip(names, files, strict=True))]
    assert notes == []
    real = walshkv.bench.generation.shipped_file  # only walshkv:3.5 (and its fast form) shipped
    monkeypatch.setattr(
        walshkv.bench.generation,
        "shipped_file",
        lambda model, preset: real(model, preset) if preset in ("walshkv:3.5", "walshkv:3.5-fast") else None,
    )
    requests, notes = default_generation_codecs("smollm2-135m")
    assert [r[0] if isinstance(r, tuple) else r for r in requests] == [
        "rot+int4",
        "q4_0",
        "walshkv:3.5",
        "walshkv:3.5-fast",
    ]
    assert len(notes) == 1
    assert "for walshkv:2.5, walshkv:3, walshkv:4.5, so the default table has no row for them" in notes[0]
    assert "walshkv calibrate --preset walshkv:2.5 --model smollm2-135m -o FILE" in notes[0]
    monkeypatch.undo()
    requests, notes = default_generation_codecs("tiny-model-without-presets")
    assert requests == ["rot+int4", "q4_0"]
    assert len(notes) == 1 and "walshkv ships no calibration for tiny-model-without-presets" in notes[0]
    assert "walshkv calibrate --preset walshkv:2.5 " in notes[0] and "--kv-mean-center FILE" in notes[0]


def test_bench_generation_refuses_mixed_codec_kinds():
    with pytest.raises(TypeError, match="not both"):
        GenerationBenchConfig("smollm2-135m", [8], [GenerationCodec("int4"), "int8"], progress=False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"codecs": "int4"}, "codecs is a list of cache specs or presets: give ['int4'], not 'int4'"),
        (
            {"codecs": [GenerationCodec("int4")], "kv_mean_center": "f.gguf"},
            "kv_mean_center and calib_text calibrate codecs given as specs or presets; GenerationCodec objects carry "
            "their own calibration (resolve_generation_codecs)",
        ),
        ({"contexts": []}, "contexts (--ctx) must be token counts of at least 1, got []"),
        ({"contexts": [8, 0]}, "contexts (--ctx) must be token counts of at least 1, got [8, 0]"),
        ({"prefill": "lazy"}, "--prefill must be one of quantized, exact, got 'lazy'"),
        ({"calib_tokens": 0}, "--calib-tokens must be at least 1 token, got 0"),
        ({"new_tokens": 0}, "--new-tokens must be at least 1 token, got 0"),
        ({"prefill_chunk": 0}, "--prefill-chunk must be at least 1 token, got 0"),
        ({"decoded_max_ctx": 0}, "decoded_max_ctx must be at least 1 token, got 0"),
        ({"runs": True}, "runs (--gen-runs) must be a whole number >= 1, got True"),
        ({"runs": 1.5}, "runs (--gen-runs) must be a whole number >= 1, got 1.5"),
        (
            {"malloc_mmap_threshold": -1},
            "--malloc-mmap-threshold must be at least 0 bytes (0: glibc's default), got -1",
        ),
    ],
)
def test_generation_bench_config_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError) as err:
        GenerationBenchConfig(**settings)
    assert str(err.value) == message


def test_generation_bench_config_defaults_and_tuples():
    config = GenerationBenchConfig(contexts=[8, 16], codecs=["int4"], dynamic_dtypes=["float32"])
    assert (config.contexts, config.codecs, config.dynamic_dtypes) == ((8, 16), ("int4",), ("float32",))
    assert not config.resolved and GenerationBenchConfig(codecs=[]).resolved
    assert GenerationBenchConfig(codecs=[GenerationCodec("int4")]).resolved
    default = GenerationBenchConfig()
    assert (default.model, default.contexts, default.codecs, default.runs) == (
        "smollm2-135m",
        (1024, 8192, 32768),
        None,
        1,
    )


def _row(ctx, cache, x, *, codec=None, preset=None, dtype="float32", **extra):
    return {
        "model": "m",
        "ctx": ctx,
        "cache": cache,
        "dtype": dtype,
        "codec": codec,
        "preset": preset,
        "new_tokens": 16,
        "speedup_vs_dynamic": x,
        "decode_tokens_per_s": x,
        "prefill_seconds": 1.0,
        "cache_bytes": 2**20,
        "rss_after_load": 100 * 2**20,
        "peak_rss": 150 * 2**20,
        "peak_minus_loaded_minus_cache": 0,
        **extra,
    }


def test_report_of_presets_and_old_rows():
    spec = "sink:1:prerope+center+eq+tq:4/tq:2.5"
    gen = [
        _row(8192, "dynamic", 1.0, speedup_vs_dynamic_bf16=1.5, prefill_vs_dynamic=1.0, label="DynamicCache fp32"),
        _row(8192, "dynamic", 0.7, dtype="bfloat16", speedup_vs_dynamic_bf16=1.0, label="DynamicCache bf16"),
        _row(8192, "fused", 2.1, codec=spec, preset="walshkv:3.5", speedup_vs_dynamic_bf16=1.2, prefill_vs_dynamic=1.1),
        _row(8192, "fused", 3.0, codec="rot+int4", update_ms=0.5, attn_ms=1.0, other_ms=3.0, step_ms=4.5),
    ]
    table = format_generation_table(gen)
    assert "fused (rot+int4)" in table and "update ms" in table and "3.00" in table
    lines = targets({"generation": gen})
    preset_line = next(line for line in lines if line.startswith("- walshkv:3.5"))
    assert "2x DynamicCache fp32: x2.10: met" in preset_line and "1.5x DynamicCache bf16: x1.20: missed" in preset_line
    assert "prefill at most 1.1x DynamicCache's: x1.10: met" in preset_line
    assert any("worst x3.00" in line for line in lines)  # issue 7's check reads the plain codecs only
    assert crossover(gen, "fused", "rot+int4") == 8192 and crossover(gen, "fused", spec) == 8192
    meta = {
        "machine": {"cpu": "c", "logical_cpus": 2, "torch": "t", "torch_threads": 2, "cpu_capability": "AVX2"},
        "command": "walshkv bench",
        "crossover_context": {f"walshkv:3.5 = {spec}": 8192},
        "notes": ["note: something"],
    }
    md = "\n".join(bench_markdown({"meta": meta, "generation": gen}))
    assert "(ISA AVX2)" in md and f"walshkv:3.5 = {spec}: 8192" in md and "note: something" in md
    old = {k: v for k, v in gen[3].items() if k not in ("update_ms", "attn_ms", "other_ms", "step_ms", "preset")}
    assert "rot+int4" in format_generation_table([old])  # a saved bench.json from before still renders


def test_position_notes():
    rows = [_row(8192, "dynamic", 1.0, max_position_embeddings=8192), _row(4096, "dynamic", 1.0)]
    (line,) = position_notes(rows)
    assert "ctx 8,192 + 16 new tokens passes m's max_position_embeddings 8,192" in line and "8,176" in line
    assert position_notes([_row(8176, "dynamic", 1.0, max_position_embeddings=8192)]) == []


def test_shipped_files_are_the_packages():
    package = Path(walshkv.bench.generation.__file__).resolve().parents[1] / "calibrations" / "smollm2-135m"
    assert shipped_preset_file("smollm2-135m", "walshkv:3.5").parent == package
    assert shipped_preset_file("smollm2-135m", "walshkv:7") is None
    assert shipped_preset_file("mystery-7b", "walshkv:3.5") is None  # a model walshkv does not list


def _run(step_ms, prefill, loaded_mib, peak_mib):
    row = _row(8176, "fused", 1.0, codec="rot+int4", label="fused rot+int4", malloc_mmap_threshold=0)
    seconds = step_ms / 1000
    row.update(
        decode_seconds_median=seconds,
        step_ms=step_ms,
        update_ms=1.0,
        attn_ms=2.0,
        other_ms=step_ms - 3.0,
        prefill_seconds=prefill,
        prefill_update_seconds=0.1,
        prefill_attn_seconds=0.2,
        rss_after_load=loaded_mib * 2**20,
        peak_rss=peak_mib * 2**20,
        decode_tokens_per_s=1 / seconds,
    )
    return row


def test_rows_of_several_runs_report_their_medians_and_spread():
    runs = [_run(100.0, 20.0, 550, 1400), _run(90.0, 22.0, 552, 1300), _run(95.0, 21.0, 549, 1350)]
    assert combine_runs(runs[:1]) is runs[0]
    row = combine_runs(runs)
    assert row["runs"] == 3 and row["step_ms"] == 95.0 and row["prefill_seconds"] == 21.0
    assert row["decode_tokens_per_s"] == pytest.approx(1000 / 95.0)
    assert row["peak_rss"] == 1350 * 2**20 and row["rss_after_load"] == 550 * 2**20
    assert row["peak_minus_loaded_minus_cache"] == (1350 - 550 - 1) * 2**20  # the columns agree with each other
    assert [v["peak_rss"] for v in row["run_values"]] == [r["peak_rss"] for r in runs]
    spread = format_run_spread([row])
    assert "90.0 - 100.0" in spread and "20.0 - 22.0" in spread and "1300 - 1400" in spread
    small = combine_runs([_run(80.0, 5.0, 550, 1200), _run(81.0, 5.0, 550, 1210), _run(82.0, 5.0, 550, 1190)])
    small["ctx"] = 3072
    (line,) = [x for x in targets({"generation": [small, row]}) if x.startswith("- Peak memory")]
    assert "glibc's default allocator settings (medians of 3 runs)" in line
    meta = {
        "machine": {"cpu": "c", "logical_cpus": 2, "torch": "t", "torch_threads": 2},
        "command": "walshkv bench",
        "crossover_context": {},
    }
    md = "\n".join(bench_markdown({"meta": meta, "generation": [small, row]}))
    assert "median of its runs" in md and "| runs" in md


def test_runs_must_be_a_whole_number(capsys):
    with pytest.raises(ValueError, match=r"runs \(--gen-runs\) must be a whole number >= 1, got 0"):
        bench_generation(GenerationBenchConfig("smollm2-135m", [8], ["int4"], runs=0, progress=False))
    assert main(["bench", "generation", "--gen-runs", "0", "--quiet"]) == 2
    assert "runs (--gen-runs) must be a whole number >= 1, got 0" in capsys.readouterr().err
