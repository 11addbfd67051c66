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

Rotations (``rot+``/``rrot+``): the query is multiplied once by the K codec's forward rotation (random
signs included) and the V sum once by the V codec's inverse rotation; both are cached d x d matrices,
fused with the softmax scale and the plane order above, so the kernel only ever reads the inner codec's
codes. ``center+`` is peeled (its decode adds no bias back); ``eq+`` (a per-kv-head matrix) is applied
to the query and the V sum by the caller (:func:`peel_equalizer`). All other codecs are not read here;
:func:`walshkv.ops.attention.decode_attention` sends them to the pure-torch reference.

Why C++: a torch-only chunked path (unpack 4096 tokens of codes at a time with shifts/masks, float
matmuls with the query, the offset folded in through the query's sum, online softmax across chunks)
was timed against this kernel in one process, one thread, smollm2-135m's shape (3 kv heads, 9 query
heads, d = 64), medians of warm calls on a shared 2-core machine: at 16k tokens 6.5 ms vs 1.5 ms
(int4), 4.3 vs 1.2 ms (int8), 15.7 vs 1.2 ms (q4_0); at 64k tokens 24.8 vs 5.9 ms (int4), 16.8 vs
4.7 ms (int8), 61.5 vs 4.8 ms (q4_0). SDPA over an fp16 cache took 4.8 ms (16k) and 20.0 ms (64k):
the torch path was slower than it, the kernel 3-4x faster.

The extension is compiled with ``torch.utils.cpp_extension.load_inline`` (``-O3 -march=native
-fopenmp``; cached in torch's extension directory under a name that hashes the source, the flags and
the CPU's vector capability, so only the first use pays the build, about 10-20 s). It includes only pybind11 (no ATen
headers, which keeps the build short) and receives raw data pointers and strides that the Python side
checks first. It uses AVX-512 or AVX2 intrinsics where the CPU has them and GCC/Clang vector
extensions otherwise (GCC >= 12 or Clang). Without a working compiler :func:`load_kernel` returns
``None`` after one warning and callers fall back to the reference.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import platform
import threading
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from walshkv.codecs.base import Codec, Packed
from walshkv.codecs.center import Centered
from walshkv.codecs.equalize import Equalized
from walshkv.codecs.ggml import QK, GGMLCodec
from walshkv.codecs.intq import IntCodec
from walshkv.codecs.rotation import Rotated
from walshkv.codecs.turbo import TurboQuant
from walshkv.codecs.vht2 import VHT2Codec
from walshkv.ops.packing import packed_nbytes

__all__ = [
    "CPU_SUPPORTED",
    "CpuPlan",
    "core_codec",
    "cpu_format",
    "cpu_plan",
    "cpu_supports",
    "fused_decode_cpu",
    "kernel_available",
    "load_kernel",
    "peel",
    "peel_equalizer",
]

#: Human-readable list of the (inner) codecs the fused CPU kernel reads.
CPU_SUPPORTED = "int2..int8, q4_0, q8_0, vht2, tq (each also under rot+, rrot+, center+ and eq+)"

# Formats understood by the C++ kernel (keep in sync with the enum in _CPP_SOURCE).
_FMT_INT4 = 0
_FMT_INT8 = 1
_FMT_INT_GENERIC = 2  # int3, int5, int6, int7
_FMT_Q4_0 = 3
_FMT_Q8_0 = 4
_FMT_INT2 = 5
_FMT_BANDED = 6  # vht2
_FMT_TQ = 7  # tq: Lloyd-Max codes in one or two segments (own tensors), one fp16 norm

_MIN_SPLIT_TOKENS = 256  # no parallel range shorter than this many tokens

_CPP_SOURCE = r"""
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <stdexcept>
#include <vector>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace py = pybind11;

// Lanes of the generic vector type (GCC/Clang vector extensions, lowered to whatever SIMD the target has).
#if defined(__AVX512F__)
#define WK_VW 16
#else
#define WK_VW 8
#endif
static constexpr int VW = WK_VW;
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int32_t vi __attribute__((vector_size(VW * 4)));
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

enum Fmt : int {
  FMT_INT4 = 0, FMT_INT8 = 1, FMT_INT_GENERIC = 2, FMT_Q4_0 = 3, FMT_Q8_0 = 4, FMT_INT2 = 5, FMT_BANDED = 6,
  FMT_TQ = 7
};
static constexpr int MAX_BANDS = 32;
static constexpr int MAX_SEGS = 2;
#include <array>
static constexpr int TILE = 32;  // tokens per tile
static constexpr int JB = 4;     // query heads per register block

static inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);  // little-endian fp16, possibly unaligned (ggml blocks)
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  const uint32_t ex = (h >> 10) & 0x1fu, man = h & 0x3ffu;
  if (ex == 0) {
    const float f = std::ldexp((float)man, -24);
    return sign ? -f : f;
  }
  const uint32_t bits = ex == 31 ? (sign | 0x7f800000u | (man << 13)) : (sign | ((ex + 112u) << 23) | (man << 13));
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

static inline vf splat(float x) { return vf{} + x; }

static inline v8f half8(vf v) {
#if WK_VW == 16
  return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
         __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return v;
#endif
}

static inline float hsum(vf v) {
  const v8f a = half8(v);
  v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b = b + __builtin_shufflevector(b, b, 2, 3, 0, 1);
  return b[0] + b[1];
}

// Lane sums of four vectors at once (fewer shuffles than four hsum calls).
static inline void hsum4(vf a0, vf a1, vf a2, vf a3, float* out) {
  const v8f b0 = half8(a0), b1 = half8(a1), b2 = half8(a2), b3 = half8(a3);
  const v8f c01 = __builtin_shufflevector(b0, b1, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(b0, b1, 4, 5, 6, 7, 12, 13, 14, 15);  // [b0 x4, b1 x4]
  const v8f c23 = __builtin_shufflevector(b2, b3, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(b2, b3, 4, 5, 6, 7, 12, 13, 14, 15);  // [b2 x4, b3 x4]
  const v8f d = __builtin_shufflevector(c01, c23, 0, 1, 8, 9, 4, 5, 12, 13) +
                __builtin_shufflevector(c01, c23, 2, 3, 10, 11, 6, 7, 14, 15);  // [b0 x2, b2 x2, b1 x2, b3 x2]
  const v4f e = __builtin_shufflevector(d, d, 0, 2, 4, 6) + __builtin_shufflevector(d, d, 1, 3, 5, 7);
  out[0] = e[0];
  out[1] = e[2];
  out[2] = e[1];
  out[3] = e[3];
}

// exp(x) for x <= 0, lane-wise: Cody-Waite range reduction and a degree-6 polynomial (relative
// error ~1e-7, no libm call); 0 below -87 and for -inf.
static inline vf vexp_nonpos(vf x) {
  const vf lo = splat(-87.0f);
  const vf xc = x < lo ? lo : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vf n = (xc * 1.44269504088896341f + magic) - magic;
  vf r = xc - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  vf p = splat(1.3981999507e-3f);
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  const vf y = p * (vf)e;
  return x < lo ? vf{} : y;
}

struct Src {
  const uint8_t* codes;
  int64_t cs0, cs1, cs2;  // byte strides of codes/blocks over (batch, head, token)
  const uint8_t* scale;   // fp16 per-token scale (intB); unused for ggml
  int64_t ss0, ss1, ss2;  // byte strides of the scale
  int fmt, bits, row_bytes, d, L;
  float offset;       // qmax for intB
  const uint8_t* end;  // one past the last byte of the codes tensor (bounds for over-wide vector loads)
  int nbands;          // FMT_BANDED: bands of (first byte, first buffer position, size, bits), one fp16 scale each
  int band_byte[MAX_BANDS], band_start[MAX_BANDS], band_size[MAX_BANDS], band_bits[MAX_BANDS];
  int nseg;            // FMT_TQ: segments of codes, each its own tensor, decoded through its level table
  const uint8_t* seg_codes[MAX_SEGS];
  int64_t seg_s0[MAX_SEGS], seg_s1[MAX_SEGS], seg_s2[MAX_SEGS];
  const uint8_t* seg_end[MAX_SEGS];
  int seg_start[MAX_SEGS], seg_size[MAX_SEGS], seg_bits[MAX_SEGS];
  const float* seg_levels[MAX_SEGS];  // max(2^bits, 32) floats (zero padded: whole-vector permutes)
  float row_mul;                      // FMT_TQ: the row factor is norm * row_mul (1 / sqrt(d))
};

static Src make_src(const std::vector<int64_t>& a) {
  Src s;
  s.codes = reinterpret_cast<const uint8_t*>(a.at(0));
  s.cs0 = a[1];
  s.cs1 = a[2];
  s.cs2 = a[3];
  s.scale = reinterpret_cast<const uint8_t*>(a[4]);
  s.ss0 = a[5];
  s.ss1 = a[6];
  s.ss2 = a[7];
  s.fmt = (int)a[8];
  s.bits = (int)a[9];
  s.row_bytes = (int)a[10];
  s.d = (int)a[11];
  s.L = (int)a[12];
  s.offset = (float)a[13];
  s.end = reinterpret_cast<const uint8_t*>(a.at(14));
  s.nbands = 0;
  s.nseg = 0;
  s.row_mul = 1.0f;
  if (s.fmt == FMT_TQ) {
    s.nseg = a.size() > 15 ? (int)a[15] : 0;
    if (s.nseg < 1 || s.nseg > MAX_SEGS || (int64_t)a.size() != 16 + 9 * (int64_t)s.nseg)
      throw std::invalid_argument("walshkv decode attention: bad tq segment table");
    for (int i = 0; i < s.nseg; ++i) {
      const int64_t* e = a.data() + 16 + 9 * i;
      s.seg_codes[i] = reinterpret_cast<const uint8_t*>(e[0]);
      s.seg_s0[i] = e[1];
      s.seg_s1[i] = e[2];
      s.seg_s2[i] = e[3];
      s.seg_end[i] = reinterpret_cast<const uint8_t*>(e[4]);
      s.seg_start[i] = (int)e[5];
      s.seg_size[i] = (int)e[6];
      s.seg_bits[i] = (int)e[7];
      s.seg_levels[i] = reinterpret_cast<const float*>(e[8]);
      if (s.seg_bits[i] < 1 || s.seg_bits[i] > 8 || s.seg_start[i] < 0 || s.seg_start[i] + s.seg_size[i] > s.L)
        throw std::invalid_argument("walshkv decode attention: bad tq segment");
    }
    s.row_mul = 1.0f / std::sqrt((float)s.d);
    return s;
  }
  s.nbands = a.size() > 15 ? (int)a[15] : 0;
  if (s.fmt == FMT_BANDED && (s.nbands < 1 || s.nbands > MAX_BANDS || (int64_t)a.size() != 16 + 4 * (int64_t)s.nbands))
    throw std::invalid_argument("walshkv decode attention: bad band table");
  for (int i = 0; i < s.nbands && i < MAX_BANDS; ++i) {
    s.band_byte[i] = (int)a[16 + 4 * i];
    s.band_start[i] = (int)a[17 + 4 * i];
    s.band_size[i] = (int)a[18 + 4 * i];
    s.band_bits[i] = (int)a[19 + 4 * i];
  }
  return s;
}

// Bit fields (2 or 4 bits) of bytes -> planes: buf[p * nb + k] = field p of byte k, minus `off`.
template <int BITS>
static inline void unpack_planes(const uint8_t* __restrict row, int nb, float off, float* __restrict buf) {
  constexpr int P = 8 / BITS;
  constexpr unsigned M = (1u << BITS) - 1u;
  int k = 0;
#if defined(__AVX512F__)
  {
    const __m512 o = _mm512_set1_ps(off);
    const __m128i m = _mm_set1_epi8((char)M);
    for (; k + 16 <= nb; k += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      for (int p = 0; p < P; ++p) {
        const __m128i f = _mm_and_si128(_mm_srli_epi16(c, p * BITS), m);
        _mm512_storeu_ps(buf + p * nb + k, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(f)), o));
      }
    }
  }
#elif defined(__AVX2__)
  {
    const __m256 o = _mm256_set1_ps(off);
    const __m128i m = _mm_set1_epi8((char)M);
    for (; k + 16 <= nb; k += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      for (int p = 0; p < P; ++p) {
        const __m128i f = _mm_and_si128(_mm_srli_epi16(c, p * BITS), m);
        float* dst = buf + p * nb + k;
        _mm256_storeu_ps(dst, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(f)), o));
        _mm256_storeu_ps(dst + 8, _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(f, 8))), o));
      }
    }
  }
#endif
  for (int p = 0; p < P; ++p)
    for (int kk = k; kk < nb; ++kk) buf[p * nb + kk] = (float)((row[kk] >> (p * BITS)) & M) - off;
}

// n bytes (unsigned, or signed with SIGNED) -> (x - off) * mul.
template <bool SIGNED>
static inline void widen_bytes(const uint8_t* __restrict row, int n, float off, float mul, float* __restrict buf) {
  int k = 0;
#if defined(__AVX512F__)
  {
    const __m512 o = _mm512_set1_ps(off), mm = _mm512_set1_ps(mul);
    for (; k + 16 <= n; k += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
      const __m512i w = SIGNED ? _mm512_cvtepi8_epi32(c) : _mm512_cvtepu8_epi32(c);
      _mm512_storeu_ps(buf + k, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(w), o), mm));
    }
  }
#elif defined(__AVX2__)
  {
    const __m256 o = _mm256_set1_ps(off), mm = _mm256_set1_ps(mul);
    for (; k + 8 <= n; k += 8) {
      const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
      const __m256i w = SIGNED ? _mm256_cvtepi8_epi32(c) : _mm256_cvtepu8_epi32(c);
      _mm256_storeu_ps(buf + k, _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(w), o), mm));
    }
  }
#endif
  for (; k < n; ++k) buf[k] = ((SIGNED ? (float)(int8_t)row[k] : (float)row[k]) - off) * mul;
}

// Byte-shuffle control and shifts that put code i of a group (B bits each, LSB-first) in dword i:
// bytes (i*B)>>3 and +1 into the low half, then a right shift by (i*B)&7. Per 128-bit lane the
// shuffle indexes the same (broadcast) 16 source bytes; 0x80 writes a zero byte.
template <int BITS, int LANES>
static constexpr std::array<int8_t, 4 * LANES> generic_shuffle() {
  std::array<int8_t, 4 * LANES> c{};
  for (int i = 0; i < LANES; ++i) {
    c[4 * i] = (int8_t)((i * BITS) >> 3);
    c[4 * i + 1] = (int8_t)(((i * BITS) >> 3) + 1);
    c[4 * i + 2] = (int8_t)0x80;
    c[4 * i + 3] = (int8_t)0x80;
  }
  return c;
}

template <int BITS, int LANES>
static constexpr std::array<int32_t, LANES> generic_shifts() {
  std::array<int32_t, LANES> c{};
  for (int i = 0; i < LANES; ++i) c[i] = (i * BITS) & 7;
  return c;
}

// B in 1..8 (used for 3, 5, 6, 7 and for vht2 bands): groups of GR codes (GR * B / 8 bytes) with one
// byte shuffle + variable shift; the codes after the last whole group bit by bit.
template <int BITS>
static inline void unpack_generic(const uint8_t* __restrict row, int d, float off, const uint8_t* end,
                                  float* __restrict buf) {
  constexpr uint32_t M = (1u << BITS) - 1u;
  int i = 0;
#if defined(__AVX512VBMI__)
  if constexpr (BITS == 3) {  // 64 codes (24 bytes) at a time: byte permute + multishift, no per-lane shifts
    alignas(64) static constexpr std::array<uint8_t, 64> idx = [] {
      std::array<uint8_t, 64> a{};
      for (int j = 0; j < 8; ++j)
        for (int k = 0; k < 8; ++k) a[8 * j + k] = (uint8_t)(3 * j + (k < 3 ? k : 2));  // qword j: bytes 3j..3j+2
      return a;
    }();
    alignas(64) static constexpr std::array<uint8_t, 64> sh = [] {
      std::array<uint8_t, 64> a{};
      for (int j = 0; j < 64; ++j) a[j] = (uint8_t)(3 * (j % 8));  // byte k of a qword: bits 3k..3k+7
      return a;
    }();
    const __m512i pi = _mm512_load_si512(idx.data()), ms = _mm512_load_si512(sh.data());
    const __m512i m7 = _mm512_set1_epi8(7);
    const __m512 o = _mm512_set1_ps(off);
    for (; i + 64 <= d; i += 64) {
      const __m512i x = _mm512_maskz_loadu_epi8(0xFFFFFFull, row + i / 8 * 3);  // 24 bytes, never past them
      const __m512i c = _mm512_and_si512(_mm512_multishift_epi64_epi8(ms, _mm512_permutexvar_epi8(pi, x)), m7);
      _mm512_storeu_ps(buf + i, _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_castsi512_si128(c))), o));
      _mm512_storeu_ps(buf + i + 16,
                       _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, 1))), o));
      _mm512_storeu_ps(buf + i + 32,
                       _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, 2))), o));
      _mm512_storeu_ps(buf + i + 48,
                       _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(c, 3))), o));
    }
  }
#endif
#if defined(__AVX512BW__)
  {
    constexpr int GR = 16, GB = GR * BITS / 8;
    alignas(64) static constexpr std::array<int8_t, 64> ctl = generic_shuffle<BITS, 16>();
    alignas(64) static constexpr std::array<int32_t, 16> shl = generic_shifts<BITS, 16>();
    const __m512i c = _mm512_load_si512(ctl.data()), sh = _mm512_load_si512(shl.data());
    const __m512i m = _mm512_set1_epi32((int)M);
    const __m512 o = _mm512_set1_ps(off);
    uint8_t tmp[16] = {0};
    for (; i + GR <= d; i += GR) {
      const uint8_t* p = row + i / GR * GB;
      __m128i x;
      if (p + 16 <= end) {
        x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      } else {  // near the end of the tensor: never read past it
        std::memcpy(tmp, p, GB);
        x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      const __m512i y = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(x), c);
      const __m512i w = _mm512_and_si512(_mm512_srlv_epi32(y, sh), m);
      _mm512_storeu_ps(buf + i, _mm512_sub_ps(_mm512_cvtepi32_ps(w), o));
    }
  }
#elif defined(__AVX2__)
  {
    constexpr int GR = 8, GB = BITS;
    alignas(32) static constexpr std::array<int8_t, 32> ctl = generic_shuffle<BITS, 8>();
    alignas(32) static constexpr std::array<int32_t, 8> shl = generic_shifts<BITS, 8>();
    const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl.data()));
    const __m256i sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(shl.data()));
    const __m256i m = _mm256_set1_epi32((int)M);
    const __m256 o = _mm256_set1_ps(off);
    uint8_t tmp[16] = {0};
    for (; i + GR <= d; i += GR) {
      const uint8_t* p = row + i / GR * GB;
      __m128i x;
      if (p + 16 <= end) {
        x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      } else {
        std::memcpy(tmp, p, GB);
        x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
      }
      const __m256i y = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), c);
      const __m256i w = _mm256_and_si256(_mm256_srlv_epi32(y, sh), m);
      _mm256_storeu_ps(buf + i, _mm256_sub_ps(_mm256_cvtepi32_ps(w), o));
    }
  }
#else
  (void)end;
#endif
  for (; i < d; ++i) {
    const int bp = i * BITS;
    unsigned w = row[bp >> 3];
    if (((bp & 7) + BITS) > 8) w |= (unsigned)row[(bp >> 3) + 1] << 8;  // the code spills into the next byte
    buf[i] = (float)((w >> (bp & 7)) & M) - off;
  }
}

// Unpack one row into buf[0..L) (c - qmax for intB, dequantized values for ggml; entries from L on
// are never written and stay 0); returns the factor of the whole row (intB scale, 1 for ggml).
template <int FMT>
static inline float decode_row(const Src& s, const uint8_t* __restrict row, const uint8_t* __restrict sc,
                               float* __restrict buf) {
  if constexpr (FMT == FMT_INT4) {
    unpack_planes<4>(row, s.row_bytes, s.offset, buf);
    return h2f(sc);
  } else if constexpr (FMT == FMT_INT2) {
    unpack_planes<2>(row, s.row_bytes, s.offset, buf);
    return h2f(sc);
  } else if constexpr (FMT == FMT_INT8) {
    widen_bytes<false>(row, s.row_bytes, s.offset, 1.0f, buf);
    return h2f(sc);
  } else if constexpr (FMT == FMT_INT_GENERIC) {
    switch (s.bits) {
      case 3: unpack_generic<3>(row, s.d, s.offset, s.end, buf); break;
      case 5: unpack_generic<5>(row, s.d, s.offset, s.end, buf); break;
      case 6: unpack_generic<6>(row, s.d, s.offset, s.end, buf); break;
      default: unpack_generic<7>(row, s.d, s.offset, s.end, buf); break;
    }
    return h2f(sc);
  } else if constexpr (FMT == FMT_Q4_0) {
    const int nblk = s.d / 32;
    for (int k = 0; k < nblk; ++k) {
      const uint8_t* __restrict blk = row + k * 18;
      const float dd = h2f(blk);
      float* __restrict dst = buf + k * 32;
      unpack_planes<4>(blk + 2, 16, 8.0f, dst);  // value j low nibble, value j + 16 high nibble
#if WK_VW == 16
      ((vf*)dst)[0] *= dd;  // dst is 64-byte aligned (k * 32 floats)
      ((vf*)dst)[1] *= dd;
#else
      for (int j = 0; j < 4; ++j) ((vf*)dst)[j] *= dd;
#endif
    }
    return 1.0f;
  } else if constexpr (FMT == FMT_BANDED) {  // vht2: per band c - qmax (1 bit: 2c - 1) times its fp16 scale
    for (int i = 0; i < s.nbands; ++i) {
      const uint8_t* r = row + s.band_byte[i];
      float* __restrict dst = buf + s.band_start[i];
      const int n = s.band_size[i], bits = s.band_bits[i];
      const float off = bits == 1 ? 0.5f : (float)((1 << (bits - 1)) - 1);
      switch (bits) {
        case 1: unpack_generic<1>(r, n, off, s.end, dst); break;
        case 2: unpack_generic<2>(r, n, off, s.end, dst); break;
        case 3: unpack_generic<3>(r, n, off, s.end, dst); break;
        case 4: unpack_generic<4>(r, n, off, s.end, dst); break;
        case 5: unpack_generic<5>(r, n, off, s.end, dst); break;
        case 6: unpack_generic<6>(r, n, off, s.end, dst); break;
        case 7: unpack_generic<7>(r, n, off, s.end, dst); break;
        default: unpack_generic<8>(r, n, off, s.end, dst); break;
      }
      const float f = h2f(sc + 2 * i) * (bits == 1 ? 2.0f : 1.0f);
      for (int j = 0; j < n; ++j) dst[j] *= f;
    }
    return 1.0f;
  } else {  // FMT_Q8_0
    const int nblk = s.d / 32;
    for (int k = 0; k < nblk; ++k) widen_bytes<true>(row + k * 34 + 2, 32, 0.0f, h2f(row + k * 34), buf + k * 32);
    return 1.0f;
  }
}

// Decode rows t..t+nt of one (batch, head) into tile rows of ld floats; rs[i] = row factor.
typedef void (*TileFn)(const Src&, int64_t, int64_t, int64_t, int, float*, int64_t, float*);

template <int FMT>
static void decode_tile(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld, float* rs) {
  const uint8_t* c = s.codes + b * s.cs0 + h * s.cs1 + t * s.cs2;
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  for (int i = 0; i < nt; ++i) rs[i] = decode_row<FMT>(s, c + i * s.cs2, sc + i * s.ss2, tile + i * ld);
}

// buf[j] (a code c, as float) -> lv[c], for j < n. lv holds at least 32 floats (zero padded).
static inline void lookup_levels(float* __restrict buf, int n, const float* __restrict lv, int bits) {
  int j = 0;
#if defined(__AVX512F__)
  if (bits <= 5) {  // every level in one or two registers: a lane permute per 16 codes
    const __m512 l0 = _mm512_loadu_ps(lv), l1 = _mm512_loadu_ps(lv + 16);
    for (; j + 16 <= n; j += 16) {
      const __m512i idx = _mm512_cvttps_epi32(_mm512_loadu_ps(buf + j));
      _mm512_storeu_ps(buf + j, bits <= 4 ? _mm512_permutexvar_ps(idx, l0) : _mm512_permutex2var_ps(l0, idx, l1));
    }
  } else {
    for (; j + 16 <= n; j += 16)
      _mm512_storeu_ps(buf + j, _mm512_i32gather_ps(_mm512_cvttps_epi32(_mm512_loadu_ps(buf + j)), lv, 4));
  }
#elif defined(__AVX2__)
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(buf + j, _mm256_i32gather_ps(lv, _mm256_cvttps_epi32(_mm256_loadu_ps(buf + j)), 4));
#endif
  for (; j < n; ++j) buf[j] = lv[(int)buf[j]];
}

// tq: each segment's codes (own tensor and strides) unpacked to its buffer positions, then replaced by
// their Lloyd-Max levels; the row factor is norm / sqrt(d).
static void decode_tile_tq(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                           float* rs) {
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  for (int i = 0; i < nt; ++i) {
    float* row_buf = tile + i * ld;
    for (int g = 0; g < s.nseg; ++g) {
      const uint8_t* r = s.seg_codes[g] + b * s.seg_s0[g] + h * s.seg_s1[g] + (t + i) * s.seg_s2[g];
      float* dst = row_buf + s.seg_start[g];
      const int n = s.seg_size[g];
      switch (s.seg_bits[g]) {
        case 1: unpack_generic<1>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 2: unpack_generic<2>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 3: unpack_generic<3>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 4: unpack_generic<4>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 5: unpack_generic<5>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 6: unpack_generic<6>(r, n, 0.0f, s.seg_end[g], dst); break;
        case 7: unpack_generic<7>(r, n, 0.0f, s.seg_end[g], dst); break;
        default: unpack_generic<8>(r, n, 0.0f, s.seg_end[g], dst); break;
      }
      lookup_levels(dst, n, s.seg_levels[g], s.seg_bits[g]);
    }
    rs[i] = h2f(sc + i * s.ss2) * s.row_mul;
  }
}

static TileFn tile_fn(int fmt) {
  switch (fmt) {
    case FMT_INT4: return decode_tile<FMT_INT4>;
    case FMT_INT2: return decode_tile<FMT_INT2>;
    case FMT_INT8: return decode_tile<FMT_INT8>;
    case FMT_INT_GENERIC: return decode_tile<FMT_INT_GENERIC>;
    case FMT_Q4_0: return decode_tile<FMT_Q4_0>;
    case FMT_Q8_0: return decode_tile<FMT_Q8_0>;
    case FMT_BANDED: return decode_tile<FMT_BANDED>;
    case FMT_TQ: return decode_tile_tq;
  }
  throw std::invalid_argument("walshkv decode attention: unknown packed format");
}

// Scores of NB query heads (rows of q, stride LK) against nt decoded K rows: sc[c * TILE + i].
template <int NB>
static inline void score_block(const float* __restrict q, int64_t LK, int64_t nk, const float* __restrict ktile,
                               int nt, const float* __restrict rsk, float* __restrict sc) {
  const vf* qv[NB];
  for (int c = 0; c < NB; ++c) qv[c] = (const vf*)(q + c * LK);
  for (int i = 0; i < nt; ++i) {
    const vf* kb = (const vf*)(ktile + i * LK);
    vf a[4] = {vf{}, vf{}, vf{}, vf{}};
    for (int64_t k = 0; k < nk; ++k) {
      const vf x = kb[k];
      for (int c = 0; c < NB; ++c) a[c] += x * qv[c][k];
    }
    float s4[4];
    hsum4(a[0], a[1], a[2], a[3], s4);
    for (int c = 0; c < NB; ++c) sc[c * TILE + i] = s4[c] * rsk[i];
  }
}

// acc[c] += sum_i w[c * TILE + i] * vtile[i] for NB heads, one vector of the row at a time in registers.
template <int NB>
static inline void acc_block(const float* __restrict w, const float* __restrict vtile, int nt, int64_t LV, int64_t nv,
                             float* __restrict acc) {
  for (int64_t k = 0; k < nv; ++k) {
    vf a[NB];
    for (int c = 0; c < NB; ++c) a[c] = ((vf*)(acc + c * LV))[k];
    for (int i = 0; i < nt; ++i) {
      const vf x = ((const vf*)(vtile + i * LV))[k];
      for (int c = 0; c < NB; ++c) a[c] += w[c * TILE + i] * x;
    }
    for (int c = 0; c < NB; ++c) ((vf*)(acc + c * LV))[k] = a[c];
  }
}

// One (batch, head, token range): online softmax over tiles. q: [G][LK] (zero columns pad), acc: [G][LV];
// m, l: [G]. LK, LV are multiples of VW; buffers 64-byte aligned.
static void run_range(const Src& K, const Src& V, TileFn kdec, TileFn vdec, const float* __restrict q, int64_t b,
                      int64_t h, int64_t t0, int64_t t1, int64_t G, int64_t LK, int64_t LV, float* __restrict m,
                      float* __restrict l, float* __restrict acc, float* __restrict ktile, float* __restrict vtile,
                      float* __restrict sc) {
  const int64_t nk = LK / VW, nv = LV / VW;
  float rsk[TILE], rsv[TILE];
  bool first = true;
  for (int64_t tb = t0; tb < t1; tb += TILE) {
    const int nt = (int)std::min<int64_t>(TILE, t1 - tb);
    kdec(K, b, h, tb, nt, ktile, LK, rsk);
    for (int64_t j0 = 0; j0 < G; j0 += JB) {  // scores: (integer) codes . query, times the row factor
      const float* qj = q + j0 * LK;
      float* sj = sc + j0 * TILE;
      switch (std::min<int64_t>(JB, G - j0)) {
        case 1: score_block<1>(qj, LK, nk, ktile, nt, rsk, sj); break;
        case 2: score_block<2>(qj, LK, nk, ktile, nt, rsk, sj); break;
        case 3: score_block<3>(qj, LK, nk, ktile, nt, rsk, sj); break;
        default: score_block<4>(qj, LK, nk, ktile, nt, rsk, sj); break;
      }
    }
    for (int64_t j = 0; j < G; ++j) {  // online softmax update
      float* sj = sc + j * TILE;
      for (int i = nt; i < TILE; ++i) sj[i] = -std::numeric_limits<float>::infinity();
      vf* sv = (vf*)sj;
      vf mv = sv[0];
      for (int v = 1; v < TILE / VW; ++v) mv = mv > sv[v] ? mv : sv[v];
      float mt = mv[0];
      for (int z = 1; z < VW; ++z) mt = std::max(mt, mv[z]);
      const float mn = first ? mt : std::max(m[j], mt);
      vf sum = vf{};
      for (int v = 0; v < TILE / VW; ++v) {
        const vf p = vexp_nonpos(sv[v] - mn);  // unused slots: -inf -> 0
        sum += p;
        sv[v] = p;
      }
      if (!first && mn > m[j]) {
        const float alpha = vexp_nonpos(splat(m[j] - mn))[0];
        vf* a = (vf*)(acc + j * LV);
        for (int64_t k = 0; k < nv; ++k) a[k] *= alpha;
        l[j] *= alpha;
      }
      l[j] += hsum(sum);
      m[j] = mn;
    }
    first = false;
    vdec(V, b, h, tb, nt, vtile, LV, rsv);
    for (int64_t j = 0; j < G; ++j)
      for (int i = 0; i < nt; ++i) sc[j * TILE + i] *= rsv[i];
    for (int64_t j0 = 0; j0 < G; j0 += JB) {  // weighted V rows: up to JB heads x one vector in registers
      const float* w = sc + j0 * TILE;
      float* a = acc + j0 * LV;
      switch (std::min<int64_t>(JB, G - j0)) {
        case 1: acc_block<1>(w, vtile, nt, LV, nv, a); break;
        case 2: acc_block<2>(w, vtile, nt, LV, nv, a); break;
        case 3: acc_block<3>(w, vtile, nt, LV, nv, a); break;
        default: acc_block<4>(w, vtile, nt, LV, nv, a); break;
      }
    }
  }
}

static inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

static float* alloc_floats(int64_t n) {  // 64-byte aligned, zeroed
  const size_t bytes = (size_t)round_up(std::max<int64_t>(n, 1) * 4, 64);
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) throw std::bad_alloc();
  std::memset(p, 0, bytes);
  return p;
}

// q: float [B*H][G][K.L] (scaled, in K's buffer order). Outputs: m, l: [B*H][G]; acc: [B*H][G][V.L] (V's
// buffer order). The T tokens are cut into nsplit ranges run in parallel, then merged.
static void run(const std::vector<int64_t>& kdesc, const std::vector<int64_t>& vdesc, int64_t q_ptr, int64_t m_ptr,
                int64_t l_ptr, int64_t acc_ptr, int64_t B, int64_t H, int64_t G, int64_t T, int64_t nsplit,
                int64_t nthreads) {
  const Src K = make_src(kdesc), V = make_src(vdesc);
  const TileFn kdec = tile_fn(K.fmt), vdec = tile_fn(V.fmt);
  const float* q = reinterpret_cast<const float*>(q_ptr);
  float* m_out = reinterpret_cast<float*>(m_ptr);
  float* l_out = reinterpret_cast<float*>(l_ptr);
  float* acc_out = reinterpret_cast<float*>(acc_ptr);
  nsplit = std::max<int64_t>(1, nsplit);
  const int64_t N = B * H, LK = round_up(K.L, VW), LV = round_up(V.L, VW);
  const int64_t per = (T + nsplit - 1) / nsplit;
  const float NEG_INF = -std::numeric_limits<float>::infinity();
  float* qp = alloc_floats(N * G * LK);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < G; ++j) std::memcpy(qp + (n * G + j) * LK, q + (n * G + j) * K.L, sizeof(float) * K.L);
  std::vector<float> pm(N * nsplit * G, NEG_INF), pl(N * nsplit * G, 0.0f);
  float* pacc = alloc_floats(N * nsplit * G * LV);
  {
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads))
    {
      float* ktile = alloc_floats(TILE * LK + TILE * LV + G * TILE);
      float* vtile = ktile + TILE * LK;
      float* sc = vtile + TILE * LV;
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < N * nsplit; ++task) {
        const int64_t n = task / nsplit, sp = task % nsplit;
        const int64_t t0 = sp * per, t1 = std::min<int64_t>(T, t0 + per);
        if (t0 < t1)
          run_range(K, V, kdec, vdec, qp + n * G * LK, n / H, n % H, t0, t1, G, LK, LV, pm.data() + task * G,
                    pl.data() + task * G, pacc + task * G * LV, ktile, vtile, sc);
      }
      std::free(ktile);
    }
  }
  for (int64_t n = 0; n < N; ++n) {  // merge the ranges
    for (int64_t j = 0; j < G; ++j) {
      float M = NEG_INF, L = 0.0f;
      for (int64_t sp = 0; sp < nsplit; ++sp) M = std::max(M, pm[(n * nsplit + sp) * G + j]);
      float* out = acc_out + (n * G + j) * V.L;
      std::fill(out, out + V.L, 0.0f);
      for (int64_t sp = 0; sp < nsplit && M != NEG_INF; ++sp) {
        const int64_t task = n * nsplit + sp;
        if (pl[task * G + j] == 0.0f) continue;
        const float w = std::exp(pm[task * G + j] - M);
        L += w * pl[task * G + j];
        const float* a = pacc + (task * G + j) * LV;
        for (int64_t k = 0; k < V.L; ++k) out[k] += w * a[k];
      }
      m_out[n * G + j] = M;
      l_out[n * G + j] = L;
    }
  }
  std::free(qp);
  std::free(pacc);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("run", &run, "fused decode attention over packed K/V (see walshkv.ops.attention_cpu)");
  mod.attr("vector_lanes") = VW;
}
"""

_CFLAGS_NATIVE = ["-O3", "-march=native", "-fopenmp", "-std=c++20"]
_CFLAGS_PORTABLE = ["-O3", "-fopenmp", "-std=c++20"]

_lock = threading.Lock()
_kernel: Any = None
_kernel_failed = False


def load_kernel() -> Any:
    """Compile (first use) or load the C++ kernel; ``None`` if no compiler works (warns once).

    Returns:
        The extension module (with a ``run`` function), or ``None``.
    """
    global _kernel, _kernel_failed
    if _kernel is not None or _kernel_failed:
        return _kernel
    with _lock:
        if _kernel is not None or _kernel_failed:
            return _kernel
        from torch.utils import cpp_extension

        errors = []
        for flags in (_CFLAGS_NATIVE, _CFLAGS_PORTABLE):
            tag = f"{_CPP_SOURCE}{flags}{platform.machine()}{torch.backends.cpu.get_cpu_capability()}"
            name = "walshkv_decode_attn_" + hashlib.sha256(tag.encode()).hexdigest()[:12]
            # without the implicit <torch/extension.h> (all of ATen) the build is much shorter
            lean = "no_implicit_headers" in inspect.signature(cpp_extension.load_inline).parameters
            try:
                _kernel = cpp_extension.load_inline(
                    name=name,
                    cpp_sources=[_CPP_SOURCE],
                    extra_cflags=flags,
                    extra_ldflags=["-fopenmp"],
                    verbose=False,
                    **({"no_implicit_headers": True} if lean else {}),
                )
                return _kernel
            except Exception as exc:  # no compiler, no ninja, a flag the compiler refuses, ...
                errors.append(f"{' '.join(flags)}: {type(exc).__name__}: {str(exc).strip()[-400:]}")
        _kernel_failed = True
        warnings.warn(
            "walshkv: could not build the fused CPU decode-attention kernel (a C++ compiler with OpenMP and "
            "ninja are needed), falling back to the pure-torch reference, which is slower. Install g++ "
            "(e.g. apt-get install g++) and ninja (pip install ninja) to enable it. Errors: " + " | ".join(errors),
            RuntimeWarning,
            stacklevel=2,
        )
        return None


def kernel_available() -> bool:
    """True if the C++ kernel is (or can be) built; builds it on the first call."""
    return load_kernel() is not None


def peel(codec: Codec) -> tuple[list[Rotated], Codec]:
    """Split a codec into its rotation wrappers (outermost first) and the codec that stores the codes.

    ``center+`` is dropped: its decode adds nothing back (the bias shifts every score of a query by the
    same amount, which softmax ignores), so the packed bytes decode exactly as its inner codec's.
    """
    rots: list[Rotated] = []
    while True:
        if isinstance(codec, Centered):
            codec = codec.inner
        elif isinstance(codec, Rotated):
            rots.append(codec)
            codec = codec.inner
        else:
            return rots, codec


def peel_equalizer(codec: Codec) -> tuple[torch.Tensor | None, Codec]:
    """Split off an ``eq+`` wrapper: ``(inverse, inner)``, or ``(None, codec)`` when there is none.

    ``center+eq+X`` stores ``X(A x)`` and decodes ``A⁻¹ X⁻¹(...)`` per kv head. Attention reads it as
    ``X``'s cache with the query multiplied by ``A⁻ᵀ`` once and the weighted V sum by ``A⁻¹`` once
    (``inverse`` is ``A⁻¹``, ``[kv_heads, head_dim, head_dim]``); ``center+`` goes too (see :func:`peel`).

    Raises:
        ValueError: an ``eq+`` codec that is not bound to a layer's transform.
    """
    inner = codec
    while isinstance(inner, Centered):
        inner = inner.inner
    if not isinstance(inner, Equalized):
        return None, codec
    inverse = inner.inverse
    if inverse is None:
        raise ValueError(f"{codec.spec} is not bound to a layer's transform; build it through CompressedCache")
    return inverse, inner.inner


def core_codec(codec: Codec) -> Codec:
    """The codec that stores the codes: ``codec`` without its ``center+``, ``eq+`` and rotation wrappers."""
    while isinstance(codec, (Centered, Equalized)):
        codec = codec.inner
    return peel(codec)[1]


@dataclass(frozen=True)
class _Format:
    """How the kernel reads one codec's rows: format id, code width, bytes per row, decoded length L.

    ``basis`` (``[head_dim, L]``, ``None`` = identity) maps a vector in the codec's own basis to the
    kernel's buffer order: buffer row ``b`` stands for the decoded vector ``b @ basis.T``.
    """

    fmt: int
    bits: int
    row_bytes: int
    length: int
    offset: int
    codes_field: str
    scale_field: str | None
    basis: torch.Tensor | None
    scales: int = 1  # fp16 scales per row
    bands: tuple[int, ...] = ()  # FMT_BANDED: (first byte, first buffer position, size, bits) per band
    # FMT_TQ: (field, first buffer position, size, bits, levels) per segment; levels float32, >= 32 entries
    segments: tuple[tuple[str, int, int, int, torch.Tensor], ...] = ()


_FORMATS: dict[tuple[str, str, int], _Format | None] = {}
_MAX_BANDS = 32  # keep in sync with MAX_BANDS in _CPP_SOURCE


def _position_basis(pos: torch.Tensor, length: int) -> torch.Tensor:
    """``[d, length]`` with a 1 at ``(i, pos[i])``: value ``i`` sits at buffer position ``pos[i]``."""
    basis = torch.zeros(pos.numel(), length)
    basis[torch.arange(pos.numel()), pos] = 1.0
    return basis


def _vht2_format(core: VHT2Codec, head_dim: int) -> _Format | None:
    """vht2: the kept coefficients band by band; the basis is the WHT followed by the codec's order."""
    try:
        core.check_head_dim(head_dim)
        bands = core.bands(head_dim)
        basis = core.coefficient_basis(head_dim)
    except ValueError:  # not bound yet (auto / variance without calibration), or a bad head_dim
        return None
    if not 1 <= len(bands) <= _MAX_BANDS:
        return None
    table: list[int] = []
    byte = start = 0
    for band in bands:
        table += [byte, start, band.size, band.bits]
        byte += band.nbytes
        start += band.size
    return _Format(_FMT_BANDED, 0, byte, start, 0, "codes", "scale", basis, len(bands), tuple(table))


def _tq_format(core: TurboQuant, head_dim: int) -> _Format | None:
    """tq: each segment's codes through its Lloyd-Max levels; the basis is the codec's inverse rotation."""
    try:
        core.check_head_dim(head_dim)
    except ValueError:
        return None
    segments = []
    for name, start, stop, bits in core.segments(head_dim):
        levels = core.quantizer(bits, head_dim).levels.to(torch.float32)
        padded = torch.zeros(max(32, levels.numel()))
        padded[: levels.numel()] = levels
        segments.append((name, start, stop - start, bits, padded))
    basis = core.unrotate(torch.eye(head_dim)).T.contiguous()  # column j: the vector buffer position j decodes to
    first = segments[0]
    row_bytes = packed_nbytes(first[2], first[3])
    return _Format(_FMT_TQ, 0, row_bytes, head_dim, 0, first[0], "norm", basis, segments=tuple(segments))


def cpu_format(core: Codec, head_dim: int) -> _Format | None:
    """How the kernel reads ``core``'s packed rows at ``head_dim``, or ``None`` if it cannot."""
    key = (type(core).__qualname__, core.spec, head_dim)
    if key in _FORMATS:
        return _FORMATS[key]
    fmt: _Format | None = None
    if type(core) is IntCodec and head_dim >= 1:
        bits = core.bits
        nb = packed_nbytes(head_dim, bits)
        qmax = (1 << (bits - 1)) - 1
        if bits == 8:
            fmt = _Format(_FMT_INT8, 8, nb, head_dim, qmax, "codes", "scale", None)
        elif bits in (2, 4):
            planes = 8 // bits
            i = torch.arange(head_dim)
            pos = (i % planes) * nb + i // planes
            kind = _FMT_INT4 if bits == 4 else _FMT_INT2
            fmt = _Format(kind, bits, nb, planes * nb, qmax, "codes", "scale", _position_basis(pos, planes * nb))
        else:
            fmt = _Format(_FMT_INT_GENERIC, bits, nb, head_dim, qmax, "codes", "scale", None)
    elif type(core) is GGMLCodec and core.name in ("q4_0", "q8_0") and head_dim >= QK and head_dim % QK == 0:
        kind = _FMT_Q4_0 if core.name == "q4_0" else _FMT_Q8_0
        nbytes = head_dim // QK * core.block_bytes
        fmt = _Format(kind, 4 if kind == _FMT_Q4_0 else 8, nbytes, head_dim, 0, "blocks", None, None)
    elif type(core) is VHT2Codec:
        fmt = _vht2_format(core, head_dim)
        if core._perm is not None:  # a calibrated (bound) codec: its spec names the layer, but do not cache
            return fmt
    elif type(core) is TurboQuant:
        fmt = _tq_format(core, head_dim)
    _FORMATS[key] = fmt
    return fmt


def cpu_supports(codec: Codec, head_dim: int) -> bool:
    """True if the fused kernel reads ``codec``'s packed rows (after peeling rotations and centering)."""
    return cpu_format(core_codec(codec), head_dim) is not None


@dataclass(frozen=True)
class CpuPlan:
    """Everything about a (K codec, V codec, head_dim, scale) that does not change between decode steps."""

    k: _Format
    v: _Format
    scale: float
    q_map: torch.Tensor | None  # [d, L_k]: scale, K's rotations and buffer order in one matmul (None: q * scale)
    out_map: torch.Tensor | None  # [L_v, d]: V's buffer order back and its unrotation (None: identity)


_PLANS: dict[tuple[Any, ...], tuple[CpuPlan | None, Codec, Codec]] = {}
_MAX_PLANS = 256


def _rotation_matrix(rots: list[Rotated], d: int, inverse: bool) -> torch.Tensor | None:
    """Row ``i`` = the chain applied to basis vector ``e_i`` (so ``x @ M`` applies it to ``x``)."""
    if not rots:
        return None
    m = torch.eye(d, dtype=torch.float32)
    for r in reversed(rots) if inverse else rots:
        m = r.unrotate(m) if inverse else r.rotate(m)
    return m


def _make_plan(k_codec: Codec, v_codec: Codec, d: int, scale: float) -> CpuPlan | None:
    k_rots, k_core = peel(k_codec)
    v_rots, v_core = peel(v_codec)
    fk, fv = cpu_format(k_core, d), cpu_format(v_core, d)
    if fk is None or fv is None:
        return None
    q_map = None
    rot_k = _rotation_matrix(k_rots, d, inverse=False)
    if rot_k is not None or fk.basis is not None:
        q_map = (rot_k if rot_k is not None else torch.eye(d)) @ (fk.basis if fk.basis is not None else torch.eye(d))
        q_map = q_map * scale
    out_map = None
    rot_v = _rotation_matrix(v_rots, d, inverse=True)
    if rot_v is not None or fv.basis is not None:
        basis_t = fv.basis.T if fv.basis is not None else torch.eye(d)
        out_map = basis_t @ (rot_v if rot_v is not None else torch.eye(d))
    return CpuPlan(fk, fv, scale, q_map, out_map)


def cpu_plan(k_codec: Codec, v_codec: Codec, head_dim: int, scale: float) -> CpuPlan | None:
    """The kernel's cached per-(codecs, head_dim, scale) setup, or ``None`` if it cannot read a codec."""
    key: tuple[Any, ...] = (type(k_codec).__qualname__, k_codec.spec, type(v_codec).__qualname__, v_codec.spec)
    key += (head_dim, scale)
    if _calibrated(k_codec) or _calibrated(v_codec):
        # a calibrated codec's spec does not identify its statistics: key on the objects themselves (the
        # entry keeps them alive, so their ids cannot be reused while it exists)
        key += (id(k_codec), id(v_codec))
    if key in _PLANS:
        return _PLANS[key][0]
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    plan = _make_plan(k_codec, v_codec, head_dim, scale)
    _PLANS[key] = (plan, k_codec, v_codec)
    return plan


def _calibrated(codec: Codec) -> bool:
    core = peel(codec)[1]
    return isinstance(core, VHT2Codec) and core._perm is not None


def _desc(packed: Packed, f: _Format, head_dim: int, what: str) -> tuple[list[int], list[torch.Tensor]]:
    """Pointer/stride/format list for the kernel, and the tensors that must stay alive during the call."""
    first = _codes_field(packed, f.codes_field, f.row_bytes, head_dim, what)
    codes, ptr, st, end = first
    shape = codes.shape
    keep: list[torch.Tensor] = [codes]
    scale_ptr, s0, s1, s2 = 0, 0, 0, 0
    if f.scale_field is not None:
        scale = packed.tensors.get(f.scale_field)
        if scale is None or scale.dtype != torch.float16 or scale.shape != (*shape[:3], f.scales):
            raise ValueError(f"packed {what} field {f.scale_field!r} must be float16 [batch, heads, seq, {f.scales}]")
        if scale.stride(3) != 1:
            scale = scale.contiguous()
        keep.append(scale)
        scale_ptr = scale.data_ptr()
        s0, s1, s2, _ = scale.stride()
        s0, s1, s2 = 2 * s0, 2 * s1, 2 * s2
    desc = [ptr, st[0], st[1], st[2], scale_ptr, s0, s1, s2, f.fmt, f.bits, f.row_bytes, head_dim, f.length]
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


def fused_decode_cpu(
    q: torch.Tensor, plan: CpuPlan, packed_k: Packed, packed_v: Packed
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Unnormalised attention of one query step over packed K/V, with the C++ kernel.

    Rotation wrappers are applied to the query (once) and to the output (once), never to the cache.

    Args:
        q: float32 ``[batch, kv_heads, group, head_dim]``, unscaled, in the model's basis.
        plan: :func:`cpu_plan` of the K and V codecs at this head_dim and softmax scale.
        packed_k, packed_v: CPU fields ``[batch, kv_heads, seq_len, ...]`` written by those codecs.

    Returns:
        ``(m, l, acc)``: running max ``[batch, kv_heads, group]`` of the scaled scores, softmax denominator
        (same shape) and unnormalised weighted V sum ``[batch, kv_heads, group, head_dim]`` in the model's
        basis, all float32; ``None`` if the kernel cannot be built (the caller falls back to the reference).
    """
    kernel = load_kernel()
    if kernel is None:
        return None
    b, h, g, d = q.shape
    kdesc, keep_k = _desc(packed_k, plan.k, d, "K")
    vdesc, keep_v = _desc(packed_v, plan.v, d, "V")
    qb = (q @ plan.q_map if plan.q_map is not None else q * plan.scale).contiguous()
    m = torch.empty(b, h, g)
    l_sum = torch.empty(b, h, g)
    acc = torch.empty(b, h, g, plan.v.length)
    t = packed_k.seq_len
    threads = torch.get_num_threads()
    nsplit = 1 if threads <= 1 else max(1, min(math.ceil(4 * threads / (b * h)), math.ceil(t / _MIN_SPLIT_TOKENS)))
    kernel.run(kdesc, vdesc, qb.data_ptr(), m.data_ptr(), l_sum.data_ptr(), acc.data_ptr(), b, h, g, t, nsplit, threads)
    del keep_k, keep_v
    if plan.out_map is not None:
        acc = acc @ plan.out_map
    return m, l_sum, acc
