// walshkv's CPU kernel (a header of cpu_kernel.cpp): a tile of packed rows to floats, per format. decode_row (intB,
// q4_0, q8_0, iq4_nl, vht2's bands) and decode_tile_tq (tq's segments through their level tables) write rows in the
// kernel's buffer order with a row factor each; tile_fn picks the decoder of a format. With AMX, tq rows of at most 4
// bits also go straight to the bf16 hi and lo parts the AMX key map reads (decode_tile_tq_pairs).
#pragma once

#include "cpu_kernel_formats.h"
#include "cpu_kernel_simd.h"
#include "cpu_kernel_unpack.h"

// kvalues_iq4nl of ggml-common.h, zero padded to 32 (whole-vector permutes).
alignas(64) static constexpr float IQ4NL_LEVELS[32] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                       1,    13,   25,  38,  53,  69,  89,  113};

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
  } else if constexpr (FMT == FMT_IQ4_NL) {  // as q4_0, each nibble through the non-linear grid
    const int nblk = s.d / 32;
    for (int k = 0; k < nblk; ++k) {
      const uint8_t* __restrict blk = row + k * 18;
      const float dd = h2f(blk);
      float* __restrict dst = buf + k * 32;
      unpack_planes<4>(blk + 2, 16, 0.0f, dst);
      lookup_levels(dst, 32, IQ4NL_LEVELS, 4);
      for (int j = 0; j < 32; ++j) dst[j] *= dd;
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

// nt rows (stride st bytes) of one tq segment's B-bit codes to their levels, into rows of ld floats from dst.
template <int BITS>
static void tq_segment_rows(const uint8_t* __restrict r, int64_t st, int nt, int n, const uint8_t* end,
                            const float* __restrict lv, float* __restrict dst, int64_t ld) {
  for (int i = 0; i < nt; ++i) {
    if (unpack_levels<BITS>(r + i * st, n, end, lv, dst + i * ld)) continue;  // codes to levels in one pass
    unpack_generic<BITS>(r + i * st, n, 0.0f, end, dst + i * ld);
    lookup_levels(dst + i * ld, n, lv, BITS);
  }
}

// tq: each segment's codes (own tensor and strides) unpacked to its buffer positions, then replaced by
// their Lloyd-Max levels; the row factor is norm / sqrt(d).
static void decode_tile_tq(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                           float* rs) {
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  for (int g = 0; g < s.nseg; ++g) {  // segment by segment: its bit width and pointers set once per tile
    const uint8_t* r = s.seg_codes[g] + b * s.seg_s0[g] + h * s.seg_s1[g] + t * s.seg_s2[g];
    const int64_t st = s.seg_s2[g];
    const int n = s.seg_size[g];
    const uint8_t* end = s.seg_end[g];
    const float* lv = s.seg_levels[g];
    float* dst = tile + s.seg_start[g];
    switch (s.seg_bits[g]) {
      case 1: tq_segment_rows<1>(r, st, nt, n, end, lv, dst, ld); break;
      case 2: tq_segment_rows<2>(r, st, nt, n, end, lv, dst, ld); break;
      case 3: tq_segment_rows<3>(r, st, nt, n, end, lv, dst, ld); break;
      case 4: tq_segment_rows<4>(r, st, nt, n, end, lv, dst, ld); break;
      case 5: tq_segment_rows<5>(r, st, nt, n, end, lv, dst, ld); break;
      case 6: tq_segment_rows<6>(r, st, nt, n, end, lv, dst, ld); break;
      case 7: tq_segment_rows<7>(r, st, nt, n, end, lv, dst, ld); break;
      default: tq_segment_rows<8>(r, st, nt, n, end, lv, dst, ld); break;
    }
  }
  for (int i = 0; i < nt; ++i) rs[i] = row_norm(s, sc + i * s.ss2) * s.row_mul;
}

// tcq: one row whose codes sit (as floats) at their buffer positions 0..L-1 to its trellis values, in place: each
// value's state from the codes that end at it (the stream wraps: ext holds the last taps-1 codes before code 0),
// then one table lookup (a gather) per value.
static inline void tcq_row(const Src& s, float* __restrict row) {
  const int L = s.L, P = s.tcq_taps - 1;
  alignas(64) int32_t ext[MAX_TCQ_D + MAX_TCQ_TAPS];
  for (int i = 0; i < L; ++i) ext[P + i] = (int32_t)row[i];
  for (int j = 0; j < P; ++j) ext[j] = ext[L + j];  // code L - P + j
  const int32_t* sh = s.tcq_shift;
  const float* tab = s.tcq_table;
  int i = 0;
#if defined(__AVX512F__)
  const __m512i m = _mm512_set1_epi32((int)s.tcq_mask);
  for (; i + 16 <= L; i += 16) {
    __m512i st = _mm512_setzero_si512();
    for (int t = 0; t <= P; ++t)
      st = _mm512_or_si512(st, _mm512_sllv_epi32(_mm512_loadu_si512(ext + P + i - t), _mm512_loadu_si512(sh + t * L + i)));
    _mm512_storeu_ps(row + i, _mm512_i32gather_ps(_mm512_and_si512(st, m), tab, 4));
  }
#elif defined(__AVX2__)
  const __m256i m = _mm256_set1_epi32((int)s.tcq_mask);
  for (; i + 8 <= L; i += 8) {
    __m256i st = _mm256_setzero_si256();
    for (int t = 0; t <= P; ++t)
      st = _mm256_or_si256(st, _mm256_sllv_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ext + P + i - t)),
                                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sh + t * L + i))));
    _mm256_storeu_ps(row + i, _mm256_i32gather_ps(tab, _mm256_and_si256(st, m), 4));
  }
#endif
  for (; i < L; ++i) {
    uint32_t st = 0;
    for (int t = 0; t <= P; ++t) {
      const int32_t k = sh[t * L + i];
      if (k < 32) st |= (uint32_t)ext[P + i - t] << k;
    }
    row[i] = tab[st & s.tcq_mask];
  }
}

#if WK_TCQ_VBMI
// 256-entry float32 lookup of 64 byte indices from the table's four byte planes (pl: 16 registers, 4 per plane): two
// 128-entry byte permutes per plane and a blend on the index's top bit, then byte and word unpacks put the four
// bytes of each float together. Out f[g] lane l element j is the value of index lane 16l + 4g + j (TcqVbmi's order).
static inline void tcq_vbmi_lookup(__m512i x, const __m512i* pl, __m512i* f) {
  const __mmask64 top = _mm512_movepi8_mask(x);
  __m512i p[4];
  for (int q = 0; q < 4; ++q)
    p[q] = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(pl[4 * q], x, pl[4 * q + 1]),
                                  _mm512_permutex2var_epi8(pl[4 * q + 2], x, pl[4 * q + 3]));
  const __m512i a = _mm512_unpacklo_epi8(p[0], p[1]), b = _mm512_unpackhi_epi8(p[0], p[1]);
  const __m512i c = _mm512_unpacklo_epi8(p[2], p[3]), d = _mm512_unpackhi_epi8(p[2], p[3]);
  f[0] = _mm512_unpacklo_epi16(a, c);
  f[1] = _mm512_unpackhi_epi16(a, c);
  f[2] = _mm512_unpacklo_epi16(b, d);
  f[3] = _mm512_unpackhi_epi16(b, d);
}

// The same lookup from the two high byte planes (pl[8..15]) of a table whose values' low 16 bits are all zero
// (TcqVbmi::hi16, a bfloat16 set): half the permutes and blends, and the low bytes of each float are zeros.
static inline void tcq_vbmi_lookup_hi16(__m512i x, const __m512i* pl, __m512i* f) {
  const __mmask64 top = _mm512_movepi8_mask(x);
  const __m512i p2 = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(pl[8], x, pl[9]),
                                            _mm512_permutex2var_epi8(pl[10], x, pl[11]));
  const __m512i p3 = _mm512_mask_blend_epi8(top, _mm512_permutex2var_epi8(pl[12], x, pl[13]),
                                            _mm512_permutex2var_epi8(pl[14], x, pl[15]));
  const __m512i z = _mm512_setzero_si512();
  const __m512i c = _mm512_unpacklo_epi8(p2, p3), d = _mm512_unpackhi_epi8(p2, p3);
  f[0] = _mm512_unpacklo_epi16(z, c);
  f[1] = _mm512_unpackhi_epi16(z, c);
  f[2] = _mm512_unpacklo_epi16(z, d);
  f[3] = _mm512_unpackhi_epi16(z, d);
}

// Byte mask of the first n (0 .. 64) bytes.
static inline __mmask64 first_bytes(int n) { return n >= 64 ? ~0ULL : n <= 0 ? 0ULL : (1ULL << n) - 1; }

// tcq with VBMI (TcqVbmi): per row the two segments in two registers (WIDE: four, two per segment; masked loads:
// nothing read past a segment), per chunk of 64 values each state as the OR over taps of (byte permute, multishift,
// mask), then the table lookup (HI16: from the two high byte planes of a bfloat16 set).
template <bool WIDE, bool HI16>
static void decode_tile_tcq_vbmi_t(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                                   float* rs) {
  const TcqVbmi& v = s.tcq_vbmi;
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  const int g1 = s.nseg > 1 ? 1 : 0;
  const uint8_t* r0 = s.seg_codes[0] + b * s.seg_s0[0] + h * s.seg_s1[0] + t * s.seg_s2[0];
  const uint8_t* r1 = s.seg_codes[g1] + b * s.seg_s0[g1] + h * s.seg_s1[g1] + t * s.seg_s2[g1];
  const int64_t st0 = s.seg_s2[0], st1 = s.seg_s2[g1];
  const __mmask64 m0 = first_bytes(v.bytes0), m1 = first_bytes(v.bytes1);
  const __mmask64 m0h = first_bytes(v.bytes0 - 64), m1h = first_bytes(v.bytes1 - 64);  // WIDE: the second halves
  __m512i pl[16];
  for (int q = 0; q < 16; ++q) pl[q] = _mm512_load_si512(v.planes[q / 4] + 64 * (q % 4));
  for (int i = 0; i < nt; ++i) {
    const uint8_t* a0 = r0 + i * st0;
    const uint8_t* a1 = r1 + i * st1;
    const __m512i A = _mm512_maskz_loadu_epi8(m0, a0), B = _mm512_maskz_loadu_epi8(m1, a1);
    __m512i A2 = _mm512_setzero_si512(), B2 = _mm512_setzero_si512();
    if (WIDE) {
      if (m0h) A2 = _mm512_maskz_loadu_epi8(m0h, a0 + 64);
      if (m1h) B2 = _mm512_maskz_loadu_epi8(m1h, a1 + 64);
    }
    float* row = tile + i * ld;
    for (int c = 0; c < v.nchunks; ++c) {
      __m512i x = _mm512_setzero_si512();
      for (int k = 0; k < v.taps; ++k) {
        const __m512i ix = _mm512_load_si512(v.idx[c][k]);
        __m512i w;
        if (WIDE) {  // index bit 7: segment 1's registers; bits 0-6: a byte of that segment's two
          w = _mm512_mask_blend_epi8(_mm512_movepi8_mask(ix), _mm512_permutex2var_epi8(A, ix, A2),
                                     _mm512_permutex2var_epi8(B, ix, B2));
        } else {
          w = _mm512_permutex2var_epi8(A, ix, B);
        }
        x = _mm512_ternarylogic_epi64(x, _mm512_multishift_epi64_epi8(_mm512_load_si512(v.ctrl[c][k]), w),
                                      _mm512_load_si512(v.mask[c][k]), 0xF8);  // x | (w & mask)
      }
      __m512i f[4];
      if (HI16) {
        tcq_vbmi_lookup_hi16(x, pl, f);
      } else {
        tcq_vbmi_lookup(x, pl, f);
      }
      for (int g = 0; g < 4; ++g) {
        const int at = 64 * c + 16 * g;
        if (at + 16 <= s.L) {
          _mm512_storeu_ps(row + at, _mm512_castsi512_ps(f[g]));
        } else if (at < s.L) {
          _mm512_mask_storeu_ps(row + at, (__mmask16)((1u << (s.L - at)) - 1u), _mm512_castsi512_ps(f[g]));
        }
      }
    }
    rs[i] = row_norm(s, sc + i * s.ss2) * s.row_mul;
  }
}

static void decode_tile_tcq_vbmi(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                                 float* rs) {
  const bool wide = s.tcq_vbmi.wide, hi16 = s.tcq_vbmi.hi16;
  if (wide && hi16) {
    decode_tile_tcq_vbmi_t<true, true>(s, b, h, t, nt, tile, ld, rs);
  } else if (wide) {
    decode_tile_tcq_vbmi_t<true, false>(s, b, h, t, nt, tile, ld, rs);
  } else if (hi16) {
    decode_tile_tcq_vbmi_t<false, true>(s, b, h, t, nt, tile, ld, rs);
  } else {
    decode_tile_tcq_vbmi_t<false, false>(s, b, h, t, nt, tile, ld, rs);
  }
}
#endif

#if defined(__AVX2__)
// tcq with AVX2 (TcqAvx2): per row the padded stream in a buffer, per 8 values each state as the OR over taps of (byte
// shuffle of the chunk's 16 broadcast bytes, per-lane shift, mask), then one gather from the table (a split table:
// its two parts by register permutes and a blend each, then their sum).
template <bool SPLIT>
static void decode_tile_tcq_avx2_t(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                                   float* rs) {
  const TcqAvx2& v = *s.tcq_avx2;
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  const int g1 = s.nseg > 1 ? 1 : 0;
  const uint8_t* r0 = s.seg_codes[0] + b * s.seg_s0[0] + h * s.seg_s1[0] + t * s.seg_s2[0];
  const uint8_t* r1 = s.seg_codes[g1] + b * s.seg_s0[g1] + h * s.seg_s1[g1] + t * s.seg_s2[g1];
  const int64_t st0 = s.seg_s2[0], st1 = s.seg_s2[g1];
  // two padded streams (8 + at most 8 bits per value, and slack): row i + 1's is written while row i's is read, so
  // that no window load waits on the stores that just wrote it (a load spanning two stores is not forwarded)
  alignas(32) uint8_t buf[2][8 + MAX_TCQ_D + 64] = {};
  const float* tab = s.tcq_table;
  // a split table (tcq_parts): P[s & 15] + Q[s >> 4], each half of P and Q in a register; a permute reads an index's
  // low 3 bits, and a blend on bit 3 (shifted to the sign) picks the half, so the sum is the table's float32 entry
  const float* parts = SPLIT ? s.tcq_parts : tab;  // unused without a split
  const __m256 p0 = _mm256_loadu_ps(parts), p1 = SPLIT ? _mm256_loadu_ps(parts + 8) : p0;
  const __m256 q0 = SPLIT ? _mm256_loadu_ps(parts + 16) : p0, q1 = SPLIT ? _mm256_loadu_ps(parts + 24) : p0;
  // whole 32-byte copies where the segment's row and 32 bytes after it lie inside its tensor (the slack of buf takes
  // what spills past the row; the next copy overwrites it), else exact copies
  const bool wide0 = v.bytes0 <= 32 && r0 + (nt - 1) * st0 + 32 <= s.seg_end[0];
  const bool wide1 = v.bytes1 <= 32 && r1 + (nt - 1) * st1 + 32 <= s.seg_end[g1];
  auto fill = [&](int i, uint8_t* dst) {
    const uint8_t* a0 = r0 + i * st0;
    const uint8_t* a1 = r1 + i * st1;
    if (wide0) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a0)));
    } else {
      std::memcpy(dst + 8, a0, v.bytes0);
    }
    if (v.bytes1) {
      if (wide1) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 8 + v.bytes0),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a1)));
      } else {
        std::memcpy(dst + 8 + v.bytes0, a1, v.bytes1);
      }
    }
    for (int p = 0; p < 8; ++p) dst[p] = v.pad[p] < v.bytes0 ? a0[v.pad[p]] : a1[v.pad[p] - v.bytes0];  // the wrap
  };
  if (nt > 0) fill(0, buf[0]);
  for (int i = 0; i < nt; ++i) {
    if (i + 1 < nt) fill(i + 1, buf[(i + 1) & 1]);
    const uint8_t* cur = buf[i & 1];
    float* row = tile + i * ld;
    for (int c = 0; c < v.nchunks; ++c) {
      const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cur + v.base[c])));
      __m256i x = _mm256_setzero_si256();
      for (int k = 0; k < v.taps; ++k) {
        const __m256i f = _mm256_shuffle_epi8(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(v.ctl[c][k])));
        x = _mm256_or_si256(x, _mm256_and_si256(_mm256_srlv_epi32(f, _mm256_load_si256(
                                                                      reinterpret_cast<const __m256i*>(v.shr[c][k]))),
                                                _mm256_load_si256(reinterpret_cast<const __m256i*>(v.mask[c][k]))));
      }
      if constexpr (SPLIT) {
        const __m256i hi = _mm256_srli_epi32(x, 4);
        const __m256 p = _mm256_blendv_ps(_mm256_permutevar8x32_ps(p0, x), _mm256_permutevar8x32_ps(p1, x),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(x, 28)));
        const __m256 q = _mm256_blendv_ps(_mm256_permutevar8x32_ps(q0, hi), _mm256_permutevar8x32_ps(q1, hi),
                                          _mm256_castsi256_ps(_mm256_slli_epi32(x, 24)));
        _mm256_storeu_ps(row + 8 * c, _mm256_add_ps(p, q));
      } else {
        _mm256_storeu_ps(row + 8 * c, _mm256_i32gather_ps(tab, x, 4));
      }
    }
    rs[i] = row_norm(s, sc + i * s.ss2) * s.row_mul;
  }
}

static void decode_tile_tcq_avx2(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                                 float* rs) {
  if (s.tcq_parts) {
    decode_tile_tcq_avx2_t<true>(s, b, h, t, nt, tile, ld, rs);
  } else {
    decode_tile_tcq_avx2_t<false>(s, b, h, t, nt, tile, ld, rs);
  }
}
#endif

// tcq: tq's segments unpacked to their buffer positions as codes, then each row through its trellis; the row factor
// is norm / sqrt(d), as tq's.
static void decode_tile_tcq(const Src& s, int64_t b, int64_t h, int64_t t, int nt, float* tile, int64_t ld,
                            float* rs) {
#if WK_TCQ_VBMI
  if (s.tcq_vbmi.ok) return decode_tile_tcq_vbmi(s, b, h, t, nt, tile, ld, rs);
#endif
#if defined(__AVX2__)
  if (s.tcq_avx2) return decode_tile_tcq_avx2(s, b, h, t, nt, tile, ld, rs);
#endif
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  for (int g = 0; g < s.nseg; ++g) {
    const uint8_t* r = s.seg_codes[g] + b * s.seg_s0[g] + h * s.seg_s1[g] + t * s.seg_s2[g];
    const int64_t st = s.seg_s2[g];
    const int n = s.seg_size[g];
    const uint8_t* end = s.seg_end[g];
    float* dst = tile + s.seg_start[g];
    for (int i = 0; i < nt; ++i) {
      switch (s.seg_bits[g]) {
        case 1: unpack_generic<1>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 2: unpack_generic<2>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 3: unpack_generic<3>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 4: unpack_generic<4>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 5: unpack_generic<5>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 6: unpack_generic<6>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        case 7: unpack_generic<7>(r + i * st, n, 0.0f, end, dst + i * ld); break;
        default: unpack_generic<8>(r + i * st, n, 0.0f, end, dst + i * ld); break;
      }
    }
  }
  for (int i = 0; i < nt; ++i) {
    tcq_row(s, tile + i * ld);
    rs[i] = row_norm(s, sc + i * s.ss2) * s.row_mul;
  }
}

#if WK_AMX
// B-bit codes (B <= 4) of one tq segment straight to the bf16 hi and lo parts of their levels (the AMX key map's
// split of each decoded row, the same bits as converting the float levels): a lane permute of the integer codes
// over a table of (hi | lo << 16), two narrowing stores; no float row written and read back.
template <int BITS>
static inline void unpack_pairs(const uint8_t* __restrict row, int n, const uint8_t* end,
                                const int32_t* __restrict pairs, uint16_t* __restrict hi, uint16_t* __restrict lo) {
  const __m512i tab = _mm512_load_si512(pairs);  // codes of <= 4 bits index the first 16 entries
  int i = code_groups16<BITS>(row, n, end, [&](int j, __m512i w) {
    const __m512i pr = _mm512_permutexvar_epi32(w, tab);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + j), _mm512_cvtepi32_epi16(pr));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + j), _mm512_cvtepi32_epi16(_mm512_srli_epi32(pr, 16)));
  });
  for (; i < n; ++i) {  // the codes after the last whole group, one at a time
    const uint32_t pr = (uint32_t)pairs[code_at<BITS>(row, i)];
    hi[i] = (uint16_t)(pr & 0xFFFFu);
    lo[i] = (uint16_t)(pr >> 16);
  }
}

// Whether tq rows can go straight to bf16 parts (every segment of at most 4 bits).
static bool tq_pairs_ok(const Src& s) {
  if (s.fmt != FMT_TQ) return false;
  for (int g = 0; g < s.nseg; ++g)
    if (s.seg_bits[g] > 4) return false;
  return true;
}

// tq rows t..t+nt-1 straight to the AMX map's scratch (ahi, alo: [TILE][Lp], positions L..Lp-1 stay zero), their
// row factors (norm / sqrt(d)) in rs, as decode_tile_tq gives them.
template <int BITS>
static void tq_segment_pairs(const uint8_t* __restrict r, int64_t st, int nt, int n, const uint8_t* end,
                             const int32_t* __restrict pairs, uint16_t* __restrict hi, uint16_t* __restrict lo, int Lp) {
  for (int i = 0; i < nt; ++i) unpack_pairs<BITS>(r + i * st, n, end, pairs, hi + i * Lp, lo + i * Lp);
}

static void decode_tile_tq_pairs(const Src& s, int64_t b, int64_t h, int64_t t, int nt, uint16_t* ahi, uint16_t* alo,
                                 int Lp, float* rs) {
  const uint8_t* sc = s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2;
  for (int g = 0; g < s.nseg; ++g) {  // segment by segment, as decode_tile_tq
    const uint8_t* r = s.seg_codes[g] + b * s.seg_s0[g] + h * s.seg_s1[g] + t * s.seg_s2[g];
    const int64_t st = s.seg_s2[g];
    const int n = s.seg_size[g];
    uint16_t* hi = ahi + s.seg_start[g];
    uint16_t* lo = alo + s.seg_start[g];
    switch (s.seg_bits[g]) {
      case 1: tq_segment_pairs<1>(r, st, nt, n, s.seg_end[g], s.seg_pairs[g], hi, lo, Lp); break;
      case 2: tq_segment_pairs<2>(r, st, nt, n, s.seg_end[g], s.seg_pairs[g], hi, lo, Lp); break;
      case 3: tq_segment_pairs<3>(r, st, nt, n, s.seg_end[g], s.seg_pairs[g], hi, lo, Lp); break;
      default: tq_segment_pairs<4>(r, st, nt, n, s.seg_end[g], s.seg_pairs[g], hi, lo, Lp); break;
    }
  }
  for (int i = 0; i < nt; ++i) rs[i] = row_norm(s, sc + i * s.ss2) * s.row_mul;
}
#endif

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
    case FMT_TCQ: return decode_tile_tcq;
    case FMT_IQ4_NL: return decode_tile<FMT_IQ4_NL>;
  }
  throw std::invalid_argument("walshkv decode attention: unknown packed format");
}
