"""The spectral lab and PrimePE on the real default model (smollm2-135m, llama layout)."""

from __future__ import annotations

import pytest
import torch

from walshkv.cli import main
from walshkv.data import load_text
from walshkv.eval.capture import unrotate_keys
from walshkv.eval.rd import capture_window
from walshkv_research.primepe import read_rope_freqs
from walshkv_research.rope_sweep import measure_rope_sweep

pytestmark = pytest.mark.model


def test_keys_before_rope_are_the_projection_output(smollm2):
    model = smollm2.model
    ids = smollm2.tokenizer(load_text().content[:2000], add_special_tokens=False)["input_ids"][:48]
    ids = torch.tensor(ids)
    seen = {}
    attn = model.model.layers[7].self_attn
    hook = attn.k_proj.register_forward_hook(lambda m, a, out: seen.__setitem__("k", out.detach()))
    try:
        ks, _, _ = capture_window(smollm2, ids, queries=False)
    finally:
        hook.remove()
    pre = seen["k"].view(1, 48, -1, attn.head_dim).transpose(1, 2)
    assert torch.allclose(unrotate_keys(model, 7, ks[7]), pre, atol=1e-4)


def test_rope_sweep_identity_and_a_real_change(smollm2):
    res = measure_rope_sweep(
        smollm2,
        load_text(),
        alphas=[0, 0.2],
        generators=["composite"],
        conventions=["divide"],
        ctx=128,
        windows=1,
        progress=False,
    )
    ref, mod = res.rows
    assert ref["kld_mean"] == 0.0 and ref["ppl_ratio"] == 1.0
    assert mod["kld_mean"] > 1e-4 and mod["factor_min"] == pytest.approx(0.8, abs=1e-3)


def test_rope_factors_cli_writes_rope_freqs(smollm2, tmp_path, capsys):
    out = tmp_path / "primepe.gguf"
    assert main(["rope", "factors", "--alpha", "0.2", "--convention", "multiply", "-o", str(out), "--quiet"]) == 0
    assert "rope_freqs.weight (32 values" in capsys.readouterr().out
    back = read_rope_freqs(out)
    assert back.divisor.shape == (32,) and back.meta["convention"] == "multiply"
    assert back.meta["model"] == "smollm2-135m" and back.meta["head_dim"] == 64
    assert 1 / back.divisor.max().item() == pytest.approx(0.8, abs=1e-3)  # multiply: the file holds 1 / f
