// walshkv's CPU kernel (a header of cpu_kernel.cpp): keys stored before RoPE (prerope+, walshkv/attention/keys.py).
// Each decoded K row is mapped to the pre-RoPE key by one matrix per kv head and rotated to its position: a dense
// matrix in fp32 multiply-adds (key_rows) or as bf16x3 products on AMX tiles (amx_tiles), or a fast Walsh-Hadamard
// transform where the matrix is one (had_core; decode attention scores each such key in registers where it is made,
// had_scores, and never writes it; decode_rows writes it, had_key, fwht_row). KPost is the map's descriptor;
// decode_k_tile decodes a K tile for it.
#pragma once

#include "cpu_kernel_decode.h"
#include "cpu_kernel_formats.h"
#include "cpu_kernel_simd.h"

// Keys stored before RoPE (prerope+, see walshkv/attention/keys.py): each decoded K row b (row factor rs) becomes
// z = rs * (b @ mt[h]) + mu[h], rotated to its position p: [z1 c - z2 s, z2 c + z1 s] (c, s: cos/sin[p][d/2]).
// mt: [H][L][ld] floats (zero columns from d to ld), mu: [H][ld], cos/sin: [positions][d/2].
// Hadamard form (had = true; the caller found mt[h] = diag(r[h]) H diag(c[h]) with H the d x d Sylvester
// Hadamard matrix, L = d, as every prerope+ spec without eq+ has): z = rs * (fwht(b * r[h]) * c[h]) + mu[h],
// d log2(d) additions per key instead of the L x d multiply-adds of the matrix. r, c: [H][ld] (zero padded).
// AMX form (amx = true, matrix only): mt[h] split into bf16 hi + lo ([H][Lp/2][ld][2], the tile unit's pair
// layout, Lp = L rounded up to 32, zero rows past L), each decoded row split the same way in the kernel, and
// b @ mt = b_hi @ mt_hi + b_lo @ mt_hi + b_hi @ mt_lo summed in fp32 by the tile unit: the terms dropped are
// below 2^-16 of each product, about fp32 reassociation's size, at a fraction of the fp32 multiply-adds' time.
struct KPost {
  bool on = false;
  bool had = false;
  bool amx = false;
  const uint16_t* bhi = nullptr;
  const uint16_t* blo = nullptr;
  int Lp = 0;
  const float* mt = nullptr;
  const float* mu = nullptr;
  const float* cs = nullptr;
  const float* sn = nullptr;
  const float* r = nullptr;
  const float* c = nullptr;
  bool r_one = false;  // Hadamard form with every r == 1 (tq's own rotation without sign flips): no multiply
  int64_t pos0 = 0, npos = 0;
  int d = 0, L = 0;
  int64_t ld = 0;
};

static KPost make_kpost(const std::vector<int64_t>& a, int64_t H, int64_t T) {
  KPost k;
  if (a.empty()) return k;
  if (a.size() != 8 && a.size() != 10 && a.size() != 11)
    throw std::invalid_argument("walshkv decode attention: bad prerope descriptor");
  k.on = true;
  k.mt = reinterpret_cast<const float*>(a[0]);
  k.mu = reinterpret_cast<const float*>(a[1]);
  k.cs = reinterpret_cast<const float*>(a[2]);
  k.sn = reinterpret_cast<const float*>(a[3]);
  k.pos0 = a[4];
  k.npos = a[5];
  k.d = (int)a[6];
  k.L = (int)a[7];
  k.ld = (k.d + 2 * VW - 1) / (2 * VW) * (2 * VW);  // two output vectors per register block
  if (k.d < 2 || k.d % 2 || k.pos0 < 0 || k.pos0 + T > k.npos || H < 1)
    throw std::invalid_argument("walshkv decode attention: prerope positions outside the RoPE table");
  if (a.size() == 10) {
    k.had = true;
    k.r = reinterpret_cast<const float*>(a[8]);
    k.c = reinterpret_cast<const float*>(a[9]);
    if (k.L != k.d || (k.d & (k.d - 1)))
      throw std::invalid_argument("walshkv decode attention: a Hadamard prerope transform needs L = d, a power of 2");
    k.r_one = true;
    for (int64_t j = 0; j < H * k.ld && k.r_one; ++j) k.r_one = k.r[j] == 1.0f || (j % k.ld) >= k.d;
  }
  if (a.size() == 11) {
    k.amx = true;
    k.bhi = reinterpret_cast<const uint16_t*>(a[8]);
    k.blo = reinterpret_cast<const uint16_t*>(a[9]);
    k.Lp = (int)a[10];
    if (!WK_AMX || VW != 16 || k.Lp % 32 || k.Lp < k.L || k.ld % 32)
      throw std::invalid_argument("walshkv decode attention: AMX key map requested where it cannot run");
  }
  return k;
}

// The process's permission to use AMX tile data (Linux: arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)),
// asked once; false where AMX is not compiled in or the kernel refuses.
static bool amx_ready() {
#if WK_AMX
  static const bool ok = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (!__builtin_cpu_supports("amx-bf16")) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

#if WK_AMX
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes: C (fp32 16 x 16 outputs) in 0-3, A (16 keys x 32 bf16) in 4, B (32 bf16 of
// mt's rows in pairs x 16 outputs) in 5-7. The configuration is thread state: each thread loads it.
static void amx_configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// 16 rows x NC column tiles of z = b_hi @ mt_hi + b_lo @ mt_hi + b_hi @ mt_lo: three passes over the K dimension,
// NC independent accumulators (one chain of dependent tile products each).
template <int NC>
static inline void amx_cols(const uint16_t* __restrict ah, const uint16_t* __restrict al, int Lp,
                            const uint16_t* __restrict bhi, const uint16_t* __restrict blo, int64_t ld, int64_t c0,
                            float* __restrict z) {
  static_assert(NC == 2 || NC == 4, "two or four column tiles");
  const int64_t bs = ld * 4;  // bytes per B row: ld pairs of bf16
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (NC == 4) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int pass = 0; pass < 3; ++pass) {
    const uint16_t* a = pass == 1 ? al : ah;
    const uint16_t* bm = pass == 2 ? blo : bhi;
    for (int ks = 0; ks < Lp / 32; ++ks) {
      _tile_loadd(4, a + ks * 32, Lp * 2);
      const uint16_t* bb = bm + ((int64_t)ks * 16 * ld + c0 * 16) * 2;
      _tile_loadd(5, bb, bs);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, bb + 32, bs);
      _tile_dpbf16ps(1, 4, 6);
      if constexpr (NC == 4) {
        _tile_loadd(7, bb + 64, bs);
        _tile_dpbf16ps(2, 4, 7);
        _tile_loadd(5, bb + 96, bs);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
  }
  _tile_stored(0, z + c0 * 16, bs);
  _tile_stored(1, z + (c0 + 1) * 16, bs);
  if constexpr (NC == 4) {
    _tile_stored(2, z + (c0 + 2) * 16, bs);
    _tile_stored(3, z + (c0 + 3) * 16, bs);
  }
}

// ktile rows (ld_in floats, L used) -> their bf16 hi and lo parts, ahi, alo: [TILE][Lp] uint16 (zeros past L).
static void amx_convert(const KPost& kp, int nt, const float* __restrict ktile, int64_t ld_in, uint16_t* __restrict ahi,
                        uint16_t* __restrict alo) {
  const int Lp = kp.Lp;
  for (int i = 0; i < nt; ++i) {
    const float* src = ktile + i * ld_in;
    for (int l = 0; l < Lp; l += 16) {
      const int left = kp.L - l;
      const __mmask16 mk = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(mk, src + l);
      const __m256bh hi = _mm512_cvtneps_pbh(x);
      const __m512 hif = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)hi), 16));
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(x, hif));
      _mm256_storeu_si256((__m256i*)(ahi + i * Lp + l), (__m256i)hi);
      _mm256_storeu_si256((__m256i*)(alo + i * Lp + l), (__m256i)lo);
    }
  }
}

// z rows (kp.ld floats) = b @ mt[h] by bf16x3 tile products (see KPost) from the rows' parts ahi, alo ([TILE][Lp]).
// Rows nt..15 of a started block of 16 are computed from stale (finite) scratch and never read.
static void amx_tiles(const KPost& kp, int64_t h, int nt, const uint16_t* __restrict ahi,
                      const uint16_t* __restrict alo, float* __restrict z) {
  const int Lp = kp.Lp;
  const int64_t ld = kp.ld, nct = ld / 16;  // ld: a multiple of 32, so nct is even
  const uint16_t* __restrict bhi = kp.bhi + h * (int64_t)(Lp / 2) * ld * 2;
  const uint16_t* __restrict blo = kp.blo + h * (int64_t)(Lp / 2) * ld * 2;
  for (int rb = 0; rb * 16 < nt; ++rb) {
    const uint16_t* ah = ahi + rb * 16 * Lp;
    const uint16_t* al = alo + rb * 16 * Lp;
    float* zr = z + rb * 16 * ld;
    int64_t c = 0;
    for (; c + 4 <= nct; c += 4) amx_cols<4>(ah, al, Lp, bhi, blo, ld, c, zr);
    if (c < nct) amx_cols<2>(ah, al, Lp, bhi, blo, ld, c, zr);
  }
}
#endif

// In-vector butterflies of the fast Walsh-Hadamard transform: lane k := x[k ^ len] + sign * x[k], len < VW.
static inline vf fwht_lanes(vf a) {
#if WK_VW == 16
  const vf s1 = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  const vf s2 = {1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1, 1, 1, -1, -1};
  const vf s4 = {1, 1, 1, 1, -1, -1, -1, -1, 1, 1, 1, 1, -1, -1, -1, -1};
  const vf s8 = {1, 1, 1, 1, 1, 1, 1, 1, -1, -1, -1, -1, -1, -1, -1, -1};
  a = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14) + a * s1;
  a = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) + a * s2;
  a = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) + a * s4;
  return __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) + a * s8;
#else
  const vf s1 = {1, -1, 1, -1, 1, -1, 1, -1};
  const vf s2 = {1, 1, -1, -1, 1, 1, -1, -1};
  const vf s4 = {1, 1, 1, 1, -1, -1, -1, -1};
  a = __builtin_shufflevector(a, a, 1, 0, 3, 2, 5, 4, 7, 6) + a * s1;
  a = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5) + a * s2;
  return __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3) + a * s4;
#endif
}

// x[0 .. d) := x @ H (the Sylvester Hadamard matrix, unnormalised), in place; d a power of two; x aligned to a
// vector when d >= VW. Butterflies within a vector: lane k takes x[k ^ len] + sign * x[k] (one permute, one FMA).
static inline void fwht_row(float* __restrict x, int d) {
  if (d < VW) {
    for (int len = 1; len < d; len <<= 1)
      for (int i = 0; i < d; i += 2 * len)
        for (int j = i; j < i + len; ++j) {
          const float a = x[j], b = x[j + len];
          x[j] = a + b;
          x[j + len] = a - b;
        }
    return;
  }
  vf* __restrict xv = (vf*)x;
  const int nv = d / VW;
  for (int v = 0; v < nv; ++v) xv[v] = fwht_lanes(xv[v]);
  for (int len = 1; len < nv; len <<= 1)  // butterflies between whole vectors
    for (int i = 0; i < nv; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        const vf a = xv[j], b = xv[j + len];
        xv[j] = a + b;
        xv[j + len] = a - b;
      }
}

// NR rows of the K tile times mt[h] (two output vectors at a time in registers), row factor, plus the mean.
template <int NR>
static inline void key_rows(const KPost& kp, const float* __restrict M, const float* __restrict mu,
                            const float* __restrict krows, int64_t ld_in, const float* __restrict rs,
                            float* __restrict z) {
  const int64_t nvo = kp.ld / VW;  // even (make_kpost)
  for (int64_t o0 = 0; o0 < nvo; o0 += 2) {
    vf a0[NR], a1[NR];
    for (int r = 0; r < NR; ++r) a0[r] = a1[r] = vf{};
    const float* __restrict mcol = M + o0 * VW;
    for (int l = 0; l < kp.L; ++l) {
      const vf m0 = ((const vf*)(mcol + (int64_t)l * kp.ld))[0], m1 = ((const vf*)(mcol + (int64_t)l * kp.ld))[1];
      for (int r = 0; r < NR; ++r) {
        const vf x = splat(krows[r * ld_in + l]);
        a0[r] += x * m0;
        a1[r] += x * m1;
      }
    }
    for (int r = 0; r < NR; ++r) {
      vf* zr = (vf*)(z + r * kp.ld) + o0;
      zr[0] = a0[r] * rs[r] + ((const vf*)mu)[o0];
      zr[1] = a1[r] * rs[r] + ((const vf*)mu)[o0 + 1];
    }
  }
}

// One key, NV vectors, in registers: x = rope_p(fwht(b * r) * (c * f) + mu) (Hadamard form of KPost); R_ONE: r == 1.
template <int NV, bool R_ONE>
static inline void had_core(const float* __restrict b, const vf* __restrict r, const vf* __restrict c,
                            const vf* __restrict mu, float f, const float* __restrict cs, const float* __restrict sn,
                            vf* __restrict x) {
  for (int v = 0; v < NV; ++v) x[v] = fwht_lanes(R_ONE ? ((const vf*)b)[v] : ((const vf*)b)[v] * r[v]);
  // butterflies between whole vectors, fully unrolled (a loop here kept x on the stack)
#pragma GCC unroll 8
  for (int len = 1; len < NV; len <<= 1)
#pragma GCC unroll 16
    for (int i = 0; i < NV; i += 2 * len)
#pragma GCC unroll 16
      for (int j = i; j < i + len; ++j) {
        const vf a = x[j], bb = x[j + len];
        x[j] = a + bb;
        x[j + len] = a - bb;
      }
  const vf fv = splat(f);
  for (int v = 0; v < NV; ++v) x[v] = x[v] * (c[v] * fv) + mu[v];
  for (int v = 0; v < NV / 2; ++v) {  // RoPE: entry j pairs with j + d/2, i.e. vector v with v + NV/2
    const vf cc = *(const vfu*)(cs + v * VW), ss = *(const vfu*)(sn + v * VW);
    const vf a = x[v], bb = x[v + NV / 2];
    x[v] = a * cc - bb * ss;
    x[v + NV / 2] = bb * cc + a * ss;
  }
}

// One key to z (kp.ld = d floats): had_core, stored.
template <int NV, bool R_ONE>
static inline void had_key(const float* __restrict b, const vf* __restrict r, const vf* __restrict c,
                           const vf* __restrict mu, float f, const float* __restrict cs, const float* __restrict sn,
                           float* __restrict z) {
  vf x[NV];
  had_core<NV, R_ONE>(b, r, c, mu, f, cs, sn, x);
  for (int v = 0; v < NV; ++v) ((vf*)z)[v] = x[v];
}

// NB query heads (rows of q, stride LK) against two keys x, y of NV vectors in registers: sx[c], sy[c].
template <int NV, int NB>
static inline void score_pair(const vf* __restrict x, const vf* __restrict y, const float* __restrict q, int64_t LK,
                              float* __restrict sx, float* __restrict sy) {
  static_assert(NB == 1 || NB == 2, "one or two heads against two keys");
  vf ax0 = vf{}, ax1 = vf{}, ay0 = vf{}, ay1 = vf{};  // named sums: an array here stayed on the stack
  const vf* q0 = (const vf*)q;
  const vf* q1 = (const vf*)(q + (NB == 2 ? LK : 0));
  for (int v = 0; v < NV; ++v) {
    ax0 += x[v] * q0[v];
    ay0 += y[v] * q0[v];
    if constexpr (NB == 2) {
      ax1 += x[v] * q1[v];
      ay1 += y[v] * q1[v];
    }
  }
  float s4[4];
  hsum4(ax0, ax1, ay0, ay1, s4);
  sx[0] = s4[0], sy[0] = s4[2];
  if constexpr (NB == 2) sx[1] = s4[1], sy[1] = s4[3];
}

// One query head against one key x in registers.
template <int NV>
static inline float score_one(const vf* __restrict x, const float* __restrict q) {
  const vf* qv = (const vf*)q;
  vf a = vf{};
  for (int v = 0; v < NV; ++v) a += x[v] * qv[v];
  return hsum(a);
}

// Hadamard form, scored where the key is made: each of nt decoded rows (ktile, ld_in floats) becomes its key in
// registers (had_core) and meets the G query rows (q, stride LK = d) there, two keys and two heads at a time (every
// bound known to the compiler, so the sums stay in registers); the key is never written. sc[j * TILE + i]: head j's
// score of row i, as score_tile over transform_keys' rows gives it.
template <int NV, bool R_ONE>
static void had_scores(const KPost& kp, int64_t h, int64_t t, int nt, const float* __restrict ktile, int64_t ld_in,
                       const float* __restrict rs, const float* __restrict q, int64_t G, int64_t LK,
                       float* __restrict sc) {
  const vf* r = (const vf*)(kp.r + h * kp.ld);
  const vf* c = (const vf*)(kp.c + h * kp.ld);
  const vf* m = (const vf*)(kp.mu + h * kp.ld);
  const int half = kp.d / 2;
  float sx[2], sy[2];
  int i = 0;
  // two keys at a time (two independent chains of shuffles and adds in flight) where both keys, four sums and the
  // query's vectors fit in the registers (32 vector registers with AVX-512, 16 with AVX2)
  constexpr bool PAIRS = 2 * NV + 6 <= (VW == 16 ? 32 : 16);
  for (; PAIRS && i + 2 <= nt; i += 2) {
    const int64_t pos = kp.pos0 + t + i;
    vf x[NV], y[NV];
    had_core<NV, R_ONE>(ktile + i * ld_in, r, c, m, rs[i], kp.cs + pos * half, kp.sn + pos * half, x);
    had_core<NV, R_ONE>(ktile + (i + 1) * ld_in, r, c, m, rs[i + 1], kp.cs + (pos + 1) * half,
                        kp.sn + (pos + 1) * half, y);
    int64_t j = 0;
    for (; j + 2 <= G; j += 2) {
      score_pair<NV, 2>(x, y, q + j * LK, LK, sx, sy);
      sc[j * TILE + i] = sx[0], sc[(j + 1) * TILE + i] = sx[1];
      sc[j * TILE + i + 1] = sy[0], sc[(j + 1) * TILE + i + 1] = sy[1];
    }
    if (j < G) {
      score_pair<NV, 1>(x, y, q + j * LK, LK, sx, sy);
      sc[j * TILE + i] = sx[0], sc[j * TILE + i + 1] = sy[0];
    }
  }
  for (; i < nt; ++i) {
    const int64_t pos = kp.pos0 + t + i;
    vf x[NV];
    had_core<NV, R_ONE>(ktile + i * ld_in, r, c, m, rs[i], kp.cs + pos * half, kp.sn + pos * half, x);
    for (int64_t j = 0; j < G; ++j) sc[j * TILE + i] = score_one<NV>(x, q + j * LK);
  }
}

// Whether the Hadamard form scores in registers (had_scores): ld = d of 2 to 16 whole vectors.
static inline bool had_fused(const KPost& kp) {
  const int nv = kp.d / VW;
  return kp.had && kp.ld == kp.d && (nv == 2 || nv == 4 || nv == 8 || nv == 16);
}

// had_scores for this key map's vector count and r.
static void had_score_tile(const KPost& kp, int64_t h, int64_t t, int nt, const float* __restrict ktile,
                           int64_t ld_in, const float* __restrict rs, const float* __restrict q, int64_t G, int64_t LK,
                           float* __restrict sc) {
  const bool one = kp.r_one;
  switch (kp.d / VW) {
    case 2: (one ? had_scores<2, true> : had_scores<2, false>)(kp, h, t, nt, ktile, ld_in, rs, q, G, LK, sc); break;
    case 4: (one ? had_scores<4, true> : had_scores<4, false>)(kp, h, t, nt, ktile, ld_in, rs, q, G, LK, sc); break;
    case 8: (one ? had_scores<8, true> : had_scores<8, false>)(kp, h, t, nt, ktile, ld_in, rs, q, G, LK, sc); break;
    default:
      (one ? had_scores<16, true> : had_scores<16, false>)(kp, h, t, nt, ktile, ld_in, rs, q, G, LK, sc);
      break;
  }
}

// ktile rows (ld_in floats, L used) -> ztile rows (kp.ld floats): the pre-RoPE key, then RoPE at pos0 + t + i.
// AMX form: abf holds the rows' bf16 parts ([2][TILE][Lp]); converted: the decoder wrote them there already (tq).
static void transform_keys(const KPost& kp, int64_t h, int64_t t, int nt, const float* __restrict ktile, int64_t ld_in,
                           const float* __restrict rs, float* __restrict ztile, uint16_t* __restrict abf,
                           bool converted = false) {
  const float* __restrict mu = kp.mu + h * kp.ld;
  float* __restrict z = ztile;
  const int nv = kp.d / VW;
  if (had_fused(kp)) {  // all in registers, RoPE included
    const vf* r = (const vf*)(kp.r + h * kp.ld);
    const vf* c = (const vf*)(kp.c + h * kp.ld);
    const vf* m = (const vf*)mu;
    for (int i = 0; i < nt; ++i) {
      const int64_t pos = kp.pos0 + t + i;
      const float* cs = kp.cs + pos * (kp.d / 2);
      const float* sn = kp.sn + pos * (kp.d / 2);
      const float* b = ktile + i * ld_in;
      float* zi = z + i * kp.ld;
      switch (nv) {  // (decode_rows: the keys themselves; decode attention scores them in had_scores)
        case 2: had_key<2, false>(b, r, c, m, rs[i], cs, sn, zi); break;
        case 4: had_key<4, false>(b, r, c, m, rs[i], cs, sn, zi); break;
        case 8: had_key<8, false>(b, r, c, m, rs[i], cs, sn, zi); break;
        default: had_key<16, false>(b, r, c, m, rs[i], cs, sn, zi); break;
      }
    }
    return;
  }
  if (kp.had) {  // z = rs * fwht(b * r) * c + mu, row by row
    const float* __restrict r = kp.r + h * kp.ld;
    const float* __restrict c = kp.c + h * kp.ld;
    for (int i = 0; i < nt; ++i) {
      const float* __restrict b = ktile + i * ld_in;
      float* __restrict zi = z + i * kp.ld;
      for (int j = 0; j < kp.d; ++j) zi[j] = b[j] * r[j];
      fwht_row(zi, kp.d);
      const float f = rs[i];
      for (int j = 0; j < kp.d; ++j) zi[j] = zi[j] * c[j] * f + mu[j];
      for (int64_t j = kp.d; j < kp.ld; ++j) zi[j] = 0.0f;
    }
  } else if (kp.amx) {
#if WK_AMX
    if (!converted) amx_convert(kp, nt, ktile, ld_in, abf, abf + TILE * kp.Lp);
    amx_tiles(kp, h, nt, abf, abf + TILE * kp.Lp, z);
    const vf* m = (const vf*)mu;
    const int half = kp.d / 2;
    if (half % VW == 0) {  // row factor, mean and RoPE in one pass over each row
      const int hv = half / VW;
      for (int i = 0; i < nt; ++i) {
        const int64_t pos = kp.pos0 + t + i;
        const float* cs = kp.cs + pos * half;
        const float* sn = kp.sn + pos * half;
        vf* zi = (vf*)(z + i * kp.ld);
        const vf f = splat(rs[i]);
        for (int v = 0; v < hv; ++v) {
          const vf a = zi[v] * f + m[v], bb = zi[v + hv] * f + m[v + hv];
          const vf cc = *(const vfu*)(cs + v * VW), ss = *(const vfu*)(sn + v * VW);
          zi[v] = a * cc - bb * ss;
          zi[v + hv] = bb * cc + a * ss;
        }
      }
      return;
    }
    for (int i = 0; i < nt; ++i) {
      vf* zi = (vf*)(z + i * kp.ld);
      const vf f = splat(rs[i]);
      for (int64_t v = 0; v < kp.ld / VW; ++v) zi[v] = zi[v] * f + m[v];
    }
#endif
  } else {
    const float* __restrict M = kp.mt + h * (int64_t)kp.L * kp.ld;
    int i0 = 0;
    for (; i0 + 6 <= nt; i0 += 6) key_rows<6>(kp, M, mu, ktile + i0 * ld_in, ld_in, rs + i0, z + i0 * kp.ld);
    for (; i0 < nt; ++i0) key_rows<1>(kp, M, mu, ktile + i0 * ld_in, ld_in, rs + i0, z + i0 * kp.ld);
  }
  const int half = kp.d / 2;
  for (int i = 0; i < nt; ++i) {  // RoPE in place: entry j and j + half only read each other
    const int64_t pos = kp.pos0 + t + i;
    const float* __restrict c = kp.cs + pos * half;
    const float* __restrict s = kp.sn + pos * half;
    float* __restrict zi = z + i * kp.ld;
    for (int j = 0; j < half; ++j) {
      const float a = zi[j], bb = zi[j + half];
      zi[j] = a * c[j] - bb * s[j];
      zi[j + half] = bb * c[j] + a * s[j];
    }
  }
}

// Per thread: the AMX key map's scratch (a K tile's rows as bf16 hi and lo parts, zeroed) with the thread's tile
// configuration loaded; nullptr without the AMX map. Freed (and the tiles released) by amx_scratch_free.
static uint16_t* amx_scratch(const KPost& kp) {
  if (!kp.amx) return nullptr;
  uint16_t* abf = static_cast<uint16_t*>(std::aligned_alloc(64, (size_t)(2 * TILE * kp.Lp * 2 + 63) / 64 * 64));
  if (!abf) throw std::bad_alloc();
  std::memset(abf, 0, (size_t)2 * TILE * kp.Lp * 2);
#if WK_AMX
  amx_configure();
#endif
  return abf;
}

static void amx_scratch_free(uint16_t* abf) {
  if (!abf) return;
#if WK_AMX
  _tile_release();
#endif
  std::free(abf);
}

// K rows t..t+nt-1 into the float tile, or, for the AMX map over tq codes of at most 4 bits, straight to the
// scratch's bf16 parts (returns true: transform_keys then skips the conversion). Row factors in rs either way.
static bool decode_k_tile(const Src& K, TileFn dec, const KPost& kp, int64_t b, int64_t h, int64_t t, int nt,
                          float* tile, int64_t ld, float* rs, uint16_t* abf) {
#if WK_AMX
  if (kp.amx && tq_pairs_ok(K)) {
    decode_tile_tq_pairs(K, b, h, t, nt, abf, abf + TILE * kp.Lp, kp.Lp, rs);
    return true;
  }
#else
  (void)kp, (void)abf;
#endif
  dec(K, b, h, t, nt, tile, ld, rs);
  return false;
}
