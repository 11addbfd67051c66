// Fused CPU decode attention straight from packed K/V codes: walshkv's C++ kernel.
//
// Built on first use by walshkv.attention.cpu.load_kernel (torch.utils.cpp_extension.load_inline over
// this file's text; the build cache name hashes the text, so any edit here builds a fresh module). The
// byte layouts it reads are described in walshkv/attention/cpu.py; walshkv/attention/cpu_formats.py
// describes each codec to it. The format ids and limits below are exported to Python (FORMATS,
// MAX_BANDS, MAX_SEGS) and checked against the Python side when the module loads.

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
// AMX (Sapphire Rapids and later; Linux asks for the tile state per process): eq+'s dense key map as bf16 tile
// products, see amx_tiles below. Compiled in only where the build targets AMX-BF16 (and AVX512-BF16 for the
// conversions); used only where Linux granted the tile state (amx_ready) and the caller asks for it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define WK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define WK_AMX 0
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
  FMT_TQ = 7, FMT_IQ4_NL = 8
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

static inline vf splat(float x) {  // one broadcast (vf{} + x costs an extra add that keeps -0.0 exact)
#if defined(__AVX512F__) && WK_VW == 16
  return (vf)_mm512_set1_ps(x);
#elif defined(__AVX__) && WK_VW == 8
  return (vf)_mm256_set1_ps(x);
#else
  return vf{} + x;
#endif
}

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
  // each level as bf16 hi (low half) and lo (high half) parts, the split the AMX key map makes (levels of <= 5 bits)
  alignas(64) int32_t seg_pairs[MAX_SEGS][32];
  float row_mul;                      // FMT_TQ: the row factor is norm * row_mul (1 / sqrt(d))
};

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

typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // an unaligned load

// One key, NV vectors, in registers: z = rope_p(fwht(b * r) * (c * f) + mu) (Hadamard form of KPost).
template <int NV>
static inline void had_key(const float* __restrict b, const vf* __restrict r, const vf* __restrict c,
                           const vf* __restrict mu, float f, const float* __restrict cs, const float* __restrict sn,
                           float* __restrict z) {
  vf x[NV];
  for (int v = 0; v < NV; ++v) x[v] = fwht_lanes(((const vf*)b)[v] * r[v]);
  for (int len = 1; len < NV; len <<= 1)
    for (int i = 0; i < NV; i += 2 * len)
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
  for (int v = 0; v < NV; ++v) ((vf*)z)[v] = x[v];
}

// ktile rows (ld_in floats, L used) -> ztile rows (kp.ld floats): the pre-RoPE key, then RoPE at pos0 + t + i.
// AMX form: abf holds the rows' bf16 parts ([2][TILE][Lp]); converted: the decoder wrote them there already (tq).
static void transform_keys(const KPost& kp, int64_t h, int64_t t, int nt, const float* __restrict ktile, int64_t ld_in,
                           const float* __restrict rs, float* __restrict ztile, uint16_t* __restrict abf,
                           bool converted = false) {
  const float* __restrict mu = kp.mu + h * kp.ld;
  float* __restrict z = ztile;
  const int nv = kp.d / VW;
  if (kp.had && kp.ld == kp.d && (nv == 2 || nv == 4 || nv == 8 || nv == 16)) {  // all in registers, RoPE included
    const vf* r = (const vf*)(kp.r + h * kp.ld);
    const vf* c = (const vf*)(kp.c + h * kp.ld);
    const vf* m = (const vf*)mu;
    for (int i = 0; i < nt; ++i) {
      const int64_t pos = kp.pos0 + t + i;
      const float* cs = kp.cs + pos * (kp.d / 2);
      const float* sn = kp.sn + pos * (kp.d / 2);
      const float* b = ktile + i * ld_in;
      float* zi = z + i * kp.ld;
      switch (nv) {
        case 2: had_key<2>(b, r, c, m, rs[i], cs, sn, zi); break;
        case 4: had_key<4>(b, r, c, m, rs[i], cs, sn, zi); break;
        case 8: had_key<8>(b, r, c, m, rs[i], cs, sn, zi); break;
        default: had_key<16>(b, r, c, m, rs[i], cs, sn, zi); break;
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

// float -> bf16 bits, round to nearest even (finite inputs), as the AVX512-BF16 conversions round
static inline uint32_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

static inline float bf16_float(uint32_t h) {
  const uint32_t u = h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

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
      for (int c = 0; c < 32; ++c) {  // the level table holds at least 32 floats (zero padded)
        const float lv = s.seg_levels[i][c];
        const uint32_t hi = bf16_bits(lv), lo = bf16_bits(lv - bf16_float(hi));
        s.seg_pairs[i][c] = (int32_t)(hi | (lo << 16));
      }
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

static inline void lookup_levels(float* __restrict buf, int n, const float* __restrict lv, int bits);

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
  for (int i = 0; i < nt; ++i) rs[i] = h2f(sc + i * s.ss2) * s.row_mul;
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
  for (int i = 0; i < nt; ++i) rs[i] = h2f(sc + i * s.ss2) * s.row_mul;
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
    case FMT_IQ4_NL: return decode_tile<FMT_IQ4_NL>;
  }
  throw std::invalid_argument("walshkv decode attention: unknown packed format");
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

static inline void score_tile(const float* __restrict krows, const float* __restrict q, int64_t G, int64_t LK,
                              int64_t nk, int nt, const float* __restrict rsk, float* __restrict sc) {
  for (int64_t j0 = 0; j0 < G; j0 += JB) {
    const float* qj = q + j0 * LK;
    float* sj = sc + j0 * TILE;
    switch (std::min<int64_t>(JB, G - j0)) {
      case 1: score_block<1>(qj, LK, nk, krows, nt, rsk, sj); break;
      case 2: score_block<2>(qj, LK, nk, krows, nt, rsk, sj); break;
      case 3: score_block<3>(qj, LK, nk, krows, nt, rsk, sj); break;
      default: score_block<4>(qj, LK, nk, krows, nt, rsk, sj); break;
    }
  }
}

static inline float hmax(vf v) {  // the largest lane
  const v8f a0 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
#if WK_VW == 16
  const v8f a1 = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v8f a = a0 > a1 ? a0 : a1;
#else
  const v8f a = a0;
#endif
  const v4f b0 = __builtin_shufflevector(a, a, 0, 1, 2, 3), b1 = __builtin_shufflevector(a, a, 4, 5, 6, 7);
  v4f b = b0 > b1 ? b0 : b1;
  const v4f c = __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b = b > c ? b : c;
  return std::max(b[0], b[1]);
}

// Online softmax update of every head over one tile's scores (sc rows become the tile's unnormalised weights; the
// slots past nt are set to weight 0): running max m, denominator l, and the V sums acc rescaled where m grows.
static inline void softmax_tile(float* __restrict sc, int nt, int64_t G, bool first, float* __restrict m,
                                float* __restrict l, float* __restrict acc, int64_t LV, int64_t nv) {
  for (int64_t j = 0; j < G; ++j) {
    float* sj = sc + j * TILE;
    for (int i = nt; i < TILE; ++i) sj[i] = -std::numeric_limits<float>::infinity();
    vf* sv = (vf*)sj;
    vf mv = sv[0];
    for (int v = 1; v < TILE / VW; ++v) mv = mv > sv[v] ? mv : sv[v];
    const float mt = hmax(mv);
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
}

// One (batch, head, token range): online softmax over tiles. q: [G][LK] (zero columns pad), acc: [G][LV];
// m, l: [G]. LK, LV are multiples of VW; buffers 64-byte aligned.
static void run_range(const Src& K, const Src& V, TileFn kdec, TileFn vdec, const KPost& kp,
                      const float* __restrict q, int64_t b, int64_t h, int64_t t0, int64_t t1, int64_t G, int64_t LKD,
                      int64_t LK, int64_t LV, float* __restrict m, float* __restrict l, float* __restrict acc,
                      float* __restrict ktile, float* __restrict ztile, float* __restrict vtile,
                      float* __restrict sc, uint16_t* __restrict abf, IdotFn idot, const IQuery* __restrict iq,
                      int nch) {
  // LKD: floats per decoded K row; LK: per scored row (the query's length: LKD, or kp.ld for prerope+)
  // iq: the heads' integer queries where K's 4-bit codes are scored by byte dot products (idot), else nullptr
  const int64_t nk = LK / VW, nv = LV / VW;
  float rsk[TILE], rsv[TILE];
  bool first = true;
  for (int64_t tb = t0; tb < t1; tb += TILE) {
    const int nt = (int)std::min<int64_t>(TILE, t1 - tb);
    if (iq) {
      idot(K, b, h, tb, nt, iq, G, nch, sc);
    } else {
      const bool pairs = decode_k_tile(K, kdec, kp, b, h, tb, nt, ktile, LKD, rsk, abf);
      const float* kscore = ktile;
      if (kp.on) {  // keys before RoPE: to the model's basis and rotated to their positions (row factor folded)
        transform_keys(kp, h, tb, nt, ktile, LKD, rsk, ztile, abf, pairs);
        for (int i = 0; i < nt; ++i) rsk[i] = 1.0f;
        kscore = ztile;
      }
      score_tile(kscore, q, G, LK, nk, nt, rsk, sc);
    }
    softmax_tile(sc, nt, G, first, m, l, acc, LV, nv);
    first = false;
    vdec(V, b, h, tb, nt, vtile, LV, rsv);
    for (int i = nt; i < TILE; ++i) rsv[i] = 0.0f;
    for (int64_t j = 0; j < G; ++j)  // the weights times V's row factors
      for (int v = 0; v < TILE / VW; ++v) ((vf*)(sc + j * TILE))[v] *= *(const vfu*)(rsv + v * VW);
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
// kpost: empty, or the prerope+ descriptor (make_kpost); then q is [B*H][G][d] in the model's basis.
static void run(const std::vector<int64_t>& kdesc, const std::vector<int64_t>& vdesc, const std::vector<int64_t>& kpost,
                int64_t q_ptr, int64_t m_ptr, int64_t l_ptr, int64_t acc_ptr, int64_t B, int64_t H, int64_t G, int64_t T,
                int64_t nsplit, int64_t nthreads, bool int_dot) {
  const Src K = make_src(kdesc), V = make_src(vdesc);
  const KPost kp = make_kpost(kpost, H, T);
  if (kp.on && kp.L != K.L) throw std::invalid_argument("walshkv decode attention: prerope matrix rows != K row length");
  if (kp.amx && !amx_ready()) throw std::invalid_argument("walshkv decode attention: AMX is not available here");
  const TileFn kdec = tile_fn(K.fmt), vdec = tile_fn(V.fmt);
  const float* q = reinterpret_cast<const float*>(q_ptr);
  float* m_out = reinterpret_cast<float*>(m_ptr);
  float* l_out = reinterpret_cast<float*>(l_ptr);
  float* acc_out = reinterpret_cast<float*>(acc_ptr);
  nsplit = std::max<int64_t>(1, nsplit);
  const int64_t N = B * H, LKD = round_up(K.L, VW), LV = round_up(V.L, VW);
  const int64_t LK = kp.on ? kp.ld : LKD, QL = kp.on ? kp.d : K.L;  // scored row length; query floats given
  const int64_t per = (T + nsplit - 1) / nsplit;
  const float NEG_INF = -std::numeric_limits<float>::infinity();
  float* qp = alloc_floats(N * G * LK);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < G; ++j) std::memcpy(qp + (n * G + j) * LK, q + (n * G + j) * QL, sizeof(float) * QL);
  // 4-bit K (int4, q4_0; not keys before RoPE): the heads' queries split for byte dot products (IQuery)
  const int nch = int_dot && !kp.on ? idot_chunks(K) : 0;
  IQuery* iqs = nullptr;
  if (nch > 0) {
    iqs = static_cast<IQuery*>(std::aligned_alloc(64, (size_t)round_up(N * G * (int64_t)sizeof(IQuery), 64)));
    if (!iqs) throw std::bad_alloc();
    for (int64_t r = 0; r < N * G && iqs; ++r)
      if (!idot_prepare(K, nch, qp + r * LK, iqs[r])) {  // a non-finite query: the float path
        std::free(iqs);
        iqs = nullptr;
      }
  }
  const IdotFn idot = iqs ? idot_fn(K.fmt, nch) : nullptr;
  std::vector<float> pm(N * nsplit * G, NEG_INF), pl(N * nsplit * G, 0.0f);
  float* pacc = alloc_floats(N * nsplit * G * LV);
  {
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads))
    {
      float* ktile = alloc_floats(TILE * LKD + TILE * LK + TILE * LV + G * TILE);
      float* ztile = ktile + TILE * LKD;
      float* vtile = ztile + TILE * LK;
      float* sc = vtile + TILE * LV;
      uint16_t* abf = amx_scratch(kp);  // AMX: the K tile's rows as bf16 hi and lo
#pragma omp for schedule(dynamic, 1)
      for (int64_t task = 0; task < N * nsplit; ++task) {
        const int64_t n = task / nsplit, sp = task % nsplit;
        const int64_t t0 = sp * per, t1 = std::min<int64_t>(T, t0 + per);
        if (t0 < t1)
          run_range(K, V, kdec, vdec, kp, qp + n * G * LK, n / H, n % H, t0, t1, G, LKD, LK, LV, pm.data() + task * G,
                    pl.data() + task * G, pacc + task * G * LV, ktile, ztile, vtile, sc, abf, idot,
                    iqs ? iqs + n * G : nullptr, nch);
      }
      std::free(ktile);
      amx_scratch_free(abf);
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
  std::free(iqs);
}

// Packed rows t0 .. t0+n-1 of every (batch, head) to floats: out [B*H][n][Lout], 64-byte aligned rows not needed.
// Without kpost: the kernel's buffer rows times their row factor (Lout = the format's L; the caller maps them to
// the model's basis with one matrix). With kpost (prerope+ K): the model's keys, mapped and rotated to their
// positions as decode attention reads them (Lout = d). What a prefill tile decodes, at the kernel's speed and
// without the float temporaries of a codec's decode.
static void decode_rows(const std::vector<int64_t>& desc, const std::vector<int64_t>& kpost, int64_t out_ptr,
                        int64_t B, int64_t H, int64_t t0, int64_t n, int64_t nthreads) {
  const Src S = make_src(desc);
  const KPost kp = make_kpost(kpost, H, t0 + n);
  if (kp.on && kp.L != S.L) throw std::invalid_argument("walshkv decode rows: prerope matrix rows != K row length");
  if (kp.amx && !amx_ready()) throw std::invalid_argument("walshkv decode rows: AMX is not available here");
  if (t0 < 0 || n < 0) throw std::invalid_argument("walshkv decode rows: negative token range");
  const TileFn dec = tile_fn(S.fmt);
  const int64_t LD = round_up(S.L, VW), Lout = kp.on ? kp.d : S.L, ntiles = (n + TILE - 1) / TILE;
  float* out = reinterpret_cast<float*>(out_ptr);
  {
    py::gil_scoped_release nogil;
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads))
    {
      float* tile = alloc_floats(TILE * LD + TILE * (kp.on ? kp.ld : 0));
      float* ztile = tile + TILE * LD;
      uint16_t* abf = amx_scratch(kp);
      float rs[TILE];
#pragma omp for schedule(static)
      for (int64_t task = 0; task < B * H * ntiles; ++task) {
        const int64_t bh = task / ntiles, tb = (task % ntiles) * TILE;
        const int nt = (int)std::min<int64_t>(TILE, n - tb);
        const int64_t b = bh / H, h = bh % H;
        const bool pairs = decode_k_tile(S, dec, kp, b, h, t0 + tb, nt, tile, LD, rs, abf);
        float* dst = out + (bh * n + tb) * Lout;
        if (kp.on) {
          transform_keys(kp, h, t0 + tb, nt, tile, LD, rs, ztile, abf, pairs);
          for (int i = 0; i < nt; ++i) std::memcpy(dst + i * Lout, ztile + i * kp.ld, sizeof(float) * Lout);
        } else {
          for (int i = 0; i < nt; ++i)
            for (int64_t j = 0; j < Lout; ++j) dst[i * Lout + j] = tile[i * LD + j] * rs[i];
        }
      }
      std::free(tile);
      amx_scratch_free(abf);
    }
  }
}

// tq's encoder after its rotation (walshkv.codecs.turbo.TurboQuant._encode, whose torch path is the reference):
// rows r [n][d] (float32, the rotated vectors H(s * x)) and their fp16 norms to packed Lloyd-Max codes. Per row:
// scale = norm / sqrt(d) in float32 (1 where it is 0), t = r / scale, each t_i's code = how many of its segment's
// sorted thresholds lie strictly below it, codes packed LSB-first per segment. Every step is the torch path's
// float32 operation, so the bits are the same. desc: n, d, r, norm16, nseg, then per segment start, stop, bits,
// thresholds (float32), their count, out (uint8 [n][ceil((stop - start) * bits / 8)]). Returns the largest norm
// (NaN if any norm is NaN): the caller refuses what the torch path refuses.
static double tq_pack(const std::vector<int64_t>& desc, int64_t nthreads) {
  if (desc.size() < 5) throw std::invalid_argument("walshkv tq pack: descriptor too short");
  const int64_t n = desc[0], d = desc[1], nseg = desc[4];
  if (n < 0 || d < 1 || nseg < 1 || (int64_t)desc.size() != 5 + 6 * nseg)
    throw std::invalid_argument("walshkv tq pack: bad descriptor");
  const float* r = reinterpret_cast<const float*>(desc[2]);
  const uint8_t* norm = reinterpret_cast<const uint8_t*>(desc[3]);
  const float root = (float)std::sqrt((double)d);
  double biggest = -1.0;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float v = h2f(norm + 2 * i);
    if (std::isnan(v)) nan = true;
    else if (v > biggest) biggest = v;
  }
  if (nan) return std::numeric_limits<double>::quiet_NaN();
  if (!(biggest <= 65504.0)) return biggest;  // an Inf norm: nothing packed, the caller raises
  py::gil_scoped_release nogil;
#pragma omp parallel for schedule(static) num_threads((int)std::max<int64_t>(1, nthreads)) if (n * d >= 65536)
  for (int64_t i = 0; i < n; ++i) {
    const float scale = h2f(norm + 2 * i) / root;
    const float den = scale > 0.0f ? scale : 1.0f;
    const float* row = r + i * d;
    for (int64_t g = 0; g < nseg; ++g) {
      const int64_t* sd = desc.data() + 5 + 6 * g;
      const int64_t start = sd[0], stop = sd[1], bits = sd[2], nthr = sd[4];
      const float* thr = reinterpret_cast<const float*>(sd[3]);
      const int64_t nbytes = ((stop - start) * bits + 7) / 8;
      uint8_t* out = reinterpret_cast<uint8_t*>(sd[5]) + i * nbytes;
      std::memset(out, 0, (size_t)nbytes);
      for (int64_t j = start; j < stop; ++j) {
        const float t = row[j] / den;
        const uint32_t code = (uint32_t)(std::lower_bound(thr, thr + nthr, t) - thr);  // thresholds < t
        const int64_t bit = (j - start) * bits, byte = bit >> 3, shift = bit & 7;
        out[byte] |= (uint8_t)(code << shift);
        if (shift + bits > 8) out[byte + 1] |= (uint8_t)(code >> (8 - shift));
      }
    }
  }
  return biggest;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("run", &run, "fused decode attention over packed K/V (see walshkv.attention.cpu)", py::arg("kdesc"),
          py::arg("vdesc"), py::arg("kpost"), py::arg("q"), py::arg("m"), py::arg("l"), py::arg("acc"), py::arg("B"),
          py::arg("H"), py::arg("G"), py::arg("T"), py::arg("nsplit"), py::arg("nthreads"), py::arg("int_dot") = true);
  mod.def("decode_rows", &decode_rows, "packed rows to floats, as the kernel reads them (prefill tiles)");
  mod.def("tq_pack", &tq_pack, "tq's encoder after its rotation: rows to packed codes (TurboQuant._encode)");
  mod.attr("vector_lanes") = VW;
  mod.attr("amx_compiled") = (bool)WK_AMX;
  mod.attr("int_dot_compiled") = (bool)WK_IDOT;
  mod.def("amx_ready", &amx_ready, "whether eq+'s key map can run on AMX tiles here (compiled in and permitted)");
  // What the Python side must agree with (walshkv.attention.cpu_formats reads FORMATS by name).
  py::dict formats;
  formats["int4"] = (int)FMT_INT4;
  formats["int8"] = (int)FMT_INT8;
  formats["int_generic"] = (int)FMT_INT_GENERIC;
  formats["q4_0"] = (int)FMT_Q4_0;
  formats["q8_0"] = (int)FMT_Q8_0;
  formats["int2"] = (int)FMT_INT2;
  formats["banded"] = (int)FMT_BANDED;
  formats["tq"] = (int)FMT_TQ;
  formats["iq4_nl"] = (int)FMT_IQ4_NL;
  mod.attr("FORMATS") = formats;
  mod.attr("MAX_BANDS") = MAX_BANDS;
  mod.attr("MAX_SEGS") = MAX_SEGS;
}
