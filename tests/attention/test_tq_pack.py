"""tq's encoder in the CPU kernel (``tq_pack`` in attention/cpu_kernel_tq_encode.h) against its torch path, bit for bit.

:func:`walshkv.attention.cpu.tq_pack_rows` is registered as the implementation of :data:`walshkv.codecs.turbo.PACK_ROWS`
(:mod:`walshkv.codecs.accelerated`): once the kernel is loaded, :meth:`walshkv.codecs.turbo.TurboQuant._encode` hands it
the rotated rows; its torch path, the reference, runs under :func:`walshkv.codecs.accelerated.reference_only`.
Every width, both codebooks, head sizes from 2 to 256, zero and tiny rows, every input dtype, blocks that take
the kernel's threads, and the inputs the codec refuses must come out the same either way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import cpu
from walshkv.cache.layers import CompressedLayer
from walshkv.codecs import accelerated, turbo
from walshkv.codecs.registry import parse_codec

pytestmark = pytest.mark.skipif(not cpu.kernel_available(), reason="the CPU kernel cannot be built here")


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The kernel's packer registered and counting the blocks it packs."""
    calls: list[int] = []

    def packer(rotated, norm16, tables):
        out = cpu.tq_pack_rows(rotated, norm16, tables)
        calls.append(0 if out is None else rotated.numel())
        return out

    monkeypatch.setitem(accelerated._REGISTRY, turbo.PACK_ROWS, packer)
    return calls


def _torch_path(codec, x: torch.Tensor, start: int = 0):
    with accelerated.reference_only():
        return codec.encode(x, start)


def _same(a, b) -> None:
    assert a.tensors.keys() == b.tensors.keys()
    for name in a.tensors:
        assert a.tensors[name].dtype == b.tensors[name].dtype, name
        assert torch.equal(a.tensors[name], b.tensors[name]), name


def test_the_kernel_is_tqs_registered_packer() -> None:
    assert accelerated.implementation(turbo.PACK_ROWS) is cpu.tq_pack_rows
    with accelerated.reference_only():
        assert accelerated.implementation(turbo.PACK_ROWS) is None


def test_the_packer_declines_until_the_kernel_is_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = parse_codec("tq:3.5")
    x = torch.randn(1, 2, 5, 64, generator=torch.Generator().manual_seed(2))
    monkeypatch.setattr(cpu, "_kernel", None)
    assert cpu.tq_pack_rows(codec.rotate(x), torch.ones(1, 2, 5, 1, dtype=torch.float16), []) is None
    _same(codec.encode(x), _torch_path(codec, x))


@pytest.mark.parametrize("bits", turbo.TQ_BITS)
@pytest.mark.parametrize("codebook", turbo.CODEBOOKS)
def test_every_width_and_codebook(bits: float, codebook: str, counted: list[int]) -> None:
    codec = parse_codec(f"tq:{bits:g}" + ("" if codebook == "gauss" else ":codebook=beta"))
    gen = torch.Generator().manual_seed(int(2 * bits))
    x = 3 * torch.randn(2, 3, 37, 64, generator=gen)
    x[0, 1, 4] = 0.0  # a zero row: its scale is 0, t is the rotated row itself
    x[1, 2, 9] = 1e-9  # a norm below fp16's smallest subnormal: stored as 0
    got = codec.encode(x)
    assert counted and counted[-1] == x.numel()
    _same(got, _torch_path(codec, x))


@pytest.mark.parametrize("d", [2, 4, 8, 16, 32, 128, 256])
@pytest.mark.parametrize("spec", ["tq:3", "tq:3.5", "tq:2.5", "tq:5"])
def test_head_sizes(d: int, spec: str, counted: list[int]) -> None:
    codec = parse_codec(spec)
    x = torch.randn(1, 2, 11, d, generator=torch.Generator().manual_seed(d))
    _same(codec.encode(x), _torch_path(codec, x))
    assert counted[-1] == x.numel()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_input_dtypes(dtype: torch.dtype, counted: list[int]) -> None:
    codec = parse_codec("tq:3.5")
    x = (4 * torch.randn(2, 3, 19, 64, generator=torch.Generator().manual_seed(1))).to(dtype)
    got = codec.encode(x)
    _same(got, _torch_path(codec, x))
    assert got.dtype == dtype and counted[-1] == x.numel()


@pytest.mark.parametrize("spec", ["tq:4", "tq:2.5"])
def test_a_block_the_kernel_threads(spec: str, counted: list[int]) -> None:
    codec = parse_codec(spec)
    x = torch.randn(2, 3, 700, 64, generator=torch.Generator().manual_seed(7))  # n * d >= 65536: a prefill chunk
    _same(codec.encode(x), _torch_path(codec, x))
    assert counted[-1] == x.numel()


@pytest.mark.parametrize("spec", ["prerope+center+eq+tq:3.5", "prerope+center+eqd+tq:3", "center+eq+tq:2.5"])
@pytest.mark.parametrize("tokens", [1, 13])
def test_the_presets_wrappers(spec: str, tokens: int, counted: list[int]) -> None:
    """A preset's K codec (RoPE undone, mean removed, eq+'s map) hands the packer its transformed rows."""
    bound = parse_codec(spec).bind(1, "k", CalibrationStub(64, 3))
    x = torch.randn(1, 3, tokens, 64, generator=torch.Generator().manual_seed(3))
    _same(bound.encode(x, 100), _torch_path(bound, x, 100))
    assert counted[-1] == x.numel()


def test_refused_inputs_raise_what_the_torch_path_raises(counted: list[int]) -> None:
    codec = parse_codec("tq:3.5")
    for bad in (float("nan"), float("inf")):
        x = torch.randn(1, 2, 4, 64)
        x[0, 1, 2, 5] = bad
        with pytest.raises(ValueError) as kernel_err:
            codec.encode(x)
        with pytest.raises(ValueError) as torch_err:
            _torch_path(codec, x)
        assert str(kernel_err.value) == str(torch_err.value)
    big = torch.full((1, 2, 4, 64), 1e4)  # norm 8e4: past fp16
    with pytest.raises(ValueError, match="fp16") as kernel_err:
        codec.encode(big)
    with pytest.raises(ValueError) as torch_err:
        _torch_path(codec, big)
    assert str(kernel_err.value) == str(torch_err.value)


def _decode_steps_match(spec: str, prefill: int, counted: list[int]) -> None:
    """A prefill of ``prefill`` tokens then two one-token writes of a ``spec`` layer go through the kernel (counted by
    the fixture) and store what the torch path stores."""
    layer = CompressedLayer(spec)
    twin = CompressedLayer(spec)
    gen = torch.Generator().manual_seed(5)
    sizes = (prefill, 1, 1)
    blocks = [(torch.randn(1, 3, n, 64, generator=gen), torch.randn(1, 3, n, 64, generator=gen)) for n in sizes]
    for k, v in blocks:
        layer.update(k, v)
    with accelerated.reference_only():
        for k, v in blocks:
            twin.update(k, v)
    assert len(counted) == 6 and counted[-1] == 3 * 64
    _same(layer.packed_k, twin.packed_k)
    _same(layer.packed_v, twin.packed_v)


def test_a_decode_step_packs_in_the_kernel(counted: list[int]) -> None:
    """A cache's one-token write of a tq layer goes through the kernel, and stores what the torch path stores."""
    _decode_steps_match("tq:3.5/tq:2.5", 9, counted)
