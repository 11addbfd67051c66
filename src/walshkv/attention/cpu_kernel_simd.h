// walshkv's CPU kernel (one of the headers cpu_kernel.cpp includes): the target's vector width and the small vector
// helpers every other part uses. WK_VW (16 float lanes where the build targets AVX-512F, 8 otherwise), WK_AMX (AMX-BF16
// compiled in), the GCC/Clang vector types (vf, vi, v8f, v4f, vfu), the tile sizes (TILE tokens, JB query heads per
// register block), fp16 and bf16 scalar conversions, broadcasts and lane sums.
#pragma once

#include <algorithm>
#include <array>
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
// products, see amx_tiles in cpu_kernel_keys.h. Compiled in only where the build targets AMX-BF16 (and AVX512-BF16
// for the conversions); used only where Linux granted the tile state (amx_ready) and the caller asks for it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define WK_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define WK_AMX 0
#endif

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
typedef float vfu __attribute__((vector_size(VW * 4), aligned(4)));  // an unaligned load

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
