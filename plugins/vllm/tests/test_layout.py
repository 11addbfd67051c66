"""The slot layout: slot and page sizes from the codecs' layouts, bytes <-> Packed round trips."""

from __future__ import annotations

import pytest
import torch
from walshkv.codecs import parse_codec

from vllm_helpers import HEAD_DIM, KV_HEADS, SPECS, bound, kv
from walshkv_vllm.layout import SlotLayout


@pytest.mark.parametrize("spec_text", SPECS)
def test_slot_and_page_size_follow_the_bits_formula(spec_text: str) -> None:
    spec, k_codec, v_codec = bound(spec_text)
    layout = SlotLayout.of(k_codec, v_codec, HEAD_DIM, KV_HEADS)
    bits = spec.k.bits_per_element(HEAD_DIM) + spec.v.bits_per_element(HEAD_DIM)
    assert layout.slot_bytes * 8 == bits * HEAD_DIM
    assert layout.k.nbytes == spec.k.bytes_per_vector(HEAD_DIM)
    assert layout.v.offset == layout.k.nbytes
    for block_size in (1, 16, 32):
        assert layout.page_bytes(block_size) == block_size * KV_HEADS * bits * HEAD_DIM / 8
        pages = layout.empty_pages(3, block_size)
        assert pages.shape == (3, block_size, KV_HEADS, layout.slot_bytes)
        assert pages.numel() == 3 * layout.page_bytes(block_size)


def test_known_slot_sizes() -> None:
    """Hand-counted: rot+int4 = 32 code bytes + an fp16 scale; q4_0 = 2 blocks of 18; tq:3 = 24 + an fp16 norm."""
    sizes = {"rot+int4": 34, "q4_0": 36, "q8_0": 68, "tq:3": 26}
    for text, nbytes in sizes.items():
        codec = parse_codec(text)
        assert SlotLayout.of(codec, codec, HEAD_DIM, KV_HEADS).slot_bytes == 2 * nbytes


@pytest.mark.parametrize("spec_text", SPECS)
def test_bytes_round_trip(spec_text: str) -> None:
    _, k_codec, v_codec = bound(spec_text)
    layout = SlotLayout.of(k_codec, v_codec, HEAD_DIM, KV_HEADS)
    k, v = kv(9)
    pk = k_codec.encode(k.transpose(0, 1).unsqueeze(0))
    pv = v_codec.encode(v.transpose(0, 1).unsqueeze(0))
    raw = layout.to_bytes(pk, pv)
    assert raw.shape == (1, KV_HEADS, 9, layout.slot_bytes) and raw.dtype == torch.uint8
    rk, rv = layout.from_bytes(raw, torch.float32)
    for want, got in ((pk, rk), (pv, rv)):
        assert want.tensors.keys() == got.tensors.keys()
        for name, t in want.tensors.items():
            assert got.tensors[name].dtype == t.dtype
            assert torch.equal(got.tensors[name], t), name


def test_refuses_bad_slots() -> None:
    codec = parse_codec("q8_0")
    layout = SlotLayout.of(codec, codec, HEAD_DIM, KV_HEADS)
    with pytest.raises(ValueError, match="uint8"):
        layout.from_bytes(torch.zeros(1, KV_HEADS, 1, layout.slot_bytes + 1, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        SlotLayout.of(codec, codec, 48, KV_HEADS)  # q8_0 needs a multiple of 32: refused by the codec's layout
