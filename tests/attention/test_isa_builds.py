"""The CPU kernel built for each instruction set this CPU can run, against the reference.

The kernel is built with ``-march=native`` (walshkv.attention.cpu.load_kernel), so one machine tests one ISA's code;
the machines here differ (AVX2 only, AVX-512, AVX-512 with AMX). These builds run the other paths on the same
machine: AVX2 only (``-march=haswell``), AVX-512 without AMX (``-march=skylake-avx512``) and AVX-512 with VBMI
(``-march=icelake-server``: tcq's byte-permute decoder), each where the CPU can run it (elsewhere the compiler alone
checks the source for it). The presets' parts (tq and tcq), rot+int4 and q4_0 (their K scored by byte dot products),
decode attention, a prefill tile's decode and a block frame's step (a query per block of keys, each key plus its
offset's row of a table).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codecs"))  # the shared matrix's stub

from matrix import CalibrationStub

from walshkv.attention import cpu, decode_attention
from walshkv.attention.cpu_formats import cpu_plan
from walshkv.codecs.registry import parse_codec

KV, D = 2, 64
PAIRS = [
    ("prerope+center+eq+tq:3.5", "tq:3"),
    ("prerope+center+eqd+tq:3", "tq:2.5"),
    ("sink:1:prerope+center+eq+rot+iq4_nl", "tq:4"),
    ("rot+int4", "int4"),
    ("q4_0", "q8_0"),
    ("rot+int3", "int2"),
    ("prerope+center+eqd+tcq:3.5", "tcq:2.5"),  # the trellis paths: byte permutes with VBMI, a gather without
    ("prerope+center+eqd+tcq:3.5:tables=3", "tcq:2.5:tables=3"),  # split tables: register permutes without VBMI
    ("prerope+center+eqd+tcq:3.5:tables=4", "tcq:2.5:tables=4"),  # bfloat16 set: two byte planes with VBMI
]
ISAS = {
    "avx2": ("-march=haswell", ("avx2", "fma")),
    "avx512": ("-march=skylake-avx512", ("avx512f", "avx512bw")),
    "avx512vbmi": ("-march=icelake-server", ("avx512f", "avx512bw", "avx512vbmi")),
}

pytestmark = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("c++", "g++", "clang++")),
    reason="no C++ compiler: the CPU kernel cannot be built",
)


def _cpu_has(flags: tuple[str, ...]) -> bool:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    have = set(next((ln for ln in text.splitlines() if ln.startswith("flags")), "").split())
    return all(f in have for f in flags)


def _compiles(march: str) -> subprocess.CompletedProcess:
    """The kernel's source through the compiler for ``march``, syntax and types only (nothing is loaded)."""
    from torch.utils import cpp_extension

    compiler = next(c for c in ("c++", "g++", "clang++") if shutil.which(c))
    includes = [f"-I{p}" for p in (*cpp_extension.include_paths(), sysconfig.get_paths()["include"])]
    return subprocess.run(
        [
            compiler,
            "-std=c++20",
            "-fopenmp",
            march,
            "-fsyntax-only",
            "-DTORCH_EXTENSION_NAME=walshkv_isa_check",
            *includes,
            "-x",
            "c++",
            "-",
        ],
        input=cpu.kernel_source(),
        capture_output=True,
        text=True,
        check=False,
    )


@pytest.mark.parametrize("isa", sorted(ISAS))
def test_the_kernel_built_for_each_isa_matches_the_reference(isa, monkeypatch):
    """Where this CPU cannot run an ISA's code (an AVX2-only machine and the AVX-512 build), the source still has to
    compile for it: a CPU without it cannot load the module, so that build is checked by the compiler alone."""
    march, flags = ISAS[isa]
    if not _cpu_has(flags):
        done = _compiles(march)
        assert done.returncode == 0, done.stderr[-2000:]
        return
    module = cpu.build_kernel(["-O3", march, "-fopenmp", "-std=c++20"])
    cpu.check_kernel_constants(module)
    assert not module.amx_compiled  # neither target has AMX: the fp32 key map
    assert module.int_dot_compiled  # 4-bit K scored by byte dot products (vpmaddubsw: neither target has VNNI)
    monkeypatch.setattr(cpu, "_kernel", module)
    monkeypatch.setattr(cpu, "_KPOST", {})  # row lengths follow the build's vector width
    cal = CalibrationStub(D, KV)
    gen = torch.Generator().manual_seed(11)
    for kspec, vspec in PAIRS:
        sink = kspec.startswith("sink:1:")
        kc = parse_codec(kspec.removeprefix("sink:1:")).bind(1, "k", cal)
        vc = parse_codec(vspec).bind(1, "v", cal)
        start = 1 if sink else 0
        k, v = torch.randn(2, KV, 77, D, generator=gen), torch.randn(2, KV, 77, D, generator=gen)
        pk, pv = kc.encode(k, start), vc.encode(v, start)
        for dtype in (torch.float32, torch.bfloat16):
            q = torch.randn(2, KV * 3, 1, D, generator=gen).to(dtype)
            want = decode_attention(q, pk, pv, kc, vc, backend="reference", start=start)
            got = decode_attention(q, pk, pv, kc, vc, backend="cpu", start=start)
            tol = 3e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0, msg=f"{isa} {kspec}/{vspec}")
        rows = cpu.decode_chunk_cpu(pk, pv, kc, vc, start, 5, 70)
        assert rows is not None, kspec
        torch.testing.assert_close(rows[1], vc.decode(pv.slice_seq(5, 70), start + 5).float(), atol=2e-5, rtol=0)
    for kspec, d in (("int4", 48), ("int4", 80), ("q4_0", 96)):  # code vectors the row fills in part
        kc, vc = parse_codec(kspec), parse_codec("int4")
        k, v = torch.randn(2, KV, 45, d, generator=gen), torch.randn(2, KV, 45, d, generator=gen)
        pk, pv = kc.encode(k), vc.encode(v)
        q = torch.randn(2, KV * 3, 1, d, generator=gen)
        want = decode_attention(q, pk, pv, kc, vc, backend="reference")
        got = decode_attention(q, pk, pv, kc, vc, backend="cpu")
        torch.testing.assert_close(got, want, atol=3e-5, rtol=0, msg=f"{isa} {kspec} d={d}")
    # a block frame's step (issue 35): one query per block of keys, each key plus its offset's row of a table
    kc, vc = parse_codec("tcq:3.5").bind(1, "k", cal), parse_codec("tq:3").bind(1, "v", cal)
    t, block, g = 77, 40, 3
    pk = kc.encode(torch.randn(2, KV, t, D, generator=gen))
    pv = vc.encode(torch.randn(2, KV, t, D, generator=gen))
    plan = cpu_plan(kc, vc, D, D**-0.5)
    q = torch.randn(2, KV, 2, g, D, generator=gen)
    table = torch.randn(KV, block, D, generator=gen)
    _, l_sum, acc = cpu.fused_decode_cpu(q, plan, pk, pv, query_block=block, key_table=table)
    pos = torch.arange(t)
    keys = kc.decode(pk).to(torch.float64) + table[:, pos % block].to(torch.float64)[None]
    qk = q.to(torch.float64).repeat_interleave(block, dim=2)[:, :, :t]
    s = torch.einsum("bhtgd,bhtd->bhgt", qk, keys) * D**-0.5
    want = torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), vc.decode(pv).to(torch.float64))
    got = (acc / l_sum[..., None]).to(torch.float64)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4, msg=f"{isa} query_block + key_table")


def test_kernel_march_names_the_build_and_refuses_what_is_not_an_architecture(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cpu.MARCH_ENV, raising=False)
    assert cpu.kernel_march() == "native"
    monkeypatch.setenv(cpu.MARCH_ENV, " haswell ")
    assert cpu.kernel_march() == "haswell"
    monkeypatch.setenv(cpu.MARCH_ENV, "haswell -O0")
    with pytest.raises(ValueError, match=r"WALSHKV_CPU_MARCH.*haswell \(AVX2\)"):
        cpu.kernel_march()
