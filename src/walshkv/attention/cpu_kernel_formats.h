// walshkv's CPU kernel (a header of cpu_kernel.cpp): the packed formats it reads and their descriptor. The format ids
// (Fmt) and limits (MAX_BANDS, MAX_SEGS) are exported to Python (FORMATS, by name) and checked against
// walshkv/attention/cpu_formats.py when the module loads; Src is one packed K or V tensor as the Python side describes
// it (make_src reads the descriptor list: pointers, strides, format, band or tq segment tables). The byte layouts are
// documented in walshkv/attention/cpu.py.
#pragma once

#include "cpu_kernel_simd.h"

enum Fmt : int {
  FMT_INT4 = 0, FMT_INT8 = 1, FMT_INT_GENERIC = 2, FMT_Q4_0 = 3, FMT_Q8_0 = 4, FMT_INT2 = 5, FMT_BANDED = 6,
  FMT_TQ = 7, FMT_IQ4_NL = 8, FMT_TCQ = 9
};
static constexpr int MAX_BANDS = 32;
static constexpr int MAX_SEGS = 2;
static constexpr int MAX_TCQ_D = 512;   // FMT_TCQ: longest row (values per trellis stream)
static constexpr int MAX_TCQ_TAPS = 16;  // FMT_TCQ: most codes one state is made of

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
  float row_mul;                      // FMT_TQ, FMT_TCQ: the row factor is norm * row_mul (1 / sqrt(d))
  // FMT_TCQ (tq's segments, whose codes form one wrapped trellis stream): value i decodes to
  // tcq_table[(sum over taps t of code[i - t] << tcq_shift[t * L + i]) & tcq_mask], code indices mod L, a shift of
  // 32 or more contributing nothing
  const float* tcq_table;
  const int32_t* tcq_shift;
  int tcq_taps;
  uint32_t tcq_mask;
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
  s.tcq_table = nullptr;
  s.tcq_shift = nullptr;
  s.tcq_taps = 0;
  s.tcq_mask = 0;
  if (s.fmt == FMT_TQ || s.fmt == FMT_TCQ) {
    const int64_t extra = s.fmt == FMT_TCQ ? 4 : 0;  // tcq: table, shifts, taps, state bits after the segments
    s.nseg = a.size() > 15 ? (int)a[15] : 0;
    if (s.nseg < 1 || s.nseg > MAX_SEGS || (int64_t)a.size() != 16 + 9 * (int64_t)s.nseg + extra)
      throw std::invalid_argument("walshkv decode attention: bad tq segment table");
    if (extra) {
      const int64_t* e = a.data() + 16 + 9 * s.nseg;
      s.tcq_table = reinterpret_cast<const float*>(e[0]);
      s.tcq_shift = reinterpret_cast<const int32_t*>(e[1]);
      s.tcq_taps = (int)e[2];
      if (s.tcq_taps < 1 || s.tcq_taps > MAX_TCQ_TAPS || e[3] < 1 || e[3] > 16 || s.L > MAX_TCQ_D || s.L < s.tcq_taps)
        throw std::invalid_argument("walshkv decode attention: bad tcq trellis table");
      s.tcq_mask = (1u << e[3]) - 1u;
    }
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
