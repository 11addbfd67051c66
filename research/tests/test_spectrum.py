"""Spectral lab: K before RoPE recovered exactly, band energies, reconstruction runs, LLL, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from walshkv.cli import main
from walshkv.data import Text
from walshkv.eval.capture import KVCapture, capture_kv, unrotate_keys
from walshkv.eval.rd import capture_window
from walshkv.export.kv_mean_center import to_llamacpp_channel_order
from walshkv.models import LoadedModel, _describe
from walshkv_research.reconstruct_report import format_lll_table, write_reconstruct_outputs
from walshkv_research.reconstruct_run import lll_measure, measure_reconstruction
from walshkv_research.spectrum import coefficient_energy, fraction_for_energy, measure_spectrum
from walshkv_research.spectrum_report import write_spectrum_outputs

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(1200)))


def _pre_rope_by_hook(model, ids, module_name):
    """The K projection's output (after k_norm where the model has one), per layer ``[1, kv, T, d]``."""
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        mod = getattr(attn, module_name)
        d = attn.head_dim

        def hook(m, args, out, i=i, d=d):
            # k_proj gives [1, T, kv*d]; gemma3's k_norm runs on [1, kv, T, d] (already transposed)
            seen[i] = out.detach() if out.dim() == 4 else out.detach().view(1, out.shape[1], -1, d).transpose(1, 2)

        hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            model(input_ids=ids.view(1, -1))
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize(("fixture", "module"), [("tiny_llama", "k_proj"), ("tiny_gemma3", "k_norm")])
def test_unrotated_keys_are_the_projection_output(request, toy_tokenizer, fixture, module):
    model = request.getfixturevalue(fixture)
    lm = LoadedModel(model, toy_tokenizer, fixture, "test", _describe(model))
    ids = torch.arange(3, 43)
    ks, _, _ = capture_window(lm, ids, queries=False)
    pre = _pre_rope_by_hook(model, ids, module)
    for i, k in enumerate(ks):
        assert not torch.allclose(k, pre[i], atol=1e-3)  # RoPE did change them
        assert torch.allclose(unrotate_keys(model, i, k), pre[i], atol=1e-5)


def test_capture_shapes_and_channel_order(tiny_llama, toy_tokenizer):
    lm = LoadedModel(tiny_llama, toy_tokenizer, "tiny", "test", _describe(tiny_llama))
    cap = capture_kv(lm, TEXT, tokens=128, ctx=64, progress=False)
    assert cap.k_post.shape == cap.k_pre.shape == cap.v.shape == (2, 2, 128, 16)
    llama = capture_kv(lm, TEXT, tokens=128, ctx=64, channel_order="llamacpp", progress=False)
    assert torch.equal(llama.k_post, to_llamacpp_channel_order(cap.k_post, "llama"))
    assert torch.equal(llama.v, cap.v)  # V is never permuted
    # the permutation is a bit rotation of the channel index: WHT energies are only permuted
    e_hf, e_ll = coefficient_energy(cap.k_post), coefficient_energy(llama.k_post)
    assert torch.allclose(e_hf.sort(dim=-1).values, e_ll.sort(dim=-1).values, atol=1e-12)
    with pytest.raises(ValueError, match="hf, llamacpp"):
        capture_kv(lm, TEXT, tokens=128, ctx=64, channel_order="neox", progress=False)


def test_energy_and_fraction_helpers():
    dc = torch.ones(1, 1, 5, 8)  # constant vectors: all energy in WHT coefficient 0
    share = coefficient_energy(dc)
    assert share[0, 0, 0].item() == pytest.approx(1.0) and share.sum().item() == pytest.approx(1.0)
    assert fraction_for_energy(torch.eye(8)) == pytest.approx(1 / 8)
    assert fraction_for_energy(torch.ones(3, 10)) == pytest.approx(0.9)  # 9 of 10 equal coefficients


def test_spectrum_of_known_signals(tmp_path):
    torch.manual_seed(0)
    dc = torch.ones(2, 1, 64, 16) + 0.01 * torch.randn(2, 1, 64, 16)
    cap = KVCapture(k_post=dc, k_pre=dc, v=torch.randn(2, 1, 64, 16), windows=1, ctx=64)
    res = measure_spectrum(cap, bands=4, meta={"model": {"name": "toy"}})
    k = next(r for r in res.rows if r["kind"] == "k_post" and r["order"] == "sequency")
    v = next(r for r in res.rows if r["kind"] == "v" and r["order"] == "natural")
    assert k["first_band_share"] > 0.99 and sum(k["band_share"]) == pytest.approx(1.0)
    assert abs(v["first_band_share"] - 0.25) < 0.1 and v["flatness"] > k["flatness"]
    assert len(res.per_layer["v"]["natural"]) == 2 and len(res.per_layer["v"]["natural"][0]) == 4
    written = write_spectrum_outputs(res, tmp_path)
    assert {p.name for p in written} >= {"spectrum.json", "spectrum.csv", "spectrum.md", "spectrum.png"}
    assert json.loads((tmp_path / "spectrum.json").read_text())["results"][0]["bands"] == 4
    with pytest.raises(ValueError, match="must divide head_dim 16"):
        measure_spectrum(cap, bands=3)


def test_reconstruction_rows_and_outputs(tmp_path):
    torch.manual_seed(1)
    signals = {"k_post": torch.randn(3, 20, 16), "noise": torch.randn(1, 40, 16)}
    rows = measure_reconstruction(signals, bases=["walsh", "dct", "vilenkin"], fractions=[0.5, 1.0], progress=False)
    assert len(rows) == 2 * 3 * (2 + 2 + 1 + 1)
    for r in rows:
        if r["fraction"] == 1.0 and r["coefficients"] == 16 and r["mode"] in ("topk", "fixed"):
            assert r["correlation"] == pytest.approx(1.0) and r["relative_mse"] < 1e-20
    padded = next(
        r for r in rows if r["basis"].startswith("vilenkin:") and r["fraction"] == 1.0 and r["mode"] == "topk"
    )
    assert padded["coefficients"] == 25 and padded["relative_mse"] > 1e-6  # 16 of 25 coefficients kept
    written = write_reconstruct_outputs(rows, {"model": {"name": "toy"}}, tmp_path)
    assert {p.name for p in written} == {"reconstruct.json", "reconstruct.csv", "reconstruct.md", "reconstruct.png"}
    with pytest.raises(ValueError, match="topk, fixed, signs"):
        measure_reconstruction(signals, modes=["best"], progress=False)
    with pytest.raises(ValueError, match="same length"):
        measure_reconstruction({"a": torch.randn(1, 4, 16), "b": torch.randn(1, 4, 8)}, progress=False)


def test_fixed_positions_are_chosen_per_group():
    a = torch.zeros(10, 8)
    a[:, 0] = torch.linspace(1, 2, 10)
    b = torch.zeros(10, 8)
    b[:, 7] = torch.linspace(1, 2, 10)
    rows = measure_reconstruction(
        {"x": torch.stack([a, b])}, bases=["identity"], fractions=[0.125], modes=["fixed"], progress=False
    )
    assert rows[0]["relative_mse"] < 1e-20  # one position kept per group, a different one in each


def test_lll():
    pytest.importorskip("fpylll")
    torch.manual_seed(0)
    out = lll_measure(torch.randn(2, 32, 16), bits=4, rows=8, blocks=4)
    assert out["blocks"] == 4 and out["rank_mean"] <= 8
    assert 0 < out["norm_ratio_mean"] <= 1.0 + 1e-9 and out["entry_bits_before"] <= 4
    assert out["storage_ratio"] == pytest.approx(out["block_bits_after_with_u"] / out["block_bits_before"])
    assert "storage after (with U) / before" in format_lll_table({"k_post": out})
    with pytest.raises(ValueError, match="lll-rows"):
        lll_measure(torch.randn(1, 4, 16), rows=8)


def test_cli_lab_help(capsys):
    for cmd in ("spectrum", "reconstruct"):
        with pytest.raises(SystemExit) as exc:
            main([cmd, "--help"])
        assert exc.value.code == 0
        assert "--channel-order" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["reconstruct", "--fraction", "0,2"])
    assert "fractions must be in (0, 1]" in capsys.readouterr().err
