"""Accelerated implementations of codec steps (walshkv.codecs.accelerated): one per step, declinable, switchable off.

The kernel's tq packer against the torch path is tests/attention/test_tq_pack.py; here the registry itself, on a
step of its own, and tq's torch path where the registered packer declines.
"""

from __future__ import annotations

import threading

import pytest
import torch

from walshkv.codecs import accelerated, turbo
from walshkv.codecs.registry import parse_codec

STEP: accelerated.Step = accelerated.Step("test.double", "takes an int, returns twice it")


def _double(x: int) -> int:
    return 2 * x


def _twice(x: int) -> int:
    return x + x


@pytest.fixture(autouse=True)
def registry(monkeypatch: pytest.MonkeyPatch) -> dict:
    """A copy of the registry: what a test registers goes with it."""
    copy = dict(accelerated._REGISTRY)
    monkeypatch.setattr(accelerated, "_REGISTRY", copy)
    return copy


def test_a_step_without_an_implementation_runs_the_reference() -> None:
    assert accelerated.implementation(STEP) is None


def test_one_implementation_per_step() -> None:
    accelerated.register(STEP, _double)
    accelerated.register(STEP, _double)  # the same one again (a module imported twice): nothing changes
    assert accelerated.implementation(STEP) is _double
    with pytest.raises(ValueError, match=r"test\.double has an accelerated implementation already .*_double.*_twice"):
        accelerated.register(STEP, _twice)
    assert accelerated.implementation(STEP) is _double


def test_reference_only_holds_in_its_block_and_thread() -> None:
    accelerated.register(STEP, _double)
    seen: list[object] = []
    with accelerated.reference_only():
        assert accelerated.implementation(STEP) is None
        with accelerated.reference_only():
            assert accelerated.implementation(STEP) is None
        assert accelerated.implementation(STEP) is None
        worker = threading.Thread(target=lambda: seen.append(accelerated.implementation(STEP)))
        worker.start()
        worker.join()
    assert seen == [_double]  # another thread is not switched
    assert accelerated.implementation(STEP) is _double


def test_tq_takes_the_torch_path_where_its_packer_declines(registry: dict) -> None:
    calls: list[int] = []

    def declines(rotated, norm16, tables):
        calls.append(rotated.shape[-1])
        return None

    codec = parse_codec("tq:2.5")
    x = torch.randn(1, 2, 7, 64, generator=torch.Generator().manual_seed(4))
    with accelerated.reference_only():
        want = codec.encode(x)
    assert not calls
    registry[turbo.PACK_ROWS] = declines
    got = codec.encode(x)
    assert calls == [64]
    assert got.tensors.keys() == want.tensors.keys()
    for name in want.tensors:
        assert torch.equal(got.tensors[name], want.tensors[name]), name
