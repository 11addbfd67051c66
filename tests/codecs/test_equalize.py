"""``eq+``: the calibrated, query-weighted K transform (math, codec, calibration, files, cache)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from conftest import ToyTokenizer, logits_in_splits
from walshkv.cache import CompressedCache, enable_fused_attention
from walshkv.calibration import MergedCalibration, collect_kv_stats
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.spec import parse_cache_spec, parse_codec
from walshkv.data import Text
from walshkv.export import read_kv_mean_center, write_kv_mean_center
from walshkv.models import LoadedModel, _describe, recording_queries
from walshkv.ops.equalize import k_equalizer, predicted_gain_db
from walshkv.preset_file import equalized_kinds, write_preset_file
from walshkv.presets import Preset

TEXT = Text("toy-calib", "generated", "".join(chr(97 + (i * 7 + i // 5) % 26) for i in range(2000)))


def _spd(d: int, seed: int, spread: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    e = torch.exp(spread * torch.randn(d, generator=g, dtype=torch.float64))
    return (q * e) @ q.T


# ---- the math ----------------------------------------------------------------------------------------


def test_diagonal_moments_give_the_fourth_root_scaling():
    c = torch.diag(torch.tensor([4.0, 1.0, 0.25, 9.0], dtype=torch.float64))
    m = torch.diag(torch.tensor([1.0, 16.0, 1.0, 0.5], dtype=torch.float64))
    a = k_equalizer(c, m)
    want = (m.diagonal() / c.diagonal()) ** 0.25
    want = want / want.log().mean().exp()  # determinant 1
    assert torch.allclose(a, torch.diag(want), atol=1e-6)
    assert float(torch.linalg.det(a)) == pytest.approx(1.0, rel=1e-9)


def test_the_transform_reaches_the_predicted_optimum():
    c, m = _spd(8, 1), _spd(8, 2)
    a = k_equalizer(c, m, max_cond=1e9)
    ms = torch.linalg.cholesky(m)  # any square root: tr((M^½ C M^½)^½) is basis-free
    lam = torch.linalg.eigvalsh(ms.T @ c @ ms)
    best = 10 * torch.log10(torch.trace(c) * torch.trace(m) / lam.sqrt().sum() ** 2)
    assert float(predicted_gain_db(c, m, a)) == pytest.approx(float(best), rel=1e-6)
    assert float(best) > 1.0
    # no other transform does better: random perturbations lose
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        b = a @ (torch.eye(8, dtype=torch.float64) + 0.1 * torch.randn(8, 8, generator=g, dtype=torch.float64))
        assert float(predicted_gain_db(c, m, b)) < float(best) + 1e-9


def test_queries_shaped_like_the_keys_need_no_transform():
    c = _spd(8, 4)
    assert torch.allclose(k_equalizer(c, 3.0 * c), torch.eye(8, dtype=torch.float64), atol=1e-6)


def test_slightly_indefinite_moments_still_give_a_finite_transform():
    # float32 sums over 4k-token windows left a qwen2.5-1.5b pre-RoPE K covariance with an eigenvalue of -1.5e-4
    # next to 9.4: the inverse square root turned it into NaN and recommend --ctx 4096 stopped
    c = _spd(8, 5)
    e, u = torch.linalg.eigh(c)
    e[0] = -1.6e-5 * float(e.max())
    indefinite = (u * e) @ u.T
    a = k_equalizer(torch.stack([indefinite, c]), torch.stack([_spd(8, 6), _spd(8, 6)]))
    assert bool(torch.isfinite(a).all()) and torch.allclose(torch.linalg.det(a), torch.ones(2, dtype=a.dtype))
    assert torch.equal(a[1], k_equalizer(c, _spd(8, 6)))  # a positive definite head is left exactly as it was


def test_the_condition_number_is_capped():
    c = torch.diag(torch.tensor([1e6, 1.0, 1e-6, 1.0], dtype=torch.float64))
    a = k_equalizer(c, torch.eye(4, dtype=torch.float64), max_cond=10.0)
    s = torch.linalg.svdvals(a)
    assert float(s.max() / s.min()) <= 10.0 + 1e-6


@pytest.mark.parametrize(
    ("cov", "qm", "message"),
    [
        (torch.eye(4), torch.eye(3), "one shape"),
        (torch.full((4, 4), float("nan")), torch.eye(4), "NaN/Inf"),
    ],
)
def test_bad_moments_are_refused(cov, qm, message):
    with pytest.raises(ValueError, match=message):
        k_equalizer(cov, qm)


# ---- the codec ---------------------------------------------------------------------------------------


class Moments:
    """An eq+ / center+ calibration with fixed random transforms."""

    def __init__(self, layers: int = 2, heads: int = 2, head_dim: int = 16) -> None:
        self.eq = torch.stack(
            [
                torch.stack([k_equalizer(_spd(head_dim, 10 * i + h), _spd(head_dim, 99 + h)) for h in range(heads)])
                for i in range(layers)
            ]
        ).to(torch.float32)
        self.bias = 2.0 * torch.randn(layers, heads, head_dim, generator=torch.Generator().manual_seed(5))
        self.veq = self.eq.flip(0).contiguous()

    def k_equalizer(self, layer: int) -> torch.Tensor:
        return self.eq[layer]

    def v_equalizer(self, layer: int) -> torch.Tensor:
        return self.veq[layer]

    def k_bias(self, layer: int, basis: str) -> torch.Tensor:
        return self.bias[layer]

    def check_matches(self, *args, **kwargs) -> None:
        pass


def test_the_transform_is_exact_around_a_lossless_codec():
    codec = parse_codec("eq+fp32").bind(0, "k", Moments())
    x = torch.randn(2, 2, 5, 16)
    assert torch.allclose(codec.decode(codec.encode(x)), x, atol=1e-5)
    assert codec.bits_per_element(16) == parse_codec("fp32").bits_per_element(16)


def test_values_take_their_own_transform():
    calib = Moments()
    codec = parse_codec("eq+fp32").bind(1, "v", calib)
    assert torch.equal(codec.matrix, calib.veq[1])
    x = torch.randn(1, 2, 4, 16)
    assert torch.allclose(codec.decode(codec.encode(x)), x, atol=1e-5)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("eq+center+tq:3", "write center\\+ first: center\\+eq\\+tq:3"),
        ("rot+eq+tq:3", "write eq\\+rot\\+tq:3"),
        ("eq+eq+tq:3", "twice"),
        ("eq:2+tq:3", "takes no arguments"),
    ],
)
def test_misplaced_eq_names_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_codec(spec)


def test_an_unbound_or_uncalibrated_eq_says_what_to_pass():
    with pytest.raises(ValueError, match="CompressedCache"):
        parse_codec("eq+tq:3").encode(torch.randn(1, 2, 3, 16))
    with pytest.raises(ValueError, match="--calib-text"):
        parse_codec("eq+tq:3").bind(0, "k", None)
    with pytest.raises(ValueError, match="kv heads"):
        parse_codec("eq+tq:3").bind(0, "k", Moments(heads=3)).encode(torch.randn(1, 2, 3, 16))


# ---- calibration -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_lm(tiny_llama):
    return LoadedModel(tiny_llama, ToyTokenizer(), "tiny-llama", "test", _describe(tiny_llama))


@pytest.fixture(scope="module")
def stats(tiny_lm):
    return collect_kv_stats(tiny_lm, TEXT, tokens=128, ctx=64, progress=False)


def test_calibration_keeps_the_moments_eq_needs(tiny_lm, stats):
    assert stats.count1 is not None and stats.count1.tolist() == [126.0, 126.0]  # first tokens left out
    assert stats.q_count is not None and stats.q_count.tolist() == [128.0, 128.0]
    for layer in range(2):
        cov, qm = stats.k_covariance(layer), stats.query_moment(layer)
        assert cov.shape == qm.shape == (2, 16, 16)
        assert float(torch.linalg.eigvalsh(qm).min()) > -1e-6 and float(torch.linalg.eigvalsh(cov).min()) > -1e-6
        a = stats.k_equalizer(layer)
        assert a.shape == (2, 16, 16) and a.dtype == torch.float32
        assert stats.v_covariance(layer).shape == stats.output_metric(layer).shape == (2, 16, 16)
        assert stats.v_equalizer(layer).shape == (2, 16, 16)
    assert tiny_lm.model.config._attn_implementation == "sdpa"  # the recorder is gone afterwards


def test_the_output_metric_sums_each_groups_projection(tiny_lm, stats):
    w = tiny_lm.model.model.layers[1].self_attn.o_proj.weight.detach().double()  # [hidden, 4 heads * 16]
    group = [w[:, h * 16 : (h + 1) * 16] for h in (2, 3)]  # q heads 2, 3 read kv head 1
    want = sum(g.T @ g for g in group)
    assert torch.allclose(stats.output_metric(1)[1], want, atol=1e-8)


def test_query_recording_sees_every_layer_and_restores_attention(tiny_lm):
    sink: dict[int, torch.Tensor] = {}
    before = tiny_lm.model.config._attn_implementation
    ids = torch.randint(3, 90, (1, 9))
    with torch.inference_mode(), recording_queries(tiny_lm.model, sink) as ok:
        with_hook = tiny_lm.model(input_ids=ids).logits
    assert ok and sorted(sink) == [0, 1] and sink[0].shape == (1, 4, 9, 16)
    assert tiny_lm.model.config._attn_implementation == before
    with torch.inference_mode():
        assert torch.equal(with_hook, tiny_lm.model(input_ids=ids).logits)


# ---- files -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transforms_round_trip_through_the_file(tmp_path: Path, arch: str):
    mean = torch.randn(3, 2, 8, dtype=torch.float64)
    eq = torch.stack([torch.stack([_spd(8, 3 * i + h) for h in range(2)]) for i in range(3)])
    path = tmp_path / "eq.gguf"
    write_kv_mean_center(path, mean, arch=arch, k_equalizer=eq, v_equalizer=eq.flip(0))
    got = read_kv_mean_center(path, model_arch=arch)
    assert got.has_k_equalizer and got.has_v_equalizer
    assert torch.allclose(got.k_eq, eq, atol=1e-5 * float(eq.abs().max()))
    assert torch.allclose(got.v_eq, eq.flip(0), atol=1e-5 * float(eq.abs().max()))
    assert torch.allclose(got.plain, mean, atol=1e-6)
    plain = tmp_path / "plain.gguf"
    write_kv_mean_center(plain, mean, arch=arch)
    with pytest.raises(ValueError, match="--eq"):
        read_kv_mean_center(plain).k_equalizer(0)


def test_bad_transforms_are_refused(tmp_path: Path):
    mean = torch.randn(2, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="layers, kv_heads, head_dim, head_dim"):
        write_kv_mean_center(tmp_path / "a.gguf", mean, arch="qwen2", k_equalizer=torch.eye(8).expand(2, 2, 8, 8))
    bad = torch.eye(8).repeat(2, 1, 1, 1)
    bad[1, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN/Inf"):
        write_kv_mean_center(tmp_path / "b.gguf", mean, arch="qwen2", k_equalizer=bad)


def test_a_file_missing_a_layer_of_transforms_is_refused(tmp_path: Path):
    import gguf
    import numpy as np

    path = tmp_path / "partial.gguf"
    writer = gguf.GGUFWriter(str(path), arch="kv_mean_center")
    writer.add_bool("kv_mean_center.k_rot", False)
    for il in range(2):
        writer.add_tensor(f"kv_bar.blk.{il}.k", np.zeros((1, 8), dtype=np.float32))
    writer.add_tensor("walshkv.k_eq.blk.0", np.eye(8, dtype=np.float32)[None])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"walshkv\.k_eq\.blk\.1"):
        read_kv_mean_center(path)


def test_a_preset_file_holds_the_transforms_its_spec_needs(tmp_path: Path, tiny_lm, stats):
    assert equalized_kinds("sink:1:layers:center+tq:3/tq:3@0;center+eq+tq:3/tq:3") == {"k"}
    assert equalized_kinds("center+tq:3/eq+tq:3") == {"v"} and equalized_kinds("eq+tq:3") == {"k", "v"}
    path = tmp_path / "p.gguf"
    write_preset_file(path, tiny_lm, Preset("walshkv:3.5", 3.5, "center+eq+tq:3.5/eq+tq:3"), stats)
    got = read_kv_mean_center(path, model_arch="llama")
    assert torch.allclose(got.k_equalizer(1), stats.k_equalizer(1), atol=1e-4)
    assert torch.allclose(got.v_equalizer(1), stats.v_equalizer(1), atol=1e-4)
    write_preset_file(path, tiny_lm, Preset("walshkv:3.5", 3.5, "center+eq+tq:3.5/tq:3"), stats)
    got = read_kv_mean_center(path, model_arch="llama")
    assert got.has_k_equalizer and not got.has_v_equalizer
    with pytest.raises(ValueError, match=r"walshkv\.v_eq\.blk"):
        got.v_equalizer(0)
    merged = MergedCalibration(stats, got)
    assert torch.equal(merged.k_equalizer(0), stats.k_equalizer(0))


# ---- the cache ---------------------------------------------------------------------------------------


_logits = logits_in_splits


def test_a_lossless_eq_cache_is_the_reference(tiny_llama):
    ids = torch.randint(3, 90, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = _logits(tiny_llama, DynamicCache(config=tiny_llama.config), ids, [12, 13, 20])
    for spec in ("center+eq+fp32", "sink:2:center+eq+fp32/fp32", "center+eq+fp32/eq+fp32"):
        got = _logits(
            tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=Moments()), ids, [12, 13, 20]
        )
        assert (got - ref).abs().max() < 1e-3, spec


def test_fused_attention_reads_an_eq_cache(tiny_llama, monkeypatch):
    """Decode steps of a fused eq+ tq cache run in the CPU kernel (eq+ mapped outside it), same logits."""
    from walshkv.attention import decode as attention

    calls: list[int] = []
    kernel = attention.fused_decode_cpu

    def spy(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(attention, "fused_decode_cpu", spy)
    spec = "sink:1:center+eq+tq:4/eq+tq:3"
    ids = torch.randint(3, 90, (2, 24), generator=torch.Generator().manual_seed(2))
    splits = [15, 16, 17, 24]
    tiny_llama.set_attn_implementation("sdpa")
    ref = _logits(tiny_llama, CompressedCache(spec, config=tiny_llama.config, calibration=Moments()), ids, splits)
    enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache(spec, config=tiny_llama.config, calibration=Moments(), fused=True)
        got = _logits(tiny_llama, cache, ids, splits)
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    assert torch.allclose(ref, got, atol=2e-5), float((ref - got).abs().max())
    assert cache.bits_per_element() == pytest.approx(parse_cache_spec(spec).bits_at(16, 24))
    assert calls  # the decode steps (16, 17) went through the kernel


def test_gemma3_sliding_layers_calibrate_and_run(tiny_gemma3):
    lm = LoadedModel(tiny_gemma3, ToyTokenizer(), "tiny-gemma3", "test", _describe(tiny_gemma3))
    stats = collect_kv_stats(lm, TEXT, tokens=64, ctx=32, progress=False)
    assert stats.q_outer is not None and stats.k_equalizer(0).shape == (1, 32, 32)
    ids = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(4))
    ref = _logits(tiny_gemma3, DynamicCache(config=tiny_gemma3.config), ids, [20])
    cache = CompressedCache("center+eq+fp32", config=tiny_gemma3.config, calibration=stats)
    assert (_logits(tiny_gemma3, cache, ids, [12, 20]) - ref).abs().max() < 1e-3


# ---- transforms are validated where they are read --------------------------------------------------------


def _write_eq_file(path: Path, matrices: list[torch.Tensor]) -> None:
    """A calibration file holding these K transforms ``[kv_heads, d, d]``, one per layer (written with gguf-py
    directly, so that the file can hold what walshkv's writer would refuse)."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch="kv_mean_center")
    writer.add_bool("kv_mean_center.k_rot", False)
    for il, m in enumerate(matrices):
        writer.add_tensor(f"kv_bar.blk.{il}.k", np.zeros((m.shape[0], m.shape[-1]), dtype=np.float32))
        writer.add_tensor(f"walshkv.k_eq.blk.{il}", m.to(torch.float32).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _bad_transforms() -> dict[str, tuple[torch.Tensor, str]]:
    good = _spd(8, 1, spread=0.5)
    good = good / torch.linalg.det(good) ** (1 / 8)
    singular = good.clone()
    singular[3] = 0.0
    skewed = good @ torch.diag(torch.logspace(0, 8, 8, dtype=torch.float64))
    skewed = skewed / torch.linalg.det(skewed).abs() ** (1 / 8)
    return {
        "near zero": (1e-6 * good, "near zero"),
        "huge": (1e6 * good, "near zero or huge"),
        "singular": (singular, "singular"),
        "ill conditioned": (skewed, "condition number"),
    }


@pytest.mark.parametrize("case", list(_bad_transforms()))
def test_a_bad_transform_in_a_file_is_refused_by_name(tmp_path: Path, case: str):
    bad, message = _bad_transforms()[case]
    good = torch.eye(8, dtype=torch.float64)
    path = tmp_path / "eq.gguf"
    _write_eq_file(path, [torch.stack([good, good]), torch.stack([good, bad])])
    with pytest.raises(ValueError, match=rf"walshkv\.k_eq\.blk\.1.*head 1.*{message}.*recalibrate") as refused:
        read_kv_mean_center(path)
    assert not isinstance(refused.value, torch.linalg.LinAlgError)
    _write_eq_file(path, [torch.stack([good, good]), torch.stack([good, good])])  # the same file, healthy
    assert torch.equal(read_kv_mean_center(path).k_equalizer(1), torch.eye(8).expand(2, 8, 8).double())


@pytest.mark.parametrize("case", list(_bad_transforms()))
def test_a_bad_transform_is_refused_by_the_codec(case: str):
    bad, message = _bad_transforms()[case]
    with pytest.raises(ValueError, match=rf"eq\+tq:4.*head 0.*{message}.*recalibrate") as refused:
        Equalized(parse_codec("tq:4"), bad[None])
    assert not isinstance(refused.value, torch.linalg.LinAlgError)


def test_calibrated_transforms_pass_the_checks(tiny_lm, stats):
    for layer in range(tiny_lm.config.num_hidden_layers):
        codec = parse_codec("eq+tq:4").bind(layer, "k", stats)
        assert codec.inverse is not None


# ---- eqd+: the diagonal transform --------------------------------------------------------------------


def test_the_diagonal_fit_is_eqs_on_diagonal_moments_and_diagonal_otherwise():
    from walshkv.ops.equalize import k_equalizer_diagonal

    c = torch.diag(torch.tensor([4.0, 1.0, 0.25, 9.0], dtype=torch.float64))
    m = torch.diag(torch.tensor([1.0, 16.0, 1.0, 0.5], dtype=torch.float64))
    assert torch.allclose(k_equalizer_diagonal(c, m), k_equalizer(c, m), atol=1e-9)
    a = k_equalizer_diagonal(_spd(8, 1), _spd(8, 2))
    assert torch.equal(a, torch.diag_embed(torch.diagonal(a))) and float(torch.linalg.det(a)) == pytest.approx(1.0)
    capped = k_equalizer_diagonal(torch.diag(torch.tensor([1e6, 1.0, 1e-6, 1.0])), torch.eye(4), max_cond=10.0)
    assert float(capped.diagonal().max() / capped.diagonal().min()) <= 10.0 + 1e-6
    with pytest.raises(ValueError, match="NaN/Inf"):
        k_equalizer_diagonal(torch.full((4, 4), float("nan")), torch.eye(4))


def test_eqd_binds_a_diagonal_transform_and_keeps_the_fast_key_map(stats):
    from walshkv.attention.cpu import prerope_key_map
    from walshkv.codecs.base import find_wrapper
    from walshkv.codecs.equalize import DiagonalEqualized

    k = parse_codec("center+eqd+tq:3.5").bind(1, "k", stats)
    eqd = find_wrapper(k, DiagonalEqualized)
    assert eqd is not None and eqd.matrix is not None
    assert torch.equal(eqd.matrix, stats.k_equalizer_diagonal(1)) and eqd.spec == "eqd+tq:3.5"
    assert parse_cache_spec("center+eqd+tq:3/eqd+tq:3").spec == "center+eqd+tq:3/eqd+tq:3"
    x = torch.randn(1, 2, 5, 16)
    assert (k.decode(k.encode(x)) - x).abs().max() < 0.5 * x.abs().max()
    with pytest.raises(ValueError, match="write eqd\\+rot\\+tq:3, not rot\\+eqd\\+tq:3"):
        parse_codec("rot+eqd+tq:3")
    with pytest.raises(ValueError, match="eqd\\+tq:3 needs a calibrated K transform"):
        parse_codec("eqd+tq:3").bind(0, "k", None)
    pre = stats.pre_rope()
    for spec, want in (("prerope+center+eqd+tq:3", {"hadamard"}), ("prerope+center+eq+tq:3", {"matrix", "matrix-amx"})):
        kc, vc = parse_codec(spec).bind(1, "k", pre), parse_codec("tq:3").bind(1, "v", pre)
        assert prerope_key_map(kc, vc, 16, 2) in want, spec


def test_eqd_files_hold_diagonal_transforms_and_eq_files_are_refused(tmp_path: Path, tiny_lm, stats):
    from walshkv.preset_file import diagonal_equalizers

    assert diagonal_equalizers("center+eqd+tq:3/tq:3", "k") and not diagonal_equalizers("center+eq+tq:3", "k")
    with pytest.raises(ValueError, match="eq\\+ in some layers and eqd\\+ in others"):
        diagonal_equalizers("layers:center+eq+tq:3/tq:3@0;center+eqd+tq:3/tq:3", "k")
    path = tmp_path / "d.gguf"
    write_preset_file(path, tiny_lm, Preset("walshkv:3.5", 3.5, "center+eqd+tq:3.5/eqd+tq:3"), stats)
    got = read_kv_mean_center(path, model_arch="llama")
    assert torch.allclose(got.k_equalizer(1), stats.k_equalizer_diagonal(1), atol=1e-6)
    bound = parse_codec("center+eqd+tq:3.5").bind(1, "k", got)  # a file written for eqd+: accepted
    assert bound.spec == "center+eqd+tq:3.5"
    dense = tmp_path / "e.gguf"
    write_preset_file(dense, tiny_lm, Preset("walshkv:3.5", 3.5, "center+eq+tq:3.5/tq:3"), stats)
    with pytest.raises(ValueError, match="not diagonal \\(a file written for eq\\+"):
        parse_codec("center+eqd+tq:3.5").bind(1, "k", read_kv_mean_center(dense, model_arch="llama"))
