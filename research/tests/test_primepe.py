"""PrimePE: factor generators (hand-computed cases), both conventions on tiny models, the GGUF file and
the alpha sweep on the tiny model (no download)."""

from __future__ import annotations

import csv
import json

import gguf
import pytest
import torch

from walshkv.cli import main
from walshkv.data import Text
from walshkv.models import LoadedModel, _describe
from walshkv_research.primepe import (
    frequency_factors,
    lattice,
    read_rope_freqs,
    rope_factors_applied,
    rotary_tables,
    tier_counts,
    write_rope_freqs,
)
from walshkv_research.rope_report import write_rope_outputs
from walshkv_research.rope_sweep import measure_rope_sweep

TEXT = Text("toy", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(1200)))
THETA = torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64)


def test_tier_counts():
    assert tier_counts(32) == (8, 11, 13)  # head_dim 64
    assert tier_counts(64) == (16, 21, 27)  # head_dim 128
    assert tier_counts(4) == (1, 1, 2)
    assert tier_counts(1) == (0, 0, 1)
    with pytest.raises(ValueError, match="at least one rotary pair"):
        tier_counts(0)


def test_lattice_small_cases():
    # one sample per tier takes its smallest candidate; two take the first and the last
    assert lattice("composite", 4).tolist() == [4, 102, 1010, 8208]  # 8209 is prime
    assert lattice("prime", 4).tolist() == [5, 103, 1013, 8209]
    lat = lattice("composite", 32)
    assert lat.tolist() == sorted(lat.tolist()) and len(set(lat.tolist())) == 32
    assert ((lat >= 4) & (lat <= 8209)).all()
    with pytest.raises(ValueError, match="composite, prime"):
        lattice("geometric", 4)


def test_factors_by_hand():
    r = 0.001 + (torch.tensor([4.0, 102, 1010, 8208], dtype=torch.float64) - 4) / 8204 * 0.999
    f = frequency_factors(THETA, "composite", 0.5)  # published: ascending lattice on descending theta
    assert torch.allclose(f, (0.5 * THETA + 0.5 * r) / THETA)
    assert f[0].item() == pytest.approx(0.5005) and f[-1].item() == pytest.approx(500.5)
    m = frequency_factors(THETA, "composite", 0.5, pairing="matched")
    assert torch.allclose(m, (0.5 * THETA + 0.5 * r.flip(0)) / THETA)
    assert m[0].item() == pytest.approx(1.0) and m[-1].item() == pytest.approx(1.0)
    # an ascending table is paired the same way (by frequency, not by index)
    assert torch.allclose(frequency_factors(THETA.flip(0), "composite", 0.5), f.flip(0))


def test_published_factor_range_matches_the_review():
    for base, top in ((1e4, 1e3), (5e5, 5e4)):
        theta = 1.0 / base ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
        f = frequency_factors(theta, "composite", 0.2)
        assert f.min().item() == pytest.approx(0.8, abs=1e-3)
        assert top < f.max().item() < 0.2 * base


def test_identity_cases_and_errors():
    assert torch.equal(frequency_factors(THETA, "geometric", 0.7), torch.ones(4, dtype=torch.float64))
    assert torch.allclose(frequency_factors(THETA, "prime", 0.0), torch.ones(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"alpha must be in \[0, 1\]"):
        frequency_factors(THETA, "prime", 1.5)
    with pytest.raises(ValueError, match="geometric, composite, prime"):
        frequency_factors(THETA, "fibonacci", 0.1)
    with pytest.raises(ValueError, match="published, matched"):
        frequency_factors(THETA, "prime", 0.1, pairing="random")
    with pytest.raises(ValueError, match="positive finite"):
        frequency_factors(torch.tensor([1.0, 0.0]), "prime", 0.1)


@pytest.mark.parametrize("convention", ["multiply", "divide"])
def test_conventions_change_the_rotary_frequencies(tiny_llama, convention):
    ids = torch.arange(3, 40).view(1, -1)
    with torch.inference_mode():
        before = tiny_llama(input_ids=ids).logits
    ((name, module, buf),) = rotary_tables(tiny_llama)
    theta = getattr(module, buf).clone()
    with rope_factors_applied(tiny_llama, "composite", 0.3, convention) as factors:
        f = factors[name]
        expected = theta.double() * f if convention == "multiply" else theta.double() / f
        assert torch.allclose(getattr(module, buf).double(), expected, rtol=1e-6)
        with torch.inference_mode():
            changed = tiny_llama(input_ids=ids).logits
    assert not torch.allclose(before, changed, atol=1e-4)  # the model really uses the new table
    assert torch.equal(getattr(module, buf), theta)  # and it is restored
    with torch.inference_mode():
        assert torch.equal(tiny_llama(input_ids=ids).logits, before)


def test_every_table_of_a_sliding_window_model(tiny_gemma3):
    tables = rotary_tables(tiny_gemma3)
    assert len(tables) == 2  # gemma3's local and global tables
    saved = [getattr(m, b).clone() for _, m, b in tables]
    with rope_factors_applied(tiny_gemma3, "prime", 0.2, "divide") as factors:
        for (name, m, b), old in zip(tables, saved, strict=True):
            assert torch.allclose(getattr(m, b).double(), old.double() / factors[name], rtol=1e-6)
    for (_, m, b), old in zip(tables, saved, strict=True):
        assert torch.equal(getattr(m, b), old)


def test_restored_after_an_exception(tiny_llama):
    ((_, module, buf),) = rotary_tables(tiny_llama)
    theta = getattr(module, buf).clone()
    with pytest.raises(RuntimeError), rope_factors_applied(tiny_llama, "prime", 0.5, "multiply"):
        raise RuntimeError("boom")
    assert torch.equal(getattr(module, buf), theta)


@pytest.mark.parametrize("convention", ["multiply", "divide"])
def test_rope_freqs_gguf_round_trip(tmp_path, convention):
    f = frequency_factors(THETA, "composite", 0.2)
    path = write_rope_freqs(tmp_path / "r.gguf", f, convention, {"alpha": 0.2, "generator": "composite"})
    back = read_rope_freqs(path)
    expected = f if convention == "divide" else 1.0 / f  # what llama.cpp divides the angle by
    assert torch.allclose(back.divisor.double(), expected, rtol=1e-6)
    assert back.meta["convention"] == convention and back.meta["generator"] == "composite"
    assert back.meta["alpha"] == pytest.approx(0.2)
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    assert (
        list(tensors) == ["rope_freqs.weight"]
        and tensors["rope_freqs.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    )


def test_rope_freqs_refusals(tmp_path):
    with pytest.raises(FileNotFoundError, match="walshkv rope factors"):
        read_rope_freqs(tmp_path / "none.gguf")
    path = write_rope_freqs(tmp_path / "r.gguf", torch.ones(4), "divide")
    data = path.read_bytes()
    for cut in (10, len(data) // 2, len(data) - 20):  # the last 16 bytes are alignment padding
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=r"truncated|damaged|bad magic"):
            read_rope_freqs(bad)
    with pytest.raises(ValueError, match="positive finite"):
        write_rope_freqs(tmp_path / "x.gguf", torch.tensor([1.0, float("nan")]), "divide")
    with pytest.raises(ValueError, match="multiply, divide"):
        write_rope_freqs(tmp_path / "x.gguf", torch.ones(2), "add")


@pytest.fixture
def tiny_lm(tiny_llama, toy_tokenizer):
    return LoadedModel(tiny_llama, toy_tokenizer, "tiny-llama", "test", _describe(tiny_llama))


def test_sweep_rows_and_outputs(tiny_lm, tmp_path):
    res = measure_rope_sweep(tiny_lm, TEXT, alphas=[0, 0.2, 1], codecs=["rot+int4"], ctx=64, windows=2, progress=False)
    rows = res.rows
    assert len(rows) == (1 + 2 * 2 * 2) * 2  # (reference + generators x conventions x nonzero alphas) x caches
    ref = next(r for r in rows if r["generator"] == "none" and r["codec"] == "none")
    assert ref["kld_mean"] == 0.0 and ref["ppl_ratio"] == 1.0 and ref["top1_agreement"] == 1.0
    codec_alone = next(r for r in rows if r["generator"] == "none" and r["codec"] == "rot+int4")
    assert codec_alone["kld_mean"] > 0
    strong = next(
        r for r in rows if r["generator"] == "composite" and r["convention"] == "multiply" and r["alpha"] == 1
    )
    assert strong["kld_mean"] > 0 and strong["factor_max"] > 1
    assert res.meta["scored_tokens"] == 2 * 31 and res.meta["windows"] == 2
    written = write_rope_outputs(res, tmp_path, plot=True)
    assert {p.name for p in written} == {"rope.json", "rope.csv", "rope.md", "rope.png"}
    assert len(json.loads((tmp_path / "rope.json").read_text())["results"]) == len(rows)
    assert len(list(csv.DictReader((tmp_path / "rope.csv").open()))) == len(rows)
    assert "windows of 64 tokens" in (tmp_path / "rope.md").read_text()


def test_sweep_errors(tiny_lm):
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        measure_rope_sweep(tiny_lm, TEXT, alphas=[2.0], progress=False)
    with pytest.raises(ValueError, match="geometric, composite, prime"):
        measure_rope_sweep(tiny_lm, TEXT, generators=["golden"], progress=False)


def test_cli_rope(capsys):
    with pytest.raises(SystemExit):
        main(["rope", "sweep", "--alpha", "0,3"])
    assert "alphas must be numbers in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["rope", "sweep", "--generator", "golden"])
    assert "choose among geometric, composite, prime" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["rope", "--help"])
    assert exc.value.code == 0 and "multiply" in capsys.readouterr().out
