"""The calibration/preset file matrix: a full file (K mean, eq+ K and V transforms, RoPE tables, preset keys)
written by :func:`walshkv.export.write_kv_mean_center`, then damaged every way a file on disk can be.

tests/export/test_kv_mean_center.py checks hand-made bad files (missing, misshapen, F16 or non-finite tensors,
bad magic, a file without ``k_rot``, truncation of a small K-mean-only file at every 5th byte). This file adds
what a full file meets: truncation at every 97th byte and in each of the last 64, random bytes behind a valid
header or over a run of the file, one byte flipped in every tensor's data region, the file used on another
model (through the cache that reads it, too), and paths that are a directory, missing, a FIFO, or under a file.

A flipped byte that leaves valid finite numbers cannot be detected: the GGUF format has no checksum, and
the file reads back with that one value changed. What is refused is what makes the contents invalid: NaN/Inf
anywhere, a RoPE scaling <= 0, an eq+ transform that fails :func:`walshkv.codecs.equalize.checked_inverse`.
Every refusal is a ValueError (or OSError) naming the file; no raw gguf/numpy exception reaches the caller.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from walshkv.cache import CompressedCache
from walshkv.codecs.equalize import MAX_TRANSFORM_COND, TRANSFORM_SCALE_RANGE
from walshkv.constants import Keys
from walshkv.export import KMeanBias, read_kv_mean_center, write_kv_mean_center

LAYERS, HEADS, HEAD_DIM = 3, 2, 32
SPEC = "prerope+center+eq+tq:3.5/eq+tq:3"
CASES: Counter[str] = Counter()  # cases tried per kind of damage
OUTCOMES: Counter[str] = Counter()  # refused, read back intact, or read back with the flipped value (undetectable)
MARGIN = 10.0  # how far from each limit of an eq+ transform a flipped head must be for _checks to decide it
_DAMAGED = r"truncated or damaged|not a GGUF file|holds no|is missing|holds \d+|NaN/Inf|declares|has shape|expected"


@pytest.fixture(scope="module", autouse=True)
def _report_counts(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    capture = pytestconfig.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and CASES:
        with capture.global_and_fixture_disabled():
            cases = ", ".join(f"{kind} {n}" for kind, n in CASES.items())
            outcomes = ", ".join(f"{kind} {n}" for kind, n in OUTCOMES.items())
            reporter.write_line(f"\nfile matrix: {sum(CASES.values())} cases ({cases}); {outcomes}")


def _write(path: Path, seed: int = 0) -> Path:
    gen = torch.Generator().manual_seed(seed)
    eye = torch.eye(HEAD_DIM, dtype=torch.float64)
    shape = (LAYERS, HEADS, HEAD_DIM, HEAD_DIM)
    k_eq = eye + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64) / HEAD_DIM**0.5
    v_eq = eye + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64) / HEAD_DIM**0.5
    inv_freq = (10000.0 ** (-torch.arange(0, HEAD_DIM, 2) / HEAD_DIM)).expand(LAYERS, -1).clone()
    write_kv_mean_center(
        path,
        torch.randn(LAYERS, HEADS, HEAD_DIM, generator=gen, dtype=torch.float64) + 0.5,
        arch="llama",
        tokens=1024,
        text="python-docs",
        model="smollm2-135m",
        extra={Keys.Preset.NAME: "walshkv:3.5", Keys.Preset.SPEC: SPEC},
        k_equalizer=k_eq,
        v_equalizer=v_eq,
        rope=(inv_freq, torch.ones(LAYERS)),
    )
    return path


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write(tmp_path_factory.mktemp("matrix") / "full.gguf")


def _refused(path: Path, match: str = _DAMAGED) -> str:
    """Read ``path``; it must be refused with a ValueError/OSError that names it and matches ``match``."""
    with pytest.raises((ValueError, OSError)) as info:
        read_kv_mean_center(path, model_arch="llama")
    assert type(info.value) is ValueError or isinstance(info.value, OSError), type(info.value)  # no raw subclass
    message = str(info.value)
    assert str(path) in message and "\n" not in message, message
    assert re.search(match, message), message
    OUTCOMES["refused"] += 1
    return message


def test_the_full_file_reads_back(full: Path) -> None:
    bias = read_kv_mean_center(full, model_arch="llama")
    assert bias.has_k_equalizer and bias.has_v_equalizer and bias.k_basis == "pre-rope"
    assert bias.rope_table(LAYERS - 1).head_dim == HEAD_DIM
    assert bias.meta[Keys.Preset.SPEC] == SPEC
    CASES["intact"] += 1
    OUTCOMES["read back intact"] += 1


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    return {t.name: (int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors}


def test_truncation_at_every_97th_byte_and_in_the_last_64_is_refused(full: Path, tmp_path: Path) -> None:
    raw = full.read_bytes()
    end = max(offset + size for offset, size in _tensor_spans(full).values())
    cut = tmp_path / "cut.gguf"
    for n in sorted({*range(0, len(raw), 97), *range(len(raw) - 64, len(raw))}):
        cut.write_bytes(raw[:n])
        if n >= end:  # only the alignment padding after the last tensor is gone: every value is there
            assert torch.equal(read_kv_mean_center(cut).plain, read_kv_mean_center(full).plain)
            OUTCOMES["read back intact"] += 1
        else:
            _refused(cut)
        CASES["truncation"] += 1


@pytest.mark.parametrize("seed", range(8))
def test_random_bytes_are_refused(full: Path, tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    raw = full.read_bytes()
    path = tmp_path / f"random{seed}.gguf"
    behind_header = raw[:8] + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes()  # magic + version, then noise
    path.write_bytes(behind_header)
    _refused(path)
    damaged = bytearray(raw)
    at = int(rng.integers(8, _tensor_spans(full)["kv_bar.blk.0.k"][0] - 64))  # a run of noise in the metadata
    damaged[at : at + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
    path.write_bytes(bytes(damaged))
    _refused(path, _DAMAGED + "|walshkv|kv_mean_center")
    CASES["random bytes"] += 2


def _flip(raw: bytes, at: int, mask: int) -> bytes:
    out = bytearray(raw)
    out[at] ^= mask
    return bytes(out)


def test_a_flipped_byte_in_every_tensor_changes_one_value_or_is_refused(full: Path, tmp_path: Path) -> None:
    """Four flips per tensor, in a value whose exponent's low bit is set (so that one byte can reach 0xFF):
    the lowest mantissa byte (a valid number: undetectable, read back changed), the exponent to all ones
    (NaN/Inf: refused), its bit 5 (x 2^±32) and bit 7 (x 2^128, or Inf): finite results are refused where an
    eq+ transform then fails its check, and read back changed elsewhere."""
    raw, spans = full.read_bytes(), _tensor_spans(full)
    original = read_kv_mean_center(full, model_arch="llama")
    path = tmp_path / "flipped.gguf"
    flips = (("mantissa", 0, 0x01), ("to NaN/Inf", 3, None), ("exponent bit 5", 3, 0x20), ("exponent bit 7", 3, 0x40))
    for name in spans:
        offset, size = spans[name]
        values = np.frombuffer(raw[offset : offset + size], dtype="<u4")
        index = int(np.flatnonzero(values & 0x00800000)[len(values) // 3 :][0])
        at = offset + 4 * index
        for what, byte, mask in flips:
            damaged = _flip(raw, at + byte, raw[at + 3] ^ 0x7F if mask is None else mask)
            value = np.frombuffer(damaged[at : at + 4], dtype="<f4")[0]
            path.write_bytes(damaged)
            if not np.isfinite(value) or (name == Keys.Rope.SCALING and value <= 0):
                _refused(path, r"NaN/Inf")
            elif "_eq." in name and not _checks(damaged[offset : offset + size], name):
                _refused(path, r"ill-conditioned|near zero or huge|no accurate inverse")
            else:  # undetectable without a checksum: read back with that one value changed
                assert _changed(original, read_kv_mean_center(path, model_arch="llama")) == 1, (name, what)
                OUTCOMES["undetectable (one value changed)"] += 1
            CASES[f"flip {what}"] += 1


def _checks(data: bytes, name: str) -> bool:
    """Whether an eq+ tensor's bytes still make valid transforms, decided independently of the reader: numpy's
    SVD and log-determinant (the reader runs torch's) against the documented limits, a condition number of at
    most MAX_TRANSFORM_COND and a scale |det|^(1/head_dim) within 1/TRANSFORM_SCALE_RANGE..TRANSFORM_SCALE_RANGE.
    Every head must sit at least a factor MARGIN from each limit, so that no case rests on rounding."""
    matrix = np.frombuffer(data, dtype="<f4").reshape(HEADS, HEAD_DIM, HEAD_DIM).astype(np.float64)
    cond = np.linalg.cond(matrix)  # per head; inf for a singular one
    scale = np.exp(np.linalg.slogdet(matrix)[1] / HEAD_DIM)
    low, high = 1 / TRANSFORM_SCALE_RANGE, TRANSFORM_SCALE_RANGE
    cond_ok, scale_ok = cond * MARGIN <= MAX_TRANSFORM_COND, (scale >= low * MARGIN) & (scale * MARGIN <= high)
    cond_bad = cond >= MAX_TRANSFORM_COND * MARGIN
    scale_bad = (scale * MARGIN <= low) | (scale >= high * MARGIN)
    clear = (cond_ok & scale_ok) | cond_bad | scale_bad
    assert clear.all(), f"{name}: a flipped head sits near a limit (cond {cond}, scale {scale}): choose another value"
    return bool((cond_ok & scale_ok).all())


def _changed(a: KMeanBias, b: KMeanBias) -> int:
    """How many values differ between two readings (mean, transforms, RoPE tables)."""
    pairs = [(a.plain, b.plain), (a.k_eq, b.k_eq), (a.v_eq, b.v_eq), (a.rope_inv_freq, b.rope_inv_freq)]
    pairs.append((a.rope_scaling, b.rope_scaling))
    return sum(int((x != y).sum()) for x, y in pairs if x is not None and y is not None)


@pytest.mark.parametrize(
    ("shape", "model", "match"),
    [
        ((LAYERS + 1, HEADS, HEAD_DIM), None, r"\(3, 2, 32\), but this model has \(4, 2, 32\)"),
        ((LAYERS, HEADS + 1, HEAD_DIM), None, r"but this model has \(3, 3, 32\)"),
        ((LAYERS, HEADS, 2 * HEAD_DIM), None, r"but this model has \(3, 2, 64\)"),
        ((LAYERS, HEADS, HEAD_DIM), "qwen2.5-1.5b", r"calibrated on 'smollm2-135m', not 'qwen2.5-1.5b'"),
    ],
)
def test_the_file_on_another_model_is_refused(
    full: Path, shape: tuple[int, int, int], model: str | None, match: str
) -> None:
    bias = read_kv_mean_center(full, model_arch="llama")
    with pytest.raises(ValueError, match=match):
        bias.check_matches(*shape, model=model)
    CASES["other model"] += 1
    OUTCOMES["refused"] += 1


def test_another_architecture_is_refused(full: Path) -> None:
    with pytest.raises(ValueError, match="calibrated on a 'llama' model, not 'gemma3'; calibrate on this model"):
        read_kv_mean_center(full, model_arch="gemma3")
    CASES["other model"] += 1
    OUTCOMES["refused"] += 1


@pytest.mark.parametrize("how", ["spec", "preset"])
def test_a_cache_refuses_the_file_of_another_model(full: Path, tiny_llama, how: str) -> None:
    """The tiny llama has (2 layers, 2 kv heads, head_dim 16): the file's (3, 2, 32) is refused before any layer."""
    bias = read_kv_mean_center(full, model_arch="llama")
    with pytest.raises(ValueError, match=r"\(3, 2, 32\), but this model has \(2, 2, 16\)"):
        if how == "spec":
            CompressedCache(SPEC, config=tiny_llama.config, calibration=bias)
        else:
            CompressedCache.from_preset(tiny_llama, "walshkv:3.5", calibration=bias)
    CASES["other model"] += 1
    OUTCOMES["refused"] += 1


def _fifo(tmp_path: Path) -> Path:
    path = tmp_path / "fifo.gguf"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize(
    ("where", "match"),
    [
        ("directory", "is a directory"),
        ("missing", "does not exist"),
        ("fifo", "not a regular file"),
        ("under a file", "does not exist"),
    ],
)
def test_paths_that_are_not_a_readable_file_are_refused(full: Path, tmp_path: Path, where: str, match: str) -> None:
    path = {
        "directory": lambda: tmp_path,
        "missing": lambda: tmp_path / "nope.gguf",
        "fifo": lambda: _fifo(tmp_path),  # reading it would block forever: refused without opening it
        "under a file": lambda: full / "calib.gguf",
    }[where]()
    _refused(path, match)
    CASES["path"] += 1
