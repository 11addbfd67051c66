"""tcq's rows as the CPU kernel decodes them (``decode_tile_tcq`` in attention/cpu_kernel_decode.h) against the codec.

Three decoders read a tcq row: with AVX-512 VBMI, each state is built from the packed bytes by byte permutes and
multishifts and each value comes from the table's four byte planes (``TcqVbmi`` in cpu_kernel_formats.h); with AVX2
(and no VBMI plan), each state from 16 broadcast bytes of the row's padded stream by a byte shuffle, a per-lane shift
and a mask per tap, then a gather (``TcqAvx2``); elsewhere the codes are unpacked, each state ORed from its taps and
the table read by a gather (``tcq_row``). All must give the codec's values bit for bit:
``table[codes_to_states(codes)] * norm * (1 / sqrt(d))``, the row factor the kernel applies, for every shipped width
and head sizes from 16 (one partial chunk of 64 lanes) to 256 (segments over 64 bytes: the VBMI path's wide form,
each segment in two registers), and 512 at two widths (past both plans' 256: the generic decoder), in the native build
and the AVX2 one. ``tcq_path`` says which decoder reads a layout: the presets' (head_dim 64, 128 and 256) must take
the VBMI path wherever the build has it, and the AVX2 one elsewhere.
"""

from __future__ import annotations

import pytest
import torch

# the ISA helpers the kernel build tests share (tests/attention is on the path, as for test_attention)
from test_isa_builds import _cpu_has

from walshkv.attention import cpu
from walshkv.codecs.registry import parse_codec
from walshkv.ops import trellis

pytestmark = pytest.mark.skipif(not cpu.kernel_available(), reason="the CPU kernel cannot be built here")

HEAD_DIMS = (16, 64, 128, 256)
AVX2 = ("-O3", "-march=haswell", "-fopenmp", "-std=c++20")  # test_isa_builds' AVX2 build: the same cached module
VBMI_HEAD_DIMS = (16, 64, 128, 256)  # rows of up to 256 values, every segment at most 128 bytes


def _module(build: str):
    if build == "native":
        return cpu.load_kernel()
    if not _cpu_has(("avx2", "fma")):
        pytest.skip("this CPU cannot run the AVX2 build")
    return cpu.build_kernel(list(AVX2))


def _desc(module, spec: str, d: int, n: int, seed: int):
    codec = parse_codec(spec)
    x = torch.randn(2, 3, n, d, generator=torch.Generator().manual_seed(seed))
    x[0, 0, 0] = 0.0  # a zero row: norm 0
    x[1, 2, 1] = 1.0  # a constant row
    packed = codec.encode(x)
    plan = cpu.cpu_plan(parse_codec("int8"), codec, d, 1.0)
    desc, keep = cpu._desc(packed, plan.v, d, "V", module.FORMATS[plan.v.fmt])
    return codec, packed, plan, desc, keep


AVX2_MAX_D = 256  # longest row the AVX2 plan takes (TCQ_AVX2_CHUNKS * 8); longer rows take the generic path
GENERIC_CASES = (("tcq:3", 512), ("tcq:2.5", 512))  # the generic decoder (tcq_row), which no shipped layout takes
#: The split table set (tables=3, P[s & 15] + Q[s >> 4]): the AVX2 decoder reads it by register permutes, the others
#: as any table; every width at head_dim 64 and the presets' head sizes at 3.5 bits, and one row past the AVX2 plan
SPLIT_CASES = (
    *((f"tcq:{bits:g}:tables=3", 64) for bits in trellis.TRELLIS_BITS),
    ("tcq:3.5:tables=3", 128),
    ("tcq:3.5:tables=3", 256),
    ("tcq:4.5:tables=3", 16),
    ("tcq:3:tables=3", 512),
)

#: The bfloat16 set (tables=4, set 2 rounded): the VBMI decoder reads its two high byte planes only; every width at
#: head_dim 64, the presets' head sizes at 3.5 bits, a wide row (a segment over 64 bytes) and one past the AVX2 plan
ROUNDED_CASES = (
    *((f"tcq:{bits:g}:tables=4", 64) for bits in trellis.TRELLIS_BITS),
    ("tcq:3.5:tables=4", 128),
    ("tcq:3.5:tables=4", 256),
    ("tcq:4.5:tables=4", 16),
    ("tcq:3:tables=4", 512),
)


def _cases():
    for d in HEAD_DIMS:
        for bits in trellis.TRELLIS_BITS:
            codec = parse_codec(f"tcq:{bits:g}")
            try:
                codec.check_head_dim(d)
            except ValueError:
                continue  # fewer bits in the row than the trellis state
            yield f"tcq:{bits:g}", d
    yield from GENERIC_CASES
    yield from SPLIT_CASES
    yield from ROUNDED_CASES


def _bits(spec: str) -> float:
    return float(spec.split(":")[1])


@pytest.mark.parametrize("build", ["native", "avx2"])
@pytest.mark.parametrize(("spec", "d"), list(_cases()))
def test_kernel_rows_are_the_codecs_values_bit_for_bit(build, spec, d):
    module = _module(build)
    n, i0 = 70, 3  # three tiles of 32 (the last partial), starting past token 0
    codec, packed, plan, desc, keep = _desc(module, spec, d, n, seed=int(10 * d + 2 * _bits(spec)))
    out = torch.full((2, 3, n - i0, plan.v.length), float("nan"))
    module.decode_rows(desc, [], out.data_ptr(), 2, 3, i0, n - i0, 1)
    del keep
    states = trellis.codes_to_states(codec.codes(packed)[:, :, i0:], codec.widths(d), codec.state_bits)
    factor = packed.tensors["norm"][:, :, i0:].float() * (1.0 / torch.sqrt(torch.tensor(float(d))))
    want = codec.table()[states] * factor
    assert torch.equal(out, want), f"{build} {spec} d={d}: {(out != want).float().mean().item():.3f} of values differ"


@pytest.mark.parametrize(("spec", "d"), list(_cases()))
def test_the_vbmi_path_reads_the_layouts_it_was_built_for(spec, d):
    module = cpu.load_kernel()
    _, _, _, desc, _keep = _desc(module, spec, d, 4, seed=0)
    vbmi = _cpu_has(("avx512vbmi", "avx512bw")) and "-march=native" in cpu._CFLAGS_NATIVE
    bits = _bits(spec)
    segments = [d * bits / 8] if bits.is_integer() else [d // 2 * (bits + 0.5) / 8, d // 2 * (bits - 0.5) / 8]
    fits = d in VBMI_HEAD_DIMS and max(segments) <= 128  # tcq:5 at 256 is one segment of 160 bytes
    avx2 = "avx2" if d <= AVX2_MAX_D else "generic"  # every shipped layout fits the AVX2 plan
    want = "vbmi" if vbmi and fits else avx2
    assert module.tcq_path(desc) == want
    if _cpu_has(("avx2", "fma")):
        assert cpu.build_kernel(list(AVX2)).tcq_path(desc) == avx2  # no VBMI: byte shuffles, shifts and a gather


def test_tcq_path_refuses_another_format():
    module = cpu.load_kernel()
    codec = parse_codec("tq:3")
    packed = codec.encode(torch.randn(1, 1, 2, 64))
    plan = cpu.cpu_plan(parse_codec("int8"), codec, 64, 1.0)
    desc, _keep = cpu._desc(packed, plan.v, 64, "V", module.FORMATS[plan.v.fmt])
    with pytest.raises(ValueError, match="not a tcq descriptor"):
        module.tcq_path(desc)
