"""serial_blas: a small block's BLAS calls on one thread, the same bits whatever torch's thread count."""

from __future__ import annotations

import pytest
import torch

from walshkv.codecs import parse_codec
from walshkv.ops import threads
from walshkv.ops.hadamard import hadamard_transform
from walshkv.ops.threads import SERIAL_BLAS_MAX, serial_blas


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_the_setting_is_restored_after_the_block_and_after_an_error(two_threads):
    if threads._SET_LOCAL is None:  # a torch build without MKL: the block changes nothing
        with serial_blas():
            pass
        return
    before = threads._SET_LOCAL(0)  # read the thread's setting (and set "global")
    threads._SET_LOCAL(before)
    with serial_blas():
        assert threads._SET_LOCAL(1) == 1
    with pytest.raises(RuntimeError), serial_blas():
        raise RuntimeError("inside")
    assert threads._SET_LOCAL(before) == before
    with serial_blas(active=False):
        assert threads._SET_LOCAL(before) == before


def test_a_small_product_is_the_same_on_one_thread_and_on_two(two_threads):
    """MKL's threaded sgemm sums some small shapes in another order (6 x 128 rows here, on the AMD EPYC where this
    was found); under serial_blas the bits do not depend on the thread count."""
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    with serial_blas():
        two = hadamard_transform(x)
    torch.set_num_threads(1)
    assert torch.equal(two, hadamard_transform(x))


@pytest.mark.parametrize("spec", ["rot+int4", "tq:3.5", "tcq:3"])
def test_a_decode_steps_encode_is_the_same_bytes_on_one_thread_and_on_two(two_threads, spec):
    codec = parse_codec(spec)
    x = torch.randn(1, 6, 1, 128, generator=torch.Generator().manual_seed(1))
    assert x.numel() <= SERIAL_BLAS_MAX
    two = codec.encode(x)
    torch.set_num_threads(1)
    one = codec.encode(x)
    assert all(torch.equal(two.tensors[k], one.tensors[k]) for k in one.tensors)
