// walshkv's CPU kernel (a header of cpu_kernel.cpp): LSB-first code streams to floats, whatever codec wrote them. Bit
// fields of bytes to planes (2 and 4 bits), bytes widened (8 bits), groups of B-bit codes by one byte shuffle and
// per-lane shifts (any B in 1..8; AVX-512 VBMI, AVX-512BW, AVX2, scalar tails), and codes to their Lloyd-Max levels
// (lane permutes or gathers).
#pragma once

#include "cpu_kernel_simd.h"

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

// Code i of a B-bit LSB-first row (B <= 8).
template <int BITS>
static inline unsigned code_at(const uint8_t* __restrict row, int i) {
  const int bp = i * BITS;
  unsigned v = row[bp >> 3];
  if (((bp & 7) + BITS) > 8) v |= (unsigned)row[(bp >> 3) + 1] << 8;  // the code spills into the next byte
  return (v >> (bp & 7)) & ((1u << BITS) - 1u);
}

#if defined(__AVX2__) || defined(__AVX512BW__)
// The 16 bytes from p, whose first gb hold a group of codes, never read past end (one past the tensor's last byte):
// near the end they come through a zero-padded copy.
static inline __m128i group_bytes(const uint8_t* p, const uint8_t* end, int gb) {
  if (p + 16 <= end) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  uint8_t tmp[16] = {0};
  std::memcpy(tmp, p, gb);
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(tmp));
}
#endif

#if defined(__AVX512BW__)
// The whole groups of 16 B-bit LSB-first codes of a row, each as 16 int32 lanes handed to f(first code, lanes): one
// byte shuffle, one per-lane shift and a mask per group. Returns the first code after the last whole group.
template <int BITS, class F>
static inline int code_groups16(const uint8_t* __restrict row, int n, const uint8_t* end, F&& f) {
  constexpr uint32_t M = (1u << BITS) - 1u;
  constexpr int GR = 16, GB = GR * BITS / 8;
  alignas(64) static constexpr std::array<int8_t, 64> ctl = generic_shuffle<BITS, 16>();
  alignas(64) static constexpr std::array<int32_t, 16> shl = generic_shifts<BITS, 16>();
  const __m512i c = _mm512_load_si512(ctl.data()), sh = _mm512_load_si512(shl.data());
  const __m512i m = _mm512_set1_epi32((int)M);
  int i = 0;
  for (; i + GR <= n; i += GR) {
    const __m128i x = group_bytes(row + i / GR * GB, end, GB);
    f(i, _mm512_and_si512(_mm512_srlv_epi32(_mm512_shuffle_epi8(_mm512_broadcast_i32x4(x), c), sh), m));
  }
  return i;
}
#endif

// B in 1..8 (used for 3, 5, 6, 7 and for vht2 bands): groups of GR codes (GR * B / 8 bytes) with one
// byte shuffle + variable shift; the codes after the last whole group bit by bit.
template <int BITS>
static inline void unpack_generic(const uint8_t* __restrict row, int d, float off, const uint8_t* end,
                                  float* __restrict buf) {
  [[maybe_unused]] constexpr uint32_t M = (1u << BITS) - 1u;  // the SIMD paths' mask
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
    for (; i + GR <= d; i += GR) {
      const uint8_t* p = row + i / GR * GB;
      const __m128i x = group_bytes(p, end, GB);
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
    for (; i + GR <= d; i += GR) {
      const uint8_t* p = row + i / GR * GB;
      const __m128i x = group_bytes(p, end, GB);
      const __m256i y = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), c);
      const __m256i w = _mm256_and_si256(_mm256_srlv_epi32(y, sh), m);
      _mm256_storeu_ps(buf + i, _mm256_sub_ps(_mm256_cvtepi32_ps(w), o));
    }
  }
#else
  (void)end;
#endif
  for (; i < d; ++i) buf[i] = (float)code_at<BITS>(row, i) - off;
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
  if (bits <= 4) {  // 8 or 16 levels in one or two registers: lane permutes (and a blend on bit 3), no gather
    const __m256 l0 = _mm256_loadu_ps(lv), l1 = _mm256_loadu_ps(lv + 8);
    for (; j + 8 <= n; j += 8) {
      const __m256i idx = _mm256_cvttps_epi32(_mm256_loadu_ps(buf + j));
      const __m256 lo = _mm256_permutevar8x32_ps(l0, idx);
      if (bits <= 3) {
        _mm256_storeu_ps(buf + j, lo);
      } else {
        const __m256 hi = _mm256_permutevar8x32_ps(l1, idx);
        _mm256_storeu_ps(buf + j, _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28))));
      }
    }
  }
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(buf + j, _mm256_i32gather_ps(lv, _mm256_cvttps_epi32(_mm256_loadu_ps(buf + j)), 4));
#endif
  for (; j < n; ++j) buf[j] = lv[(int)buf[j]];
}

// Codes i..n-1 of a B-bit LSB-first row to their levels, one at a time (the part after the last whole group).
template <int BITS>
static inline void levels_tail(const uint8_t* __restrict row, int i, int n, const float* __restrict lv,
                               float* __restrict buf) {
  for (; i < n; ++i) buf[i] = lv[code_at<BITS>(row, i)];
}

// B-bit codes (B <= 4) straight to their levels lv[c], as unpack_generic's groups then a lane permute on the
// integer codes (no round trip through float); false where this ISA has no such path (the caller falls back).
template <int BITS>
static inline bool unpack_levels(const uint8_t* __restrict row, int n, const uint8_t* end, const float* __restrict lv,
                                 float* __restrict buf) {
#if defined(__AVX2__) && !defined(__AVX512BW__)
  if constexpr (BITS <= 4) {
    constexpr uint32_t M = (1u << BITS) - 1u;
    constexpr int GR = 8, GB = BITS;
    alignas(32) static constexpr std::array<int8_t, 32> ctl = generic_shuffle<BITS, 8>();
    alignas(32) static constexpr std::array<int32_t, 8> shl = generic_shifts<BITS, 8>();
    const __m256i c = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl.data()));
    const __m256i sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(shl.data()));
    const __m256i m = _mm256_set1_epi32((int)M);
    const __m256 l0 = _mm256_loadu_ps(lv), l1 = _mm256_loadu_ps(lv + 8);
    int i = 0;
    for (; i + GR <= n; i += GR) {
      const uint8_t* p = row + i / GR * GB;
      const __m128i x = group_bytes(p, end, GB);
      const __m256i w = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_broadcastsi128_si256(x), c), sh), m);
      __m256 y = _mm256_permutevar8x32_ps(l0, w);
      if constexpr (BITS == 4)
        y = _mm256_blendv_ps(y, _mm256_permutevar8x32_ps(l1, w), _mm256_castsi256_ps(_mm256_slli_epi32(w, 28)));
      _mm256_storeu_ps(buf + i, y);
    }
    levels_tail<BITS>(row, i, n, lv, buf);
    return true;
  }
#elif defined(__AVX512BW__)
  if constexpr (BITS <= 4) {
    const __m512 l0 = _mm512_loadu_ps(lv);
    const int i = code_groups16<BITS>(row, n, end, [&](int j, __m512i w) {
      _mm512_storeu_ps(buf + j, _mm512_permutexvar_ps(w, l0));
    });
    levels_tail<BITS>(row, i, n, lv, buf);
    return true;
  }
#endif
  (void)row, (void)n, (void)end, (void)lv, (void)buf;
  return false;
}
