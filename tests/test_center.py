"""``center+SPEC``: K mean-centering is exact for attention, leaves V alone and refuses misuse."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from conftest import ToyTokenizer
from walshkv import CompressedCache
from walshkv.calibration import KVStats, MergedCalibration, collect_kv_stats
from walshkv.cli import main
from walshkv.cli.common import calibration_from_args as calibrate_if_needed
from walshkv.codecs.center import Centered
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.spec import parse_cache_spec, parse_codec
from walshkv.data import Text
from walshkv.export import KMeanBias, write_kv_mean_center
from walshkv.models import LoadedModel, _describe
from walshkv.ops.hadamard import hadamard_transform

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))
EVAL_TEXT = Text("toy-eval", "generated", "".join(chr(97 + (i * 3 + i // 7) % 26) for i in range(2000)))
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16  # the tiny llama of conftest.py


class RandomBias:
    """The least a ``center+`` calibration needs: ``k_bias(layer, basis)`` (and ``check_matches``).

    Returns the same random ``[kv_heads, head_dim]`` bias for either basis and records each call.
    """

    def __init__(self, layers: int = LAYERS, heads: int = KV_HEADS, head_dim: int = HEAD_DIM, scale: float = 3.0):
        gen = torch.Generator().manual_seed(1234)
        self.bias = scale * torch.randn(layers, heads, head_dim, generator=gen) + 2.0
        self.calls: list[tuple[int, str]] = []

    def k_bias(self, layer: int, basis: str) -> torch.Tensor:
        self.calls.append((layer, basis))
        return self.bias[layer]

    def check_matches(
        self, num_layers: int, num_kv_heads: int, head_dim: int, model: str | None = None, **_: object
    ) -> None:
        assert (num_layers, num_kv_heads, head_dim) == tuple(self.bias.shape)


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture(scope="module")
def stats(tiny_lm) -> KVStats:
    return collect_kv_stats(tiny_lm, TEXT, tokens=64, ctx=64, progress=False)


def _ids(n: int = 24, vocab: int = 96) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    return torch.randint(3, vocab, (1, n), generator=gen)


def _logits(model, cache, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Prefill all but ``steps`` tokens, then feed those one at a time (several cache updates)."""
    out = []
    with torch.no_grad():
        n = ids.shape[1] - steps
        out.append(model(input_ids=ids[:, :n], cache=cache, use_cache=True).logits)
        for i in range(n, ids.shape[1]):
            out.append(model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


def _reference(model, ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    cache = DynamicCache(config=model.config)
    return _logits(model, cache, ids), cache


# ---- 1. softmax invariance -----------------------------------------------------------------------


def test_softmax_ignores_a_per_head_key_bias() -> None:
    """softmax(q·(k - b)) == softmax(q·k): q·b is the same for every key one query sees."""
    gen = torch.Generator().manual_seed(3)
    heads, tq, tk, d = 4, 5, 11, 32
    q = torch.randn(1, heads, tq, d, generator=gen, dtype=torch.float64)
    k = torch.randn(1, heads, tk, d, generator=gen, dtype=torch.float64)
    v = torch.randn(1, heads, tk, d, generator=gen, dtype=torch.float64)
    b = 5.0 * torch.randn(1, heads, 1, d, generator=gen, dtype=torch.float64)  # one bias per head and channel

    def probs(keys: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ keys.transpose(-1, -2) / math.sqrt(d), dim=-1)

    torch.testing.assert_close(probs(k - b), probs(k), rtol=0, atol=1e-12)
    torch.testing.assert_close(
        F.scaled_dot_product_attention(q, k - b, v, is_causal=True),
        F.scaled_dot_product_attention(q, k, v, is_causal=True),
        rtol=0,
        atol=1e-12,
    )
    # the scores themselves move (the invariance is not vacuous) ...
    assert (q @ (k - b).transpose(-1, -2) - q @ k.transpose(-1, -2)).abs().max() > 1.0
    # ... and a bias that varies from key to key does change the weights
    per_key = 5.0 * torch.randn(1, heads, tk, d, generator=gen, dtype=torch.float64)
    assert (probs(k - per_key) - probs(k)).abs().max() > 1e-2


@pytest.mark.parametrize("spec", ["center+fp32", "center+rot+fp32"])
def test_random_bias_leaves_logits_unchanged(tiny_llama, spec: str) -> None:
    ids = _ids()
    ref, _ = _reference(tiny_llama, ids)
    calibration = RandomBias()
    cache = CompressedCache(spec, config=tiny_llama.config, calibration=calibration)
    got = _logits(tiny_llama, cache, ids)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    basis = "rot" if "rot+" in spec else "plain"
    assert calibration.calls == [(i, basis) for i in range(LAYERS)]  # one K bias per layer, none for V


@pytest.mark.parametrize("spec", ["center+fp32", "center+rot+fp32", "center+rrot:5+fp32"])
def test_collected_stats_leave_logits_unchanged(tiny_llama, stats: KVStats, spec: str) -> None:
    ids = _ids()
    ref, _ = _reference(tiny_llama, ids)
    cache = CompressedCache(spec, config=tiny_llama.config, calibration=stats)
    torch.testing.assert_close(_logits(tiny_llama, cache, ids), ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("spec", "basis"), [("center+fp32", "plain"), ("center+rot+fp32", "rot")])
def test_bias_file_object_leaves_logits_unchanged(tiny_llama, spec: str, basis: str) -> None:
    plain = 3.0 * torch.randn(LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    bias = KMeanBias(plain, basis, "llama", "random.gguf")
    ids = _ids()
    ref, _ = _reference(tiny_llama, ids)
    cache = CompressedCache(spec, config=tiny_llama.config, calibration=bias)
    torch.testing.assert_close(_logits(tiny_llama, cache, ids), ref, rtol=0, atol=1e-4)


def test_sliding_window_model_is_invariant_too(tiny_gemma3) -> None:
    ids = _ids(n=16)  # longer than the sliding window (6) of layers 0 and 1
    ref, _ = _reference(tiny_gemma3, ids)
    cache = CompressedCache("center+rot+fp32", config=tiny_gemma3.config, calibration=RandomBias(3, 1, 32))
    torch.testing.assert_close(_logits(tiny_gemma3, cache, ids), ref, rtol=0, atol=1e-4)


def test_centering_beats_no_centering_for_a_large_offset() -> None:
    """Why center+ exists: a big shared K offset eats int4's range; removing it restores precision."""
    gen = torch.Generator().manual_seed(5)
    offset = 20.0 * torch.randn(KV_HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(1, KV_HEADS, 32, HEAD_DIM, generator=gen) + offset[None, :, None, :]
    calibration = RandomBias()
    calibration.bias = offset[None].repeat(LAYERS, 1, 1)
    plain = parse_codec("int4")
    centered = parse_codec("center+int4").bind(0, "k", calibration)
    err_plain = (plain.decode(plain.encode(k)) - k).pow(2).mean()
    err_centered = (centered.decode(centered.encode(k)) - (k - offset[None, :, None, :])).pow(2).mean()
    assert err_centered < 0.1 * err_plain


# ---- 2./3. V untouched, K left centered ----------------------------------------------------------


def test_v_codec_is_the_plain_inner_codec(tiny_llama) -> None:
    calibration = RandomBias()
    cache = CompressedCache("center+rot+int4", config=tiny_llama.config, calibration=calibration)
    plain = parse_codec("rot+int4")
    gen = torch.Generator().manual_seed(11)
    for idx, layer in enumerate(cache.layers):
        k_codec, v_codec = layer.spec.k, layer.spec.v
        assert isinstance(k_codec, Centered) and k_codec.spec == "center+rot+int4"
        assert isinstance(v_codec, Rotated) and not isinstance(v_codec, Centered)
        assert v_codec.spec == "rot+int4" and not getattr(v_codec, "is_centering", False)
        k = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen)
        v = torch.randn(1, KV_HEADS, 9, HEAD_DIM, generator=gen) + 4.0
        out_k, out_v = cache.update(k, v, idx)
        assert torch.equal(out_v, plain.decode(plain.encode(v)))
        # K: rotate, subtract the rot-basis bias, int4, rotate back; the bias is not added back
        int4 = parse_codec("int4")
        y = hadamard_transform(k) - calibration.bias[idx][None, :, None, :]
        expected_k = hadamard_transform(int4.decode(int4.encode(y)))
        torch.testing.assert_close(out_k, expected_k, rtol=0, atol=1e-5)
    assert calibration.calls == [(0, "rot"), (1, "rot")]
    assert cache.nbytes() == cache.layout_nbytes()
    assert cache.bits_per_element_kv() == (plain.bits_per_element(HEAD_DIM),) * 2  # the bias costs no bits


def test_decoded_k_is_centered(tiny_llama) -> None:
    calibration = RandomBias()
    cache = CompressedCache("center+fp32", config=tiny_llama.config, calibration=calibration)
    for idx in range(LAYERS):
        bias = calibration.bias[idx][None, :, None, :]
        k1, v1 = torch.randn(1, KV_HEADS, 5, HEAD_DIM), torch.randn(1, KV_HEADS, 5, HEAD_DIM)
        out_k, out_v = cache.update(k1, v1, idx)
        assert torch.equal(out_k, k1 - bias)  # k - bias, nothing added back
        assert torch.equal(out_v, v1)  # V exact and uncentered
        k2, v2 = torch.randn(1, KV_HEADS, 1, HEAD_DIM), torch.randn(1, KV_HEADS, 1, HEAD_DIM)
        out_k, out_v = cache.update(k2, v2, idx)
        assert torch.equal(out_k, torch.cat([k1, k2], dim=2) - bias)
        assert torch.equal(out_v, torch.cat([v1, v2], dim=2))


def test_model_cache_holds_centered_keys(tiny_llama, stats: KVStats) -> None:
    """In a forward pass, the cache stores exactly (K after RoPE) - (calibrated mean)."""
    ids = _ids()
    _, dyn = _reference(tiny_llama, ids)
    cache = CompressedCache("center+fp32", config=tiny_llama.config, calibration=stats)
    _logits(tiny_llama, cache, ids)
    for idx, layer in enumerate(cache.layers):
        mean = stats.k_bias(idx, "plain").to(torch.float32)[None, :, None, :]
        stored = layer.spec.k.decode(layer.packed_k)
        torch.testing.assert_close(stored, dyn.layers[idx].keys - mean, rtol=0, atol=1e-5)
        assert (stored - dyn.layers[idx].keys).abs().max() > 1e-3  # something was subtracted
        # V unchanged (later layers differ by float rounding: their inputs went through centered attention)
        torch.testing.assert_close(layer.spec.v.decode(layer.packed_v), dyn.layers[idx].values, rtol=0, atol=1e-5)


def test_kvstats_k_bias_bases(stats: KVStats) -> None:
    for layer in range(LAYERS):
        assert torch.equal(stats.k_bias(layer, "plain"), stats.mean("k", layer, "plain"))
        torch.testing.assert_close(
            stats.k_bias(layer, "rot"), hadamard_transform(stats.k_bias(layer, "plain")), rtol=0, atol=1e-9
        )
    with pytest.raises(ValueError, match="'plain' or 'rot'"):
        stats.k_bias(0, "wht")


def test_merged_calibration_takes_k_bias_from_the_file(stats: KVStats) -> None:
    plain = torch.randn(LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    merged = MergedCalibration(stats, KMeanBias(plain, "plain", "llama", "f.gguf"))
    assert torch.equal(merged.k_bias(1, "plain"), plain[1])
    assert torch.equal(merged.mean("v", 1), stats.mean("v", 1))
    assert torch.equal(merged.variance("k", 0), stats.variance("k", 0))
    merged.check_matches(LAYERS, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="calibrate"):
        merged.check_matches(LAYERS + 1, KV_HEADS, HEAD_DIM)
    assert merged.describe()["k_bias"]["file"] == "f.gguf"


# ---- 5. refusals (spec, binding, cache) ----------------------------------------------------------


def test_rot_before_center_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"center\+rot\+int4"):
        parse_codec("rot+center+int4")
    with pytest.raises(ValueError, match=r"center\+rot\+int4"):
        parse_cache_spec("rot+center+int4/int4")


def test_rrot_before_center_suggests_the_same_rotation() -> None:
    with pytest.raises(ValueError, match=r"center\+rrot:3\+int4"):
        parse_codec("rrot:3+center+int4")


def test_center_twice_is_refused() -> None:
    with pytest.raises(ValueError, match=r"center\+ appears twice"):
        parse_codec("center+center+int4")
    with pytest.raises(ValueError, match=r"center\+"):  # refused (rot+center+ is the first error seen)
        parse_codec("center+rot+center+int4")
    with pytest.raises(ValueError, match="takes no arguments"):
        parse_codec("center:1+int4")


def test_center_spec_parses_and_needs_calibration() -> None:
    spec = parse_cache_spec("center+rot+int4/int4")
    assert isinstance(spec.k, Centered) and spec.k.spec == "center+rot+int4" and spec.k.basis == "rot"
    assert spec.k.needs_calibration and not spec.v.needs_calibration
    assert parse_codec("center+int4").basis == "plain"
    assert spec.k.bits_per_element(HEAD_DIM) == parse_codec("rot+int4").bits_per_element(HEAD_DIM)


def test_binding_without_a_k_mean_names_kv_mean_center() -> None:
    codec = parse_codec("center+int4")
    with pytest.raises(ValueError, match="--kv-mean-center"):
        codec.bind(0, "k", None)
    with pytest.raises(ValueError, match="--kv-mean-center"):
        codec.bind(0, "k", object())  # no k_bias
    assert codec.bind(0, "v", None).spec == "int4"  # V never needs the mean


@pytest.mark.parametrize("with_config", [True, False])
def test_cache_without_calibration_names_kv_mean_center(tiny_llama, with_config: bool) -> None:
    with pytest.raises(ValueError, match="--kv-mean-center"):
        CompressedCache("center+int4", config=tiny_llama.config if with_config else None)


def test_cache_without_calibration_is_refused(tiny_llama) -> None:
    with pytest.raises(ValueError, match="calibrat"):
        CompressedCache("center+int4", config=tiny_llama.config)


def test_unbound_centered_codec_refuses_to_encode() -> None:
    x = torch.randn(1, KV_HEADS, 3, HEAD_DIM)
    with pytest.raises(ValueError, match="not bound"):
        parse_codec("center+int4").encode(x)
    bound = Centered(parse_codec("int4"), torch.zeros(3, HEAD_DIM))
    with pytest.raises(ValueError, match="3 kv heads"):
        bound.encode(x)
    with pytest.raises(ValueError, match="head_dim"):
        Centered(parse_codec("int4"), torch.zeros(KV_HEADS, 8)).encode(x)


def test_plain_bias_file_refused_for_rot_codec(tiny_llama) -> None:
    plain_file = KMeanBias(torch.zeros(LAYERS, KV_HEADS, HEAD_DIM), "plain", "llama", "plain.gguf")
    with pytest.raises(ValueError, match=r"'plain' basis but the codec needs 'rot'.*--basis rot"):
        CompressedCache("center+rot+int4", config=tiny_llama.config, calibration=plain_file)
    rot_file = KMeanBias(torch.zeros(LAYERS, KV_HEADS, HEAD_DIM), "rot", "llama", "rot.gguf")
    with pytest.raises(ValueError, match=r"'rot' basis but the codec needs 'plain'.*center\+rot\+SPEC"):
        CompressedCache("center+int4", config=tiny_llama.config, calibration=rot_file)
    with pytest.raises(ValueError, match="cannot serve rrot"):
        CompressedCache("center+rrot+int4", config=tiny_llama.config, calibration=rot_file)


def test_bias_file_for_another_model_refused_by_the_cache(tiny_llama) -> None:
    other = KMeanBias(torch.zeros(30, 3, 64), "plain", "llama", "smollm2.gguf")
    with pytest.raises(ValueError, match="walshkv calibrate"):
        CompressedCache("center+int4", config=tiny_llama.config, calibration=other)


def test_bias_that_is_not_finite_never_reaches_the_cache(tiny_llama) -> None:
    calibration = RandomBias()
    calibration.bias[1, 0, 3] = float("nan")
    cache = CompressedCache("center+int4", config=tiny_llama.config, calibration=calibration)
    k = torch.randn(1, KV_HEADS, 2, HEAD_DIM)
    cache.update(k, k, 0)  # layer 0 is fine
    with pytest.raises(ValueError, match="layer 1"):
        cache.update(k, k, 1)


# ---- calibrate_if_needed and the CLI -------------------------------------------------------------


def _args(**kw) -> argparse.Namespace:
    base = {"kv_mean_center": None, "calib_text": None, "calib_tokens": 64, "quiet": True}
    return argparse.Namespace(**{**base, **kw})


def _bias_file(tmp_path: Path, shape=(LAYERS, KV_HEADS, HEAD_DIM), arch: str = "llama", basis: str = "plain"):
    mean = torch.randn(*shape, dtype=torch.float64)
    path = tmp_path / f"bias-{arch}-{basis}.gguf"
    write_kv_mean_center(path, mean, arch=arch, basis=basis, tokens=64, text="toy-calib")
    return path, mean


def test_calibrate_if_needed_without_calibration_names_kv_mean_center(tiny_lm) -> None:
    with pytest.raises(ValueError, match="--kv-mean-center FILE or --calib-text TEXT"):
        calibrate_if_needed(tiny_lm, ["center+int4"], _args(), EVAL_TEXT)
    assert calibrate_if_needed(tiny_lm, ["int4", "rot+int4"], _args(), EVAL_TEXT) is None


def test_calibrate_if_needed_reads_the_bias_file(tiny_lm, tiny_llama, tmp_path: Path) -> None:
    path, mean = _bias_file(tmp_path)
    got = calibrate_if_needed(tiny_lm, ["center+int4", "int8"], _args(kv_mean_center=str(path)), EVAL_TEXT)
    assert isinstance(got, KMeanBias) and got.basis == "plain" and got.arch == "llama"
    torch.testing.assert_close(got.plain, mean, rtol=0, atol=1e-6)
    ids = _ids()
    ref, _ = _reference(tiny_llama, ids)
    cache = CompressedCache("center+fp32", config=tiny_llama.config, calibration=got)
    torch.testing.assert_close(_logits(tiny_llama, cache, ids), ref, rtol=0, atol=1e-4)


def test_calibrate_if_needed_merges_file_and_text(tiny_lm, tmp_path: Path) -> None:
    path, mean = _bias_file(tmp_path)
    text_file = tmp_path / "calib.txt"
    text_file.write_text(TEXT.content, encoding="utf-8")
    args = _args(kv_mean_center=str(path), calib_text=str(text_file))
    got = calibrate_if_needed(tiny_lm, ["center+int4/vht2:auto@4"], args, EVAL_TEXT)
    assert isinstance(got, MergedCalibration)
    torch.testing.assert_close(got.k_bias(0, "plain"), mean[0], rtol=0, atol=1e-6)
    assert got.variance("v", 0).shape == (KV_HEADS, HEAD_DIM)
    # text only: the K mean comes from the same run's statistics
    stats = calibrate_if_needed(tiny_lm, ["center+int4"], _args(calib_text=str(text_file)), EVAL_TEXT)
    assert isinstance(stats, KVStats)


@pytest.mark.parametrize(
    ("shape", "arch", "match"),
    [
        ((LAYERS + 1, KV_HEADS, HEAD_DIM), "llama", "walshkv calibrate"),
        ((LAYERS, KV_HEADS, 2 * HEAD_DIM), "llama", "walshkv calibrate"),
        ((LAYERS, KV_HEADS, HEAD_DIM), "qwen2", "calibrated on a 'qwen2' model, not 'llama'"),
    ],
)
def test_calibrate_if_needed_refuses_a_file_for_another_model(tiny_lm, tmp_path: Path, shape, arch, match) -> None:
    path, _ = _bias_file(tmp_path, shape, arch)
    with pytest.raises(ValueError, match=match):
        calibrate_if_needed(tiny_lm, ["center+int4"], _args(kv_mean_center=str(path)), EVAL_TEXT)


def test_calibrate_help_mentions_kv_bar(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "kv_bar" in out and "--basis" in out and "kv_mean_center.k_rot" in out
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--basis", "wht"])
    assert exc.value.code == 2


def test_eval_refuses_rot_before_center_before_loading(capsys) -> None:
    assert main(["eval", "--codec", "rot+center+int4", "--quiet"]) == 2
    assert "center+rot+int4" in capsys.readouterr().err


def test_eval_help_lists_kv_mean_center(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "--kv-mean-center" in capsys.readouterr().out


# ---- the evaluation text is never the calibration text -------------------------------------------


def _bias_on(text_name: str) -> KMeanBias:
    plain = torch.randn(LAYERS, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    return KMeanBias(plain, "plain", "llama", "f.gguf", {"walshkv.text": text_name})


def test_bias_file_made_on_the_eval_text_is_refused(tiny_lm) -> None:
    from walshkv.eval import evaluate

    with pytest.raises(ValueError, match="calibrate on other text"):
        evaluate(tiny_lm, EVAL_TEXT, ["center+int4"], ctx=32, windows=1, calibration=_bias_on("toy-eval"))
    ok = evaluate(tiny_lm, EVAL_TEXT, ["center+int4"], ctx=32, windows=1, calibration=_bias_on("toy-calib"))
    assert ok.meta["calibration"]["kind"] == "kv-mean-center file"


def test_merged_calibration_with_a_bias_file_made_on_the_eval_text_is_refused(tiny_lm, stats: KVStats) -> None:
    from walshkv.eval import evaluate

    merged = MergedCalibration(stats, _bias_on("toy-eval"))
    with pytest.raises(ValueError, match="calibrate on other text"):
        evaluate(tiny_lm, EVAL_TEXT, ["center+int4/vht2:auto@4"], ctx=32, windows=1, calibration=merged)
