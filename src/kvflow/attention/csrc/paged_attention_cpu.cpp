// Attention over the paged KV cache on CPU, reading K and V in place from their blocks.
//
// One work item is (request, KV head): the G = H / Hkv query heads that share the KV head, for up
// to 16 queries of the request at a time, in three passes over the keys they see: (1) the scores,
// walking the key blocks; (2) each row's softmax over all its scores at once (one max, one sum);
// (3) the probability-weighted values, walking the value blocks. Blocks lie anywhere in the pool,
// where the hardware prefetcher, which follows addresses, never sees the next one coming, so each
// pass requests the block three ahead of the one in use into L2, a line between each of its own
// loads (`Prefetcher`). Scores over a block come 16 keys at a time for bfloat16 caches (`scores16`:
// keys transposed in registers, widened to float by a shift or a mask, float multiply-adds) and one key
// at a time from keys widened to float otherwise; the values accumulate in float (bfloat16 caches:
// each value row widened once for the query's G heads, `accumulate_rows`; others: values widened
// to float first). A running softmax, rescaled block by block, had spent more time in its short
// reductions than the scores took. On the Intel Xeons this was tuned on, bfloat16 dot products
// (`vdpbf16ps`) were the slower way: one occupies the vector ports ~4.5× as long as a float
// multiply-add. On the AMD EPYC (Zen 4) scores on them measured no faster either (128 decodes:
// 1.49-1.52 against 1.51-1.70 ms a layer): the passes are bound by their reads of K and V more
// than by the multiply-adds (docs/performance-journal.md, stop 37). Values and scores of keys no query
// sees are never used: a block's unwritten tail, padding entries of the block table and blocks a
// window released hold whatever bits the pool had (`scores16` reads a visible block's whole
// sixteens of keys, but a score of an unwritten key is never read), and using them would let
// 0 x NaN into the sum.
//
// Where the CPU has AMX, the scores of bfloat16 queries over a bfloat16 cache, for up to 16 rows
// (a decode's G heads, a short chunk's few queries), run on tiles instead (`scores16_amx`): the
// keys are the A operand exactly as they lie, so no transpose, and each 16 keys x 32 dimensions
// takes one tile multiply. With the K/V in cache this took 9-30% off a W1-shaped decode's
// attention; read from memory it is bound by the reads either way (docs/performance-journal.md, stop 33).
// The values stay on multiply-adds: interleaving them by key pairs for tiles cost more than it saved.
// The caller asks for tiles (`tiles`) only for calls with enough keys to repay their fixed cost
// (cpu_paged.use_tiles), and never in batch-invariant mode: which path a row takes must not
// depend on its batch, and the two sum a score's products in different orders.
//
// Quantized caches (kv_quant.py: int8, fp8 E4M3 or fp8 E5M2 codes, one bfloat16 scale per position
// and head, a (block, head) row holding the block's codes then its scales) are read in place too,
// at half a bfloat16 cache's bytes. The scale of a position multiplies its key's score and its
// value's probability, so the codes themselves are widened exactly (an int8 or an fp8 number is a
// float) and code x scale is never rounded. int8 codes with AVX-512 take the sixteens path
// (`scores16_int8`: four codes per 32-bit lane of the transposed keys, each widened by two shifts
// and a convert; `accumulate_code_rows`); so do fp8 codes (`scores16_fp8`, `accumulate_code_rows`:
// each code made a half, two codes per 32-bit lane, and widened by the half-to-float convert, which
// handles subnormals exactly; an E4M3 code's bits are moved into a half's places, an E5M2 code is
// a half's top byte already). Other widths and block sizes widen codes to float first.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "kvflow_avx512.h"
#define KVFLOW_AVX512 1
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "kvflow_amx.h"
#define KVFLOW_PAGED_AMX 1
#endif
#endif

namespace {

// How far ahead a pass requests blocks: at one block ahead, a block's compute (~1,000 cycles)
// ended before its successor had arrived from memory (2026-11-27, 128 W1-shaped decodes, one
// layer, two threads, pool from DRAM: 1, 2, 3, 4 blocks ahead 2.41, 2.33, 2.23, 2.28 ms).
constexpr int64_t kPrefetchBlocks = 3;
// Queries attended together: their scores over every key they see stay in a per-thread buffer
// (16 queries x G heads x the context, in float).
constexpr int64_t kQueryChunk = 16;
constexpr int64_t kMaxBlock = 128;  // the largest block size (config.py)

inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  // A bfloat16 is the top half of a float: a shift, which the compiler vectorises.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Quantized caches: codes of one position x its scale, to float (exact: both have 8 significant
// bits). The fp8 forms follow the AVX-512 helpers they share.
inline void widen_codes(const int8_t* src, float scale, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}


inline float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// exp(x) for x <= 0 (a score minus the running max), vectorisable: 2^n · e^r with n = round(x / ln 2)
// and |r| <= ln 2 / 2 (ln 2 in two parts, Cody and Waite), e^r by its Taylor polynomial to r^7
// (relative error under 2^-23 there). Below -87 the result is clamped to e^-87 ~ 1.6e-38 instead of
// a subnormal or 0: a weight no float32 sum of probabilities can see.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer, vectorisably
  const float n = (x * 1.44269504088896341f + kRound) - kRound;
  float r = x - n * 0.693145751953125f;
  r = r - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// ar[d] += Σ_t p[t] · v[t][d] from values widened to float (float and half caches; bfloat16 ones
// take accumulate_rows). The sums stay in registers over all the keys, W columns at a
// time, 64 first: four independent 16-wide multiply-adds per key, where one 16-wide column at a
// time made each key's multiply-add wait for the previous one's. Each sum adds the keys in order.
template <int W>
inline int64_t accumulate_columns(float* ar, const float* p, const float* values, int64_t t_lo, int64_t t_hi,
                                  int64_t head_dim, int64_t d0) {
  for (; d0 + W <= head_dim; d0 += W) {
    float a[W];
#pragma omp simd
    for (int dd = 0; dd < W; ++dd) a[dd] = ar[d0 + dd];
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const float pt = p[t];
      const float* vt = values + t * head_dim + d0;
#pragma omp simd
      for (int dd = 0; dd < W; ++dd) a[dd] += pt * vt[dd];
    }
#pragma omp simd
    for (int dd = 0; dd < W; ++dd) ar[d0 + dd] = a[dd];
  }
  return d0;
}

inline void accumulate_values(float* ar, const float* p, const float* values, int64_t t_lo, int64_t t_hi, int64_t head_dim) {
  int64_t d0 = accumulate_columns<64>(ar, p, values, t_lo, t_hi, head_dim, 0);
  d0 = accumulate_columns<16>(ar, p, values, t_lo, t_hi, head_dim, d0);
  for (int64_t t = t_lo; t < t_hi && d0 < head_dim; ++t)
    for (int64_t d = d0; d < head_dim; ++d) ar[d] += p[t] * values[t * head_dim + d];
}

// The lines of one block of one KV head, requested a line at a time between the loads of the block
// in use: requested all at once, they stalled the core while they waited for free line-fill
// buffers. They are requested into L2 (prefetcht1), not L1: on an AMD EPYC (Zen 4) 128 W1-shaped
// decodes from memory took 1.43-1.80 ms a layer against 2.04-2.21 into L1, whose few miss
// buffers capped the lines in flight; on the Xeon the two hints measured alike (docs/performance-journal.md,
// stops 33 and 35).
struct Prefetcher {
  const char* next = nullptr;
  const char* end = nullptr;
  void start(const void* block, int64_t bytes) {
    next = static_cast<const char*>(block);
    end = next + bytes;
  }
  void stop() { next = end = nullptr; }
  [[gnu::always_inline]] void step() {
    if (next < end) {
      __builtin_prefetch(next, 0, 2);
      next += 64;
    }
  }
  void rest() {
    while (next < end) step();
  }
};

// Rows [0, rows) in groups of up to four, each group's size a compile-time constant:
// f(std::integral_constant<int, R>{}, r0) for R = 4, ..., then the 1 to 3 left over. The kernels
// below keep R rows' sums in registers.
template <typename F>
inline void in_row_groups(int64_t rows, F&& f) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    switch (std::min<int64_t>(4, rows - r0)) {
      case 1: f(std::integral_constant<int, 1>{}, r0); break;
      case 2: f(std::integral_constant<int, 2>{}, r0); break;
      case 3: f(std::integral_constant<int, 3>{}, r0); break;
      default: f(std::integral_constant<int, 4>{}, r0);
    }
  }
}

#ifdef KVFLOW_AVX512
// r[i] = row i of a 16 x 16 matrix of 32-bit elements, transposed in place. Always inlined, as is
// Prefetcher::step: GCC had kept both out of line, so each 16 keys' rows went to the stack and back
// (on the AMD EPYC, 2026-11-27, a layer of 128 W1-shaped decodes from memory, three alternated
// rounds: 2.08, 1.51, 1.54 ms out of line against 1.60, 1.43, 1.38 inlined; 16 decodes 0.236,
// 0.201, 0.288 against 0.203, 0.197, 0.235).
[[gnu::always_inline]] inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16], v[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      v[8 * i + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0x88);
      v[8 * i + 4 + j] = _mm512_shuffle_i32x4(u[8 * i + j], u[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(v[j], v[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(v[j], v[8 + j], 0xdd);
  }
}

// Rows r0..r0+R of scores16: for each dimension pair j of the 16 keys (k[j], transposed), its two
// halves widened to float once for the R rows, one multiply-add per row and half.
template <int R>
inline void score_rows(float* scores, int64_t scores_stride, const __m512i* k, const float* q, int64_t head_dim,
                       int64_t j0) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m512 even[R], odd[R];  // two sums per row: consecutive pairs' products do not wait on each other
  for (int r = 0; r < R; ++r) {
    even[r] = _mm512_loadu_ps(scores + r * scores_stride);
    odd[r] = _mm512_setzero_ps();
  }
  for (int j = 0; j < 16; ++j) {
    const __m512 k_even = _mm512_castsi512_ps(_mm512_slli_epi32(k[j], 16));
    const __m512 k_odd = _mm512_castsi512_ps(_mm512_and_si512(k[j], high_half));
    for (int r = 0; r < R; ++r) {
      const float* qr = q + r * head_dim + 2 * (j0 + j);
      even[r] = _mm512_fmadd_ps(k_even, _mm512_set1_ps(qr[0]), even[r]);
      odd[r] = _mm512_fmadd_ps(k_odd, _mm512_set1_ps(qr[1]), odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * scores_stride, _mm512_add_ps(even[r], odd[r]));
}

// scores[r][t] = q_r · k_t for 16 keys (bfloat16 rows `pos_stride` apart) and every query row (q:
// float, already scaled, head_dim apart). The keys are transposed in registers to pairs of
// dimensions × 16 keys, so each multiply-add takes one dimension of all 16 keys against a
// broadcast query value: no horizontal sum per key. (vdpbf16ps on the pairs as they are issued
// ~1.5× the work here: it occupies the vector ports ~4.5× as long as a multiply-add.)
inline void scores16(float* scores, int64_t scores_stride, const c10::BFloat16* keys, int64_t pos_stride,
                     const float* q, int64_t n_rows, int64_t head_dim, Prefetcher& prefetch) {
  const int64_t pairs = head_dim / 2;
  for (int64_t r = 0; r < n_rows; ++r) _mm512_storeu_ps(scores + r * scores_stride, _mm512_setzero_ps());
  for (int64_t j0 = 0; j0 < pairs; j0 += 16) {
    __m512i k[16];
    for (int t = 0; t < 16; ++t) {
      k[t] = _mm512_loadu_si512(keys + t * pos_stride + 2 * j0);
      prefetch.step();
    }
    transpose16(k);  // k[j]: dimension pair j0 + j of keys 0..15
    in_row_groups(n_rows, [&](auto rows, int64_t r0) {
      score_rows<decltype(rows)::value>(scores + r0 * scores_stride, scores_stride, k, q + r0 * head_dim, head_dim, j0);
    });
  }
}

using kvflow_avx512::exp_nonpositive16;  // exp_nonpositive on 16 lanes, the same steps

// Lanes of the 16 keys from `t0` that lie in [t_lo, t_hi).
inline __mmask16 visible(int64_t t0, int64_t t_lo, int64_t t_hi) {
  const int64_t a = std::max<int64_t>(t_lo - t0, 0), b = std::min<int64_t>(t_hi - t0, 16);
  return b <= a ? 0 : static_cast<__mmask16>(((1u << b) - 1) & ~((1u << a) - 1));
}

// The largest of sc[t_lo..t_hi), 16 at a time (sc holds whole sixteens; other lanes are ignored).
inline float max16(const float* sc, int64_t t_lo, int64_t t_hi) {
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t0 = t_lo / 16 * 16; t0 < t_hi; t0 += 16) m = _mm512_mask_max_ps(m, visible(t0, t_lo, t_hi), m, _mm512_loadu_ps(sc + t0));
  return _mm512_reduce_max_ps(m);
}

// pr[t] = exp(sc[t] − max) over [t_lo, t_hi) (zero elsewhere in those sixteens); their sum.
inline float exp16(const float* sc, float* pr, int64_t t_lo, int64_t t_hi, float max) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t0 = t_lo / 16 * 16; t0 < t_hi; t0 += 16) {
    const __mmask16 live = visible(t0, t_lo, t_hi);
    const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive16(_mm512_maskz_sub_ps(live, _mm512_loadu_ps(sc + t0), _mm512_set1_ps(max))));
    _mm512_storeu_ps(pr + t0, e);
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

// acc_r += Σ_t p_r[t] · v[t] over keys [t_lo, t_hi) of a block, for `rows` rows (a query's G
// heads: the same keys) at once: each value row is read and widened to float once for all of
// them, then one float multiply-add per row and 16 dimensions. A bfloat16 pair of dimensions
// widens by a shift (the even one) and a mask (the odd one), so each 32 dimensions of acc hold
// their even dimensions, then their odd ones. (Two keys per vdpbf16ps, with the values re-laid as
// pairs first, issued 2.3× the work: that instruction occupies the vector ports ~4.5× as long
// as a multiply-add here.) p_r: row r's probabilities, p_stride apart; values: the block's rows,
// pos_stride apart; head_dim a multiple of 32.
template <int R>
inline void accumulate_rows_upto4(float* acc, const float* p, int64_t p_stride, const c10::BFloat16* values,
                                  int64_t pos_stride, int64_t t_lo, int64_t t_hi, int64_t head_dim,
                                  Prefetcher& prefetch) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t d0 = 0; d0 < head_dim; d0 += 32) {
    __m512 even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      even[r] = _mm512_loadu_ps(acc + r * head_dim + d0);
      odd[r] = _mm512_loadu_ps(acc + r * head_dim + d0 + 16);
    }
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const __m512i v = _mm512_loadu_si512(values + t * pos_stride + d0);
      prefetch.step();
      const __m512 v_even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
      const __m512 v_odd = _mm512_castsi512_ps(_mm512_and_si512(v, high_half));
      for (int r = 0; r < R; ++r) {
        const __m512 pt = _mm512_set1_ps(p[r * p_stride + t]);
        even[r] = _mm512_fmadd_ps(pt, v_even, even[r]);
        odd[r] = _mm512_fmadd_ps(pt, v_odd, odd[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(acc + r * head_dim + d0, even[r]);
      _mm512_storeu_ps(acc + r * head_dim + d0 + 16, odd[r]);
    }
  }
}

inline void accumulate_rows(float* acc, const float* p, int64_t p_stride, int64_t rows, const c10::BFloat16* values,
                            int64_t pos_stride, int64_t t_lo, int64_t t_hi, int64_t head_dim, Prefetcher& prefetch) {
  in_row_groups(rows, [&](auto group, int64_t r0) {
    accumulate_rows_upto4<decltype(group)::value>(acc + r0 * head_dim, p + r0 * p_stride, p_stride, values, pos_stride, t_lo, t_hi,
                                 head_dim, prefetch);
  });
}

// 16 bfloat16 scales, widened.
inline __m512 widen16(const c10::BFloat16* s) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}

// Rows r0..r0+R of scores16_int8: k[j] holds dimensions 4j..4j+3 of the 16 keys as bytes of each
// lane; byte b widened by moving it to the top and shifting it back with its sign.
template <int R>
inline void score_rows_int8(float* scores, int64_t scores_stride, const __m512i* k, const float* q, int64_t head_dim,
                            int64_t d0) {
  __m512 even[R], odd[R];
  for (int r = 0; r < R; ++r) {
    even[r] = _mm512_loadu_ps(scores + r * scores_stride);
    odd[r] = _mm512_setzero_ps();
  }
  for (int j = 0; j < 16; ++j) {
    const __m512 k0 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(k[j], 24), 24));
    const __m512 k1 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(k[j], 16), 24));
    const __m512 k2 = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(k[j], 8), 24));
    const __m512 k3 = _mm512_cvtepi32_ps(_mm512_srai_epi32(k[j], 24));
    for (int r = 0; r < R; ++r) {
      const float* qr = q + r * head_dim + d0 + 4 * j;
      even[r] = _mm512_fmadd_ps(k0, _mm512_set1_ps(qr[0]), even[r]);
      odd[r] = _mm512_fmadd_ps(k1, _mm512_set1_ps(qr[1]), odd[r]);
      even[r] = _mm512_fmadd_ps(k2, _mm512_set1_ps(qr[2]), even[r]);
      odd[r] = _mm512_fmadd_ps(k3, _mm512_set1_ps(qr[3]), odd[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(scores + r * scores_stride, _mm512_add_ps(even[r], odd[r]));
}

// scores16 for 16 int8 keys (codes `pos_stride` apart, head_dim a multiple of 64) and their scales:
// each 64 dimensions of the keys transposed to 16 lanes of four codes, then each row's score times
// its key's scale.
inline void scores16_int8(float* scores, int64_t scores_stride, const int8_t* keys, int64_t pos_stride,
                          const c10::BFloat16* key_scales, const float* q, int64_t n_rows, int64_t head_dim,
                          Prefetcher& prefetch) {
  for (int64_t r = 0; r < n_rows; ++r) _mm512_storeu_ps(scores + r * scores_stride, _mm512_setzero_ps());
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    __m512i k[16];
    for (int t = 0; t < 16; ++t) {
      k[t] = _mm512_loadu_si512(keys + t * pos_stride + d0);
      prefetch.step();
    }
    transpose16(k);  // k[j]: dimensions d0 + 4j .. d0 + 4j + 3 of keys 0..15
    in_row_groups(n_rows, [&](auto rows, int64_t r0) {
      score_rows_int8<decltype(rows)::value>(scores + r0 * scores_stride, scores_stride, k, q + r0 * head_dim, head_dim, d0);
    });
  }
  const __m512 scale = widen16(key_scales);
  for (int64_t r = 0; r < n_rows; ++r)
    _mm512_storeu_ps(scores + r * scores_stride, _mm512_mul_ps(_mm512_loadu_ps(scores + r * scores_stride), scale));
}

// fp8 codes made halves of 1 / kHalfScale their value (widen_codes' rule), two per 32-bit lane at
// once: `x` holds code pairs in the low byte of each 16-bit lane (`low`) or in the high byte
// (`high`). E4M3: the bits moved into a half's places, 1/256 of the value (a half's bias is 15,
// E4M3's 7); E5M2: the code is the half's top byte, its value itself.
struct E4m3Halves {
  static constexpr float kHalfScale = 256.0f;
  static __m512i low(__m512i x) { return kvflow_avx512::fp8_halves_low(x); }
  static __m512i high(__m512i x) {
    const __m512i rest = _mm512_and_si512(_mm512_srli_epi16(x, 1), _mm512_set1_epi16(0x3F80));
    return _mm512_ternarylogic_epi32(x, rest, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xEC);
  }
};
struct E5m2Halves {
  static constexpr float kHalfScale = 1.0f;
  static __m512i low(__m512i x) { return kvflow_avx512::e5m2_halves_low(x); }
  static __m512i high(__m512i x) { return _mm512_and_si512(x, _mm512_set1_epi16(static_cast<int16_t>(0xFF00))); }
};
template <typename fp8_t>
struct HalvesOf;
template <>
struct HalvesOf<c10::Float8_e4m3fn> {
  using type = E4m3Halves;
};
template <>
struct HalvesOf<c10::Float8_e5m2> {
  using type = E5m2Halves;
};
// The 32 halves of h as floats: [0, 16) and [16, 32).
inline void widen_halves(__m512i h, __m512& lo, __m512& hi) {
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

// Rows r0..r0+R of scores16_fp8. k[j] holds dimensions 4j..4j+3 of the 16 keys as bytes of each
// lane; the halves of bytes 0 and 2 widen to floats that pair them up per key (keys 0-7, then
// 8-15), as do bytes 1 and 3; qp: each row's query with each four dimensions ordered 0, 2, 1, 3,
// so that one 64-bit broadcast holds the pair. acc[r][0..3]: keys 0-7 (0, 2 / 1, 3), keys 8-15.
template <typename Halves, int R>
inline void score_rows_fp8(__m512 (*acc)[4], const __m512i* k, const float* qp, int64_t head_dim, int64_t d0) {
  for (int j = 0; j < 16; ++j) {
    __m512 f02_lo, f02_hi, f13_lo, f13_hi;
    widen_halves(Halves::low(k[j]), f02_lo, f02_hi);
    widen_halves(Halves::high(k[j]), f13_lo, f13_hi);
    for (int r = 0; r < R; ++r) {
      const float* q = qp + r * head_dim + d0 + 4 * j;
      double pair02, pair13;
      std::memcpy(&pair02, q, sizeof pair02);
      std::memcpy(&pair13, q + 2, sizeof pair13);
      const __m512 q02 = _mm512_castpd_ps(_mm512_set1_pd(pair02)), q13 = _mm512_castpd_ps(_mm512_set1_pd(pair13));
      acc[r][0] = _mm512_fmadd_ps(f02_lo, q02, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(f13_lo, q13, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(f02_hi, q02, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(f13_hi, q13, acc[r][3]);
    }
  }
}

// Rows r0..r0+R of scores16_fp8, summed over all of head_dim, times the keys' scales. The keys'
// transposed 64 dimensions in k are reused where head_dim is 64 and an earlier group of rows loaded them.
template <typename Halves, int R>
inline void scores16_fp8_rows(float* scores, int64_t scores_stride, const uint8_t* keys, int64_t pos_stride,
                              const float* qp, int64_t head_dim, __m512 scale, Prefetcher& prefetch, __m512i* k,
                              bool k_loaded) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    if (!k_loaded) {
      for (int t = 0; t < 16; ++t) {
        k[t] = _mm512_loadu_si512(keys + t * pos_stride + d0);
        prefetch.step();
      }
      transpose16(k);
    }
    score_rows_fp8<Halves, R>(acc, k, qp, head_dim, d0);
  }
  // Lanes 2i and 2i + 1 of keys 0-7's sums are key i's two halves; keys 8-15's follow.
  const __m512i evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  const __m512i odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  for (int r = 0; r < R; ++r) {
    const __m512 low = _mm512_add_ps(acc[r][0], acc[r][1]), high = _mm512_add_ps(acc[r][2], acc[r][3]);
    const __m512 sum = _mm512_add_ps(_mm512_permutex2var_ps(low, evens, high), _mm512_permutex2var_ps(low, odds, high));
    _mm512_storeu_ps(scores + r * scores_stride, _mm512_mul_ps(sum, scale));
  }
}

// scores16 for 16 fp8 keys (codes `pos_stride` apart, head_dim a multiple of 64) and their scales;
// qp: the rows' queries in score_rows_fp8's order.
template <typename fp8_t>
inline void scores16_fp8(float* scores, int64_t scores_stride, const fp8_t* keys, int64_t pos_stride,
                         const c10::BFloat16* key_scales, const float* qp, int64_t n_rows, int64_t head_dim,
                         Prefetcher& prefetch) {
  using Halves = typename HalvesOf<fp8_t>::type;
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(keys);
  const __m512 scale = _mm512_mul_ps(widen16(key_scales), _mm512_set1_ps(Halves::kHalfScale));
  __m512i k[16];
  in_row_groups(n_rows, [&](auto rows, int64_t r0) {
    scores16_fp8_rows<Halves, decltype(rows)::value>(scores + r0 * scores_stride, scores_stride, codes, pos_stride, qp + r0 * head_dim, head_dim,
                            scale, prefetch, k, /*k_loaded=*/r0 > 0 && head_dim == 64);
  });
}

// One position's 64 codes widened to floats of 1/kScale their value: int8 exactly; fp8 by way of
// halves (32 at a time, Halves::low), 1 / kHalfScale of their value.
struct Int8Codes {
  static constexpr float kScale = 1.0f;
  static void widen64(const uint8_t* codes, __m512* v) {
    for (int c = 0; c < 4; ++c)
      v[c] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16 * c))));
  }
};
// 32 fp8 codes as floats of 1 / kHalfScale their value: [0, 16) and [16, 32).
template <typename Halves>
inline void fp8_widen32(const uint8_t* codes, __m512& lo, __m512& hi) {
  const __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  widen_halves(Halves::low(w), lo, hi);
}
template <typename Halves>
struct Fp8Codes {
  static constexpr float kScale = Halves::kHalfScale;
  static void widen64(const uint8_t* codes, __m512* v) {
    fp8_widen32<Halves>(codes, v[0], v[1]);
    fp8_widen32<Halves>(codes + 32, v[2], v[3]);
  }
};
// accumulate_code_rows' Codes for a cache's code type.
template <typename cache_t>
struct CodesOf {
  using type = Fp8Codes<typename HalvesOf<cache_t>::type>;
};
template <>
struct CodesOf<int8_t> {
  using type = Int8Codes;
};

// accumulate_rows for int8 or fp8 values: each value row's 64 codes widened once for the R rows,
// each row's probability times the value's scale (and Codes::kScale); acc in natural order.
template <typename Codes, int R>
inline void accumulate_code_rows_upto4(float* acc, const float* p, int64_t p_stride, const uint8_t* values,
                                       int64_t pos_stride, const c10::BFloat16* scales, int64_t t_lo, int64_t t_hi,
                                       int64_t head_dim, Prefetcher& prefetch) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += 64) {
    __m512 a[R][4];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_ps(acc + r * head_dim + d0 + 16 * c);
    for (int64_t t = t_lo; t < t_hi; ++t) {
      __m512 v[4];
      Codes::widen64(values + t * pos_stride + d0, v);
      prefetch.step();
      const float scale = static_cast<float>(scales[t]) * Codes::kScale;
      for (int r = 0; r < R; ++r) {
        const __m512 pt = _mm512_set1_ps(p[r * p_stride + t] * scale);
        for (int c = 0; c < 4; ++c) a[r][c] = _mm512_fmadd_ps(pt, v[c], a[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * head_dim + d0 + 16 * c, a[r][c]);
  }
}

template <typename Codes, typename cache_t>
inline void accumulate_code_rows(float* acc, const float* p, int64_t p_stride, int64_t rows, const cache_t* values,
                                 int64_t pos_stride, const c10::BFloat16* scales, int64_t t_lo, int64_t t_hi,
                                 int64_t head_dim, Prefetcher& prefetch) {
  in_row_groups(rows, [&](auto group, int64_t r0) {
    accumulate_code_rows_upto4<Codes, decltype(group)::value>(acc + r0 * head_dim, p + r0 * p_stride, p_stride,
                                             reinterpret_cast<const uint8_t*>(values), pos_stride, scales, t_lo, t_hi,
                                             head_dim, prefetch);
  });
}
#endif

#ifdef KVFLOW_PAGED_AMX
// Scores of a bfloat16 cache on AMX tiles, for up to 16 query rows: keys are the A operand as they
// lie (16 keys x 32 dimensions a tile, rows pos_stride apart), so no transpose; the queries are
// the B operand, laid out once per work item (`AmxQuery`), and stay in tiles 2, 3, 5, 6 (one per
// 32 dimensions). Tile 0 sums 16 keys x 16 rows in float; tiles 1 and 4 take the keys' slices.
// The products of two bfloat16 numbers are exact in float, as are the rows' bfloat16 values, so
// the scores differ from the multiply-add path's only in the order of their sums; the scale
// multiplies the float sums.
struct AmxQuery {
  alignas(64) uint32_t pairs[4][16][16];  // [32-dimension slice][dimension pair][row]: B tiles
  int64_t slices = 0;

  template <typename scalar_t>
  void lay_out(const scalar_t* query, int64_t q_start, int64_t q0, int64_t n_rows, int64_t group, int64_t kv_head,
               int64_t q_token_stride, int64_t q_head_stride, int64_t head_dim) {
    slices = head_dim / 32;
    std::memset(pairs, 0, sizeof pairs);
    for (int64_t r = 0; r < n_rows; ++r) {
      const scalar_t* row = query + (q_start + q0 + r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
      for (int64_t c = 0; c < slices; ++c)
        for (int64_t i = 0; i < 16; ++i) std::memcpy(&pairs[c][i][r], row + 2 * (c * 16 + i), sizeof(uint32_t));
    }
  }
  void load() const {
    // _tile_loadd takes its tile number as a constant.
    if (slices > 0) _tile_loadd(2, pairs[0], 64);
    if (slices > 1) _tile_loadd(3, pairs[1], 64);
    if (slices > 2) _tile_loadd(5, pairs[2], 64);
    if (slices > 3) _tile_loadd(6, pairs[3], 64);
  }
};

// scores[r][t] = scale * q_r . k_t for the 16 keys at `keys` (bfloat16, rows pos_stride apart) and
// rows r < n_rows, the queries in their tiles (AmxQuery::load).
inline void scores16_amx(float* scores, int64_t scores_stride, const c10::BFloat16* keys, int64_t pos_stride,
                         int64_t slices, int64_t n_rows, float scale, Prefetcher& prefetch) {
  alignas(64) float sums[16][16];  // [key][row]
  const int64_t stride = pos_stride * static_cast<int64_t>(sizeof(c10::BFloat16));
  _tile_zero(0);
  _tile_loadd(1, keys, stride);
  _tile_dpbf16ps(0, 1, 2);
  if (slices > 1) {
    _tile_loadd(4, keys + 32, stride);
    _tile_dpbf16ps(0, 4, 3);
  }
  if (slices > 2) {
    _tile_loadd(1, keys + 64, stride);
    _tile_dpbf16ps(0, 1, 5);
  }
  if (slices > 3) {
    _tile_loadd(4, keys + 96, stride);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, sums, 64);
  for (int64_t i = 0; i < 16 * slices; ++i) prefetch.step();
  const __m512i column = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < n_rows; ++r)
    _mm512_storeu_ps(scores + r * scores_stride, _mm512_mul_ps(_mm512_i32gather_ps(column, &sums[0][r], 4), scale16));
}
#endif

// widen_codes for fp8: 32 codes at a time by way of halves where the CPU has AVX-512 (exact, the
// halves' kHalfScale folded into the scale), c10's conversion elsewhere.
template <typename fp8_t>
inline void widen_fp8_codes(const fp8_t* src, float scale, float* dst, int64_t n) {
  int64_t i = 0;
#ifdef KVFLOW_AVX512
  using Halves = typename HalvesOf<fp8_t>::type;
  const __m512 scaled = _mm512_set1_ps(scale * Halves::kHalfScale);
  for (; i + 32 <= n; i += 32) {
    __m512 lo, hi;
    fp8_widen32<Halves>(reinterpret_cast<const uint8_t*>(src + i), lo, hi);
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(lo, scaled));
    _mm512_storeu_ps(dst + i + 16, _mm512_mul_ps(hi, scaled));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}
inline void widen_codes(const c10::Float8_e4m3fn* src, float scale, float* dst, int64_t n) {
  widen_fp8_codes(src, scale, dst, n);
}
inline void widen_codes(const c10::Float8_e5m2* src, float scale, float* dst, int64_t n) {
  widen_fp8_codes(src, scale, dst, n);
}

// Where a cache's rows lie: (block, head) rows `block_stride` and `head_stride` elements apart,
// positions `pos_stride` apart inside them; a quantized row's scales follow its block_size x
// head_dim codes.
struct CacheLayout {
  int64_t block_stride, head_stride, pos_stride, block_size, head_dim;
};

// Sparse decode (sparse_decode.py): each work item (a decode's KV head) reads only the top_k blocks
// of highest bound on its G heads' scores, its first (with `sinks`) and last among them, chosen
// here from the key summaries ([num_blocks, kv_heads, 2, head_dim] float: min, max); the choice is
// written to `picked` ([requests, kv_heads, top_k], ascending, -1 after). Chosen in the kernel:
// in torch (gathering each request's summaries, two matmuls, topk) the choice alone took as long
// as the dense attention it was to save (docs/performance-journal.md, sparse decode).
// `summaries` null: every block a query sees (the dense kernel).
struct SparseChoice {
  const float* summaries = nullptr;
  int64_t top_k = 0;
  bool sinks = true;
  int64_t* picked = nullptr;
};

// One work item's choice into `picked`: how many blocks. A decode of at most top_k blocks reads
// them all, in the dense kernel's order (so its result is the dense kernel's, bit for bit).
// Bounds: sum_d max(q_d min_d, q_d max_d), the largest of the G heads'; ties go to the earlier block.
// Since min <= max, that is q+ . max + q- . min (q's positive and negative parts): two vectorised
// dot products a head and block, where the max per dimension kept the loop scalar. The choice
// reads a 512-byte summary per block, an eighth of the dense walk's bytes, yet from memory it
// costs about half the dense walk's time: sparse decode pays off only at small K
// (docs/performance-journal.md, sparse decode).
template <typename scalar_t>
int64_t choose_blocks(int64_t* picked, const SparseChoice& choice, const int64_t* table, int64_t num_blocks,
                      int64_t n_blocks, const scalar_t* q_row, int64_t q_head_stride, int64_t group, int64_t kv_head,
                      int64_t kv_heads, int64_t head_dim) {
  if (n_blocks <= choice.top_k) {
    for (int64_t j = 0; j < n_blocks; ++j) picked[j] = j;
    return n_blocks;
  }
  thread_local std::vector<float> q, positive, negative;
  thread_local std::vector<std::pair<float, int64_t>> ranked;
  q.resize(group * head_dim);
  positive.resize(group * head_dim);
  negative.resize(group * head_dim);
  for (int64_t g = 0; g < group; ++g) widen(q_row + (kv_head * group + g) * q_head_stride, q.data() + g * head_dim, head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) {
    positive[i] = std::max(q[i], 0.f);
    negative[i] = std::min(q[i], 0.f);
  }
  const int64_t first = choice.sinks ? 1 : 0;
  const int64_t row = 2 * head_dim;  // a (block, KV head)'s min then max
  const auto summary_of = [&](int64_t j) { return choice.summaries + (table[j] * kv_heads + kv_head) * row; };
  for (int64_t j = 0; j < n_blocks - 1; ++j)
    TORCH_CHECK(table[j] >= 0 && table[j] < num_blocks, "paged_attention_sparse: block table entry ", table[j],
                " is not a block of the cache");
  ranked.clear();
  for (int64_t j = first; j < n_blocks - 1; ++j) {
    const float* low = summary_of(j);
    const float* high = low + head_dim;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t g = 0; g < group; ++g)
      best = std::max(best, dot(positive.data() + g * head_dim, high, head_dim) + dot(negative.data() + g * head_dim, low, head_dim));
    ranked.emplace_back(best, j);
  }
  const int64_t keep = choice.top_k - 1 - first;
  std::nth_element(ranked.begin(), ranked.begin() + keep, ranked.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  int64_t n = 0;
  if (choice.sinks) picked[n++] = 0;
  for (int64_t i = 0; i < keep; ++i) picked[n++] = ranked[i].second;
  std::sort(picked + first, picked + n);
  picked[n++] = n_blocks - 1;
  return n;
}

// Queries [q0, q1) of one work item (see the file's comment). Rows r: query q0 + r / group, head
// kv_head * group + r % group.
template <typename scalar_t, typename cache_t>
void attend_queries(scalar_t* out, const scalar_t* query, const cache_t* key_cache, const cache_t* value_cache,
                    const int64_t* table, int64_t table_width, int64_t num_blocks, int64_t seq_len, int64_t q_start,
                    int64_t q_len, int64_t q0, int64_t q1, int64_t kv_head, int64_t group, int64_t window, float scale,
                    int64_t q_token_stride, int64_t q_head_stride, int64_t o_token_stride, int64_t o_head_stride,
                    const CacheLayout& c, bool amx, const int64_t* picked, int64_t n_picked) {
  const int64_t head_dim = c.head_dim, block_size = c.block_size;
  const int64_t n_rows = (q1 - q0) * group;
  const int64_t first_pos = seq_len - q_len;
  // bfloat16 caches are read where they lie, 16 keys at a time for the scores (scores16) and a key
  // for all of a query's G rows at a time for the values (accumulate_rows); so are int8 ones
  // (scores16_int8) and fp8 ones, E4M3 or E5M2 (scores16_fp8), both with accumulate_code_rows;
  // other dtypes widen keys and values to float.
  constexpr bool any_fp8 = std::is_same_v<cache_t, c10::Float8_e4m3fn> || std::is_same_v<cache_t, c10::Float8_e5m2>;
  constexpr bool quantized = std::is_same_v<cache_t, int8_t> || any_fp8;
#ifdef KVFLOW_AVX512
  constexpr bool bf16 = std::is_same_v<cache_t, c10::BFloat16>;
  constexpr bool int8 = std::is_same_v<cache_t, int8_t>;
  constexpr bool fp8 = any_fp8;
#else
  constexpr bool bf16 = false, int8 = false, fp8 = false;
#endif
  const bool in_sixteens = block_size % 16 == 0 && block_size <= kMaxBlock &&
                           ((bf16 && head_dim % 32 == 0) || ((int8 || fp8) && head_dim % 64 == 0));
  // Query i (position first_pos + i) sees keys [visible_from(i), first_pos + i] (causal, and its
  // window); these queries together see [lowest, highest).
  const auto visible_from = [&](int64_t query_index) {
    return window > 0 ? std::max<int64_t>(0, first_pos + query_index - window + 1) : int64_t{0};
  };
  const int64_t lowest = visible_from(q0), highest = first_pos + q1;
  const int64_t first_block = lowest / block_size, end_block = (highest + block_size - 1) / block_size;
  // The walk: the blocks read, in order, [first_block, end_block) or the picked ones (a sparse
  // decode, which sees every key of them up to its own). Walk block i's scores lie at i *
  // block_size; a row's visible keys [lo, hi) in positions lie at [lo - shift, hi - shift) of the
  // walk (a sparse decode's lo is 0, and its hi in the last block, picked last).
  const int64_t n_walk = picked != nullptr ? n_picked : end_block - first_block;
  const auto block_at = [&](int64_t i) { return picked != nullptr ? picked[i] : first_block + i; };
  const int64_t span = n_walk * block_size;
  const int64_t shift = picked != nullptr ? (block_at(n_walk - 1) - (n_walk - 1)) * block_size : first_block * block_size;
  for (int64_t i = 0; i < n_walk; ++i) {
    const int64_t block = block_at(i);
    TORCH_CHECK(block >= 0 && block < table_width && table[block] >= 0 && table[block] < num_blocks,
                "paged_attention: block table entry ", block >= 0 && block < table_width ? table[block] : block,
                " for visible keys is not a block of the cache");
  }
  // scores: row r's scores, then probabilities, over the walk's keys at r * span (whole sixteens
  // of each block: scores16's stores). acc: the bfloat16 path keeps each 32 dimensions as its
  // even ones, then its odd ones (see accumulate_rows); the output is written back in order.
  thread_local std::vector<float> scores, q, keys, values;
  scores.resize(n_rows * span);
  std::vector<float> acc(n_rows * head_dim, 0.f), row_sum(n_rows, 0.f);
  // Up to 16 rows' scores on AMX tiles (scores16_amx) where `amx` says the types and widths allow
  // (paged_attention_typed); the tiles take the bfloat16 query rows as they are.
#ifdef KVFLOW_PAGED_AMX
  const bool on_tiles = amx && in_sixteens && n_rows <= 16;
  thread_local AmxQuery amx_query;
  if (on_tiles) {
    amx_query.lay_out(query, q_start, q0, n_rows, group, kv_head, q_token_stride, q_head_stride, head_dim);
    amx_query.load();
  }
#else
  constexpr bool on_tiles = false;
#endif
  if (!on_tiles) {  // the other paths take the rows widened to float and scaled
    q.resize(n_rows * head_dim);
    for (int64_t r = 0; r < n_rows; ++r) {
      const scalar_t* row = query + (q_start + q0 + r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
      widen(row, q.data() + r * head_dim, head_dim);
      for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] *= scale;
      if (fp8 && in_sixteens)  // score_rows_fp8's order: each four dimensions as 0, 2, 1, 3
        for (int64_t d = 0; d < head_dim; d += 4) std::swap(q[r * head_dim + d + 1], q[r * head_dim + d + 2]);
    }
  }
  if (!in_sixteens) {
    keys.resize(block_size * head_dim);
    values.resize(block_size * head_dim);
  }
  const auto block_of = [&](const cache_t* cache, int64_t block) {
    return cache + table[block] * c.block_stride + kv_head * c.head_stride;
  };
  const auto scales_of = [&](const cache_t* row) {  // quantized caches only
    return reinterpret_cast<const c10::BFloat16*>(row + block_size * head_dim);
  };
  // Position t of a block, widened to float.
  const auto widen_position = [&](const cache_t* row, int64_t t, float* dst) {
    if constexpr (quantized) widen_codes(row + t * c.pos_stride, static_cast<float>(scales_of(row)[t]), dst, head_dim);
    else widen(row + t * c.pos_stride, dst, head_dim);
  };
  const int64_t block_bytes = quantized ? block_size * (head_dim + static_cast<int64_t>(sizeof(c10::BFloat16)))
                                        : ((block_size - 1) * c.pos_stride + head_dim) * static_cast<int64_t>(sizeof(cache_t));
  // The block `kPrefetchBlocks` after walk block i in the walk over the keys' blocks and then the
  // values', requested over the loads of block i (the first ones at once).
  Prefetcher prefetch;
  const auto prefetch_ahead = [&](const cache_t* cache, int64_t i) {
    const int64_t ahead = i + kPrefetchBlocks;
    if (ahead < n_walk) prefetch.start(block_of(cache, block_at(ahead)), block_bytes);
    else if (cache == key_cache && ahead - n_walk < n_walk)
      prefetch.start(block_of(value_cache, block_at(ahead - n_walk)), block_bytes);
    else prefetch.stop();
  };
  for (int64_t i = 0; i < std::min(n_walk, kPrefetchBlocks); ++i) {
    prefetch.start(block_of(key_cache, block_at(i)), block_bytes);
    prefetch.rest();
  }
  // 1. Scores of every row against the keys, block by block.
  for (int64_t i = 0; i < n_walk; ++i) {
    const int64_t start = block_at(i) * block_size;
    const int64_t lo = std::max(start, lowest) - start, hi = std::min(start + block_size, highest) - start;
    const cache_t* block_keys = block_of(key_cache, block_at(i));
    float* sc = scores.data() + i * block_size;
    prefetch_ahead(key_cache, i);
#ifdef KVFLOW_AVX512
    // Whole sixteens of the block, the visible keys' included; the scores of keys no query may
    // see (a tail nobody wrote) are computed from whatever bits lie there but never read.
    if (in_sixteens) {
      for (int64_t t0 = lo / 16 * 16; t0 < hi; t0 += 16) {
        const cache_t* keys16 = block_keys + t0 * c.pos_stride;
#ifdef KVFLOW_PAGED_AMX
        if (on_tiles) {
          scores16_amx(sc + t0, span, reinterpret_cast<const c10::BFloat16*>(keys16), c.pos_stride, amx_query.slices,
                       n_rows, scale, prefetch);
          continue;
        }
#endif
        if constexpr (bf16) scores16(sc + t0, span, keys16, c.pos_stride, q.data(), n_rows, head_dim, prefetch);
        else if constexpr (int8)
          scores16_int8(sc + t0, span, keys16, c.pos_stride, scales_of(block_keys) + t0, q.data(), n_rows, head_dim, prefetch);
        else if constexpr (fp8)
          scores16_fp8(sc + t0, span, keys16, c.pos_stride, scales_of(block_keys) + t0, q.data(), n_rows, head_dim, prefetch);
      }
    }
#endif
    if (!in_sixteens) {
      for (int64_t t = lo; t < hi; ++t) widen_position(block_keys, t, keys.data() + t * head_dim);
      for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t t = lo; t < hi; ++t) sc[r * span + t] = dot(q.data() + r * head_dim, keys.data() + t * head_dim, head_dim);
    }
    prefetch.rest();  // what the loads of this block left to request
  }
  // 2. Each row's softmax over the keys it sees, in place.
  for (int64_t r = 0; r < n_rows; ++r) {
    const int64_t k_lo = std::max<int64_t>(visible_from(q0 + r / group) - shift, 0);
    const int64_t k_hi = first_pos + q0 + r / group + 1 - shift;
    if (k_lo >= k_hi) continue;
    float* s = scores.data() + r * span;
#ifdef KVFLOW_AVX512
    if (in_sixteens) {
      row_sum[r] = exp16(s, s, k_lo, k_hi, max16(s, k_lo, k_hi));
      continue;
    }
#endif
    float row_max = -std::numeric_limits<float>::infinity();
    for (int64_t t = k_lo; t < k_hi; ++t) row_max = std::max(row_max, s[t]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = k_lo; t < k_hi; ++t) {
      s[t] = exp_nonpositive(s[t] - row_max);
      sum += s[t];
    }
    row_sum[r] = sum;
  }
  // 3. The probability-weighted values, block by block: once per query for its G rows (they see
  // the same keys).
  for (int64_t i = 0; i < n_walk; ++i) {
    const int64_t start = block_at(i) * block_size;
    const int64_t lo = std::max(start, lowest), hi = std::min(start + block_size, highest);
    const cache_t* block_values = block_of(value_cache, block_at(i));
    const float* pr = scores.data() + i * block_size;
    prefetch_ahead(value_cache, i);
    if (!in_sixteens) {
      for (int64_t t = lo; t < hi; ++t) widen_position(block_values, t - start, values.data() + (t - start) * head_dim);
    }
    for (int64_t query_index = q0; query_index < q1; ++query_index) {
      const int64_t k_lo = std::max(lo, visible_from(query_index)), k_hi = std::min(hi, first_pos + query_index + 1);
      if (k_lo >= k_hi) continue;
      const int64_t r0 = (query_index - q0) * group;
#ifdef KVFLOW_AVX512
      if (in_sixteens) {
        if constexpr (bf16)
          accumulate_rows(acc.data() + r0 * head_dim, pr + r0 * span, span, group, block_values, c.pos_stride,
                          k_lo - start, k_hi - start, head_dim, prefetch);
        else if constexpr (quantized)
          accumulate_code_rows<typename CodesOf<cache_t>::type>(
              acc.data() + r0 * head_dim, pr + r0 * span, span, group, block_values, c.pos_stride,
              scales_of(block_values), k_lo - start, k_hi - start, head_dim, prefetch);
        continue;
      }
#endif
      for (int64_t r = r0; r < r0 + group; ++r)
        accumulate_values(acc.data() + r * head_dim, pr + r * span, values.data(), k_lo - start, k_hi - start, head_dim);
    }
    prefetch.rest();
  }
  const bool pairs_first = bf16 && in_sixteens;  // accumulate_rows' order: each 32's even dims, then odd
  for (int64_t r = 0; r < n_rows; ++r) {
    scalar_t* dst = out + (q_start + q0 + r / group) * o_token_stride + (kv_head * group + r % group) * o_head_stride;
    const float inv = row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) {
      const int64_t at = pairs_first ? d / 32 * 32 + d % 2 * 16 + d % 32 / 2 : d;
      dst[d] = static_cast<scalar_t>(acc[r * head_dim + at] * inv);
    }
  }
}

template <typename scalar_t, typename cache_t>
void paged_attention_typed(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, const at::Tensor& requests, int64_t window, double scale,
                           const CacheLayout& layout, bool tiles, const SparseChoice& choice) {
  const int64_t heads = query.size(1);
  const int64_t kv_heads = key_cache.size(1);
  const int64_t group = heads / kv_heads, n_items = requests.size(0) * kv_heads;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* reqs = requests.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const cache_t* k_ptr = static_cast<const cache_t*>(key_cache.data_ptr());
  const cache_t* v_ptr = static_cast<const cache_t*>(value_cache.data_ptr());
  const int64_t table_stride = block_tables.stride(0);
#ifdef KVFLOW_PAGED_AMX
  const bool amx = tiles && std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<cache_t, c10::BFloat16> &&
                   layout.head_dim % 32 == 0 && layout.head_dim <= 128 && kvflow_amx::permitted();
#else
  const bool amx = false;
  (void)tiles;
#endif
  // One work item: every query of a request's chunk for one KV head, kQueryChunk at a time.
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
#ifdef KVFLOW_PAGED_AMX
    if (amx) kvflow_amx::configure_full_tiles();
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = reqs[item / kv_heads], kv_head = item % kv_heads;
      const int64_t q_len = starts[b + 1] - starts[b];
      int64_t* item_picked = nullptr;
      int64_t n_picked = 0;
      if (choice.summaries != nullptr) {
        const int64_t n_blocks = (lens[b] + layout.block_size - 1) / layout.block_size;
        TORCH_CHECK(n_blocks <= block_tables.size(1), "paged_attention_sparse: request ", b, "'s context of ", lens[b],
                    " tokens is longer than its block table");
        item_picked = choice.picked + item * choice.top_k;
        n_picked = choose_blocks(item_picked, choice, tables + b * table_stride, key_cache.size(0), n_blocks,
                                 q_ptr + starts[b] * query.stride(0), query.stride(1), group, kv_head, kv_heads,
                                 layout.head_dim);
        std::fill(item_picked + n_picked, item_picked + choice.top_k, int64_t{-1});
      }
      for (int64_t q0 = 0; q0 < q_len; q0 += kQueryChunk)
        attend_queries<scalar_t, cache_t>(out_ptr, q_ptr, k_ptr, v_ptr, tables + b * table_stride, block_tables.size(1),
                                          key_cache.size(0), lens[b], starts[b], q_len, q0,
                                          std::min(q_len, q0 + kQueryChunk), kv_head, group, window,
                                          static_cast<float>(scale), query.stride(0), query.stride(1), out.stride(0),
                                          out.stride(1), layout, amx, item_picked, n_picked);
    }
#ifdef KVFLOW_PAGED_AMX
    if (amx) _tile_release();
#endif
  });
}

// The query's dtype, then the cache's: the cache is the query's dtype or quantized codes.
template <typename cache_t>
void dispatch_query(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                    const at::Tensor& requests, int64_t window, double scale, const CacheLayout& layout, bool tiles,
                    const SparseChoice& choice) {
  switch (query.scalar_type()) {
    case at::kFloat: paged_attention_typed<float, cache_t>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    case at::kBFloat16: paged_attention_typed<c10::BFloat16, cache_t>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    case at::kHalf: paged_attention_typed<c10::Half, cache_t>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported query dtype ", query.scalar_type());
  }
}

void run_paged_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                         const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc, const at::Tensor& requests, int64_t window, double scale,
                         bool tiles, const SparseChoice& choice) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && out.scalar_type() == query.scalar_type(),
              "query and out share one dtype, head_dim contiguous");
  TORCH_CHECK(value_cache.strides() == key_cache.strides() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == key_cache.scalar_type(),
              "key and value caches share one layout");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc, &requests})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->stride(-1) == 1, "index tensors are contiguous int64");
  const int64_t head_dim = query.size(2);
  const at::ScalarType codes = key_cache.scalar_type();
  if (codes == at::kChar || codes == at::kFloat8_e4m3fn || codes == at::kFloat8_e5m2) {
    // kv_quant.py's packed rows: [blocks, kv_heads, block_size * (head_dim + 2)] one-byte elements.
    TORCH_CHECK(key_cache.dim() == 3 && key_cache.stride(2) == 1 && key_cache.size(2) % (head_dim + 2) == 0,
                "a quantized cache: [blocks, kv_heads, block_size * (head_dim + 2)], rows contiguous");
    TORCH_CHECK(query.size(1) % key_cache.size(1) == 0, "head counts disagree");
    const CacheLayout layout{key_cache.stride(0), key_cache.stride(1), head_dim, key_cache.size(2) / (head_dim + 2), head_dim};
    if (codes == at::kChar)
      dispatch_query<int8_t>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice);
    else if (codes == at::kFloat8_e4m3fn)
      dispatch_query<c10::Float8_e4m3fn>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice);
    else
      dispatch_query<c10::Float8_e5m2>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice);
    return;
  }
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.stride(3) == 1, "key/value cache: [blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(query.scalar_type() == codes, "query and an unquantized cache share one dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0 && head_dim == key_cache.size(3), "head shapes disagree");
  const CacheLayout layout{key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), key_cache.size(2), head_dim};
  switch (codes) {
    case at::kFloat: paged_attention_typed<float, float>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    case at::kBFloat16: paged_attention_typed<c10::BFloat16, c10::BFloat16>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    case at::kHalf: paged_attention_typed<c10::Half, c10::Half>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale, layout, tiles, choice); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", codes);
  }
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& requests, int64_t window, double scale,
                     bool tiles) {
  run_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window,
                      scale, tiles, SparseChoice{});
}

// Decodes (one query per request, no window), each KV head over the blocks it chooses (see
// SparseChoice): the softmax runs over those blocks' keys only.
void paged_attention_sparse(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                            const at::Tensor& query_start_loc, const at::Tensor& requests, double scale, bool tiles,
                            const at::Tensor& summaries, int64_t top_k, bool sinks, at::Tensor picked) {
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK(summaries.scalar_type() == at::kFloat && summaries.is_contiguous() && summaries.dim() == 4 &&
                  summaries.size(0) == key_cache.size(0) && summaries.size(1) == kv_heads && summaries.size(2) == 2 &&
                  summaries.size(3) == query.size(2),
              "paged_attention_sparse: summaries are contiguous float [num_blocks, kv_heads, 2, head_dim]");
  TORCH_CHECK(top_k >= 2, "paged_attention_sparse: top_k (sparse_decode_blocks) must be >= 2, got ", top_k);
  TORCH_CHECK(picked.scalar_type() == at::kLong && picked.is_contiguous() && picked.dim() == 3 &&
                  picked.size(0) == requests.size(0) && picked.size(1) == kv_heads && picked.size(2) == top_k,
              "paged_attention_sparse: picked is contiguous int64 [requests, kv_heads, top_k]");
  TORCH_CHECK(query_start_loc.is_contiguous() && requests.is_contiguous(), "index tensors are contiguous int64");
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* reqs = requests.data_ptr<int64_t>();
  for (int64_t i = 0; i < requests.size(0); ++i)
    TORCH_CHECK(starts[reqs[i] + 1] - starts[reqs[i]] == 1, "paged_attention_sparse: request ", reqs[i],
                " is not a decode (one query)");
  run_paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, 0, scale,
                      tiles, SparseChoice{summaries.data_ptr<float>(), top_k, sinks, picked.data_ptr<int64_t>()});
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor requests, int window, float scale, bool tiles) -> ()");
  m.def("paged_attention_sparse(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor requests, float scale, bool tiles, "
        "Tensor summaries, int top_k, bool sinks, Tensor(b!) picked) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("paged_attention_sparse", &paged_attention_sparse);
}
