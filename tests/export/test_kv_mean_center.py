"""K mean-centering bias files: GGUF layout, channel order, round trips and every refusal."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import walshkv
from walshkv.export import (
    KMeanBias,
    from_llamacpp_channel_order,
    read_kv_mean_center,
    to_llamacpp_channel_order,
    write_kv_mean_center,
)
from walshkv.ops.hadamard import hadamard_transform

LAYERS, HEADS, HEAD_DIM = 30, 3, 64  # smollm2-135m's shape
FIX = "walshkv calibrate"


def _mean(layers: int = LAYERS, heads: int = HEADS, head_dim: int = HEAD_DIM, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(layers, heads, head_dim, generator=gen, dtype=torch.float64) * 2.0 + 0.5


def _write_raw(
    path: Path,
    tensors: dict[str, np.ndarray],
    *,
    k_rot: bool | None = False,
    meta: dict[str, int | str] | None = None,
) -> Path:
    """A GGUF written directly with gguf.GGUFWriter (to build files walshkv would never write)."""
    writer = gguf.GGUFWriter(str(path), arch="kv_mean_center")
    if k_rot is not None:
        writer.add_bool("kv_mean_center.k_rot", k_rot)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_uint32(key, value)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _layers(n: int = 3, heads: int = 2, head_dim: int = 16, dtype=np.float32) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {f"kv_bar.blk.{i}.k": rng.standard_normal((heads, head_dim)).astype(dtype) for i in range(n)}


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


# ---- channel order -------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [2, 8, 64, 128])
def test_to_llamacpp_maps_channel_a_half_plus_b_to_2b_plus_a(head_dim: int) -> None:
    half = head_dim // 2
    hf = torch.arange(head_dim, dtype=torch.float64)  # value == HF channel index
    out = to_llamacpp_channel_order(hf, "llama")
    for a in (0, 1):
        for b in range(half):
            assert out[2 * b + a] == a * half + b
    assert sorted(out.tolist()) == hf.tolist()  # a permutation


def test_to_llamacpp_small_example() -> None:
    x = torch.arange(8)
    assert to_llamacpp_channel_order(x, "llama").tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert from_llamacpp_channel_order(x, "llama").tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_channel_orders_are_inverse_permutations(arch: str) -> None:
    x = _mean(4, 3, 64)
    to = to_llamacpp_channel_order(x, arch)
    assert not torch.equal(to, x)
    assert torch.equal(from_llamacpp_channel_order(to, arch), x)
    assert torch.equal(to_llamacpp_channel_order(from_llamacpp_channel_order(x, arch), arch), x)
    # acts on the last dimension only: each (layer, head) row is permuted on its own
    assert torch.equal(to[2, 1], to_llamacpp_channel_order(x[2, 1], arch))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3", "unknown"])
def test_neox_architectures_keep_hf_order(arch: str) -> None:
    x = _mean(2, 2, 16)
    assert torch.equal(to_llamacpp_channel_order(x, arch), x)
    assert torch.equal(from_llamacpp_channel_order(x, arch), x)


# ---- round trip through gguf.GGUFReader ----------------------------------------------------------


@pytest.mark.parametrize("basis", ["plain", "rot"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_round_trip_through_gguf_reader(tmp_path: Path, arch: str, basis: str) -> None:
    mean = _mean()
    path = tmp_path / f"{arch}-{basis}.gguf"
    write_kv_mean_center(path, mean, arch=arch, basis=basis, tokens=1024, text="python-docs", model="smollm2-135m")

    reader = gguf.GGUFReader(str(path))
    assert [t.name for t in reader.tensors] == [f"kv_bar.blk.{il}.k" for il in range(LAYERS)]
    in_file_order = to_llamacpp_channel_order(mean, arch)
    expected = hadamard_transform(in_file_order) if basis == "rot" else in_file_order
    for il, t in enumerate(reader.tensors):
        assert [int(n) for n in t.shape] == [HEAD_DIM, HEADS]  # ne: channel fastest
        assert t.tensor_type == gguf.GGMLQuantizationType.F32
        assert t.n_elements == HEAD_DIM * HEADS
        stored = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(HEADS, HEAD_DIM).copy())
        torch.testing.assert_close(stored.double(), expected[il], rtol=0, atol=1e-5)
    assert _field(reader, "kv_mean_center.k_rot") is (basis == "rot")
    assert reader.fields["kv_mean_center.k_rot"].types == [gguf.GGUFValueType.BOOL]
    assert _field(reader, "walshkv.layer_count") == LAYERS
    assert _field(reader, "walshkv.head_dim") == HEAD_DIM
    assert _field(reader, "walshkv.n_head_kv") == HEADS
    assert _field(reader, "walshkv.tokens") == 1024
    assert _field(reader, "walshkv.text") == "python-docs"
    assert _field(reader, "walshkv.architecture") == arch
    assert _field(reader, "walshkv.model") == "smollm2-135m"
    assert _field(reader, "walshkv.version") == walshkv.__version__

    for model_arch in (None, arch):
        bias = read_kv_mean_center(path, model_arch=model_arch)
        assert isinstance(bias, KMeanBias)
        assert (bias.basis, bias.arch, bias.num_layers) == (basis, arch, LAYERS)
        assert bias.plain.shape == mean.shape
        torch.testing.assert_close(bias.plain, mean, rtol=0, atol=1e-6)  # HF order, plain basis
        assert bias.text == "python-docs" and bias.meta["walshkv.tokens"] == 1024
        assert bias.source == str(path)
        described = bias.describe()
        assert described["basis"] == basis and described["file"] == str(path)
        bias.check_matches(LAYERS, HEADS, HEAD_DIM, "smollm2-135m")
        layer_bias = bias.k_bias(7, basis)
        want = hadamard_transform(mean[7]) if basis == "rot" else mean[7]
        torch.testing.assert_close(layer_bias, want, rtol=0, atol=1e-6)


def test_llama_stored_tensor_is_the_permuted_mean(tmp_path: Path) -> None:
    """For llama the file holds the mean in llama.cpp's channel order; for qwen2 the HF order."""
    mean = _mean(2, 3, 64)
    for arch, want in (("llama", to_llamacpp_channel_order(mean, "llama")), ("qwen2", mean)):
        path = tmp_path / f"{arch}.gguf"
        write_kv_mean_center(path, mean, arch=arch)
        t = gguf.GGUFReader(str(path)).tensors[1]
        stored = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(3, 64).copy()).double()
        torch.testing.assert_close(stored, want[1], rtol=0, atol=1e-6)
    assert not torch.allclose(to_llamacpp_channel_order(mean, "llama"), mean)


def test_rot_basis_is_rotated_in_llamacpp_order(tmp_path: Path) -> None:
    """The file holds H(P m). The channel permutation P is a rotation of the index bits, and the
    Sylvester Hadamard matrix is invariant under index-bit permutations, so H(P m) == P(H m):
    walshkv's rot basis (H in HF order) and llama.cpp's agree up to the same channel permutation."""
    mean = _mean(1, 3, 64)
    path = tmp_path / "rot.gguf"
    write_kv_mean_center(path, mean, arch="llama", basis="rot")
    t = gguf.GGUFReader(str(path)).tensors[0]
    stored = torch.from_numpy(np.asarray(t.data, dtype=np.float32).reshape(3, 64).copy()).double()
    in_llama_order = hadamard_transform(to_llamacpp_channel_order(mean[0], "llama"))
    torch.testing.assert_close(stored, in_llama_order, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        stored, to_llamacpp_channel_order(hadamard_transform(mean[0]), "llama"), atol=1e-5, rtol=0
    )
    # ... while a generic permutation does not commute with H
    swap = torch.arange(64)
    swap[[1, 2]] = swap[[2, 1]]
    assert not torch.allclose(hadamard_transform(mean[0][:, swap]), hadamard_transform(mean[0])[:, swap], atol=1e-3)


def test_single_kv_head_round_trip(tmp_path: Path) -> None:
    """gemma3-270m has one KV head of 256 channels."""
    mean = _mean(18, 1, 256)
    path = tmp_path / "gemma3.gguf"
    write_kv_mean_center(path, mean, arch="gemma3", basis="rot")
    t = gguf.GGUFReader(str(path)).tensors[0]
    assert [int(n) for n in t.shape] == [256, 1]
    bias = read_kv_mean_center(path, model_arch="gemma3")
    torch.testing.assert_close(bias.plain, mean, rtol=0, atol=1e-6)
    bias.check_matches(18, 1, 256)


def test_file_without_walshkv_metadata_uses_model_arch(tmp_path: Path) -> None:
    """A file from another tool (only the fork's keys): model_arch decides the channel mapping."""
    tensors = _layers(2, 2, 16)
    path = _write_raw(tmp_path / "fork.gguf", tensors, k_rot=False)
    fork_order = torch.from_numpy(np.stack(list(tensors.values()))).double()
    llama = read_kv_mean_center(path, model_arch="llama")
    assert llama.arch == "llama" and llama.basis == "plain"
    torch.testing.assert_close(llama.plain, from_llamacpp_channel_order(fork_order, "llama"), rtol=0, atol=0)
    qwen = read_kv_mean_center(path, model_arch="qwen2")
    torch.testing.assert_close(qwen.plain, fork_order, rtol=0, atol=0)
    rot = read_kv_mean_center(_write_raw(tmp_path / "fork-rot.gguf", tensors, k_rot=True), model_arch="qwen2")
    assert rot.basis == "rot"
    torch.testing.assert_close(rot.plain, hadamard_transform(fork_order), rtol=0, atol=1e-6)


def test_k_bias_basis_and_layer_checks(tmp_path: Path) -> None:
    mean = _mean(2, 2, 16)
    plain_path = tmp_path / "plain.gguf"
    write_kv_mean_center(plain_path, mean, arch="llama", basis="plain")
    plain = read_kv_mean_center(plain_path)
    torch.testing.assert_close(plain.k_bias(1, "plain"), mean[1], rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match=r"'plain' basis but the codec needs 'rot'.*--basis rot"):
        plain.k_bias(0, "rot")
    with pytest.raises(ValueError, match="2 layers; layer 2 requested"):
        plain.k_bias(2, "plain")
    with pytest.raises(ValueError, match="layer -1"):
        plain.k_bias(-1, "plain")
    rot_path = tmp_path / "rot.gguf"
    write_kv_mean_center(rot_path, mean, arch="llama", basis="rot")
    with pytest.raises(ValueError, match=r"'rot' basis but the codec needs 'plain'.*center\+rot\+SPEC"):
        read_kv_mean_center(rot_path).k_bias(0, "plain")


# ---- refusals ------------------------------------------------------------------------------------


def test_missing_layer_tensor_is_named(tmp_path: Path) -> None:
    tensors = _layers(3)
    del tensors["kv_bar.blk.1.k"]
    path = _write_raw(tmp_path / "missing.gguf", tensors)
    with pytest.raises(ValueError, match=rf"missing tensors kv_bar\.blk\.1\.k.*{FIX}"):
        read_kv_mean_center(path)
    first = _layers(3)
    del first["kv_bar.blk.0.k"]
    with pytest.raises(ValueError, match=r"missing tensors kv_bar\.blk\.0\.k"):
        read_kv_mean_center(_write_raw(tmp_path / "missing0.gguf", first))


def test_layer_count_disagreeing_with_tensors_is_refused(tmp_path: Path) -> None:
    tensors = _layers(3)
    del tensors["kv_bar.blk.1.k"]
    path = _write_raw(tmp_path / "declared.gguf", tensors, meta={"walshkv.layer_count": 3})
    with pytest.raises(ValueError, match=rf"declares 3 layers but holds 2 kv_bar tensors.*{FIX}"):
        read_kv_mean_center(path)


def test_no_layer_tensors_is_refused(tmp_path: Path) -> None:
    path = _write_raw(tmp_path / "empty.gguf", {"other.weight": np.zeros(4, np.float32)})
    with pytest.raises(ValueError, match=r"no kv_bar\.blk\.<il>\.k tensors"):
        read_kv_mean_center(path)


@pytest.mark.parametrize("odd_shape", [(3, 16), (2, 8), (32,)])
def test_misshapen_layer_is_refused(tmp_path: Path, odd_shape: tuple[int, ...]) -> None:
    tensors = _layers(3, heads=2, head_dim=16)
    tensors["kv_bar.blk.2.k"] = np.ones(odd_shape, np.float32)
    path = _write_raw(tmp_path / "shape.gguf", tensors)
    with pytest.raises(ValueError, match=rf"kv_bar\.blk\.2\.k has shape .*layer 0 has \(2, 16\).*{FIX}"):
        read_kv_mean_center(path)


def test_metadata_disagreeing_with_tensors_is_refused(tmp_path: Path) -> None:
    path = _write_raw(tmp_path / "meta.gguf", _layers(2, 2, 16), meta={"walshkv.head_dim": 32})
    with pytest.raises(ValueError, match=r"walshkv\.head_dim = 32 but the tensors say 16"):
        read_kv_mean_center(path)
    path = _write_raw(tmp_path / "meta2.gguf", _layers(2, 2, 16), meta={"walshkv.n_head_kv": 3})
    with pytest.raises(ValueError, match=r"walshkv\.n_head_kv = 3 but the tensors say 2"):
        read_kv_mean_center(path)


@pytest.mark.parametrize(
    "shape", [(LAYERS + 1, HEADS, HEAD_DIM), (LAYERS, HEADS - 1, HEAD_DIM), (LAYERS, HEADS, 2 * HEAD_DIM)]
)
def test_file_for_another_model_is_refused(tmp_path: Path, shape: tuple[int, int, int]) -> None:
    path = tmp_path / "smollm2.gguf"
    write_kv_mean_center(path, _mean(), arch="llama")
    bias = read_kv_mean_center(path, model_arch="llama")  # reading is fine ...
    with pytest.raises(ValueError, match=rf"\(30, 3, 64\).*'other-model' has \({shape[0]}, {shape[1]}, {shape[2]}\)"):
        bias.check_matches(*shape, model="other-model")  # ... using it on another model is not
    with pytest.raises(ValueError, match=FIX):
        bias.check_matches(*shape)


def test_architecture_mismatch_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_kv_mean_center(path, _mean(2, 2, 16), arch="llama")
    with pytest.raises(ValueError, match="calibrated on a 'llama' model, not 'qwen2'; calibrate on this model"):
        read_kv_mean_center(path, model_arch="qwen2")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_file_is_refused(tmp_path: Path, bad: float) -> None:
    tensors = _layers(3)
    tensors["kv_bar.blk.1.k"][1, 5] = bad
    path = _write_raw(tmp_path / "nan.gguf", tensors)
    with pytest.raises(ValueError, match="NaN/Inf values; recalibrate"):
        read_kv_mean_center(path)


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "full.gguf"
    write_kv_mean_center(path, _mean(), arch="llama")
    raw = path.read_bytes()
    cut = tmp_path / "half.gguf"
    cut.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=rf"truncated or damaged.*{FIX}"):
        read_kv_mean_center(cut)


def test_every_truncation_is_refused(tmp_path: Path) -> None:
    """Cut anywhere (header, metadata, tensor infos, data): always a ValueError, never garbage."""
    path = tmp_path / "small.gguf"
    write_kv_mean_center(path, _mean(3, 2, 16), arch="llama", basis="rot")
    raw = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for n in [*range(0, len(raw), 5), len(raw) - 1]:
        cut.write_bytes(raw[:n])
        with pytest.raises(ValueError, match=r"GGUF|truncated|damaged"):
            read_kv_mean_center(cut)


def test_non_gguf_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match=rf"not a GGUF file \(bad magic\).*{FIX}"):
        read_kv_mean_center(path)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_kv_mean_center(empty)


def test_gguf_without_k_rot_is_refused(tmp_path: Path) -> None:
    path = _write_raw(tmp_path / "nokrot.gguf", _layers(2), k_rot=None)
    with pytest.raises(ValueError, match=rf"no kv_mean_center\.k_rot key.*{FIX}"):
        read_kv_mean_center(path)


def test_missing_path_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        read_kv_mean_center(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match="is a directory"):
        read_kv_mean_center(tmp_path)  # a folder


def test_f16_tensor_is_refused(tmp_path: Path) -> None:
    path = _write_raw(tmp_path / "f16.gguf", _layers(2, dtype=np.float16))
    assert gguf.GGUFReader(str(path)).tensors[0].tensor_type == gguf.GGMLQuantizationType.F16
    with pytest.raises(ValueError, match=rf"kv_bar\.blk\.0\.k is F16, expected F32.*{FIX}"):
        read_kv_mean_center(path)


# ---- writer refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_writer_refuses_non_finite_mean(tmp_path: Path, bad: float) -> None:
    mean = _mean(2, 2, 16)
    mean[1, 0, 3] = bad
    path = tmp_path / "nan.gguf"
    with pytest.raises(ValueError, match="NaN/Inf"):
        write_kv_mean_center(path, mean, arch="llama")
    assert not path.exists()


@pytest.mark.parametrize("basis", ["wht", "ROT", ""])
def test_writer_refuses_a_bad_basis(tmp_path: Path, basis: str) -> None:
    path = tmp_path / "basis.gguf"
    with pytest.raises(ValueError, match="--basis must be one of plain, rot"):
        write_kv_mean_center(path, _mean(2, 2, 16), arch="llama", basis=basis)
    assert not path.exists()


def test_writer_refuses_a_bad_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\[layers, kv_heads, head_dim\]"):
        write_kv_mean_center(tmp_path / "shape.gguf", torch.zeros(2, 16), arch="llama")
