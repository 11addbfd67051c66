// walshkv's CPU kernel (a header of cpu_kernel.cpp): tcq's encoder after its rotation (tcq_encode), the accelerated
// implementation of walshkv.codecs.trellis.TCQ_CODES that walshkv/attention/cpu.py registers; the torch path
// (walshkv.ops.trellis.encode) is its reference (the same codes: tests/attention/test_tcq_encode.py).
#pragma once

#include <pybind11/pybind11.h>

#include <utility>

#include "cpu_kernel_simd.h"

// Same codes as the torch path, bit for bit, because every cost is the same float32 number and every choice between
// equal costs goes the same way:
// - a state's cost is best + (x - tab[s])**2 as torch computes it: a subtract, a multiply, an add, each rounded once.
//   No FMA: GCC contracts a * b + c into one in C++ at any -std (-ffp-contract=fast; only ISO C modes turn it off),
//   and -march=haswell or native has FMA, so each product passes through tcq_rounded, which the compiler cannot see
//   through, before it is added;
// - torch's min(dim=1) over a predecessor group and argmin over the last states both return the FIRST index of the
//   smallest value (a strict < here: a later equal cost never replaces an earlier one), and an all-Inf group (the
//   second pass's excluded states) gives index 0 in both.
// A non-finite value makes the call decline (the codec never passes one: it refuses non-finite K/V first).
namespace tcq_enc {

constexpr int MAX_K = 8;  // bits per value (2**K predecessors: a uint8 back pointer holds j < 256)

// v, as a value the compiler must have rounded and cannot fuse into the add that follows: an empty asm that may change
// it, in a register where the target has one of its size (the portable build's 32-byte vectors without AVX: memory).
template <class T>
static inline T tcq_rounded(T v) {
#if defined(__x86_64__)
#if defined(__AVX512F__)
  constexpr size_t reg = 64;
#elif defined(__AVX__)
  constexpr size_t reg = 32;
#else
  constexpr size_t reg = 16;
#endif
  if constexpr (sizeof(T) <= reg)
    __asm__("" : "+x"(v));
  else
    __asm__("" : "+m"(v));
#elif defined(__aarch64__)
  if constexpr (sizeof(T) <= 16)
    __asm__("" : "+w"(v));
  else
    __asm__("" : "+m"(v));
#else
  __asm__("" : "+m"(v));
#endif
  return v;
}

// Per-thread buffers of one row's two passes.
struct Scratch {
  std::vector<float> cost, next, turned;
  std::vector<uint8_t> back;
  std::vector<int32_t> states, twidths;
  void fit(int64_t n, int64_t size) {
    if ((int64_t)cost.size() < size) {
      cost.resize(size);
      next.resize(size);
    }
    if ((int64_t)back.size() < n * (size >> 1)) back.resize(n * (size >> 1));
    if ((int64_t)states.size() < n) {
      states.resize(n);
      turned.resize(n);
      twidths.resize(n);
    }
  }
};

// One trellis step of K bits over size = 2**L states: state s' = m * 2**K + b (b: the value's code) follows the
// states j * low + m (low = 2**(L-K), j < 2**K). Per group m: the first smallest cost of its 2**K predecessors and its
// j (the back pointer); then every state's cost, best[m] + (x - tab[s'])**2. The plain loops, for any low and K (a
// trellis too small for the vector step below, or a width above 5).
template <int K>
static void tcq_step_plain(const float* __restrict cost, float* __restrict next, uint8_t* __restrict back,
                           const float* __restrict tab, float x, int64_t size) {
  constexpr int64_t FAN = int64_t(1) << K;
  const int64_t low = size >> K;
  for (int64_t m = 0; m < low; ++m) {
    float best = cost[m];
    uint8_t arg = 0;
    for (int64_t j = 1; j < FAN; ++j) {
      if (cost[j * low + m] < best) {
        best = cost[j * low + m];
        arg = (uint8_t)j;
      }
    }
    back[m] = arg;
    for (int64_t b = 0; b < FAN; ++b) {
      const float dx = x - tab[m * FAN + b];
      const float err = tcq_rounded(dx * dx);
      next[m * FAN + b] = best + err;
    }
  }
}

// W float lanes (W = VW, or 8 in an AVX-512 build for groups of 8), their int32 and byte twins.
template <int W>
struct TcqVec {
  typedef float f __attribute__((vector_size(W * 4)));
  typedef float fu __attribute__((vector_size(W * 4), aligned(4)));  // an unaligned load
  typedef int32_t i __attribute__((vector_size(W * 4)));
  typedef uint8_t b __attribute__((vector_size(W)));
};

// W back pointers (0 .. 255) as bytes.
template <int W>
static inline void tcq_store_back(typename TcqVec<W>::i arg, uint8_t* __restrict back) {
#if defined(__AVX2__) && !defined(__AVX512VL__)
  if constexpr (W == 8) {  // GCC converts 8 int32 to 8 bytes lane by lane without AVX-512: pack them instead
    const __m256i a = (__m256i)arg;
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    _mm_storel_epi64((__m128i*)back, _mm_packus_epi16(words, words));
  } else
#endif
  {
    const typename TcqVec<W>::b narrow = __builtin_convertvector(arg, typename TcqVec<W>::b);  // AVX-512: vpmovdb
    std::memcpy(back, &narrow, W);
  }
}

// Lanes Q * W .. Q * W + W - 1 of the states that W groups lead to: each group's best repeated 2**K times (a lane
// permute while 2**K < W, a broadcast from there).
template <int K, int Q, int W, size_t... I>
static inline typename TcqVec<W>::f tcq_repeat(typename TcqVec<W>::f best, std::index_sequence<I...>) {
  return __builtin_shufflevector(best, best, (int)((Q * W + I) >> K)...);
}

// The states that W groups m0 .. m0 + W - 1 lead to (2**K vectors of W): cost best[m] + (x - tab[s'])**2.
template <int K, int W, size_t... Q>
static inline void tcq_expand(typename TcqVec<W>::f best, typename TcqVec<W>::f xv, const float* __restrict tab,
                              float* __restrict next, std::index_sequence<Q...>) {
  using fu = typename TcqVec<W>::fu;
  (
      [&] {
        const typename TcqVec<W>::f dx = xv - *(const fu*)(tab + Q * W);
        const typename TcqVec<W>::f err = tcq_rounded(dx * dx);
        *(fu*)(next + Q * W) = tcq_repeat<K, (int)Q, W>(best, std::make_index_sequence<W>{}) + err;
      }(),
      ...);
}

// tcq_step_plain's step, W groups at a time in registers (low a multiple of W). The first smallest of each group's
// 2**K predecessors (the rows j * low + m0 .. of the cost table): blocks of up to 8 rows reduced by a tree of pairs,
// the blocks then in order. Every comparison has the lower j on its left and takes the right only where strictly
// smaller, so each result is its range's FIRST smallest, as torch's min(dim=1) (3 rounds at 2**K = 8 instead of a
// chain of 7). Then the 2**K vectors of states they lead to.
template <int K, int W>
static void tcq_step(const float* __restrict cost, float* __restrict next, uint8_t* __restrict back,
                     const float* __restrict tab, float x, int64_t size) {
  using f = typename TcqVec<W>::f;
  using fu = typename TcqVec<W>::fu;
  using vi32 = typename TcqVec<W>::i;
  constexpr int64_t FAN = int64_t(1) << K, BLOCK = FAN < 8 ? FAN : 8;
  const int64_t low = size >> K;
  f xv;
  for (int l = 0; l < W; ++l) xv[l] = x;
  // the first smallest of rows j0 .. j0 + BLOCK - 1 (a tree of pairs), and its j
  const auto block = [&](int64_t m0, int64_t j0, f& least, vi32& at) {
    f c[BLOCK];
    vi32 a[BLOCK];
#pragma GCC unroll 8
    for (int64_t j = 0; j < BLOCK; ++j) {
      c[j] = *(const fu*)(cost + (j0 + j) * low + m0);
      a[j] = vi32{} + (int32_t)(j0 + j);
    }
#pragma GCC unroll 3
    for (int64_t span = 1; span < BLOCK; span *= 2) {
#pragma GCC unroll 4
      for (int64_t j = 0; j < BLOCK; j += 2 * span) {
        const vi32 less = c[j + span] < c[j];
        c[j] = less ? c[j + span] : c[j];
        a[j] = less ? a[j + span] : a[j];
      }
    }
    least = c[0];
    at = a[0];
  };
  for (int64_t m0 = 0; m0 < low; m0 += W) {
    f best, c;
    vi32 arg, a;
    block(m0, 0, best, arg);
#pragma GCC unroll 4
    for (int64_t j0 = BLOCK; j0 < FAN; j0 += BLOCK) {
      block(m0, j0, c, a);
      const vi32 less = c < best;
      best = less ? c : best;
      arg = less ? a : arg;
    }
    tcq_store_back<W>(arg, back + m0);
    tcq_expand<K, W>(best, xv, tab + m0 * FAN, next + m0 * FAN, std::make_index_sequence<FAN>{});
  }
}

typedef void (*TcqStep)(const float*, float*, uint8_t*, const float*, float, int64_t);

// The step for K bits and low groups: whole vectors of VW groups, else of 8 (an AVX-512 build), else (or above 5
// bits, wider than tcq's) the plain loops.
template <int K>
static TcqStep tcq_pick(int64_t low) {
  if constexpr (K <= 5) {
    if (low % VW == 0) return tcq_step<K, VW>;
    if constexpr (VW > 8)
      if (low % 8 == 0) return tcq_step<K, 8>;
  }
  return tcq_step_plain<K>;
}

static TcqStep tcq_pick_step(int k, int64_t low) {
  switch (k) {
    case 1: return tcq_pick<1>(low);
    case 2: return tcq_pick<2>(low);
    case 3: return tcq_pick<3>(low);
    case 4: return tcq_pick<4>(low);
    case 5: return tcq_pick<5>(low);
    case 6: return tcq_pick<6>(low);
    case 7: return tcq_pick<7>(low);
    default: return tcq_pick<8>(low);
  }
}

// One Viterbi pass (walshkv.ops.trellis._viterbi): the states [n] of the least-squares path through x [n] with
// widths w [n]; wrap >= 0: the path's first state has wrap as its high L - w[0] bits and its last state has it as its
// low L - w[0] bits.
static void tcq_pass(const float* x, const int32_t* w, int64_t n, int L, const float* tab, int64_t wrap, Scratch& s,
                     int32_t* states) {
  const int64_t size = int64_t(1) << L, bstride = size >> 1;
  const float inf = std::numeric_limits<float>::infinity();
  float* cost = s.cost.data();
  float* next = s.next.data();
  for (int64_t q = 0; q < size; ++q) {
    const float dx = x[0] - tab[q];
    cost[q] = dx * dx;  // nothing added: no FMA to fear
  }
  if (wrap >= 0)
    for (int64_t q = 0; q < size; ++q) cost[q] = (q >> w[0]) == wrap ? cost[q] : inf;
  for (int64_t i = 1; i < n; ++i) {
    uint8_t* back = s.back.data() + (i - 1) * bstride;
    tcq_pick_step(w[i], size >> w[i])(cost, next, back, tab, x[i], size);
    std::swap(cost, next);
  }
  const int64_t lowmask = (size >> w[0]) - 1;
  int64_t state = 0;
  float least = inf;
  for (int64_t q = 0; q < size; ++q) {
    const float c = wrap < 0 || (q & lowmask) == wrap ? cost[q] : inf;
    if (q == 0 || c < least) {
      least = c;
      state = q;
    }
  }
  states[n - 1] = (int32_t)state;
  for (int64_t i = n - 1; i > 0; --i) {
    const int k = w[i];
    const int64_t m = state >> k;
    state = (int64_t)s.back[(i - 1) * bstride + m] * (size >> k) + m;
    states[i - 1] = (int32_t)state;
  }
}

// The codes of one row (walshkv.ops.trellis.viterbi, then each state's low w[i] bits): a pass over the row turned by
// half (x[half:], x[:half]) picks the wrap bits (its state of value n - 1, low L - w[0] bits), a second pass is held
// to them.
static void tcq_row(const float* x, const int32_t* w, int64_t n, int L, const float* tab, Scratch& s, int32_t* out) {
  const int64_t half = n / 2;
  for (int64_t j = 0; j < n; ++j) {
    s.turned[j] = x[(j + half) % n];
    s.twidths[j] = w[(j + half) % n];
  }
  tcq_pass(s.turned.data(), s.twidths.data(), n, L, tab, -1, s, s.states.data());
  const int64_t wrap = s.states[n - 1 - half] & ((int64_t(1) << (L - w[0])) - 1);
  tcq_pass(x, w, n, L, tab, wrap, s, s.states.data());
  for (int64_t j = 0; j < n; ++j) out[j] = s.states[j] & ((1 << w[j]) - 1);
}

}  // namespace tcq_enc

// tcq's encoder after its rotation (walshkv.codecs.trellis.TrellisQuant._encode, whose torch path,
// walshkv.ops.trellis.encode, is the reference): rows t [n][d] (float32, the rotated, norm-scaled values) to the
// codes [n][d] (int32, value j's low w_j bits of its trellis state) of each row's tail-biting path. desc: n, d, L,
// t, table (float32 [2**L]), out, then the d widths. Returns false, with out undefined, where it declines: a width
// outside 1..8 or above L, L outside 1..12, or a non-finite value (the torch path runs then).
static bool tcq_encode(const std::vector<int64_t>& desc, int64_t nthreads) {
  if (desc.size() < 6) throw std::invalid_argument("walshkv tcq encode: descriptor too short");
  const int64_t n = desc[0], d = desc[1], L = desc[2];
  if (n < 0 || d < 1 || (int64_t)desc.size() != 6 + d)
    throw std::invalid_argument("walshkv tcq encode: bad descriptor");
  if (L < 1 || L > 12) return false;  // (tcq has 8 and 10; this bounds the buffers each thread keeps)
  std::vector<int32_t> w(d);
  for (int64_t j = 0; j < d; ++j) {
    const int64_t k = desc[6 + j];
    if (k < 1 || k > tcq_enc::MAX_K || k > L) return false;
    w[j] = (int32_t)k;
  }
  const float* t = reinterpret_cast<const float*>(desc[3]);
  const float* tab = reinterpret_cast<const float*>(desc[4]);
  int32_t* out = reinterpret_cast<int32_t*>(desc[5]);
  const int64_t size = int64_t(1) << L;
  pybind11::gil_scoped_release nogil;
  for (int64_t i = 0; i < n * d; ++i)
    if (!std::isfinite(t[i])) return false;
  // threads for a block worth them (16 rows of 64 at L = 8, ~5 us each): a decode step's few rows stay on this one
#pragma omp parallel num_threads((int)std::max<int64_t>(1, nthreads)) if (n * d * size >= (int64_t(1) << 18))
  {
    static thread_local tcq_enc::Scratch scratch;
    scratch.fit(d, size);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) tcq_enc::tcq_row(t + i * d, w.data(), d, (int)L, tab, scratch, out + i * d);
  }
  return true;
}
