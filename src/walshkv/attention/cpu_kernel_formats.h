// walshkv's CPU kernel (a header of cpu_kernel.cpp): the packed formats it reads and their descriptor. The format ids
// (Fmt) and limits (MAX_BANDS, MAX_SEGS) are exported to Python (FORMATS, by name) and checked against
// walshkv/attention/cpu_formats.py when the module loads; Src is one packed K or V tensor as the Python side describes
// it (make_src reads the descriptor list: pointers, strides, format, band or tq segment tables). The byte layouts are
// documented in walshkv/attention/cpu.py.
#pragma once

#include <memory>

#include "cpu_kernel_simd.h"

enum Fmt : int {
  FMT_INT4 = 0, FMT_INT8 = 1, FMT_INT_GENERIC = 2, FMT_Q4_0 = 3, FMT_Q8_0 = 4, FMT_INT2 = 5, FMT_BANDED = 6,
  FMT_TQ = 7, FMT_IQ4_NL = 8, FMT_TCQ = 9
};
static constexpr int MAX_BANDS = 32;
static constexpr int MAX_SEGS = 2;
static constexpr int MAX_TCQ_D = 512;   // FMT_TCQ: longest row (values per trellis stream)
static constexpr int MAX_TCQ_TAPS = 16;  // FMT_TCQ: most codes one state is made of

// FMT_TCQ with AVX-512 VBMI (TcqVbmi): each state built from the packed bytes by byte permutes and multishifts, each
// value from the table's four byte planes by byte permutes; no gather. Rows of up to TCQ_VBMI_CHUNKS * 64 values,
// state bits 8, at most TCQ_VBMI_TAPS taps, every segment whole bytes and at most 128 of them (over 64: the "wide"
// form, each segment in two registers and two permutes a tap; head_dim 256); others take the AVX2 or generic path.
#if defined(__AVX512VBMI__) && defined(__AVX512BW__)
#define WK_TCQ_VBMI 1
#else
#define WK_TCQ_VBMI 0
#endif
static constexpr int TCQ_VBMI_CHUNKS = 4;
static constexpr int TCQ_VBMI_TAPS = 8;

// The byte-level plan of one tcq layout (make_tcq_vbmi). Lane b of chunk c holds value 64c + 16((b/4)%4) + 4(b/16) +
// b%4: the order in which two rounds of byte and word unpacks of the four planes come out as floats in value order.
// Per chunk and tap: idx picks 8 bytes per qword from the two segment registers (each half-qword the 4 bytes of the
// padded stream that hold its 4 values' codes of that tap; the padded stream is the last 8 bytes, then the whole
// stream), ctrl the bit where each lane's 8-bit window starts in its qword (the code lands at its shift), mask the
// code's bits there.
struct TcqVbmi {
  bool ok, wide;  // wide: a segment over 64 bytes; idx then picks from (segment 0's 128 bytes, segment 1's 128)
  bool hi16;      // every table value's low 16 bits are zero (a bfloat16 set): planes 0 and 1 are zero, not read
  int nchunks, taps, bytes0, bytes1;
  alignas(64) uint8_t idx[TCQ_VBMI_CHUNKS][TCQ_VBMI_TAPS][64];
  alignas(64) uint8_t ctrl[TCQ_VBMI_CHUNKS][TCQ_VBMI_TAPS][64];
  alignas(64) uint8_t mask[TCQ_VBMI_CHUNKS][TCQ_VBMI_TAPS][64];
  alignas(64) uint8_t planes[4][256];  // byte p of each float32 table entry
};

// FMT_TCQ with AVX2 and no VBMI plan (TcqAvx2): per row the padded stream (TcqGeom) copied to a small buffer, then per
// 8 values 16 of its bytes broadcast to both lanes and, per tap, a byte shuffle, a per-lane shift and a mask give the
// tap's bits of each state; one gather reads the table (on a Zen3 EPYC a scalar loop of loads was slower, and the
// gather still takes about half the time: docs/trellis.md), or, for a split table (tcq_parts), two pairs of register
// permutes and two blends. Rows of up to TCQ_AVX2_CHUNKS * 8 values (a multiple of
// 8), at most TCQ_AVX2_TAPS taps, every chunk's bytes within 16; others take the generic path (tcq_row).
static constexpr int TCQ_AVX2_CHUNKS = 32;
static constexpr int TCQ_AVX2_TAPS = 8;

// The byte-level plan of one tcq layout (make_tcq_avx2). Chunk c holds values 8c..8c+7 in lane order; base[c] is the
// padded-stream byte its 16-byte window starts at; per tap, ctl puts the two window bytes that hold a lane's 8-bit
// state window in its dword (0x80: a tap the lane does not read), shr is the bit that window starts at, mask the
// tap's code bits at their place in the state.
struct TcqAvx2 {
  int nchunks, taps, bytes0, bytes1;
  int base[TCQ_AVX2_CHUNKS];
  int pad[8];  // padded byte p < 8 repeats stream byte pad[p]
  alignas(32) int8_t ctl[TCQ_AVX2_CHUNKS][TCQ_AVX2_TAPS][32];
  alignas(32) int32_t shr[TCQ_AVX2_CHUNKS][TCQ_AVX2_TAPS][8];
  alignas(32) int32_t mask[TCQ_AVX2_CHUNKS][TCQ_AVX2_TAPS][8];
};

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
  const float* norm_lut;              // FMT_TQ, FMT_TCQ at norm=8: the norm byte's value (float32 [256]); else fp16
  // FMT_TCQ (tq's segments, whose codes form one wrapped trellis stream): value i decodes to
  // tcq_table[(sum over taps t of code[i - t] << tcq_shift[t * L + i]) & tcq_mask], code indices mod L, a shift of
  // 32 or more contributing nothing
  const float* tcq_table;
  // a split table set's parts (P then Q, float32 [32]: tcq_table[s] = P[s & 15] + Q[s >> 4] in float32), or null;
  // with them the AVX2 decoder reads each value by register permutes instead of a gather (TcqAvx2)
  const float* tcq_parts;
  const int32_t* tcq_shift;
  int tcq_taps;
  uint32_t tcq_mask;
  TcqVbmi tcq_vbmi;                         // ok only where the build has VBMI and the layout fits (make_tcq_vbmi)
  std::shared_ptr<const TcqAvx2> tcq_avx2;  // set only where the build has AVX2, no VBMI plan and the layout fits
};

// A tq/tcq row's norm: its fp16 at p, or (norm=8, walshkv.ops.lognorm) the value of its log byte.
static inline float row_norm(const Src& s, const uint8_t* p) { return s.norm_lut ? s.norm_lut[*p] : h2f(p); }

// The value each lane of a VBMI chunk holds (TcqVbmi).
static inline int tcq_vbmi_value(int chunk, int lane) {
  return 64 * chunk + 16 * ((lane / 4) % 4) + 4 * (lane / 16) + lane % 4;
}

// One tcq row as a byte stream: the segments back to back (each whole bytes) after an 8-byte pad that repeats the
// stream's last bytes, so that every code a state reads, wrapped or not, sits at a fixed bit of the padded stream.
struct TcqGeom {
  int L, nbytes, bytes0, bytes1;
  int width[MAX_TCQ_D], bitpos[MAX_TCQ_D + 1];
  int vb(int j) const { return j >= 0 ? 64 + bitpos[j] : 64 + bitpos[j + L] - 8 * nbytes; }  // code j (-L <= j < L)
  int w(int j) const { return width[(j + L) % L]; }
  int stream_byte(int p) const { return (((p - 8) % nbytes) + nbytes) % nbytes; }  // of padded byte p
};

// False where the segments do not tile 0..L-1 in order in whole bytes (those rows take tcq_row).
static bool tcq_geom(const Src& s, TcqGeom& g) {
  int pos = 0, bytes[MAX_SEGS] = {0, 0};
  g.bitpos[0] = 0;
  for (int q = 0; q < s.nseg; ++q) {
    const int nbits = s.seg_size[q] * s.seg_bits[q];
    if (s.seg_start[q] != pos || nbits % 8 != 0) return false;
    bytes[q] = nbits / 8;
    for (int i = 0; i < s.seg_size[q]; ++i, ++pos) {
      g.width[pos] = s.seg_bits[q];
      g.bitpos[pos + 1] = g.bitpos[pos] + g.width[pos];
    }
  }
  if (pos != s.L || s.tcq_mask != 0xFFu) return false;
  g.L = s.L;
  g.nbytes = g.bitpos[s.L] / 8;
  g.bytes0 = bytes[0];
  g.bytes1 = s.nseg > 1 ? bytes[1] : 0;
  for (int t = 0; t < s.tcq_taps; ++t)  // every code a state reads lies in the padded stream
    for (int i = 0; i < s.L; ++i)
      if (s.tcq_shift[t * s.L + i] < 8 && (i - t < -s.L || g.vb(i - t) - s.tcq_shift[t * s.L + i] < 0))
        return false;
  return true;
}

// Fill s.tcq_vbmi (ok = false where the build has no VBMI or the layout does not fit it).
static void make_tcq_vbmi(Src& s, const TcqGeom& g) {
  TcqVbmi& v = s.tcq_vbmi;
  v.ok = false;
  if (!WK_TCQ_VBMI || s.L > 64 * TCQ_VBMI_CHUNKS || s.tcq_taps > TCQ_VBMI_TAPS || g.bytes0 > 128 || g.bytes1 > 128)
    return;
  const int L = s.L;
  v.bytes0 = g.bytes0;
  v.bytes1 = g.bytes1;
  v.wide = g.bytes0 > 64 || g.bytes1 > 64;
  v.nchunks = (L + 63) / 64;
  v.taps = s.tcq_taps;
  const int seg1 = v.wide ? 128 : 64;  // where segment 1's bytes start in the permute's table
  auto src_byte = [&](int p) {  // padded stream byte -> index into (segment 0's registers, segment 1's)
    const int b = g.stream_byte(p);
    return (uint8_t)(b < v.bytes0 ? b : seg1 + (b - v.bytes0));
  };
  std::memset(v.idx, 0, sizeof v.idx);
  std::memset(v.ctrl, 0, sizeof v.ctrl);
  std::memset(v.mask, 0, sizeof v.mask);
  for (int c = 0; c < v.nchunks; ++c)
    for (int t = 0; t < v.taps; ++t)
      for (int h = 0; h < 16; ++h) {  // half-qwords: lanes 4h..4h+3, four consecutive values
        int lo = 1 << 30, hi = -(1 << 30);
        for (int k = 0; k < 4; ++k) {
          const int i = tcq_vbmi_value(c, 4 * h + k);
          if (i >= L || s.tcq_shift[t * L + i] >= 8) continue;
          lo = std::min(lo, g.vb(i - t));
          hi = std::max(hi, g.vb(i - t) + g.w(i - t));
        }
        if (hi < lo) continue;  // no lane of this half reads this tap
        const int base = lo / 8;
        if (hi > 8 * base + 32) return;
        for (int b = 0; b < 4; ++b) v.idx[c][t][4 * h + b] = src_byte(base + b);
        for (int k = 0; k < 4; ++k) {
          const int lane = 4 * h + k, i = tcq_vbmi_value(c, lane);
          if (i >= L || s.tcq_shift[t * L + i] >= 8) continue;
          const int sh = s.tcq_shift[t * L + i], j = i - t;
          v.ctrl[c][t][lane] = (uint8_t)((g.vb(j) - sh - 8 * base + 32 * (h % 2)) & 63);
          v.mask[c][t][lane] = (uint8_t)((((1u << g.w(j)) - 1u) << sh) & 0xFFu);
        }
      }
  v.hi16 = true;
  for (int e = 0; e < 256; ++e) {
    uint32_t u;
    std::memcpy(&u, s.tcq_table + e, 4);
    for (int p = 0; p < 4; ++p) v.planes[p][e] = (uint8_t)(u >> (8 * p));
    v.hi16 = v.hi16 && (u & 0xFFFFu) == 0;
  }
  v.ok = true;
}

// The AVX2 plan of a layout (TcqAvx2), or null where the build has no AVX2 or the layout does not fit it.
static std::shared_ptr<const TcqAvx2> make_tcq_avx2(const Src& s, const TcqGeom& g) {
#if defined(__AVX2__)
  const int L = s.L;
  if (L % 8 != 0 || L > 8 * TCQ_AVX2_CHUNKS || s.tcq_taps > TCQ_AVX2_TAPS) return nullptr;
  auto v = std::make_shared<TcqAvx2>();  // value-initialised: every plan entry a tap leaves unset is 0
  v->nchunks = L / 8;
  v->taps = s.tcq_taps;
  v->bytes0 = g.bytes0;
  v->bytes1 = g.bytes1;
  for (int p = 0; p < 8; ++p) v->pad[p] = g.stream_byte(p);
  for (int c = 0; c < v->nchunks; ++c) {
    int lo = 1 << 30, hi = -(1 << 30);
    for (int t = 0; t < v->taps; ++t)
      for (int k = 0; k < 8; ++k) {
        const int i = 8 * c + k, sh = s.tcq_shift[t * L + i];
        if (sh >= 8) continue;
        const int p = g.vb(i - t) - sh;  // the bit where this lane's 8-bit state window starts
        lo = std::min(lo, p >> 3);
        hi = std::max(hi, (p >> 3) + 1);
      }
    if (hi < lo) lo = hi = 0;
    if (hi - lo > 15) return nullptr;
    v->base[c] = lo;
    for (int t = 0; t < v->taps; ++t)
      for (int k = 0; k < 8; ++k) {
        const int i = 8 * c + k, sh = s.tcq_shift[t * L + i], lane = 4 * (k % 4) + 16 * (k / 4);
        for (int q = 0; q < 4; ++q) v->ctl[c][t][lane + q] = (int8_t)0x80;
        if (sh >= 8) continue;
        const int j = i - t, p = g.vb(j) - sh;
        v->ctl[c][t][lane] = (int8_t)((p >> 3) - lo);
        v->ctl[c][t][lane + 1] = (int8_t)((p >> 3) - lo + 1);
        v->shr[c][t][k] = p & 7;
        v->mask[c][t][k] = (int32_t)((((1u << g.w(j)) - 1u) << sh) & 0xFFu);
      }
  }
  return v;
#else
  (void)s;
  (void)g;
  return nullptr;
#endif
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
  s.norm_lut = nullptr;
  s.tcq_table = nullptr;
  s.tcq_parts = nullptr;
  s.tcq_shift = nullptr;
  s.tcq_taps = 0;
  s.tcq_mask = 0;
  s.tcq_vbmi.ok = false;
  if (s.fmt == FMT_TQ || s.fmt == FMT_TCQ) {
    // tcq: table, shifts, taps, state bits and the split table's parts (0: none) after the segments
    const int64_t extra = s.fmt == FMT_TCQ ? 5 : 0;
    s.nseg = a.size() > 15 ? (int)a[15] : 0;
    // one more entry after them all: the norm byte's table (norm=8)
    const int64_t base = 16 + 9 * (int64_t)s.nseg + extra;
    if (s.nseg < 1 || s.nseg > MAX_SEGS || ((int64_t)a.size() != base && (int64_t)a.size() != base + 1))
      throw std::invalid_argument("walshkv decode attention: bad tq segment table");
    if ((int64_t)a.size() == base + 1) s.norm_lut = reinterpret_cast<const float*>(a[base]);
    if (extra) {
      const int64_t* e = a.data() + 16 + 9 * s.nseg;
      s.tcq_table = reinterpret_cast<const float*>(e[0]);
      s.tcq_shift = reinterpret_cast<const int32_t*>(e[1]);
      s.tcq_taps = (int)e[2];
      if (s.tcq_taps < 1 || s.tcq_taps > MAX_TCQ_TAPS || e[3] < 1 || e[3] > 16 || s.L > MAX_TCQ_D || s.L < s.tcq_taps)
        throw std::invalid_argument("walshkv decode attention: bad tcq trellis table");
      s.tcq_mask = (1u << e[3]) - 1u;
      s.tcq_parts = reinterpret_cast<const float*>(e[4]);
      if (s.tcq_parts && e[3] != 8) throw std::invalid_argument("walshkv decode attention: split tcq tables need L = 8");
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
    if (s.fmt == FMT_TCQ) {
      auto g = std::make_unique<TcqGeom>();
      if (tcq_geom(s, *g)) {
        make_tcq_vbmi(s, *g);
        if (!s.tcq_vbmi.ok) s.tcq_avx2 = make_tcq_avx2(s, *g);
      }
    }
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
