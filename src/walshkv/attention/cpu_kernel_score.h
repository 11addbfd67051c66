// walshkv's CPU kernel (a header of cpu_kernel.cpp): one tile of the attention itself. Scores of up to JB query heads
// against the decoded K rows (score_tile), the online softmax update over a tile (softmax_tile: running max,
// denominator, V sums rescaled; exp by vexp_nonpos), and the probability-weighted V rows added to the heads' sums
// (acc_block).
#pragma once

#include "cpu_kernel_simd.h"

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

// Scores of NB query heads (rows of q, stride LK) against nt decoded K rows: sc[c * TILE + i]. w: nullptr, or nt
// rows (stride LK) added to the keys first, each key's row factor applied before the add (a block frame's mean at
// each key's offset: key i is rsk[i] * row i + w row i), in registers (no second pass over the tile).
template <int NB, bool ADD>
static inline void score_block(const float* __restrict q, int64_t LK, int64_t nk, const float* __restrict ktile,
                               int nt, const float* __restrict rsk, const float* __restrict w, float* __restrict sc) {
  const vf* qv[NB];
  for (int c = 0; c < NB; ++c) qv[c] = (const vf*)(q + c * LK);
  for (int i = 0; i < nt; ++i) {
    const vf* kb = (const vf*)(ktile + i * LK);
    const vf* wb = ADD ? (const vf*)(w + i * LK) : nullptr;
    const vf r = splat(ADD ? rsk[i] : 1.0f);
    vf a[4] = {vf{}, vf{}, vf{}, vf{}};
    for (int64_t k = 0; k < nk; ++k) {
      const vf x = ADD ? kb[k] * r + wb[k] : kb[k];
      for (int c = 0; c < NB; ++c) a[c] += x * qv[c][k];
    }
    float s4[4];
    hsum4(a[0], a[1], a[2], a[3], s4);
    for (int c = 0; c < NB; ++c) sc[c * TILE + i] = ADD ? s4[c] : s4[c] * rsk[i];
  }
}

template <bool ADD>
static inline void score_tile_t(const float* __restrict krows, const float* __restrict q, int64_t G, int64_t LK,
                                int64_t nk, int nt, const float* __restrict rsk, const float* __restrict w,
                                float* __restrict sc) {
  for (int64_t j0 = 0; j0 < G; j0 += JB) {
    const float* qj = q + j0 * LK;
    float* sj = sc + j0 * TILE;
    switch (std::min<int64_t>(JB, G - j0)) {
      case 1: score_block<1, ADD>(qj, LK, nk, krows, nt, rsk, w, sj); break;
      case 2: score_block<2, ADD>(qj, LK, nk, krows, nt, rsk, w, sj); break;
      case 3: score_block<3, ADD>(qj, LK, nk, krows, nt, rsk, w, sj); break;
      default: score_block<4, ADD>(qj, LK, nk, krows, nt, rsk, w, sj); break;
    }
  }
}

// Scores of G query heads against nt decoded K rows (row factors rsk); w: nullptr, or rows added to the keys after
// their row factor (score_block).
static inline void score_tile(const float* __restrict krows, const float* __restrict q, int64_t G, int64_t LK,
                              int64_t nk, int nt, const float* __restrict rsk, float* __restrict sc,
                              const float* __restrict w = nullptr) {
  if (w) {
    score_tile_t<true>(krows, q, G, LK, nk, nt, rsk, w, sc);
  } else {
    score_tile_t<false>(krows, q, G, LK, nk, nt, rsk, w, sc);
  }
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
