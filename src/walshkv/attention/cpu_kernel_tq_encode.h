// walshkv's CPU kernel (a header of cpu_kernel.cpp): tq's encoder after its rotation (tq_pack), the accelerated
// implementation of walshkv.codecs.turbo.PACK_ROWS that walshkv/attention/cpu.py registers; the torch path of
// TurboQuant._encode is its reference (the same bits: tests/attention/test_tq_pack.py).
#pragma once

#include <pybind11/pybind11.h>

#include "cpu_kernel_simd.h"

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
  pybind11::gil_scoped_release nogil;
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
