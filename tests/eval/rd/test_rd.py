"""``walshkv rd``: K/V/query capture, the measurement, outputs and the CLI, on the tiny model (no download)."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import walshkv.eval.rd as rd
import walshkv.eval.rd.measure as rd_measure
import walshkv.eval.rd.report as rd_report
import walshkv.models
from walshkv.cli import main
from walshkv.data import Text
from walshkv.eval.rd import RDConfig, capture_window, lloyd_max_points, measure_rd, resolve_specs, shannon_bound
from walshkv.models import LoadedModel, _describe

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


def test_capture_gives_the_tensors_attention_uses(tiny_lm):
    model = tiny_lm.model
    ids = torch.arange(3, 35)
    seen = {}
    hook = model.model.layers[1].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args: seen.__setitem__("attn", args[0].detach())
    )
    try:
        with torch.inference_mode():
            ref = model(input_ids=ids.view(1, -1)).logits
        ks, vs, qs = capture_window(tiny_lm, ids)
    finally:
        hook.remove()
    assert model.config._attn_implementation == "sdpa"  # restored
    assert len(ks) == len(vs) == len(qs) == 2
    assert ks[1].shape == (1, 2, 32, 16) and qs[1].shape == (1, 4, 32, 16)
    # softmax(q k^T / sqrt(d), causal) v with the captured tensors is what went into o_proj
    q, k, v = qs[1], ks[1].repeat_interleave(2, dim=1), vs[1].repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / 4.0
    scores = scores.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, 32, -1)
    assert torch.allclose(attn, seen["attn"], atol=1e-5)
    # and recording changed nothing
    with torch.inference_mode():
        again = model(input_ids=ids.view(1, -1)).logits
    assert torch.equal(ref, again)


def test_references():
    assert shannon_bound(1) == 0.25 and shannon_bound(3) == 2.0**-6
    pts = dict(lloyd_max_points(4))
    assert pts[1] == pytest.approx(0.3634, rel=1e-3) and pts[4] == pytest.approx(0.009497, rel=1e-3)


def test_resolve_specs():
    assert resolve_specs(["tq:3.0", "tq:3", "int4/int3"]) == (["tq:3", "int4/int3"], [])
    kept, skipped = resolve_specs(["int4", "nope:1", "rot+int4"], head_dim=12, strict=False)
    assert kept == ["int4"] and [s["codec"] for s in skipped] == ["nope:1", "rot+int4"]
    with pytest.raises(ValueError, match="--codec 'nope:1'"):
        resolve_specs(["nope:1"])


def test_measure_rd_on_tiny_model(tiny_lm):
    specs = ["fp32", "int8", "int4", "int2", "tq:2", "tqprod:3", "int4/tq:3"]
    res = measure_rd(tiny_lm, TEXT, RDConfig(specs, tokens=128, ctx=64, progress=False))
    rows = {r["codec"]: r for r in res.rows}
    assert list(rows) == sorted(rows, key=lambda c: (rows[c]["bits_per_element"], c))
    assert rows["fp32"]["nmse_k"] == 0.0 and rows["fp32"]["logit_rel_mse"] == 0.0
    assert rows["fp32"]["logit_slope"] == pytest.approx(1.0, abs=1e-12)
    assert rows["int8"]["nmse_k"] < rows["int4"]["nmse_k"] < rows["int2"]["nmse_k"]
    assert rows["int8"]["nmse_v"] < rows["int4"]["nmse_v"] < rows["int2"]["nmse_v"]
    mixed = rows["int4/tq:3"]
    assert mixed["nmse_k"] == pytest.approx(rows["int4"]["nmse_k"])
    assert mixed["bits_k"] == 5.0 and mixed["bits_v"] == 4.0  # head_dim 16: +16 bits of scale/norm
    for r in res.rows:
        assert len(r["nmse_k_layers"]) == 2 and len(r["logit_slope_layers"]) == 2
        assert r["nmse_k"] == pytest.approx(sum(r["nmse_k_layers"]) / 2)
        if r["codec"] != "fp32":
            assert r["gap_db_k"] == pytest.approx(10 * math.log10(r["nmse_k"] / 2 ** (-2 * r["bits_k"])))
    meta = res.meta
    assert meta["windows"] == 2 and meta["tokens_captured"] == 128
    assert meta["model"]["name"] == "tiny-llama" and meta["text"]["name"] == "toy"
    assert "causal" in meta["logits"]


def test_measure_rd_errors(tiny_lm):
    with pytest.raises(ValueError, match="power-of-two"):
        resolve_specs(["rot+int4"], head_dim=12)
    with pytest.raises(ValueError, match="head_dim must be a multiple of 32"):  # the fit, before any forward
        measure_rd(tiny_lm, TEXT, RDConfig(["int4", "q4_0"], tokens=64, ctx=64, progress=False))
    with pytest.raises(ValueError, match="window"):
        measure_rd(tiny_lm, Text("short", "x", "abc" * 10), RDConfig(["int4"], tokens=64, ctx=64, progress=False))


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"codecs": "int4"}, "codecs is a list of cache specs: give ['int4'], not 'int4'"),
        ({"codecs": []}, "no codec specs to measure"),
        ({"codecs": ["int4", "nope"]}, "--codec 'nope': unknown codec"),
        ({"ctx": 3}, "--ctx must be at least 4 tokens, got 3"),
        ({"tokens": 32, "ctx": 64}, "--tokens (32) must be at least --ctx (64): rd captures whole windows"),
        ({"tokens": 0}, "--tokens (0) must be at least --ctx (512): rd captures whole windows"),
    ],
)
def test_rd_config_refuses_bad_settings(settings, message):
    with pytest.raises(ValueError) as err:
        RDConfig(**{"codecs": ["int4"], **settings})
    assert str(err.value).startswith(message)


def test_rd_config_keeps_tuples():
    config = RDConfig(["int4", "tq:3"], skipped=[{"codec": "x", "reason": "y"}])
    assert config.codecs == ("int4", "tq:3") and config.skipped == ({"codec": "x", "reason": "y"},)
    assert (config.tokens, config.ctx, config.calibration, config.command) == (4096, 512, None, None)


def test_codec_failing_on_the_data_is_reported_not_fatal(tiny_lm, monkeypatch):
    real = rd.capture_window

    def huge(lm, ids, queries=True):
        ks, vs, qs = real(lm, ids, queries)
        return [k * 1e5 for k in ks], vs, qs  # K norms beyond fp16

    monkeypatch.setattr(rd_measure, "capture_window", huge)
    res = measure_rd(tiny_lm, TEXT, RDConfig(["fp32", "tq:3"], tokens=64, ctx=64, progress=False))
    rows = {r["codec"]: r for r in res.rows}
    assert rows["fp32"]["error"] is None
    assert "fp16" in rows["tq:3"]["error"] and math.isnan(rows["tq:3"]["nmse_k"])
    assert "tq:3" in rd.format_rd_table(res.rows)


def test_cli_writes_json_csv_md_png(tmp_path, tiny_lm, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    text = tmp_path / "toy.txt"
    text.write_text(TEXT.content)
    out = tmp_path / "rd"
    argv = ["rd", "--model", "tiny", "--text", str(text), "--tokens", "64", "--ctx", "64", "--out", str(out)]
    assert main([*argv, "--codec", "int4", "--codec", "tq:3", "--codec", "tqprod:3", "--quiet"]) == 0
    stdout = capsys.readouterr().out
    assert "nMSE K" in stdout and "tqprod:3" in stdout and "wrote" in stdout
    payload = json.loads((out / "rd.json").read_text())
    assert [r["codec"] for r in payload["results"]] == ["tq:3", "int4", "tqprod:3"]
    assert payload["meta"]["command"].startswith("walshkv rd --model tiny")
    with (out / "rd.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert [r["codec"] for r in rows] == ["tq:3", "int4", "tqprod:3"] and float(rows[0]["nmse_k"]) > 0
    assert "| tq:3" in (out / "rd.md").read_text()
    assert (out / "rd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_default_list_skips_what_does_not_fit(tmp_path, tiny_lm, monkeypatch, capsys):
    monkeypatch.setattr(walshkv.models, "load_model", lambda name, progress=True: tiny_lm)
    monkeypatch.setattr(rd, "DEFAULT_RD_CODECS", ("int4", "tq:3", "q4_0", "no-such-codec"))
    text = tmp_path / "toy.txt"
    text.write_text(TEXT.content)
    out = tmp_path / "rd"
    argv = ["rd", "--text", str(text), "--tokens", "64", "--ctx", "64", "--out", str(out), "--quiet", "--no-plot"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "skipped no-such-codec" in err
    payload = json.loads((out / "rd.json").read_text())
    assert {r["codec"] for r in payload["results"]} == {"int4", "tq:3"}  # q4_0: parses or not, head_dim 16 fails
    assert "no-such-codec" in {s["codec"] for s in payload["meta"]["skipped"]}
    assert not (out / "rd.png").exists()


def test_cli_errors_before_loading(tmp_path, monkeypatch, capsys):
    def no_load(*a, **k):
        raise AssertionError("the model must not be loaded")

    monkeypatch.setattr(walshkv.models, "load_model", no_load)
    assert main(["rd", "--codec", "tq:9", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "tq:9" in err and "1, 1.5, 2" in err
    assert main(["rd", "--tokens", "100", "--ctx", "512"]) == 2
    assert "at least --ctx" in capsys.readouterr().err
    assert main(["rd", "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err


def test_plot_skipped_without_matplotlib(tmp_path, tiny_lm, monkeypatch, capsys):
    def no_mpl(*a, **k):
        raise ImportError("no matplotlib")

    monkeypatch.setattr(rd_report, "plot_rd", no_mpl)
    res = measure_rd(tiny_lm, TEXT, RDConfig(["int4"], tokens=64, ctx=64, progress=False))
    written = rd.write_rd_outputs(res, tmp_path)
    assert [p.name for p in written] == ["rd.json", "rd.csv", "rd.md"]
    assert "rd plots skipped: matplotlib is not installed" in capsys.readouterr().err
