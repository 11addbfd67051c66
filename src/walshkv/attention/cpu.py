"""Fused CPU decode attention straight from packed K/V codes (a C++ kernel built on first use).

One decode step (one query token) attends over a packed cache without a float copy of it: per
(batch, kv head) and its group of query heads the kernel walks the tokens in tiles of 32, unpacks a
tile of K rows into a small L1-resident float buffer, dots each row with the query heads (four heads
per register block), updates an online (streaming, max-subtracted) softmax, then unpacks the tile's V
rows the same way and accumulates the probability-weighted rows (four heads x one vector in
registers). With several threads the tokens are cut into ranges run in parallel (flash-decoding
style) whose partial results are merged at the end.

Packed layouts read (per (batch, kv head, token) row; the leading three dims may have any strides,
the last one must be contiguous):

* ``intB`` (:class:`walshkv.codecs.intq.IntCodec`, B in 2..8): ``codes uint8[ceil(d*B/8)]``, the
  offset codes ``c = q + qmax`` (``qmax = 2**(B-1) - 1``) packed LSB-first (code ``i`` in stream bits
  ``[i*B, (i+1)*B)``, stream bit ``j`` = bit ``j % 8`` of byte ``j // 8``), and ``scale float16[1]``.
  Value ``i`` is ``(c_i - qmax) * scale``. The kernel dots the *integer* values ``c_i - qmax`` with the
  query and multiplies the sum by the token's scale; on the V side it accumulates
  ``p_t * scale_t * (c_t - qmax)``.

  - B = 8: one byte per code, widened directly.
  - B = 4 and B = 2 (dedicated): byte ``k`` holds codes ``k*P .. k*P+P-1`` (``P = 8/B``) in bit fields
    ``0, B, 2B, ...``; the kernel unpacks them into *planes*: buffer position ``p*nbytes + k`` holds bit
    field ``p`` of byte ``k`` (code ``k*P + p``), so each plane is one shift-and-mask of 16 bytes at a
    time. The query is permuted into that order once per call (zeros on padding codes) and the V sum is
    permuted back once (both folded into the rotation matmuls below).
  - B = 3, 5, 6, 7 (generic): a group of 16 codes (AVX-512BW; 8 with AVX2) is one byte shuffle that puts
    bytes ``(i*B)>>3`` and ``+1`` of code ``i`` into lane ``i``, one per-lane shift by ``(i*B)&7`` and a
    mask; the codes after the last whole group are read bit by bit.

* ``q4_0`` (:class:`walshkv.codecs.ggml.GGMLCodec`): ``blocks uint8[d/32 * 18]``, per block of 32
  values ``d: float16`` (2 bytes, little-endian) then ``qs: uint8[16]``; byte ``j`` holds value ``j`` in
  its low nibble and value ``j + 16`` in its high nibble; value = ``(nibble - 8) * d``.
* ``q8_0``: ``blocks uint8[d/32 * 34]``, per block ``d: float16`` then ``qs: int8[32]``; value =
  ``qs[j] * d``.

  ggml blocks carry one scale per 32 values, so there is no per-token factor to pull out of the dot
  product: the kernel multiplies each block's integer codes by its ``d`` while unpacking.

* ``vht2`` (:class:`walshkv.codecs.vht2.VHT2Codec`): ``codes uint8[sum_i ceil(size_i*b_i/8)]``, the
  bands' LSB-first code streams one after another, each starting on a byte, and ``scale float16[n]``,
  one per band. Band ``i`` is unpacked with the generic B-bit path into buffer positions
  ``start_i .. start_i + size_i`` as ``c - qmax`` (a 1-bit band as ``2c - 1``) times its scale, so the
  buffer holds the kept WHT coefficients in the codec's order (the rest of the vector is 0). The
  query is multiplied once by the WHT and the order (the codec's *basis*, ``[d, kept]``), the V sum
  once by its transpose; calibrated codecs (``order=variance``, ``vht2:auto@BITS``) carry their own
  order and bands per layer, so their plans are keyed on the bound codec object, not on the spec.

* ``tq`` (:class:`walshkv.codecs.turbo.TurboQuant`): ``codes uint8[ceil(d*B/8)]`` (whole B) or
  ``codes_hi`` / ``codes_lo`` (half widths: the first ``d/2`` rotated coordinates at ``ceil(B)`` bits,
  the rest at ``floor(B)``), each its own tensor with its own strides, LSB-first; and ``norm
  float16[1]``. Each segment is unpacked with the generic B-bit path into its buffer positions and each
  code replaced by its Lloyd-Max level (a lane permute from one or two registers up to 5 bits with
  AVX-512, a gather otherwise); the row factor is ``norm / sqrt(d)``. The basis is the codec's inverse
  rotation (sign flips, then the WHT), so the query is rotated once and the V sum unrotated once.

* ``tcq`` (:class:`walshkv.codecs.trellis.TrellisQuant`): tq's fields; each row is one wrapped trellis stream:
  value ``i``'s state is the OR of the codes ending at it, each shifted by the widths after it (a per-position shift
  table, ``[taps, d]``), masked to ``L`` bits, and the value is the table entry at that state. With AVX-512 VBMI
  (rows of up to 128 values, each field at most 64 bytes, ``L = 8``) no code is unpacked: per 64 values and tap one
  byte permute of the two fields' registers, one multishift and a masked OR give the states as bytes, and the
  float32 table is read as four 256-byte planes by byte permutes (no gather). Otherwise the fields are unpacked as
  raw codes, the taps ORed per lane and the table read by a gather (16 lanes with AVX-512, 8 with AVX2, a scalar
  loop otherwise). Row factor and basis are tq's.

4-bit K codes (``int4``, ``q4_0``; not ``prerope+``) are scored without unpacking them to floats: the query of each
head is split into three int8 parts (``x ~ s (q1 + q2/128 + q3/16384)``, ``s = max|x| / 127``) and the codes' byte dot
products with them are summed exactly in int32 (VNNI ``vpdpbusd``, else ``vpmaddubsw`` + ``vpmaddwd``), the codes'
offset taken off with the query's own integer sums: float32-sized rounding (:func:`int_dot_scores`;
``WALSHKV_CPU_INT_DOT=0`` keeps the float path).

Keys stored before RoPE (``prerope+``, :mod:`walshkv.attention.keys`): each decoded K row is mapped to the pre-RoPE
key by one small matrix per kv head (a fast Walsh-Hadamard transform where that matrix is one) and rotated to its
position in the kernel. With ``eq+`` the matrix is dense; on CPUs with AMX-BF16 it runs on AMX tiles as three bf16
products of hi/lo parts summed in fp32 (:func:`amx_key_map`; ``WALSHKV_CPU_AMX=0`` keeps the fp32 multiply-adds).

Prefill tiles (:func:`decode_chunk_cpu`, used by :mod:`walshkv.attention.chunked`): the same decode paths write a
range of packed rows to floats (``decode_rows`` in cpu_kernel.cpp): ``prerope+`` keys mapped and rotated, other rows in
the kernel's buffer order, which one matrix puts back in the model's basis.

Rotations (``rot+``/``rrot+``): the query is multiplied once by the K codec's forward rotation (random
signs included) and the V sum once by the V codec's inverse rotation; both are cached d x d matrices,
fused with the softmax scale and the plane order above, so the kernel only ever reads the inner codec's
codes. ``center+`` is peeled (its decode adds no bias back); ``eq+`` (a per-kv-head matrix) is applied
to the query and the V sum by the caller (:func:`walshkv.attention.peeling.peel_equalizer`). All other
codecs are not read here; :func:`walshkv.attention.decode_attention` sends them to the pure-torch reference.

Why C++: a torch-only chunked path (unpack 4096 tokens of codes at a time with shifts/masks, float
matmuls with the query, the offset folded in through the query's sum, online softmax across chunks)
was timed against this kernel in one process, one thread, smollm2-135m's shape (3 kv heads, 9 query
heads, d = 64), medians of warm calls on a shared 2-core machine: at 16k tokens 6.5 ms vs 1.5 ms
(int4), 4.3 vs 1.2 ms (int8), 15.7 vs 1.2 ms (q4_0); at 64k tokens 24.8 vs 5.9 ms (int4), 16.8 vs
4.7 ms (int8), 61.5 vs 4.8 ms (q4_0). SDPA over an fp16 cache took 4.8 ms (16k) and 20.0 ms (64k):
the torch path was slower than it, the kernel 3-4x faster.

The kernel's source is ``cpu_kernel.cpp`` beside this module (package data: the entry points and bindings) and the
``cpu_kernel_*.h`` headers it includes, one per concern (vector helpers, formats, code unpacking, each format's row
decoder, the prerope+ key map, the integer-dot scores, score tile and softmax, the encoders). :func:`kernel_source`
inlines the headers into one text (:func:`assemble_source`), compiled with ``torch.utils.cpp_extension.load_inline``
(``-O3 -march=native -fopenmp``, or the ``-march`` named by ``WALSHKV_CPU_MARCH``: :func:`kernel_march`;
cached in torch's extension directory under a name that hashes that text, so every
file's, the flags and the CPU's vector capability: only the first use pays the build, about 10-20 s, and an edit of
the .cpp or of any header builds anew). It includes only pybind11 (no ATen headers, which keeps the build short) and
receives raw data pointers and strides that the Python side checks first. It uses AVX-512 or AVX2 intrinsics where
the CPU has them and GCC/Clang vector extensions otherwise (GCC >= 12 or Clang). Without a working compiler
:func:`load_kernel` returns ``None`` after one warning and callers fall back to the reference. The module exports
its format ids (``FORMATS``, by name) and limits (``MAX_BANDS``, ``MAX_SEGS``): the Python side looks the ids up by
name at each call and checks the names and ``MAX_BANDS`` when the module loads (:func:`check_kernel_constants`; the
formats themselves are in :mod:`walshkv.attention.cpu_formats`).

tq's encoder after its rotation is the kernel's too (``tq_pack``): :func:`tq_pack_rows` is registered, when this
module is imported, as the implementation of :data:`walshkv.codecs.turbo.PACK_ROWS`
(:mod:`walshkv.codecs.accelerated`), and declines until the kernel is loaded. So is tcq's trellis search
(``tcq_encode``): :func:`tcq_code_rows`, registered as :data:`walshkv.codecs.trellis.TCQ_CODES`' implementation.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import platform
import re
import threading
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from walshkv.attention.cpu_formats import (
    CPU_SUPPORTED,
    FORMAT_NAMES,
    MAX_BANDS,
    CpuPlan,
    KernelFormat,
    cpu_plan,
    cpu_supports,
)
from walshkv.attention.keys import hadamard_factors, key_transform, rope_half_tables
from walshkv.codecs import accelerated
from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.trellis import TCQ_CODES
from walshkv.codecs.turbo import PACK_ROWS
from walshkv.ops.packing import packed_nbytes

__all__ = [
    "CPU_SUPPORTED",
    "CpuPlan",
    "amx_key_map",
    "assemble_source",
    "check_kernel_constants",
    "cpu_supports",
    "decode_chunk_cpu",
    "fused_decode_cpu",
    "kernel_available",
    "kernel_march",
    "kernel_source",
    "load_kernel",
    "prerope_key_map",
    "tcq_code_rows",
    "tq_pack_rows",
]

_MIN_SPLIT_TOKENS = 256  # no parallel range shorter than this many tokens

#: The kernel's C++ translation unit, package data beside this module; the ``cpu_kernel_*.h`` headers it includes
#: lie beside it too (:func:`assemble_source`).
KERNEL_SOURCE = "cpu_kernel.cpp"

_CFLAGS_NATIVE = ["-O3", "-march=native", "-fopenmp", "-std=c++20"]
_CFLAGS_PORTABLE = ["-O3", "-fopenmp", "-std=c++20"]

#: Environment variable naming the ``-march`` the kernel is built for in place of ``native`` (``haswell``: the AVX2
#: code paths on an AVX-512 CPU, what ``walshkv bench`` measures as a stand-in for an AVX2-only machine, with
#: ``ATEN_CPU_CAPABILITY=avx2`` for torch's side).
MARCH_ENV = "WALSHKV_CPU_MARCH"
_MARCH = re.compile(r"[a-z0-9][a-z0-9.\-]*")


def kernel_march() -> str:
    """The ``-march`` :func:`load_kernel` builds for: ``native``, or the value of ``WALSHKV_CPU_MARCH``.

    Raises:
        ValueError: a value that is not a plain architecture name (``haswell``, ``skylake-avx512``, ``x86-64-v3``).
    """
    march = os.environ.get(MARCH_ENV, "").strip() or "native"
    if not _MARCH.fullmatch(march):
        raise ValueError(
            f"{MARCH_ENV}={march!r} is not an architecture name; use one gcc's -march takes, e.g. native, haswell "
            "(AVX2), x86-64-v3 (AVX2), skylake-avx512 (AVX-512), or unset it"
        )
    return march


_lock = threading.Lock()
_kernel: Any = None
_kernel_failed = False


_QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]*)"')
_PRAGMA_ONCE = re.compile(r"^\s*#\s*pragma\s+once\b")


def assemble_source(read: Callable[[str], str], main: str = KERNEL_SOURCE) -> tuple[str, tuple[str, ...]]:
    """The kernel's one translation unit: ``main`` with each ``#include "NAME"`` replaced by the text of NAME.

    A header is inlined where it is first included (its own includes first, depth first) and its later includes and
    its ``#pragma once`` become blank lines; ``#line`` marks make the compiler name the file and line each line comes
    from. ``#include <...>`` lines stay for the compiler. The build hashes the result, so it covers every file.

    Args:
        read: a file's text by its name (the package data beside this module, or a test's files).
        main: the file to start from.

    Returns:
        The text, and the files in it in the order they were inlined (``main`` first).

    Raises:
        ValueError: a quoted include names a path, not a file beside the kernel (keep every header of the kernel in
            ``walshkv/attention`` and include it by its bare name).
        OSError: whatever ``read`` raises for a missing file.
    """
    done: list[str] = []

    def inline(name: str) -> list[str]:
        done.append(name)
        out = [f'#line 1 "{name}"']
        for number, line in enumerate(read(name).splitlines(), start=1):
            match = _QUOTED_INCLUDE.match(line)
            if _PRAGMA_ONCE.match(line):
                out.append("")
            elif match is None:
                out.append(line)
            elif not re.fullmatch(r"[\w.-]+", header := match.group(1)):
                raise ValueError(
                    f"{name}:{number} includes {header!r}: the kernel's headers lie beside {KERNEL_SOURCE} and are "
                    'included by their bare names (#include "cpu_kernel_NAME.h")'
                )
            elif header in done:
                out.append("")
            else:
                out += inline(header)
                out.append(f'#line {number + 1} "{name}"')
        return out

    text = "\n".join(inline(main)) + "\n"
    return text, tuple(done)


def _read_package_file(name: str) -> str:
    return resources.files(__name__.rpartition(".")[0]).joinpath(name).read_text(encoding="utf-8")


def kernel_source() -> str:
    """The kernel's translation unit: ``cpu_kernel.cpp`` with its headers inlined (:func:`assemble_source`).

    Read through :mod:`importlib.resources` (editable and wheel installs).

    Raises:
        OSError: a file of the kernel is missing (a broken install: reinstall walshkv).
    """
    return assemble_source(_read_package_file)[0]


def check_kernel_constants(module: Any) -> None:
    """Refuse a compiled kernel whose format names or limits differ from the Python side's.

    Raises:
        RuntimeError: ``FORMATS`` names or ``MAX_BANDS`` disagree with :mod:`walshkv.attention.cpu_formats`
            (a walshkv bug: the two files were edited apart; make them agree).
    """
    names, bands = sorted(module.FORMATS), int(module.MAX_BANDS)
    if names != sorted(FORMAT_NAMES) or bands != MAX_BANDS:
        raise RuntimeError(
            f"the CPU kernel ({KERNEL_SOURCE}) exports formats {names} and MAX_BANDS={bands}, but "
            f"walshkv.attention.cpu_formats expects {sorted(FORMAT_NAMES)} and MAX_BANDS={MAX_BANDS}; make them agree"
        )


def build_kernel(flags: list[str], source: str | None = None) -> Any:
    """Compile (or load from torch's extension cache) the kernel with these compiler flags.

    :func:`load_kernel` builds it for this CPU (``-march=native``); the tests also build it for other instruction
    sets the CPU can run (``-march=haswell``: AVX2 only; ``-march=skylake-avx512``: AVX-512 without AMX), so every
    path is checked on one machine.

    Raises:
        Exception: whatever the build raises (no compiler, no ninja, a flag the compiler refuses).
    """
    from torch.utils import cpp_extension  # slow to import (setuptools); only the first use pays it

    source = kernel_source() if source is None else source
    name = kernel_name(source, flags)
    # without the implicit <torch/extension.h> (all of ATen) the build is much shorter
    lean = "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters
    with build_lock(name):
        return cpp_extension.load_inline(
            name=name,
            cpp_sources=[source],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
            **({"no_implicit_headers": True} if lean else {}),
        )


def kernel_name(source: str, flags: list[str]) -> str:
    """The extension's name for this source and these flags on this CPU (its folder in torch's extension cache):
    any edit, flag or vector capability builds anew."""
    tag = f"{source}{flags}{platform.machine()}{torch.backends.cpu.get_cpu_capability()}"
    return "walshkv_decode_attn_" + hashlib.sha256(tag.encode()).hexdigest()[:12]


#: Seconds one process waits for another that is building the same kernel (a build takes 10-60 s).
BUILD_WAIT_SECONDS = 900.0


@contextmanager
def build_lock(name: str, wait_seconds: float = BUILD_WAIT_SECONDS) -> Iterator[None]:
    """Hold an OS file lock on the build of extension ``name``, and clear a stale torch build lock under it.

    torch marks a build in progress with a file, ``<build dir>/lock``, that only the builder removes: a build that
    was killed (Ctrl-C, a CI timeout, the OOM killer) leaves it, and every later process that loads the same
    extension waits for it forever, without a word. Every walshkv build of ``name`` runs under
    ``<build dir>.walshkv-lock``, an OS lock that dies with its holder; so a torch lock file found while holding it
    was left by a dead build, and is removed (with a warning naming it) before the build.

    Args:
        name: the extension's name (its build folder in torch's extension directory).
        wait_seconds: how long to wait for another process building the same extension.

    Raises:
        RuntimeError: another process held the build for ``wait_seconds`` (names the lock file and what to do).
    """
    from filelock import FileLock, Timeout
    from torch.utils import cpp_extension

    build_directory = getattr(cpp_extension, "_get_build_directory", None)  # private: absent, build unguarded
    if build_directory is None:
        yield
        return
    build_dir = Path(build_directory(name, verbose=False))
    lock_path = build_dir.with_name(build_dir.name + ".walshkv-lock")
    try:
        with FileLock(str(lock_path), timeout=wait_seconds):
            stale = build_dir / "lock"
            if stale.exists():
                warnings.warn(
                    f"walshkv: removed {stale}, a build lock left by a build of the CPU kernel that was killed; "
                    "building it again",
                    RuntimeWarning,
                    stacklevel=3,
                )
                stale.unlink(missing_ok=True)
            yield
    except Timeout as err:
        raise RuntimeError(
            f"another process has been building the CPU kernel {name} for over {wait_seconds:.0f} s (it holds "
            f"{lock_path}): wait for it, or stop it; the lock goes with the process that holds it"
        ) from err


def load_kernel() -> Any:
    """Compile (first use) or load the C++ kernel; ``None`` if no compiler works (warns once).

    Returns:
        The extension module (with a ``run`` function, ``FORMATS``, ``MAX_BANDS`` and ``MAX_SEGS``), or ``None``.

    Raises:
        RuntimeError: the built module's constants disagree with the Python side (see
            :func:`check_kernel_constants`).
    """
    global _kernel, _kernel_failed
    if _kernel is not None or _kernel_failed:
        return _kernel
    with _lock:
        if _kernel is not None or _kernel_failed:
            return _kernel
        errors = []
        try:
            source = kernel_source()
        except OSError as exc:  # a broken install: the package data is missing
            source = None
            errors.append(f"{KERNEL_SOURCE}: {type(exc).__name__}: {exc} (reinstall walshkv)")
        native = [f"-march={kernel_march()}" if f == "-march=native" else f for f in _CFLAGS_NATIVE]
        for flags in (native, _CFLAGS_PORTABLE) if source is not None else ():
            try:
                module = build_kernel(flags, source)
            except Exception as exc:  # no compiler, no ninja, a flag the compiler refuses, ...
                errors.append(f"{' '.join(flags)}: {type(exc).__name__}: {str(exc).strip()[-400:]}")
                continue
            check_kernel_constants(module)
            _kernel = module
            return _kernel
        _kernel_failed = True
        warnings.warn(
            "walshkv: could not build the fused CPU decode-attention kernel (a C++ compiler with OpenMP and "
            "ninja are needed), falling back to the pure-torch reference, which is slower. Install g++ "
            "(e.g. apt-get install g++) and ninja (pip install ninja) to enable it. Errors: " + " | ".join(errors),
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def tq_pack_rows(
    rotated: torch.Tensor, norm16: torch.Tensor, tables: list[tuple[str, int, int, int, torch.Tensor]]
) -> tuple[dict[str, torch.Tensor], float] | None:
    """tq's encoder after its rotation, in C++: the packed code fields of ``rotated`` and the largest norm.

    The implementation of :data:`walshkv.codecs.turbo.PACK_ROWS`, registered below when this module is imported; the
    torch path of :meth:`walshkv.codecs.turbo.TurboQuant._encode` is its reference (the same bits:
    ``tests/attention/test_tq_pack.py``).

    Args:
        rotated: ``[..., d]`` float32, the rotated rows ``H(s * x)``.
        norm16: ``[..., 1]`` float16, their norms.
        tables: ``(name, start, stop, bits, thresholds)`` per segment (thresholds float32, sorted).

    Returns:
        ``({name: uint8 [..., nbytes]}, largest norm)`` (nothing packed when the largest norm is Inf or NaN), or
        ``None`` where the kernel is not loaded or the tensors are not plain contiguous CPU tensors.
    """
    kernel = _kernel
    if kernel is None or rotated.dtype != torch.float32 or not rotated.is_contiguous() or not norm16.is_contiguous():
        return None
    lead, d = rotated.shape[:-1], rotated.shape[-1]
    n = rotated.numel() // d  # d >= 1: the codec checked the head size
    fields = {}
    desc = [n, d, rotated.data_ptr(), norm16.data_ptr(), len(tables)]
    for name, start, stop, bits, thresholds in tables:
        if not thresholds.is_contiguous() or thresholds.dtype != torch.float32:
            return None
        out = torch.empty((*lead, packed_nbytes(stop - start, bits)), dtype=torch.uint8)
        fields[name] = out
        desc += [start, stop, bits, thresholds.data_ptr(), thresholds.numel(), out.data_ptr()]
    return fields, kernel.tq_pack(desc, torch.get_num_threads())


accelerated.register(PACK_ROWS, tq_pack_rows)


def tcq_code_rows(t: torch.Tensor, tab: torch.Tensor, widths: tuple[int, ...], state_bits: int) -> torch.Tensor | None:
    """tcq's trellis search after its rotation, in C++: the codes of each row's tail-biting path.

    The implementation of :data:`walshkv.codecs.trellis.TCQ_CODES`, registered below when this module is imported;
    the torch path, :func:`walshkv.ops.trellis.encode`, is its reference (the same codes:
    ``tests/attention/test_tcq_encode.py``). Rows of 16 or more (at d = 64, L = 8) take the kernel's threads.

    Args:
        t: ``[N, n]`` float32, the rotated, norm-scaled rows.
        tab: float32 ``[2**state_bits]``, the trellis table.
        widths: bits of each of the ``n`` values (1 to 8, at most ``state_bits``).
        state_bits: ``L``.

    Returns:
        int32 ``[N, n]``, value ``i``'s code in ``0 .. 2**widths[i] - 1``; or ``None`` where the kernel cannot be
        built here, the tensors are not plain contiguous CPU float32 tensors of those shapes, or the kernel declines
        (a width outside 1..8 or above ``state_bits``, ``state_bits`` above 12, a non-finite value).

    Unlike tq's packer, this one loads (builds, the first time) the kernel itself: the torch search is about 20 times
    slower (the evaluation of one 4k window took minutes), so a process that never used the fused attention still
    gets the C++ search.
    """
    kernel = _kernel if _kernel is not None else load_kernel()
    if (
        kernel is None
        or t.dtype != torch.float32
        or not t.is_cpu
        or not t.is_contiguous()
        or t.dim() != 2
        or t.shape[1] != len(widths)
        or not widths
        or tab.dtype != torch.float32
        or not tab.is_cpu
        or not tab.is_contiguous()
        or tab.numel() != 1 << state_bits
    ):
        return None
    out = torch.empty(t.shape, dtype=torch.int32)
    if t.shape[0] == 0:
        return out
    desc = [t.shape[0], t.shape[1], state_bits, t.data_ptr(), tab.data_ptr(), out.data_ptr(), *widths]
    return out if kernel.tcq_encode(desc, torch.get_num_threads()) else None


accelerated.register(TCQ_CODES, tcq_code_rows)


def kernel_available() -> bool:
    """True if the C++ kernel is (or can be) built; builds it on the first call."""
    return load_kernel() is not None


def _desc(
    packed: Packed, f: KernelFormat, head_dim: int, what: str, fmt_id: int
) -> tuple[list[int], list[torch.Tensor]]:
    """Pointer/stride/format list for the kernel, and the tensors that must stay alive during the call."""
    first = _codes_field(packed, f.codes_field, f.row_bytes, head_dim, what)
    codes, ptr, st, end = first
    shape = codes.shape
    keep: list[torch.Tensor] = [codes]
    scale_ptr, s0, s1, s2 = 0, 0, 0, 0
    if f.norm_table is not None:  # one log byte per row (norm=8)
        scale = packed.tensors.get(f.scale_field)
        if scale is None or scale.dtype != torch.uint8 or scale.shape != (*shape[:3], 1):
            raise ValueError(
                f"packed {what} field {f.scale_field!r} must be uint8 [batch, heads, seq, 1] (a log-coded norm): pass "
                "the codec that encoded this cache"
            )
        keep += [scale, f.norm_table]
        scale_ptr = scale.data_ptr()
        s0, s1, s2, _ = scale.stride()
    elif f.scale_field is not None:
        scale = packed.tensors.get(f.scale_field)
        as_bytes = scale is not None and scale.dtype == torch.uint8  # its raw bytes (a page slot's view)
        if scale is None or not (
            (scale.dtype == torch.float16 and scale.shape == (*shape[:3], f.scales))
            or (as_bytes and scale.shape == (*shape[:3], 2 * f.scales))
        ):
            raise ValueError(
                f"packed {what} field {f.scale_field!r} must be float16 [batch, heads, seq, {f.scales}] (or its "
                f"bytes, uint8 [..., {2 * f.scales}])"
            )
        if scale.stride(3) != 1:
            scale = scale.contiguous()
        keep.append(scale)
        scale_ptr = scale.data_ptr()
        s0, s1, s2, _ = scale.stride()
        if not as_bytes:
            s0, s1, s2 = 2 * s0, 2 * s1, 2 * s2
    desc = [ptr, st[0], st[1], st[2], scale_ptr, s0, s1, s2, fmt_id, f.bits, f.row_bytes, head_dim, f.length]
    desc += [f.offset, end]
    if f.bands:
        desc += [len(f.bands) // 4, *f.bands]
    if f.segments:
        desc.append(len(f.segments))
        for name, start, size, bits, levels in f.segments:
            seg, seg_ptr, seg_st, seg_end = (
                first
                if name == f.codes_field
                else _codes_field(packed, name, packed_nbytes(size, bits), head_dim, what)
            )
            if tuple(seg.shape[:3]) != tuple(shape[:3]):
                raise ValueError(f"packed {what} fields {f.codes_field!r} and {name!r} hold different token counts")
            keep += [seg, levels]
            desc += [seg_ptr, seg_st[0], seg_st[1], seg_st[2], seg_end, start, size, bits, levels.data_ptr()]
    if f.trellis is not None:
        table, shifts, taps, state_bits, parts = f.trellis
        keep += [table, shifts] + ([] if parts is None else [parts])
        desc += [table.data_ptr(), shifts.data_ptr(), taps, state_bits, 0 if parts is None else parts.data_ptr()]
    if f.norm_table is not None:
        desc.append(f.norm_table.data_ptr())
    return desc, keep


def _codes_field(
    packed: Packed, name: str, row_bytes: int, head_dim: int, what: str
) -> tuple[torch.Tensor, int, tuple[int, ...], int]:
    """A uint8 codes field ``[batch, heads, seq, row_bytes]`` (last dim made contiguous), its data pointer,
    strides and one past its last byte."""
    codes = packed.tensors.get(name)
    if codes is None or codes.dtype != torch.uint8 or codes.dim() != 4 or codes.shape[3] != row_bytes:
        got = "missing" if codes is None else f"{codes.dtype} {tuple(codes.shape)}"
        raise ValueError(
            f"packed {what} field {name!r} should be uint8 [..., {row_bytes}] at head_dim {head_dim}, got "
            f"{got}: pass the codec that encoded this cache"
        )
    if codes.stride(3) != 1:
        codes = codes.contiguous()
    shape, st = codes.shape, codes.stride()
    ptr = codes.data_ptr()
    end = ptr + (shape[0] - 1) * st[0] + (shape[1] - 1) * st[1] + (shape[2] - 1) * st[2] + shape[3]
    return codes, ptr, tuple(st), end


def _kpost(plan: CpuPlan, kv: int, start: int, t: int) -> tuple[list[int], list[torch.Tensor]]:
    """The kernel's ``prerope+`` descriptor (see ``make_kpost`` in cpu_kernel_keys.h) and the tensors it points into."""
    parts = plan.prerope
    assert parts is not None
    key = (id(plan), kv)
    arrays = _KPOST.get(key)
    if arrays is None:
        tr = key_transform(parts, plan.k.basis, kv, 0)
        d = tr.mu.shape[-1]
        ld = -(-d // (2 * _lanes())) * 2 * _lanes()  # the kernel's row length (make_kpost): two vectors a block
        mt = torch.zeros(kv, plan.k.length, ld)
        mt[..., :d] = tr.mt
        mu = torch.zeros(kv, ld)
        mu[:, :d] = tr.mu
        factors = hadamard_factors(tr.mt)  # no eq+: a fast Walsh-Hadamard transform per key, not a matrix
        had = None
        if factors is not None:
            had = (torch.zeros(kv, ld), torch.zeros(kv, ld))
            had[0][:, :d], had[1][:, :d] = factors
        if len(_KPOST) >= 256:
            _KPOST.clear()
        arrays = _KPOST[key] = (mt.contiguous(), mu.contiguous(), had, plan, {})  # (the plan: its id stays unique)
    mt, mu, had, _, lazy = arrays
    cos, sin = rope_half_tables(parts.table, start + t)
    d = parts.table.head_dim
    desc = [mt.data_ptr(), mu.data_ptr(), cos.data_ptr(), sin.data_ptr(), start, cos.shape[0], d, plan.k.length]
    keep = [mt, mu, cos, sin]
    if had is not None:
        desc += [had[0].data_ptr(), had[1].data_ptr()]
        keep += list(had)
    elif amx_key_map():
        if "amx" not in lazy:
            lazy["amx"] = _amx_pairs(mt)
        hi, lo, lp = lazy["amx"]
        desc += [hi.data_ptr(), lo.data_ptr(), lp]
        keep += [hi, lo]
    return desc, keep


def _amx_pairs(mt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``mt`` ``[kv, L, ld]`` as bf16 hi and lo parts in the tile unit's pair layout ``[kv, Lp / 2, ld, 2]``
    (``Lp``: ``L`` rounded up to 32, zero rows after ``L``), and ``Lp`` (see ``KPost`` in cpu_kernel_keys.h)."""
    kv, length, ld = mt.shape
    lp = -(-length // 32) * 32
    full = torch.zeros(kv, lp, ld)
    full[:, :length] = mt
    hi = full.to(torch.bfloat16)
    lo = (full - hi.float()).to(torch.bfloat16)

    def pairs(x: torch.Tensor) -> torch.Tensor:
        return x.view(kv, lp // 2, 2, ld).transpose(2, 3).contiguous()

    return pairs(hi), pairs(lo), lp


def amx_key_map() -> bool:
    """Whether ``eq+``'s dense per-key map runs on AMX tiles (bf16 hi + lo parts, fp32 sums; see ``amx_tiles`` in
    cpu_kernel_keys.h): the kernel was built for a CPU with AMX-BF16, Linux granted the tile state, and the environment
    variable ``WALSHKV_CPU_AMX`` is not ``0`` (set it to ``0`` to time or test the AVX path on such a CPU)."""
    if os.environ.get("WALSHKV_CPU_AMX", "1").strip() == "0":
        return False
    kernel = load_kernel()
    return kernel is not None and bool(getattr(kernel, "amx_compiled", False)) and bool(kernel.amx_ready())


def int_dot_scores() -> bool:
    """Whether 4-bit K codes (``int4`` under any rotation, ``q4_0``; not keys stored before RoPE) are scored by byte
    dot products against an integer split of the query (see ``IQuery`` in cpu_kernel_idot.h: three int8 parts, exact
    int32 sums, float32-sized rounding) instead of being unpacked to floats: the kernel was built for AVX2 or
    AVX-512BW (VNNI's ``vpdpbusd`` where the CPU has it) and the environment variable ``WALSHKV_CPU_INT_DOT`` is not
    ``0`` (set it to ``0`` to time or test the float path)."""
    if os.environ.get("WALSHKV_CPU_INT_DOT", "1").strip() == "0":
        return False
    kernel = load_kernel()
    return kernel is not None and bool(getattr(kernel, "int_dot_compiled", False))


def prerope_key_map(k_codec: Codec, v_codec: Codec, head_dim: int, kv_heads: int) -> str | None:
    """How the CPU kernel maps a ``prerope+`` K codec's decoded rows to keys: ``"hadamard"`` (a fast Walsh-Hadamard
    transform with sign flips, ``d log2 d`` additions per key: no ``eq+``, or ``eqd+``'s diagonal one), ``"matrix"``
    (one ``d x d`` matrix per kv head: ``eq+``, fp32 multiply-adds), ``"matrix-amx"`` (the same matrix on AMX tiles,
    :func:`amx_key_map`), or ``None`` (not ``prerope+``, or a pair the kernel does not read)."""
    plan = cpu_plan(k_codec, v_codec, head_dim, 1.0)
    if plan is None or plan.prerope is None:
        return None
    tr = key_transform(plan.prerope, plan.k.basis, kv_heads, 0)
    if hadamard_factors(tr.mt) is not None:
        return "hadamard"
    return "matrix-amx" if amx_key_map() else "matrix"


_KPOST: dict[
    tuple[int, int],
    tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None, CpuPlan, dict[str, Any]],
] = {}


def _lanes() -> int:
    kernel = load_kernel()
    return int(kernel.vector_lanes) if kernel is not None else 16


#: Under ``OMP_WAIT_POLICY=passive`` a parallel region first wakes its sleeping workers (about 0.1 ms on the 2-vCPU
#: machines here), so a step with less work than this runs on the calling thread alone: keys (batch x kv heads x
#: tokens) times 3 for keys stored before RoPE (their per-key map), 1 otherwise. Measured on an Intel Xeon (2 vCPUs,
#: passive): one thread is faster up to about 2k tokens x 3 kv heads for the presets, 4-8k x 3 for ``rot+int4``.
#: With spinning workers (OpenMP's default) two threads were never slower, so the rule applies to passive only.
_SERIAL_WORK = 18432


def _serial_step(keys: int, prerope: bool) -> bool:
    """Whether a decode step this small runs on one thread (see ``_SERIAL_WORK``)."""
    passive = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
    return passive and keys * (3 if prerope else 1) < _SERIAL_WORK


def _nsplit(n: int, t: int, threads: int) -> int:
    """Token ranges per (batch, kv head): about four tasks per thread, their count a multiple of the thread count
    where the ranges stay at least ``_MIN_SPLIT_TOKENS`` long (9 tasks on 2 threads leave one thread 5 of them: 11%
    of the step idle on the other), a single range on one thread."""
    if threads <= 1:
        return 1
    most = max(1, math.ceil(t / _MIN_SPLIT_TOKENS))
    want = max(1, math.ceil(4 * threads / n))
    for s in range(want, min(most, want + threads) + 1):
        if (n * s) % threads == 0:
            return s
    return min(want, most)


def fused_decode_cpu(
    q: torch.Tensor,
    plan: CpuPlan,
    packed_k: Packed,
    packed_v: Packed,
    start: int = 0,
    paged: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    query_block: int = 0,
    key_table: torch.Tensor | None = None,
    block_offset: int = 0,
    in_buffer: bool = False,
    key_table_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Unnormalised attention of one query step over packed K/V, with the C++ kernel.

    Rotation wrappers are applied to the query (once) and to the output (once), never to the cache. Keys
    stored before RoPE (``plan.prerope``) are turned into the model's keys row by row in the kernel
    (:mod:`walshkv.attention.keys`): the query stays in the model's basis.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, unscaled, in the model's basis; with ``query_block``
            ``[batch, kv_heads, n_blocks, group, head_dim]``, one query per block of keys.
        plan: :func:`cpu_plan` of the K and V codecs at this head_dim and softmax scale.
        packed_k, packed_v: CPU fields ``[batch, kv_heads, seq_len, ...]`` written by those codecs.
        start: position of packed token 0 (``prerope+`` only; sink tokens come before it).
        paged: ``(block_table, seq_lens)``, int32 ``[batch, max_blocks]`` and ``[batch]``: the packed fields are
            pages ``[num_blocks, kv_heads, block_size, ...]`` and request ``b``'s token ``t`` is row
            ``t % block_size`` of block ``block_table[b, t // block_size]``; each request reads its own
            ``seq_lens[b]`` tokens (at positions ``0 ..``; ``start`` must be 0). ``None``: fields are
            ``[batch, kv_heads, seq_len, ...]``.
        bias: float32 ``[batch, kv_heads, group, seq_len]`` (paged: ``seq_len`` the longest request's), added to
            every scaled score before the softmax: a term per key and query head that the codes do not hold.
            ``None``: no bias.
        query_block: ``G > 0``: keys ``i G .. (i + 1) G - 1`` are scored against query block ``i`` of ``q``
            (``n_blocks = ceil(seq_len / G)``): a block frame's query turned back to each block's first position
            and mapped once per block, all blocks in one kernel call. Not with ``prerope+`` keys. ``0``: one query.
            With ``block_offset`` ``o``, packed key ``t`` sits at offset ``o + t`` of the blocks (the first block holds
            ``G - o`` keys; ``n_blocks = ceil((o + seq_len) / G)``): blocks counted from a position before the cache.
        key_table: with ``query_block``, float32 ``[kv_heads, query_block, head_dim]``: row ``j`` is added to every
            decoded key at offset ``j`` of its block before it is scored (a block frame's mean turned to each offset,
            in the space the K codec encodes: before its rotations). One add per element and kv head, shared by
            its query heads; no tensor the length of the cache. Needs a K codec whose kernel buffer is an
            orthogonal map of that space (rotations, reordering). ``None``: none.
        block_offset: with ``query_block``, ``0 .. query_block - 1``: where packed key 0 sits in its block.
        in_buffer: ``q`` (scaled) and ``key_table`` are already in K's kernel buffer (the caller folded
            ``plan.q_map``, or ``plan.scale`` where it is ``None``, into its own map: one matmul per step instead of
            two). Needs a K buffer as long as the head; not with ``prerope+`` keys.
        key_table_finite: the caller has checked that ``key_table`` holds no NaN or Inf (a block frame's plan
            checks its table once, when it builds it), so the step does not scan it again.

    Returns:
        ``(m, l, acc)``: running max ``[batch, kv_heads, group]`` of the scaled scores, softmax denominator
        (same shape) and unnormalised weighted V sum ``[batch, kv_heads, group, head_dim]`` in the model's
        basis, all float32; ``None`` if the kernel cannot be built (the caller falls back to the reference).
    """
    kernel = load_kernel()
    if kernel is None:
        return None
    if query_block < 0 or (query_block > 0 and plan.prerope is not None):
        raise ValueError(f"query_block must be 0 or a block of keys >= 1 (not with prerope+ keys), got {query_block}")
    if not isinstance(block_offset, int) or block_offset < 0 or (block_offset and block_offset >= query_block):
        raise ValueError(
            f"block_offset must be in 0 .. query_block - 1 (where packed key 0 sits in its block), got {block_offset!r}"
        )
    if q.dim() != (5 if query_block else 4):
        raise ValueError(
            f"q must be [batch, kv_heads, {'n_blocks, ' if query_block else ''}group, head_dim], got {tuple(q.shape)}"
        )
    if in_buffer and plan.prerope is not None:
        raise ValueError("in_buffer needs a K codec read without prerope+ (its query stays in the model's basis)")
    b, h, g, d = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    if in_buffer and d != plan.k.length:
        raise ValueError(f"in_buffer needs K's kernel buffer as long as the head ({d}); this one is {plan.k.length}")
    kdesc, keep_k = _desc(packed_k, plan.k, d, "K", kernel.FORMATS[plan.k.fmt])
    vdesc, keep_v = _desc(packed_v, plan.v, d, "V", kernel.FORMATS[plan.v.fmt])
    t = packed_k.seq_len
    paging: list[int] = []
    keep_g: list[torch.Tensor] = []
    if paged is not None:
        table, lens = (x.to(torch.int32).contiguous() for x in paged)
        if table.dim() != 2 or lens.shape != (b,) or table.shape[0] < b or start != 0:
            raise ValueError(
                f"paged decode needs block_table [{b}, max_blocks] and seq_lens [{b}] (start 0), got "
                f"{tuple(table.shape)} and {tuple(lens.shape)}"
            )
        t = int(lens.max()) if b else 0  # the longest request: the RoPE table's reach (prerope+)
        paging = [table.data_ptr(), table.stride(0), packed_k.seq_len, lens.data_ptr(), packed_k.batch_size]
        keep_g = [table, lens]
    n_blocks = max(1, -(-(block_offset + t) // query_block)) if query_block else 0
    if query_block and q.shape[2] != n_blocks:
        raise ValueError(
            f"q has {q.shape[2]} query blocks; {t} keys in blocks of {query_block} from offset {block_offset} need "
            f"{n_blocks}"
        )
    kpost: list[int] = []
    keep_p: list[torch.Tensor] = []
    if plan.prerope is not None:
        kpost, keep_p = _kpost(plan, h, int(start), t)
    kt_desc: list[int] = []
    keep_t: list[torch.Tensor] = []
    if key_table is not None:
        if (
            not query_block
            or key_table.dtype != torch.float32
            or tuple(key_table.shape) != (h, query_block, d)
            or key_table.device.type != "cpu"
        ):
            raise ValueError(
                f"key_table needs query_block and a float32 CPU tensor [kv_heads, query_block, head_dim] = "
                f"[{h}, {query_block}, {d}], got {key_table.dtype} {tuple(key_table.shape)}"
            )
        if not key_table_finite and not bool(torch.isfinite(key_table).all()):
            raise ValueError("key_table has NaN or Inf entries: the keys would be undefined (check the mean)")
        table = key_table
        if not plan.k_buffer_orthogonal:
            raise ValueError(
                "key_table needs a K codec whose kernel buffer is an orthogonal map of the head (rotations, "
                "reordering); this one is not: add the term as a score bias instead (bias=)"
            )
        if plan.q_map is not None and not in_buffer:  # to the kernel's K buffer
            table = key_table @ (plan.q_map / plan.scale)
        if table.shape[-1] != plan.k.length:
            raise ValueError(f"key_table rows are {table.shape[-1]} floats, K's kernel buffer {plan.k.length}")
        keep_t = [table.contiguous()]
        kt_desc = [keep_t[0].data_ptr(), plan.k.length]
    bdesc: list[int] = []
    if bias is not None:
        if bias.dtype != torch.float32 or bias.shape != (b, h, g, t) or bias.device.type != "cpu":
            raise ValueError(
                f"bias must be float32 [batch, kv_heads, group, seq_len] = [{b}, {h}, {g}, {t}] on the CPU, got "
                f"{bias.dtype} {tuple(bias.shape)} on {bias.device}"
            )
        if not bool(torch.isfinite(bias).all()):
            raise ValueError("bias has NaN or Inf entries: scores would be undefined (check the query and the mean)")
        if bias.stride(3) != 1 or bias.stride(0) != h * bias.stride(1):
            bias = bias.contiguous()
        bdesc = [bias.data_ptr(), bias.stride(1), bias.stride(2)]
    qb = q if in_buffer else q @ plan.q_map if plan.q_map is not None else q * plan.scale
    qb = qb.contiguous()
    m = torch.empty(b, h, g)
    l_sum = torch.empty(b, h, g)
    acc = torch.empty(b, h, g, plan.v.length)
    threads = torch.get_num_threads()
    if threads > 1 and _serial_step(b * h * t, plan.prerope is not None):
        threads = 1
    nsplit = _nsplit(b * h, t, threads)
    kernel.run(
        kdesc,
        vdesc,
        kpost,
        qb.data_ptr(),
        m.data_ptr(),
        l_sum.data_ptr(),
        acc.data_ptr(),
        b,
        h,
        g,
        t,
        nsplit,
        threads,
        int_dot=int_dot_scores(),
        paging=paging,
        bias=bdesc,
        qblock=query_block,
        key_table=kt_desc,
        qoff=block_offset,
    )
    del keep_k, keep_v, keep_p, keep_g, keep_t, bias
    if plan.out_map is not None:
        acc = acc @ plan.out_map
    return m, l_sum, acc


def decode_chunk_cpu(
    packed_k: Packed, packed_v: Packed, k_codec: Codec, v_codec: Codec, start: int, i0: int, i1: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Packed tokens ``i0 .. i1 - 1`` as float32 keys and values ``[batch, kv_heads, i1 - i0, head_dim]`` in the
    model's basis, decoded by the C++ kernel (a prefill tile's keys: :mod:`walshkv.attention.chunked`).

    The same vectors as ``k_codec.decode`` / ``v_codec.decode`` of the slice to float rounding (``center+``'s mean
    aside where the kernel leaves it out: it shifts every score of a query alike, which softmax ignores), at the
    kernel's speed and without the float temporaries of the codecs' own decode. ``prerope+`` keys come back mapped
    and rotated to their positions (``start + i``) as decode attention reads them; other keys and the values as the
    kernel's buffer rows times one matrix (their order and rotations back).

    Returns:
        ``(keys, values)``, or ``None`` where the kernel cannot read the pair (an ``eq+`` outside ``prerope+``, a
        codec it has no format for, tensors not on the CPU, no compiler): the caller decodes with the codecs.
    """
    if any(t.device.type != "cpu" for p in (packed_k, packed_v) for t in p.tensors.values()):
        return None
    kernel = load_kernel()
    if kernel is None:
        return None
    d = packed_k.head_dim
    plan = cpu_plan(k_codec, v_codec, d, 1.0)
    if plan is None:
        return None
    b, h, n = packed_k.batch_size, packed_k.num_heads, i1 - i0
    if not 0 <= i0 <= i1 <= packed_k.seq_len or packed_v.seq_len != packed_k.seq_len:
        raise ValueError(f"tokens {i0}..{i1} of packed K/V with {packed_k.seq_len}/{packed_v.seq_len} tokens")
    kdesc, keep_k = _desc(packed_k, plan.k, d, "K", kernel.FORMATS[plan.k.fmt])
    vdesc, keep_v = _desc(packed_v, plan.v, d, "V", kernel.FORMATS[plan.v.fmt])
    kpost: list[int] = []
    keep_p: list[torch.Tensor] = []
    if plan.prerope is not None:
        kpost, keep_p = _kpost(plan, h, int(start), packed_k.seq_len)
    threads = torch.get_num_threads()
    kout = torch.empty(b, h, n, d if plan.prerope is not None else plan.k.length)
    vout = torch.empty(b, h, n, plan.v.length)
    kernel.decode_rows(kdesc, kpost, kout.data_ptr(), b, h, i0, n, threads)
    kernel.decode_rows(vdesc, [], vout.data_ptr(), b, h, i0, n, threads)
    del keep_k, keep_v, keep_p
    if plan.prerope is None and plan.q_map is not None:  # q . b = (q @ q_map) . b: the key is b @ q_map.T
        kout = kout @ plan.q_map.T
    if plan.out_map is not None:
        vout = vout @ plan.out_map
    return kout, vout
