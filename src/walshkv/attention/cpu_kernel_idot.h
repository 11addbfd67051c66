// walshkv's CPU kernel (a header of cpu_kernel.cpp): 4-bit K codes (int4, q4_0) scored against an integer query without
// a float K row. The query is split into three int8 parts and the codes' byte dot products with them are summed exactly
// in int32 (AVX512-VNNI / AVX-VNNI vpdpbusd, else vpmaddubsw + vpmaddwd); WK_IDOT is 0 where the target has neither
// AVX-512BW nor AVX2, and then idot_chunks says 0 (the float path).
#pragma once

#include "cpu_kernel_formats.h"
#include "cpu_kernel_simd.h"
#include "cpu_kernel_unpack.h"

// ---- 4-bit K codes against an integer query (int4, q4_0): scores without a float K row ----
// The scaled query x of each head is split into three int8 parts, x ~ s (q1 + q2 / 128 + q3 / 16384) with
// s = max|x| / 127 (|q1| <= 127, |q2|, |q3| <= 64; the split's error is below 2^-14 s: float32 rounding's size, not
// bf16's), and the codes' dot products with the parts are summed exactly in int32 by byte dot products
// (AVX512-VNNI vpdpbusd; AVX2 and AVX-512BW without VNNI: vpmaddubsw + vpmaddwd, exact here as 2 * 15 * 127 < 2^15)
// in Horner form ((c.q1) * 128 + c.q2) * 128 + c.q3: per int32 lane at most 4 * 15 * 2^21 per code vector, so
// up to IDOT_MAXCH vectors stay below 2^31. The codes' offset (int4's qmax, q4_0's 8) is taken off with the
// query's own lane sums, an exact integer, so a score's only roundings are the query's split and one float
// conversion per lane (and q4_0's block scale). Codes are read as bytes, 64 per AVX-512 vector (32 on AVX2):
// int4's row of nb bytes holds buffer positions k (low nibble) and nb + k (high); a vector takes VW * 2 bytes
// [lows | highs]. q4_0: a vector per 32 * VW / 8 values (two blocks on AVX-512, one on AVX2), in value order.
#if (defined(__AVX512BW__) && WK_VW == 16) || (defined(__AVX2__) && WK_VW == 8)
#define WK_IDOT 1
#if WK_VW == 16
typedef __m512i vb;
#else
typedef __m256i vb;
#endif
static constexpr int IDOT_MAXCH = 8;  // code vectors per row at most (longer rows take the float path)
static constexpr int IDOT_VB = VW * 4;  // bytes per vector

// The lane sums of VW vectors at once, as one vector (lane i: the sum of a[i]'s lanes): a transpose-and-add
// tree, about 3 shuffles and adds per vector instead of hsum's 6-8.
static inline vf hsum_lanes(const vf* __restrict a) {
#if WK_VW == 16
  __m512 s1[8], s2[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit group: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of a = a[2i], b = a[2i+1]
    const __m512 x = (__m512)a[2 * i], y = (__m512)a[2 * i + 1];
    s1[i] = _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 4; ++i)  // per 128-bit group: the group's sums of vectors 4i .. 4i+3
    s2[i] = _mm512_add_ps(_mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm512_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  const __m512 p01 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s2[0], s2[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 p23 = _mm512_add_ps(_mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_f32x4(s2[2], s2[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return (vf)_mm512_add_ps(_mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(p01, p23, _MM_SHUFFLE(3, 1, 3, 1)));
#else
  __m256 s1[4], s2[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 x = (__m256)a[2 * i], y = (__m256)a[2 * i + 1];
    s1[i] = _mm256_add_ps(_mm256_unpacklo_ps(x, y), _mm256_unpackhi_ps(x, y));
  }
  for (int i = 0; i < 2; ++i)
    s2[i] = _mm256_add_ps(_mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0x44),
                          _mm256_shuffle_ps(s1[2 * i], s1[2 * i + 1], 0xEE));
  return (vf)_mm256_add_ps(_mm256_permute2f128_ps(s2[0], s2[1], 0x20), _mm256_permute2f128_ps(s2[0], s2[1], 0x31));
#endif
}

// The query of one head, split for the byte dot products (see above), in the code vectors' byte order.
struct alignas(64) IQuery {
  int8_t q[IDOT_MAXCH][3][IDOT_VB];
  int32_t offq[IDOT_MAXCH][VW];  // per vector: offset * the Horner sums of the parts over each lane's 4 bytes
  int32_t offt[VW];              // their sum over the vectors (int4: one row factor)
  float qs;                      // s / 16384: an integer score times qs is the float score
};

// Code vectors per row for this K format (0: no integer path: another format, a row too long, a fractional offset).
static int idot_chunks(const Src& s) {
  int n = 0;
  if (s.fmt == FMT_INT4 && s.offset == std::nearbyint(s.offset)) n = (s.row_bytes + VW * 2 - 1) / (VW * 2);
  else if (s.fmt == FMT_Q4_0) n = (s.d / 32 + VW / 8 - 1) / (VW / 8);
  return n <= IDOT_MAXCH ? n : 0;
}

// Buffer position of byte u of code vector c (-1: a padding byte, whose query byte is 0).
static inline int idot_pos(const Src& s, int c, int u) {
  if (s.fmt == FMT_INT4) {
    const int sb = VW * 2, k = c * sb + u % sb;
    return k >= s.row_bytes ? -1 : (u < sb ? k : s.row_bytes + k);
  }
  const int p = c * IDOT_VB + u;
  return p < s.d ? p : -1;
}

// x: the scaled query (buffer order, s.L floats used). False where it is not finite or too small to split (the caller
// takes the float path).
static bool idot_prepare(const Src& s, int nch, const float* __restrict x, IQuery& iq) {
  float a = 0.0f;
  for (int j = 0; j < s.L; ++j) a = std::max(a, std::fabs(x[j]));
  if (!std::isfinite(a)) return false;
  const float sc = a > 0.0f ? a / 127.0f : 1.0f, inv = 1.0f / sc;
  if (!std::isfinite(inv)) return false;  // a query so small that 127 / max|x| overflows: the float path
  const int32_t off = s.fmt == FMT_INT4 ? (int32_t)s.offset : 8;
  std::memset(&iq, 0, sizeof(IQuery));
  for (int c = 0; c < nch; ++c)
    for (int u = 0; u < IDOT_VB; ++u) {
      const int p = idot_pos(s, c, u);
      if (p < 0) continue;
      float r = std::min(127.0f, std::max(-127.0f, x[p] * inv));
      const float q1 = std::nearbyint(r);
      r = (r - q1) * 128.0f;
      const float q2 = std::nearbyint(r);
      const float q3 = std::nearbyint((r - q2) * 128.0f);
      iq.q[c][0][u] = (int8_t)q1;
      iq.q[c][1][u] = (int8_t)q2;
      iq.q[c][2][u] = (int8_t)q3;
      const int32_t w = off * ((int32_t)q1 * 16384 + (int32_t)q2 * 128 + (int32_t)q3);
      iq.offq[c][u / 4] += w;
      iq.offt[u / 4] += w;
    }
  iq.qs = sc / 16384.0f;
  return true;
}

static inline vb vb_zero() {
#if WK_VW == 16
  return _mm512_setzero_si512();
#else
  return _mm256_setzero_si256();
#endif
}

static inline vb vb_load(const int32_t* p) {
#if WK_VW == 16
  return _mm512_load_si512(p);
#else
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
#endif
}

// acc + per int32 lane the sum of its 4 byte products u (unsigned) * s (signed)
static inline vb dp_u8s8(vb acc, vb u, const int8_t* s8) {
#if WK_VW == 16
  const __m512i s = _mm512_load_si512(s8);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
#else
  const __m256i s = _mm256_load_si256(reinterpret_cast<const __m256i*>(s8));
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
#endif
}

static inline vb vb_shl7(vb a) {
#if WK_VW == 16
  return _mm512_slli_epi32(a, 7);
#else
  return _mm256_slli_epi32(a, 7);
#endif
}

static inline vf vb_float(vb a, vb b) {  // float(a - b)
#if WK_VW == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_sub_epi32(a, b));
#else
  return (vf)_mm256_cvtepi32_ps(_mm256_sub_epi32(a, b));
#endif
}

// One row's code vectors (and q4_0's per-lane block scales).
template <int FMT>
static inline void idot_codes(const Src& s, const uint8_t* __restrict row, int nch, vb* __restrict cv,
                              vf* __restrict scl) {
#if WK_VW == 8
  const __m128i m4 = _mm_set1_epi8(0x0F);
#endif
  if constexpr (FMT == FMT_INT4) {
    const int nb = s.row_bytes;
    (void)scl;
    for (int c = 0; c < nch; ++c) {
#if WK_VW == 16
      const int k = c * 32;
      const __m128i x0 = group_bytes(row + k, s.end, std::min(nb - k, 16));
      const __m128i x1 =
          k + 16 < nb ? group_bytes(row + k + 16, s.end, std::min(nb - k - 16, 16)) : _mm_setzero_si128();
      const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(x0), x1, 1);
      const __m256i m = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
      cv[c] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
#else
      const int k = c * 16;
      const __m128i x = group_bytes(row + k, s.end, std::min(nb - k, 16));
      cv[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m4), _mm_and_si128(x, m4));
#endif
    }
  } else {  // FMT_Q4_0: blocks of 18 bytes, fp16 scale then 16 bytes: value j low nibble, value j + 16 high
    for (int c = 0; c < nch; ++c) {
#if WK_VW == 16
      const int nblk = s.d / 32;
      const uint8_t* b0 = row + 2 * c * 18;
      const bool two = 2 * c + 1 < nblk;
      const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 2));
      const __m128i x1 = two ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 20)) : _mm_setzero_si128();
      const __m256i x = _mm256_inserti128_si256(_mm256_castsi128_si256(x0), x1, 1);
      const __m256i m = _mm256_set1_epi8(0x0F);
      const __m256i lo = _mm256_and_si256(x, m), hi = _mm256_and_si256(_mm256_srli_epi16(x, 4), m);
      const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);  // [lo0, lo1, hi0, hi1]
      cv[c] = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));               // [lo0, hi0, lo1, hi1]
      scl[c] = (vf)_mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(h2f(b0)),
                                        _mm512_set1_ps(two ? h2f(b0 + 18) : 0.0f));
#else
      const uint8_t* b0 = row + c * 18;
      const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b0 + 2));
      cv[c] = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(x, 4), m4), _mm_and_si128(x, m4));
      scl[c] = splat(h2f(b0));
#endif
    }
  }
}

// One head's integer score of one row's code vectors, as float lanes (the caller sums them). NCH > 0: that many
// vectors (unrolled); 0: nch of them.
template <int FMT, int NCH>
static inline vf idot_one(const IQuery& Q, int nch, const vb* __restrict cv, const vf* __restrict scl) {
  const int n = NCH > 0 ? NCH : nch;
  if constexpr (FMT == FMT_INT4) {  // one row factor: Horner over every vector at once
    (void)scl;
    vb a = dp_u8s8(vb_zero(), cv[0], Q.q[0][0]);
    for (int k = 1; k < n; ++k) a = dp_u8s8(a, cv[k], Q.q[k][0]);
    a = vb_shl7(a);
    for (int k = 0; k < n; ++k) a = dp_u8s8(a, cv[k], Q.q[k][1]);
    a = vb_shl7(a);
    for (int k = 0; k < n; ++k) a = dp_u8s8(a, cv[k], Q.q[k][2]);
    return vb_float(a, vb_load(Q.offt));
  } else {  // q4_0: each vector's lanes times their block's scale
    vf s = vf{};
    for (int k = 0; k < n; ++k) {
      vb a = dp_u8s8(vb_zero(), cv[k], Q.q[k][0]);
      a = dp_u8s8(vb_shl7(a), cv[k], Q.q[k][1]);
      a = dp_u8s8(vb_shl7(a), cv[k], Q.q[k][2]);
      s += vb_float(a, vb_load(Q.offq[k])) * scl[k];
    }
    return s;
  }
}

// Scores of every head (sc[j * TILE + i]) against K rows t..t+nt-1, straight from their 4-bit codes: VW rows'
// code vectors at a time, then per head their VW scores summed by one hsum_lanes (slots from nt on: junk the
// softmax overwrites).
typedef void (*IdotFn)(const Src&, int64_t, int64_t, int64_t, int, const IQuery*, int64_t, int, float*);

template <int FMT, int NCH>
static void idot_tile(const Src& s, int64_t b, int64_t h, int64_t t, int nt, const IQuery* __restrict iq, int64_t G,
                      int nch, float* __restrict sc) {
  const uint8_t* c = s.codes + b * s.cs0 + h * s.cs1 + t * s.cs2;
  const uint8_t* sp = FMT == FMT_INT4 ? s.scale + b * s.ss0 + h * s.ss1 + t * s.ss2 : nullptr;
  const int n = NCH > 0 ? NCH : nch;
  vb cv[VW][NCH > 0 ? NCH : IDOT_MAXCH];
  vf scl[VW][FMT == FMT_Q4_0 ? (NCH > 0 ? NCH : IDOT_MAXCH) : 1];
  alignas(64) float rs[VW];
  for (int i0 = 0; i0 < nt; i0 += VW) {
    const int nb = std::min(VW, nt - i0);
    for (int i = 0; i < VW; ++i) {
      if (i < nb) {
        idot_codes<FMT>(s, c + (i0 + i) * s.cs2, n, cv[i], scl[i]);
        rs[i] = FMT == FMT_INT4 ? h2f(sp + (i0 + i) * s.ss2) : 1.0f;
      } else {
        for (int k = 0; k < n; ++k) cv[i][k] = vb_zero();
        if constexpr (FMT == FMT_Q4_0)
          for (int k = 0; k < n; ++k) scl[i][k] = vf{};
        rs[i] = 0.0f;
      }
    }
    const vf rv = *(const vf*)rs;
    for (int64_t j = 0; j < G; ++j) {
      vf part[VW];
      for (int i = 0; i < VW; ++i) part[i] = idot_one<FMT, NCH>(iq[j], n, cv[i], scl[i]);
      *(vf*)(sc + j * TILE + i0) = hsum_lanes(part) * (rv * iq[j].qs);
    }
  }
}

static IdotFn idot_fn(int fmt, int nch) {
  if (fmt == FMT_INT4) {
    switch (nch) {
      case 1: return idot_tile<FMT_INT4, 1>;
      case 2: return idot_tile<FMT_INT4, 2>;
      case 4: return idot_tile<FMT_INT4, 4>;
      default: return idot_tile<FMT_INT4, 0>;
    }
  }
  switch (nch) {
    case 1: return idot_tile<FMT_Q4_0, 1>;
    case 2: return idot_tile<FMT_Q4_0, 2>;
    case 4: return idot_tile<FMT_Q4_0, 4>;
    default: return idot_tile<FMT_Q4_0, 0>;
  }
}
#else
#define WK_IDOT 0
struct IQuery {};
typedef void (*IdotFn)(const Src&, int64_t, int64_t, int64_t, int, const IQuery*, int64_t, int, float*);
static int idot_chunks(const Src&) { return 0; }
static bool idot_prepare(const Src&, int, const float*, IQuery&) { return false; }
static IdotFn idot_fn(int, int) { return nullptr; }
#endif
