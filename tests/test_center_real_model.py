"""K mean-centering on the real default model, smollm2-135m (llama architecture, 30 x 3 x 64)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import DynamicCache

from walshkv import CompressedCache
from walshkv.cli import main
from walshkv.data import load_text
from walshkv.export import KMeanBias, from_llamacpp_channel_order, read_kv_mean_center, to_llamacpp_channel_order
from walshkv.models import MODELS, _gguf_path, ensure_gguf

pytestmark = pytest.mark.model

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64
CALIB_TOKENS = 1024


@pytest.fixture(scope="module")
def gguf_reader() -> gguf.GGUFReader:
    info = MODELS["smollm2-135m"]
    path = ensure_gguf(info, progress=False)
    assert path == _gguf_path(info)
    return gguf.GGUFReader(str(path))


@pytest.fixture(scope="module")
def calibrated(smollm2, tmp_path_factory) -> tuple[Path, dict]:
    """`walshkv calibrate` through cli.main; also hands back what collect_kv_stats computed for it.

    The CLI gets the session's smollm2 (no second load) and collect_kv_stats is wrapped, not
    replaced, so the file can be compared with the statistics of the very same run.
    """
    import walshkv.calibration
    import walshkv.models

    seen: dict = {}
    real_collect = walshkv.calibration.collect_kv_stats

    def collect(lm, text, **kwargs):
        stats = real_collect(lm, text, **kwargs)
        seen.update(lm=lm, text=text.name, kwargs=kwargs, stats=stats)
        return stats

    def load(name: str, progress: bool = True):
        assert name == "smollm2-135m"
        return smollm2

    out = tmp_path_factory.mktemp("calib") / "smollm2-kv-mean.gguf"
    argv = ["calibrate", "--model", "smollm2-135m", "--text", "python-docs", "--tokens", str(CALIB_TOKENS)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(walshkv.calibration, "collect_kv_stats", collect)
        mp.setattr(walshkv.models, "load_model", load)
        assert main([*argv, "-o", str(out), "--quiet"]) == 0
    return out, seen


@pytest.fixture
def cli_model(monkeypatch, smollm2):
    """Let `walshkv eval` reuse the session's smollm2 instead of loading it again."""

    def load(name: str, progress: bool = True):
        assert name == "smollm2-135m"
        return smollm2

    monkeypatch.setattr("walshkv.models.load_model", load)
    return smollm2


def _k_weight_rows(reader: gguf.GGUFReader, layer: int) -> torch.Tensor:
    t = next(t for t in reader.tensors if t.name == f"blk.{layer}.attn_k.weight")
    rows = gguf.quants.dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))


# ---- (a) the channel mapping, checked against the GGUF's own K weights ---------------------------


@pytest.mark.parametrize("layer", [0, 29])
def test_channel_order_matches_the_gguf_k_weights(smollm2, gguf_reader, layer: int) -> None:
    gg = _k_weight_rows(gguf_reader, layer)  # [n_kv * head_dim, hidden], llama.cpp's row order
    hf = smollm2.model.model.layers[layer].self_attn.k_proj.weight.detach().to(torch.float32)
    hidden = hf.shape[1]
    assert gg.shape == hf.shape == (KV_HEADS * HEAD_DIM, hidden)

    per_head = hf.reshape(KV_HEADS, HEAD_DIM, hidden).transpose(1, 2)  # head_dim last: the permuted axis
    permuted = to_llamacpp_channel_order(per_head, "llama").transpose(1, 2).reshape(KV_HEADS * HEAD_DIM, hidden)
    torch.testing.assert_close(permuted, gg, rtol=0, atol=1e-6)  # both dequantized from the same Q4_1 blocks
    assert not torch.allclose(hf, gg, atol=1e-3)  # the permutation matters
    back = from_llamacpp_channel_order(gg.reshape(KV_HEADS, HEAD_DIM, hidden).transpose(1, 2), "llama")
    torch.testing.assert_close(back.transpose(1, 2).reshape(KV_HEADS * HEAD_DIM, hidden), hf, rtol=0, atol=1e-6)


# ---- (b) `walshkv calibrate` writes what the issue asks for ---------------------------------------


def test_calibrate_writes_the_acceptance_file(calibrated) -> None:
    path, _ = calibrated
    reader = gguf.GGUFReader(str(path))
    names = [t.name for t in reader.tensors]
    assert names == [f"kv_bar.blk.{il}.k" for il in range(LAYERS)]
    for t in reader.tensors:
        assert t.n_elements == KV_HEADS * HEAD_DIM == 192
        assert [int(n) for n in t.shape] == [HEAD_DIM, KV_HEADS]
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert np.isfinite(np.asarray(t.data)).all()
    assert "kv_mean_center.k_rot" in reader.fields
    assert reader.fields["kv_mean_center.k_rot"].contents() is False  # default --basis plain
    assert reader.fields["walshkv.architecture"].contents() == "llama"
    assert reader.fields["walshkv.tokens"].contents() == CALIB_TOKENS
    assert reader.fields["walshkv.text"].contents() == "python-docs"


def test_calibrated_mean_is_collect_kv_stats_mean(smollm2, calibrated) -> None:
    path, seen = calibrated
    assert seen["lm"] is smollm2 and seen["text"] == "python-docs" and seen["kwargs"]["tokens"] == CALIB_TOKENS
    stats = seen["stats"]
    assert stats.tokens == CALIB_TOKENS
    bias = read_kv_mean_center(path, model_arch="llama")
    bias.check_matches(LAYERS, KV_HEADS, HEAD_DIM, "smollm2-135m")
    want = torch.stack([stats.mean("k", il, "plain") for il in range(LAYERS)])
    assert bias.plain.shape == want.shape == (LAYERS, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(bias.plain, want, rtol=0, atol=1e-5)
    assert float(want.abs().max()) > 1.0  # real K has a sizeable mean: centering has something to remove
    # the file's tensors are that mean in llama.cpp's channel order
    stored = gguf.GGUFReader(str(path)).tensors[3]
    in_file = torch.from_numpy(np.asarray(stored.data, dtype=np.float32).reshape(KV_HEADS, HEAD_DIM).copy())
    torch.testing.assert_close(in_file.double(), to_llamacpp_channel_order(want[3], "llama"), rtol=0, atol=1e-5)


def test_real_bias_leaves_logits_unchanged(smollm2, calibrated) -> None:
    plain = read_kv_mean_center(calibrated[0], model_arch="llama")
    rot = KMeanBias(plain.plain, "rot", plain.arch, plain.source, plain.meta)  # same mean, rot basis
    ids = smollm2.tokenizer(load_text().content[5000:8000], return_tensors="pt").input_ids[:, :32]
    with torch.no_grad():
        ref = smollm2.model(input_ids=ids, cache=DynamicCache(config=smollm2.config), use_cache=True).logits
        for spec, bias in (("center+fp32", plain), ("center+rot+fp32", rot)):
            cache = CompressedCache(spec, config=smollm2.config, calibration=bias)
            got = smollm2.model(input_ids=ids, cache=cache, use_cache=True).logits
            torch.testing.assert_close(got, ref, rtol=0, atol=2e-3)
            assert torch.equal(got.argmax(-1), ref.argmax(-1))


# ---- the CLI with and without a bias file --------------------------------------------------------


def test_eval_center_without_calibration_names_kv_mean_center(cli_model, capsys) -> None:
    assert main(["eval", "--codec", "center+int4", "--quiet", "--windows", "1"]) == 2
    err = capsys.readouterr().err
    assert "--kv-mean-center" in err and "center+" in err


def test_eval_with_the_bias_file(cli_model, calibrated, tmp_path: Path, capsys) -> None:
    eval_text = tmp_path / "eval.txt"
    eval_text.write_text(load_text().content[-30000:], encoding="utf-8")
    out = tmp_path / "r.json"
    common = ["eval", "--kv-mean-center", str(calibrated[0]), "--windows", "1", "--ctx", "64", "--quiet"]
    assert main([*common, "--codec", "center+int4", "--text", str(eval_text), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["codec"] for r in result["results"]] == ["center+int4"]
    assert result["meta"]["calibration"]["kind"] == "kv-mean-center file"
    assert result["meta"]["calibration"]["basis"] == "plain"
    capsys.readouterr()
    # a file calibrated on the evaluation text is refused (before any forward pass)
    assert main([*common, "--codec", "center+int4"]) == 2
    assert "calibrate on other text" in capsys.readouterr().err
