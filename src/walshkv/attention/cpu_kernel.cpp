// Fused CPU decode attention straight from packed K/V codes: walshkv's C++ kernel, its entry points and bindings.
//
// Built on first use by walshkv.attention.cpu.load_kernel: walshkv.attention.cpu.kernel_source inlines the
// "cpu_kernel_*.h" headers this file includes (each once, in this order, with #line marks so the compiler names the
// header and line) and torch.utils.cpp_extension.load_inline compiles that one text; the build cache name hashes it, so
// an edit of any of these files builds a fresh module. The byte layouts it reads are described in
// walshkv/attention/cpu.py; walshkv/attention/cpu_formats.py describes each codec to it. The format ids and limits
// (cpu_kernel_formats.h) are exported to Python (FORMATS, MAX_BANDS, MAX_SEGS) and checked against the Python side when
// the module loads. Here: run_range (one token range of one kv head through tiles), run (decode attention), decode_rows
// (prefill tiles), and the module's bindings.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "cpu_kernel_simd.h"        // vector width, vector types and helpers
#include "cpu_kernel_formats.h"     // format ids, limits, the packed-tensor descriptor (Src)
#include "cpu_kernel_unpack.h"      // code streams to floats and levels
#include "cpu_kernel_decode.h"      // a tile of rows to floats, per format
#include "cpu_kernel_keys.h"        // prerope+ keys: matrix, AMX, Hadamard maps and RoPE
#include "cpu_kernel_idot.h"        // 4-bit K scored by byte dot products
#include "cpu_kernel_score.h"       // scores, online softmax, weighted V sums
#include "cpu_kernel_tq_encode.h"   // tq's encoder after its rotation
#include "cpu_kernel_tcq_encode.h"  // tcq's encoder after its rotation (the trellis search)

namespace py = pybind11;

// A block table (vLLM's paged cache): request b's token t is row t % block_size of block table[b * table_stride +
// t / block_size]; the request has lens[b] tokens. table == nullptr: rows are (batch, token) as the strides say.
struct Paging {
  const int32_t* table = nullptr;
  const int32_t* lens = nullptr;
  int64_t table_stride = 0, block_size = 0;
};

// Paging from its descriptor: empty, or [table pointer, table row stride, block size, lens pointer, number of
// blocks]. Every block a request's tokens need is checked against the number of blocks here, before any read.
static Paging make_paging(const std::vector<int64_t>& a, int64_t B, int64_t& T) {
  Paging pg;
  if (a.empty()) return pg;
  if (a.size() != 5 || a[1] < 0 || a[2] < 1 || a[4] < 0)
    throw std::invalid_argument("walshkv decode attention: bad paging descriptor");
  pg.table = reinterpret_cast<const int32_t*>(a[0]);
  pg.table_stride = a[1];
  pg.block_size = a[2];
  pg.lens = reinterpret_cast<const int32_t*>(a[3]);
  T = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pg.lens[b];
    if (n < 0) throw std::invalid_argument("walshkv paged decode: a negative sequence length");
    if ((n + pg.block_size - 1) / pg.block_size > pg.table_stride)
      throw std::invalid_argument("walshkv paged decode: a sequence needs more blocks than a block-table row has");
    for (int64_t j = 0; j < (n + pg.block_size - 1) / pg.block_size; ++j) {
      const int64_t blk = pg.table[b * pg.table_stride + j];
      if (blk < 0 || blk >= a[4])
        throw std::invalid_argument("walshkv paged decode: request " + std::to_string(b) + " names block " +
                                    std::to_string(blk) + " but the pages hold blocks 0.." +
                                    std::to_string(a[4] - 1) +
                                    ": a block table from another cache, or one the engine did not fill; pass the "
                                    "layer's own pages and block table");
    }
    T = std::max(T, n);
  }
  return pg;
}

// An additive score bias per key (a frame whose keys carry a term the codes do not: a block frame's mean turned to
// each key's offset): bias[g * stride_g + t] is added to head g's scaled score of token t. ptr == nullptr: none.
struct Bias {
  const float* ptr = nullptr;
  int64_t stride_n = 0, stride_g = 0;
};

// Bias from its descriptor: empty, or [pointer, stride per (batch, kv head), stride per query head of a group].
static Bias make_bias(const std::vector<int64_t>& a) {
  Bias bs;
  if (a.empty()) return bs;
  if (a.size() != 3 || a[1] < 0 || a[2] < 0) throw std::invalid_argument("walshkv decode attention: bad bias descriptor");
  bs.ptr = reinterpret_cast<const float*>(a[0]);
  bs.stride_n = a[1];
  bs.stride_g = a[2];
  return bs;
}

// A vector added to every decoded key at offset j of its block (a block frame whose keys carry their mean turned to
// that offset): row = row * row_factor + W[h][j], in K's buffer basis, before the scores. One add per element and
// kv head, shared by its query heads. W: a padded copy [H][qblock][LKD]; nullptr: none.
struct KeyTab {
  float* W = nullptr;
};

// One (batch, head, token range): online softmax over tiles. q: [G][LK] (zero columns pad), acc: [G][LV];
// m, l: [G]. LK, LV are multiples of VW; buffers 64-byte aligned. bias: this (batch, head)'s rows, or nullptr.
// qblock > 0: q is [ceil((qoff + T) / qblock)][G][LK], one query per block of qblock tokens, token t at offset
// qoff + t of the blocks (the first block is short when qoff > 0; tiles stop at block ends);
// ktab: this head's rows of a KeyTab ([qblock][LKD]) or nullptr.
static void run_range(const Src& K, const Src& V, TileFn kdec, TileFn vdec, const KPost& kp,
                      const float* __restrict qall, int64_t qblock, int64_t qoff, int64_t b, int64_t h, int64_t t0, int64_t t1,
                      int64_t G, int64_t LKD, int64_t LK, int64_t LV, float* __restrict m, float* __restrict l,
                      float* __restrict acc,
                      float* __restrict ktile, float* __restrict ztile, float* __restrict vtile,
                      float* __restrict sc, uint16_t* __restrict abf, IdotFn idot, const IQuery* __restrict iq,
                      int nch, const Paging& pg, const float* __restrict bias, int64_t bias_g,
                      const float* __restrict ktab) {
  // LKD: floats per decoded K row; LK: per scored row (the query's length: LKD, or kp.ld for prerope+)
  // iq: the heads' integer queries where K's 4-bit codes are scored by byte dot products (idot), else nullptr
  // pg: with a block table, token t of request b is row t % block_size of block table[b][t / block_size] (the
  // codes' "batch" is the block); tiles stop at block ends. Positions (prerope+) stay the request's own t.
  const int64_t nk = LK / VW, nv = LV / VW;
  float rsk[TILE], rsv[TILE];
  bool first = true;
  for (int64_t tb = t0, nt = 0; tb < t1; tb += nt) {
    nt = std::min<int64_t>(TILE, t1 - tb);
    const float* q = qall;
    if (qblock > 0) {  // this block's query
      nt = std::min<int64_t>(nt, qblock - (tb + qoff) % qblock);
      q = qall + ((tb + qoff) / qblock) * G * LK;
    }
    int64_t rb = b, rt = tb;  // where the rows are: (batch, token), or (block, row in block) when paged
    if (pg.table) {
      nt = std::min<int64_t>(nt, pg.block_size - tb % pg.block_size);
      rb = pg.table[b * pg.table_stride + tb / pg.block_size];
      rt = tb % pg.block_size;
    }
    if (iq) {
      idot(K, rb, h, rt, (int)nt, iq, G, nch, sc);
    } else {
      const bool pairs = decode_k_tile(K, kdec, kp, rb, h, rt, (int)nt, ktile, LKD, rsk, abf);
      // a block frame's table: row j added to each key at offset j of its block (row factor first), in the scores
      const float* w = ktab ? ktab + ((tb + qoff) % qblock) * LKD : nullptr;  // tiles stop at block ends
      if (kp.on && had_fused(kp) && !pairs) {  // Hadamard form: each key scored in registers where it is made
        had_score_tile(kp, h, tb, (int)nt, ktile, LKD, rsk, q, G, LK, sc);
      } else {
        const float* kscore = ktile;
        if (kp.on) {  // keys before RoPE: to the model's basis and rotated to their positions (row factor folded)
          transform_keys(kp, h, tb, (int)nt, ktile, LKD, rsk, ztile, abf, pairs);
          for (int i = 0; i < nt; ++i) rsk[i] = 1.0f;
          kscore = ztile;
        }
        score_tile(kscore, q, G, LK, nk, (int)nt, rsk, sc, w);
      }
    }
    if (bias)
      for (int64_t j = 0; j < G; ++j)
        for (int i = 0; i < nt; ++i) sc[j * TILE + i] += bias[j * bias_g + tb + i];
    softmax_tile(sc, (int)nt, G, first, m, l, acc, LV, nv);
    first = false;
    vdec(V, rb, h, rt, (int)nt, vtile, LV, rsv);
    for (int i = nt; i < TILE; ++i) rsv[i] = 0.0f;
    for (int64_t j = 0; j < G; ++j)  // the weights times V's row factors
      for (int v = 0; v < TILE / VW; ++v) ((vf*)(sc + j * TILE))[v] *= *(const vfu*)(rsv + v * VW);
    for (int64_t j0 = 0; j0 < G; j0 += JB) {  // weighted V rows: up to JB heads x one vector in registers
      const float* w = sc + j0 * TILE;
      float* a = acc + j0 * LV;
      switch (std::min<int64_t>(JB, G - j0)) {
        case 1: acc_block<1>(w, vtile, (int)nt, LV, nv, a); break;
        case 2: acc_block<2>(w, vtile, (int)nt, LV, nv, a); break;
        case 3: acc_block<3>(w, vtile, (int)nt, LV, nv, a); break;
        default: acc_block<4>(w, vtile, (int)nt, LV, nv, a); break;
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

// KeyTab from its descriptor: empty, or [pointer, L] (W: [H][qblock][L] contiguous float32, L = K's buffer floats).
static KeyTab make_key_tab(const std::vector<int64_t>& a, int64_t H, int64_t qblock, int64_t L, int64_t LKD) {
  KeyTab kt;
  if (a.empty()) return kt;
  if (a.size() != 2 || a[1] != L || qblock < 1)
    throw std::invalid_argument("walshkv decode attention: bad key table descriptor (it needs a query per block and "
                                "K's buffer length)");
  const float* W = reinterpret_cast<const float*>(a[0]);
  kt.W = alloc_floats(H * qblock * LKD);
  for (int64_t r = 0; r < H * qblock; ++r) std::memcpy(kt.W + r * LKD, W + r * L, sizeof(float) * L);
  return kt;
}

// q: float [B*H][G][K.L] (scaled, in K's buffer order). Outputs: m, l: [B*H][G]; acc: [B*H][G][V.L] (V's
// buffer order). The T tokens are cut into nsplit ranges run in parallel, then merged.
// kpost: empty, or the prerope+ descriptor (make_kpost); then q is [B*H][G][d] in the model's basis.
// paging: empty, or a block table (make_paging): then B is the number of requests, T is taken from their lengths,
// and the codes' batch strides step over blocks. bias: empty, or an additive score bias per key (make_bias).
// qblock > 0: one query per block of qblock tokens, q: [B*H][ceil((qoff + T) / qblock)][G][K.L] (a block frame's
// query turned back to each block's first position and mapped once per block); token t sits at offset qoff + t of
// the blocks (0 <= qoff < qblock: a first block cut short). Not with kpost, and scored in floats.
// ktab: empty, or a vector added to each decoded key by its offset in its block (make_key_tab; needs qblock).
static void run(const std::vector<int64_t>& kdesc, const std::vector<int64_t>& vdesc, const std::vector<int64_t>& kpost,
                int64_t q_ptr, int64_t m_ptr, int64_t l_ptr, int64_t acc_ptr, int64_t B, int64_t H, int64_t G, int64_t T,
                int64_t nsplit, int64_t nthreads, bool int_dot, const std::vector<int64_t>& paging,
                const std::vector<int64_t>& bias, int64_t qblock, const std::vector<int64_t>& ktab, int64_t qoff) {
  const Paging pg = make_paging(paging, B, T);
  const Bias bs = make_bias(bias);
  const Src K = make_src(kdesc), V = make_src(vdesc);
  const KPost kp = make_kpost(kpost, H, T);
  if (kp.on && kp.L != K.L) throw std::invalid_argument("walshkv decode attention: prerope matrix rows != K row length");
  if (kp.amx && !amx_ready()) throw std::invalid_argument("walshkv decode attention: AMX is not available here");
  if (qblock < 0 || (qblock > 0 && kp.on))
    throw std::invalid_argument("walshkv decode attention: a query per block needs qblock >= 1 and no prerope matrix");
  if (qoff < 0 || (qoff > 0 && qoff >= qblock))
    throw std::invalid_argument("walshkv decode attention: the block offset must be in 0 .. qblock - 1");
  // queries per (batch, head)
  const int64_t NB = qblock > 0 ? std::max<int64_t>(1, (qoff + T + qblock - 1) / qblock) : 1;
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
  const KeyTab kt = make_key_tab(ktab, H, qblock, K.L, LKD);
  float* qp = alloc_floats(N * NB * G * LK);
  for (int64_t r = 0; r < N * NB * G; ++r) std::memcpy(qp + r * LK, q + r * QL, sizeof(float) * QL);
  // 4-bit K (int4, q4_0; not keys before RoPE, one query per head): the queries split for byte dot products (IQuery)
  const int nch = int_dot && !kp.on && qblock == 0 ? idot_chunks(K) : 0;
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
        const int64_t t0 = sp * per, t1 = std::min<int64_t>(pg.lens ? pg.lens[n / H] : T, t0 + per);
        if (t0 < t1)
          run_range(K, V, kdec, vdec, kp, qp + n * NB * G * LK, qblock, qoff, n / H, n % H, t0, t1, G, LKD, LK, LV,
                    pm.data() + task * G, pl.data() + task * G, pacc + task * G * LV, ktile, ztile, vtile, sc, abf,
                    idot, iqs ? iqs + n * G : nullptr, nch, pg, bs.ptr ? bs.ptr + n * bs.stride_n : nullptr,
                    bs.stride_g, kt.W ? kt.W + (n % H) * qblock * LKD : nullptr);
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
  std::free(kt.W);
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

// Which decoder reads a tcq descriptor's rows: "vbmi" (TcqVbmi), "avx2" (TcqAvx2) or "generic" (tcq_row); the tests
// check that the layouts the presets use take the VBMI path where the build has it, else the AVX2 one.
static std::string tcq_path(const std::vector<int64_t>& desc) {
  const Src S = make_src(desc);
  if (S.fmt != FMT_TCQ) throw std::invalid_argument("walshkv tcq path: not a tcq descriptor");
  return S.tcq_vbmi.ok ? "vbmi" : S.tcq_avx2 ? "avx2" : "generic";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("run", &run, "fused decode attention over packed K/V (see walshkv.attention.cpu)", py::arg("kdesc"),
          py::arg("vdesc"), py::arg("kpost"), py::arg("q"), py::arg("m"), py::arg("l"), py::arg("acc"), py::arg("B"),
          py::arg("H"), py::arg("G"), py::arg("T"), py::arg("nsplit"), py::arg("nthreads"), py::arg("int_dot") = true,
          py::arg("paging") = std::vector<int64_t>{}, py::arg("bias") = std::vector<int64_t>{},
          py::arg("qblock") = 0, py::arg("key_table") = std::vector<int64_t>{}, py::arg("qoff") = 0);
  mod.def("decode_rows", &decode_rows, "packed rows to floats, as the kernel reads them (prefill tiles)");
  mod.def("tq_pack", &tq_pack, "tq's encoder after its rotation: rows to packed codes (TurboQuant._encode)");
  mod.def("tcq_encode", &tcq_encode, "tcq's encoder after its rotation: rows to trellis codes (TrellisQuant._encode)");
  mod.def("tcq_path", &tcq_path, "which decoder reads a tcq descriptor's rows (vbmi, avx2 or generic)");
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
  formats["tcq"] = (int)FMT_TCQ;
  mod.attr("FORMATS") = formats;
  mod.attr("MAX_BANDS") = MAX_BANDS;
  mod.attr("MAX_SEGS") = MAX_SEGS;
}
