"""``CompressedCache.save`` / ``.load``: bit-exact round trips, generation that goes on, refused files."""

from __future__ import annotations

import copy
import errno
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from walshkv.cache import CacheFileError, CompressedCache, enable_fused_attention, persist
from walshkv.codecs.registry import parse_codec
from walshkv.presets import PRESET_BUDGETS

# the shared codec matrix lives beside the codec contract (tests/codecs/matrix.py)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # test_fileio's full disk

from matrix import MATRIX, CalibrationStub

from test_fileio import file_size_limit


def _cache_spec(spec: str) -> str:
    """A cache spec with ``spec`` on K, and on V too unless it refuses V (``prerope+``): then ``tq:3`` there."""
    try:
        parse_codec(spec).bind(0, "v", CalibrationStub(64, 1))
    except ValueError:
        return f"{spec}/tq:3"
    return spec


SPECS = sorted({_cache_spec(entry.spec) for entry in MATRIX})


def _run(model, cache, ids: torch.Tensor, splits: tuple[int, ...]) -> torch.Tensor:
    """Feed ``ids`` to ``model`` in blocks ending at ``splits``; the last block's logits."""
    start, logits = 0, None
    with torch.inference_mode():
        for stop in splits:
            logits = model(input_ids=ids[:, start:stop], cache=cache).logits
            start = stop
    assert logits is not None
    return logits


def _tensors(cache: CompressedCache) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, layer in enumerate(cache.layers):
        for side in ("packed_k", "packed_v"):
            packed = getattr(layer, side)
            out += [(f"{i}.{side}.{k}", t) for k, t in ({} if packed is None else packed.tensors).items()]
        out += [(f"{i}.{name}", getattr(layer, name)) for name in ("keys", "values", "sink_k", "sink_v")]
    return out


def _assert_same(saved: CompressedCache, loaded: CompressedCache) -> None:
    """Every stored tensor equal (bytes, dtype, shape), the same positions and byte counts."""
    assert saved.cache_spec.spec == loaded.cache_spec.spec
    pairs = list(zip(_tensors(saved), _tensors(loaded), strict=True))
    for (name_a, a), (name_b, b) in pairs:
        assert name_a == name_b
        assert (a is None) == (b is None), name_a
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name_a
    for a, b in zip(saved.layers, loaded.layers, strict=True):
        assert (a.cumulative_length, a.get_seq_length()) == (b.cumulative_length, b.get_seq_length())
        assert a.get_mask_sizes(1) == b.get_mask_sizes(1)
    assert saved.nbytes() == loaded.nbytes() == loaded.layout_nbytes()


def _data_bytes(path: Path) -> tuple[int, int]:
    """``(tensor bytes, header bytes)`` of a safetensors file."""
    raw = path.read_bytes()
    header = int.from_bytes(raw[:8], "little")
    return len(raw) - 8 - header, header


def _round_trip(
    model, cache, tmp_path, calibration=None, splits=(13, 14, 15), ids=None, at_rest="packed"
) -> CompressedCache:
    """Fill ``cache``, save, load; check bytes, sizes and the next token's logits; return the loaded cache."""
    ids = torch.randint(3, 90, (2, splits[-1] + 1), generator=torch.Generator().manual_seed(5)) if ids is None else ids
    _run(model, cache, ids, splits)
    path = tmp_path / "cache.safetensors"
    cache.save(path, at_rest=at_rest)
    loaded = CompressedCache.load(path, model, calibration)
    _assert_same(cache, loaded)
    assert loaded.reserved_nbytes() == loaded.nbytes()  # restored as held, nothing reserved
    data, header = _data_bytes(path)
    if at_rest == "packed":
        assert data == cache.nbytes()  # only the tokens held: no reserved capacity, no padding
    else:  # each field coded, or stored as it is where coding would not shorten it (20 bytes of header)
        fields = sum(len(p.tensors) for layer in cache.layers for p in (layer.packed_k, layer.packed_v) if p)
        assert data <= cache.nbytes() + 20 * fields
    assert header <= 1024 + 1024 * len(cache.layers) * (2 if at_rest == "rans" else 1)
    a = _run(model, cache, ids[:, splits[-1] :], (1,))
    b = _run(model, loaded, ids[:, splits[-1] :], (1,))
    assert torch.equal(a, b)
    _assert_same(cache, loaded)  # and the step was stored alike
    return loaded


# ---- bit-exact round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_every_matrix_codec_round_trips_bit_exact(tiny_llama_hd64, tmp_path, spec):
    stub = CalibrationStub(64, 1)
    cache = CompressedCache(spec, config=tiny_llama_hd64.config, calibration=stub)
    _round_trip(tiny_llama_hd64, cache, tmp_path, stub if cache.cache_spec.needs_calibration else None)


@pytest.mark.parametrize("spec", SPECS)
def test_every_matrix_codec_round_trips_entropy_coded(tiny_llama_hd64, tmp_path, spec):
    stub = CalibrationStub(64, 1)
    cache = CompressedCache(spec, config=tiny_llama_hd64.config, calibration=stub)
    _round_trip(tiny_llama_hd64, cache, tmp_path, stub if cache.cache_spec.needs_calibration else None, at_rest="rans")


def test_entropy_coded_file_is_smaller_where_codes_are_not_equally_likely(tiny_llama, tmp_path):
    cache = CompressedCache("int4", config=tiny_llama.config)  # min-max codes of bell-shaped values
    _run(tiny_llama, cache, torch.randint(3, 90, (4, 600), generator=torch.Generator().manual_seed(2)), (600,))
    cache.save(tmp_path / "packed.safetensors")
    cache.save(tmp_path / "rans.safetensors", at_rest="rans")
    packed, coded = _data_bytes(tmp_path / "packed.safetensors")[0], _data_bytes(tmp_path / "rans.safetensors")[0]
    assert packed == cache.nbytes() and coded < 0.95 * packed
    _assert_same(cache, CompressedCache.load(tmp_path / "rans.safetensors", tiny_llama))
    with pytest.raises(ValueError, match="at_rest must be one of packed, rans"):
        cache.save(tmp_path / "x.safetensors", at_rest="zstd")


def test_a_damaged_blob_with_a_matching_checksum_is_refused(tiny_llama, tmp_path):
    from safetensors import safe_open

    from walshkv.cache.identity import checksum

    cache = CompressedCache("int4", config=tiny_llama.config)  # coded blobs (stored ones have only the checksum)
    _run(tiny_llama, cache, torch.randint(3, 90, (4, 600), generator=torch.Generator().manual_seed(2)), (600,))
    path = tmp_path / "rans.safetensors"
    cache.save(path, at_rest="rans")
    with safe_open(str(path), framework="pt") as handle:
        meta = handle.metadata()
        tensors = {k: handle.get_tensor(k).clone() for k in handle.keys()}  # noqa: SIM118
    name = next(k for k in tensors if ".packed_k." in k)
    tensors[name][-3] ^= 0x5A  # a coded word changed, the checksum made again: only decoding can tell
    meta["walshkv.sha256"] = checksum(meta["walshkv.cache"], tensors)
    save_file(tensors, str(path), metadata=meta)
    _refused(path, tiny_llama, "corrupt", f"{name} does not decode to its saved field")


@pytest.mark.parametrize("name", sorted(PRESET_BUDGETS))
def test_shipped_presets_round_trip_bit_exact(tiny_llama_hd64, tmp_path, name):
    stub = CalibrationStub(64, 1)
    _round_trip(tiny_llama_hd64, CompressedCache.from_preset(tiny_llama_hd64, name, calibration=stub), tmp_path, stub)


@pytest.mark.parametrize(
    ("spec", "residual"),
    [
        ("sink:1:center+tq:4/tq:2.5", 0),
        ("sink:2:rot+int4", 3),
        ("int4", 3),
        ("prerope+center+tq:4/tq:3", 2),
        ("layers:tq:4@0;center+int3", 0),
        ("kivi2:g=4:r=4", 0),
    ],
)
def test_sink_window_and_positions_round_trip(tiny_llama, tmp_path, spec, residual):
    stub = CalibrationStub(16, 2)
    cache = CompressedCache(spec, config=tiny_llama.config, residual=residual, calibration=stub)
    loaded = _round_trip(tiny_llama, cache, tmp_path, stub, splits=(11, 12, 13, 17))
    assert loaded.residual == residual


@pytest.mark.parametrize("spec", ["rot+int4", "sink:1:tq:3"])
def test_sliding_window_model_round_trips(tiny_gemma3, tmp_path, spec):
    """gemma3's local layers have dropped tokens (window 6): offsets and positions come back too."""
    loaded = _round_trip(tiny_gemma3, CompressedCache(spec, config=tiny_gemma3.config, residual=2), tmp_path)
    assert loaded.layers[0].cumulative_length > loaded.layers[0].sliding_window


def test_kivi_sliding_layers_round_trip(tiny_gemma3, tmp_path):
    """KIVI's sliding layers dropped whole K groups: what they hold, and the mask offset, come back."""
    cache = CompressedCache("kivi2:g=2:r=1", config=tiny_gemma3.config)
    loaded = _round_trip(tiny_gemma3, cache, tmp_path, splits=(9, 12, 13, 15))
    layer = loaded.layers[0]
    assert layer.is_sliding and layer.get_mask_sizes(1)[1] > 0  # it dropped tokens
    assert layer.get_mask_sizes(1) == cache.layers[0].get_mask_sizes(1)


@pytest.mark.parametrize(
    ("spec", "residual"), [("sink:1:center+tq:4/tq:2.5", 2), ("kivi2:g=4:r=4", 0), ("rot+int4", 0)]
)
def test_generation_continues_after_load_as_with_the_saved_cache(tiny_llama, tmp_path, spec, residual):
    stub = CalibrationStub(16, 2)
    ids = torch.randint(3, 90, (1, 14), generator=torch.Generator().manual_seed(9))
    cache = CompressedCache(spec, config=tiny_llama.config, residual=residual, calibration=stub)
    with torch.no_grad():  # as generate runs (a store made under inference_mode cannot be written outside it)
        tiny_llama(input_ids=ids[:, :13], cache=cache)  # the prompt but its last token, as a prompt cache holds it
    cache.save(tmp_path / "prompt.safetensors")
    loaded = CompressedCache.load(tmp_path / "prompt.safetensors", tiny_llama, stub)
    kwargs = {"max_new_tokens": 12, "do_sample": False}
    want = tiny_llama.generate(ids, cache=cache, **kwargs)
    got = tiny_llama.generate(ids, cache=loaded, **kwargs)
    assert torch.equal(want, got)
    assert loaded.nbytes() == cache.nbytes()


def test_fused_cache_round_trips_and_stays_fused(tiny_llama, tmp_path):
    enable_fused_attention(tiny_llama)
    try:
        cache = CompressedCache("rot+int4", config=tiny_llama.config, fused=True, max_cache_len=64)
        loaded = _round_trip(tiny_llama, cache, tmp_path)
        assert loaded.fused and loaded.max_cache_len == 64
    finally:
        tiny_llama.set_attn_implementation("sdpa")
    with pytest.raises(CacheFileError, match=r"rebuild: .*enable_fused_attention") as err:
        CompressedCache.load(tmp_path / "cache.safetensors", tiny_llama)
    assert err.value.reason == "rebuild"


def test_a_file_holds_the_tokens_not_the_reserved_store(tiny_llama, tmp_path):
    """A 200-token cache with 1,024 tokens reserved: the file holds the 200 tokens' packed bytes."""
    cache = CompressedCache("tq:3", config=tiny_llama.config, max_cache_len=1024)
    ids = torch.randint(3, 90, (1, 200), generator=torch.Generator().manual_seed(2))
    _run(tiny_llama, cache, ids, (200,))
    cache.save(tmp_path / "c.safetensors")
    data, header = _data_bytes(tmp_path / "c.safetensors")
    assert cache.reserved_nbytes() > 4 * cache.nbytes()
    assert data == cache.nbytes() and header < 3 * 1024


def test_save_replaces_atomically_and_refuses_before_writing(tiny_llama, tmp_path):
    path = tmp_path / "c.safetensors"
    first = CompressedCache("int8", config=tiny_llama.config)
    _run(tiny_llama, first, torch.randint(3, 90, (1, 6)), (6,))
    first.save(path)
    second = CompressedCache("int4", config=tiny_llama.config)
    _run(tiny_llama, second, torch.randint(3, 90, (1, 9)), (9,))
    second.save(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]  # no temporary file left
    assert CompressedCache.load(path, tiny_llama).cache_spec.spec == "int4"
    before = path.read_bytes()
    unbound = CompressedCache("int4")  # no config: its model is unknown
    unbound.update(torch.randn(1, 2, 3, 16), torch.randn(1, 2, 3, 16), 0)
    with pytest.raises(ValueError, match=r"config=model\.config"):
        unbound.save(path)
    assert path.read_bytes() == before
    half = CompressedCache("int4", config=tiny_llama.config)
    _run(tiny_llama, half, torch.randint(3, 90, (1, 4)), (4,))
    with torch.inference_mode():
        half.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0)  # layer 0 written, layer 1 not yet
    with pytest.raises(ValueError, match="save between forwards"):
        half.save(path)
    assert path.read_bytes() == before


@pytest.mark.parametrize("limit", [64, 700, 1500])
def test_a_full_disk_names_the_path_and_keeps_the_old_file(tiny_llama, tmp_path, limit):
    """Fault matrix: safetensors reports a failed write as its own error without the path (or not at all, for a
    short one); save raises the OSError of the cause naming the file asked for, and the old file stays."""
    path = tmp_path / "c.safetensors"
    first = CompressedCache("int4", config=tiny_llama.config)
    _run(tiny_llama, first, torch.randint(3, 90, (1, 3)), (3,))
    first.save(path)
    before = path.read_bytes()
    big = CompressedCache("int8", config=tiny_llama.config)
    _run(tiny_llama, big, torch.randint(3, 90, (1, 40)), (40,))
    with file_size_limit(limit), pytest.raises(OSError) as info:
        big.save(path)
    assert info.value.errno in (errno.EFBIG, errno.ENOSPC, errno.EIO), info.value
    assert info.value.filename == str(path), info.value
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


# ---- refusals -------------------------------------------------------------------------------------------

_SPEC = "sink:1:center+rot+int4/int3"


@pytest.fixture
def saved(tiny_llama, tmp_path) -> Path:
    """A saved calibrated cache with sink tokens and a residual window."""
    cache = CompressedCache(_SPEC, config=tiny_llama.config, residual=2, calibration=CalibrationStub(16, 2))
    _run(tiny_llama, cache, torch.randint(3, 90, (1, 12)), (10, 11, 12))
    path = tmp_path / "saved.safetensors"
    cache.save(path)
    return path


def _refused(path: Path, model, reason: str, match: str | None = None, calibration=None, **kwargs) -> None:
    with pytest.raises(CacheFileError, match=None if match is None else re.escape(match)) as err:
        CompressedCache.load(path, model, calibration if calibration is not None else CalibrationStub(16, 2), **kwargs)
    assert err.value.reason == reason, str(err.value)
    assert str(path) in str(err.value)


def _write(path: Path, raw: bytes) -> Path:
    path.write_bytes(raw)
    return path


@pytest.mark.parametrize("where", ["empty", "length", "header", "header_end", "data", "last"])
def test_a_truncated_file_is_refused(saved, tiny_llama, where):
    raw = saved.read_bytes()
    header_end = 8 + int.from_bytes(raw[:8], "little")
    cut = {
        "empty": 0,
        "length": 5,
        "header": header_end // 2,
        "header_end": header_end,
        "data": (header_end + len(raw)) // 2,
        "last": len(raw) - 1,
    }[where]
    _refused(_write(saved, raw[:cut]), tiny_llama, "truncated", "incomplete")


@pytest.mark.parametrize("where", [0.05, 0.5, 1.0])
def test_a_flipped_bit_in_the_tensors_is_refused(saved, tiny_llama, where):
    raw = bytearray(saved.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    at = min(len(raw) - 1, header_end + int(where * (len(raw) - header_end)))
    raw[at] ^= 0x10
    _refused(_write(saved, bytes(raw)), tiny_llama, "checksum", "changed after it was written")


def test_an_edited_header_is_refused(saved, tiny_llama):
    raw = saved.read_bytes()
    edited = raw.replace(b'\\"residual\\":2', b'\\"residual\\":3')
    assert edited != raw and len(edited) == len(raw)
    _refused(_write(saved, edited), tiny_llama, "checksum")


def test_unreadable_and_foreign_files_are_refused(saved, tiny_llama, tmp_path):
    raw = bytearray(saved.read_bytes())
    raw[8] = ord("[")  # the safetensors JSON header no longer parses as an object
    _refused(_write(saved, bytes(raw)), tiny_llama, "corrupt")
    noise = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    with pytest.raises(CacheFileError):
        CompressedCache.load(_write(tmp_path / "noise.bin", noise.numpy().tobytes()), tiny_llama)
    save_file({"w": torch.zeros(3)}, str(tmp_path / "weights.safetensors"))
    _refused(tmp_path / "weights.safetensors", tiny_llama, "not-a-cache", "CompressedCache.save")


def test_an_unknown_format_version_is_refused(saved, tiny_llama):
    raw = saved.read_bytes()
    edited = raw.replace(b'\\"format\\":1', b'\\"format\\":7')
    assert edited != raw
    _refused(_write(saved, edited), tiny_llama, "format", "reads formats 1 and 2")


def test_another_walshkv_version_is_refused(tiny_llama, tmp_path, monkeypatch):
    cache = CompressedCache("int4", config=tiny_llama.config)
    _run(tiny_llama, cache, torch.randint(3, 90, (1, 5)), (5,))
    monkeypatch.setattr(persist, "__version__", "0.0.1")
    cache.save(tmp_path / "old.safetensors")
    monkeypatch.undo()
    _refused(tmp_path / "old.safetensors", tiny_llama, "version", "written by walshkv 0.0.1")


def test_another_model_is_refused(saved, tiny_llama, tiny_llama_hd64):
    _refused(saved, tiny_llama_hd64, "model", "num_kv_heads, head_dim", calibration=CalibrationStub(64, 1))
    config = copy.deepcopy(tiny_llama.config)
    config.rms_norm_eps = 1e-3  # same shapes, another model
    other = type(tiny_llama)(config).eval()
    _refused(saved, other, "model", "differs in config_sha256")
    _refused(saved, copy.deepcopy(tiny_llama).to(torch.bfloat16), "dtype", "load the model in float32")


def test_another_or_no_calibration_is_refused(saved, tiny_llama):
    other = CalibrationStub(16, 2)
    other._mean = other._mean + 0.25  # another K mean
    _refused(saved, tiny_llama, "calibration", "pass the calibration the cache was built with", calibration=other)
    with pytest.raises(CacheFileError, match="pass calibration=") as err:
        CompressedCache.load(saved, tiny_llama)
    assert err.value.reason == "calibration"


def test_another_spec_is_refused(saved, tiny_llama):
    _refused(saved, tiny_llama, "spec", f"holds a {_SPEC} cache, not rot+int4", spec="rot+int4")
    assert CompressedCache.load(saved, tiny_llama, CalibrationStub(16, 2), spec=_SPEC).cache_spec.spec == _SPEC


def test_a_missing_file_names_the_path(tiny_llama, tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved cache there"):
        CompressedCache.load(tmp_path / "nothing.safetensors", tiny_llama)
    with pytest.raises(IsADirectoryError, match="is a directory"):
        CompressedCache.load(tmp_path, tiny_llama)
