// How fast an AVX2 CPU decodes a 3-bit trellis row (64 values, 8-bit state) in each table form and state
// convention (research/scripts/tcq_lookup_bench.py): a timing probe, not the kernel (walshkv/attention/cpu_kernel*).
//
// Rows are 24 bytes of LSB-first 3-bit codes (any bytes are valid codes), wrapped (value 0's state reads the end of
// the row). Each variant decodes every row into a 32-row float tile that stays in L1 (as the fused attention's tiles
// do) and folds the tile into a checksum, so nothing is optimised away; `reference` gives the same values one at a
// time, to check each variant.
//
//   gather_taps     the newest-low state (walshkv's tcq, TcqAvx2): three taps of shuffle, shift, mask; one gather
//   p44_taps        the same states; the value P[s & 15] + Q[s >> 4] by two pairs of vpermps and blends
//   gather_window   the state as one 8-bit window of the stream (newest code high): one shuffle, shift, mask; gather
//   p44_window      window states; P[s & 15] + Q[s >> 4] by vpermps pairs
//   i8_44_window    window states packed to bytes, P and Q as int8 by two byte shuffles per 32, widened to float
//   tq              tq:3: each code to its Lloyd-Max level by one vpermps (the yardstick)
#include <immintrin.h>
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

namespace {

constexpr int D = 64, K = 3, RB = D * K / 8, TILE = 32;

struct Plan {  // one row's byte plan for the 8 chunks of 8 values (padded stream: 8 pad bytes, then the row)
  int base[8];
  alignas(32) int8_t ctl[8][3][32];
  alignas(32) int32_t shr[8][3][8];
  alignas(32) int32_t mask[8][3][8];
  int taps;
};

// newest-low (window = false): tap t of value i is code i - t at shift 3t (bits above 8 dropped);
// window (true): one tap, the 8 stream bits that end with value i's last bit.
Plan make_plan(bool window) {
  Plan p{};
  p.taps = window ? 1 : 3;
  for (int c = 0; c < 8; ++c) {
    int lo = 1 << 30;
    for (int t = 0; t < p.taps; ++t)
      for (int k = 0; k < 8; ++k) {
        const int i = 8 * c + k;
        const int start = window ? 64 + K * i + K - 8 : 64 + K * (i - t) - K * t;
        lo = std::min(lo, start >> 3);
      }
    p.base[c] = lo;
    for (int t = 0; t < p.taps; ++t)
      for (int k = 0; k < 8; ++k) {
        const int i = 8 * c + k, lane = 4 * (k % 4) + 16 * (k / 4);
        const int start = window ? 64 + K * i + K - 8 : 64 + K * (i - t) - K * t;
        if ((start >> 3) - lo + 1 > 15) throw std::runtime_error("plan: window past 16 bytes");
        p.ctl[c][t][lane] = (int8_t)((start >> 3) - lo);
        p.ctl[c][t][lane + 1] = (int8_t)((start >> 3) - lo + 1);
        p.ctl[c][t][lane + 2] = p.ctl[c][t][lane + 3] = (int8_t)0x80;
        p.shr[c][t][k] = start & 7;
        p.mask[c][t][k] = window ? 0xFF : (int32_t)((7u << (K * t)) & 0xFFu);
      }
  }
  return p;
}

inline void fill(const uint8_t* row, uint8_t* buf) {  // the padded stream: the row's last 8 bytes, then the row
  std::memcpy(buf, row + RB - 8, 8);
  std::memcpy(buf + 8, row, RB);
}

inline __m256i states(const Plan& p, const uint8_t* buf, int c) {
  const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(buf + p.base[c])));
  __m256i x = _mm256_setzero_si256();
  for (int t = 0; t < p.taps; ++t) {
    const __m256i f = _mm256_shuffle_epi8(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(p.ctl[c][t])));
    x = _mm256_or_si256(x, _mm256_and_si256(_mm256_srlv_epi32(f, _mm256_load_si256(reinterpret_cast<const __m256i*>(p.shr[c][t]))),
                                            _mm256_load_si256(reinterpret_cast<const __m256i*>(p.mask[c][t]))));
  }
  return x;
}

// 16-entry float lookup: entries 0-7 and 8-15 by two vpermps, chosen by bit 3 of the index (moved to the sign bit)
inline __m256 lut16(__m256 lo, __m256 hi, __m256i idx) {
  return _mm256_blendv_ps(_mm256_permutevar8x32_ps(lo, idx), _mm256_permutevar8x32_ps(hi, idx),
                          _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

float fold(const float* tile) {
  __m256 a = _mm256_setzero_ps();
  for (int i = 0; i < TILE * D; i += 8) a = _mm256_add_ps(a, _mm256_loadu_ps(tile + i));
  alignas(32) float v[8];
  _mm256_store_ps(v, a);
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

// every row of `codes` ([n, 24] uint8) decoded by `variant`; returns the checksum, or the first tile in `first`
double run(const std::string& variant, torch::Tensor codes, torch::Tensor table, torch::Tensor p, torch::Tensor q,
           torch::Tensor p8, torch::Tensor q8, torch::Tensor levels, torch::Tensor first) {
  const int64_t n = codes.size(0);
  const uint8_t* cd = codes.data_ptr<uint8_t>();
  const float* tab = table.data_ptr<float>();
  const bool window = variant.find("window") != std::string::npos;
  const Plan plan = make_plan(window);
  alignas(64) float tile[TILE * D];
  alignas(32) uint8_t bufs[2][8 + RB + 32] = {};  // row i + 1's stream is written while row i's is read (as TcqAvx2)
  const __m256 P0 = _mm256_loadu_ps(p.data_ptr<float>()), P1 = _mm256_loadu_ps(p.data_ptr<float>() + 8);
  const __m256 Q0 = _mm256_loadu_ps(q.data_ptr<float>()), Q1 = _mm256_loadu_ps(q.data_ptr<float>() + 8);
  const __m256i P8 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p8.data_ptr<int8_t>())));
  const __m256i Q8 = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8.data_ptr<int8_t>())));
  const __m256 LV = _mm256_loadu_ps(levels.data_ptr<float>());
  const __m256i m15 = _mm256_set1_epi32(15), n15 = _mm256_set1_epi8(15);
  int kind;
  if (variant == "gather_taps" || variant == "gather_window") kind = 0;
  else if (variant == "p44_taps" || variant == "p44_window") kind = 1;
  else if (variant == "i8_44_window") kind = 2;
  else if (variant == "tq") kind = 3;
  else throw std::invalid_argument("variant: gather_taps, p44_taps, gather_window, p44_window, i8_44_window, tq");
  // tq:3's unpack: 8 codes from 3 bytes per lane group, one shuffle + shift + mask (as the kernel's generic path)
  alignas(32) int8_t tqc[32];
  alignas(32) int32_t tqs[8];
  for (int k = 0; k < 8; ++k) {
    const int lane = 4 * (k % 4) + 16 * (k / 4);
    tqc[lane] = (int8_t)((3 * k) >> 3);
    tqc[lane + 1] = (int8_t)(((3 * k) >> 3) + 1);
    tqc[lane + 2] = tqc[lane + 3] = (int8_t)0x80;
    tqs[k] = (3 * k) & 7;
  }
  const __m256i TQC = _mm256_load_si256(reinterpret_cast<const __m256i*>(tqc));
  const __m256i TQS = _mm256_load_si256(reinterpret_cast<const __m256i*>(tqs));
  const __m256i m7 = _mm256_set1_epi32(7);
  double sum = 0.0;
  for (int64_t r0 = 0; r0 < n; r0 += TILE) {
    const int nt = (int)std::min<int64_t>(TILE, n - r0);
    if (kind != 3) fill(cd + r0 * RB, bufs[0]);
    for (int i = 0; i < nt; ++i) {
      const uint8_t* row = cd + (r0 + i) * RB;
      float* out = tile + i * D;
      const uint8_t* buf = bufs[i & 1];
      if (kind != 3 && i + 1 < nt) fill(row + RB, bufs[(i + 1) & 1]);
      if (kind == 3) {
        for (int c = 0; c < 8; ++c) {
          const __m256i w = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 3 * c)));
          const __m256i x = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(w, TQC), TQS), m7);
          _mm256_storeu_ps(out + 8 * c, _mm256_permutevar8x32_ps(LV, x));
        }
        continue;
      }
      if (kind == 2) {
        for (int c = 0; c < 8; c += 4) {  // 32 states to bytes, two byte shuffles, widened to float
          const __m256i s0 = states(plan, buf, c), s1 = states(plan, buf, c + 1);
          const __m256i s2 = states(plan, buf, c + 2), s3 = states(plan, buf, c + 3);
          __m256i b = _mm256_packus_epi16(_mm256_packus_epi32(s0, s1), _mm256_packus_epi32(s2, s3));
          b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
          const __m256i v = _mm256_add_epi8(_mm256_shuffle_epi8(P8, _mm256_and_si256(b, n15)),
                                            _mm256_shuffle_epi8(Q8, _mm256_and_si256(_mm256_srli_epi16(b, 4), n15)));
          const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
          _mm256_storeu_ps(out + 8 * c, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)));
          _mm256_storeu_ps(out + 8 * c + 8, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))));
          _mm256_storeu_ps(out + 8 * c + 16, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)));
          _mm256_storeu_ps(out + 8 * c + 24, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))));
        }
        continue;
      }
      for (int c = 0; c < 8; ++c) {
        const __m256i s = states(plan, buf, c);
        __m256 v;
        if (kind == 0) {
          v = _mm256_i32gather_ps(tab, s, 4);
        } else {
          v = _mm256_add_ps(lut16(P0, P1, _mm256_and_si256(s, m15)), lut16(Q0, Q1, _mm256_srli_epi32(s, 4)));
        }
        _mm256_storeu_ps(out + 8 * c, v);
      }
    }
    if (r0 == 0 && first.numel() >= TILE * D) std::memcpy(first.data_ptr<float>(), tile, sizeof(float) * nt * D);
    sum += fold(tile);
  }
  return sum;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("run", &run, "decode every row by a variant (tcq_lookup_bench)"); }
