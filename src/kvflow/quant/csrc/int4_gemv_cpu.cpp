// Few-row products with 4- or 8-bit affine weights and bfloat16 activations, on CPU (AVX-512 BF16).
//
// At batch 1 every weight is read once per token, so decode runs at the speed weights stream
// from memory. The kernel turns 32 codes into bfloat16s with one bitwise instruction (see
// kLowBias), and `vdpbf16ps` multiplies 32 codes by 32 activations and sums them in pairs into
// float lanes. A code times a bfloat16 activation is exact in float, so the only roundings are
// float accumulation and the output's: the activations are used as they are (llama.cpp rounds
// them to int8 first, which here cost 2% perplexity on SmolLM2).
//
// Weights are affine per group of 32 input channels, w = s·(u − c) + z with c = 8 for 4-bit codes
// and 128 for 8-bit ones (int4pack's form: s and z are the planes' bfloat16 scale and zero); a
// group's share of a dot product is
//     s·Σ u·x + (z − c·s)·Σ x.
// An 8-bit code is two nibbles, u = lo + 16·hi, the high one made a bfloat16 of 16× its value (exact).
//
// The arithmetic, not memory, bounds this loop on the Xeon it was tuned on: one 512-bit
// vdpbf16ps issues every ~2.3 cycles and occupies both vector ports about as long as four other
// instructions. So one activation row takes four weight rows at a time (the activations loaded
// once for the four, four independent sums), and 8-bit codes, which would need four vdpbf16ps
// per 64 codes, become floats (widen, convert: exact) for plain float multiply-adds instead.
//
// Layouts (row n of W contiguous; G = K / 32 groups, padded to an even count Ĝ with zero codes,
// scales and zeros, so that the loop takes two whole groups at a time):
//   4-bit: 16 bytes a group, byte j holding u[j] (low nibble) and u[16 + j] (high); 8-bit: 32
//     bytes a group, byte j holding u[j]. A row begins with whole blocks of 16 groups, each laid
//     out lane by lane: runs of 64 bytes, run t holding bytes 4t..4t+3 of group 0, then of group
//     1, ... 15 (4 runs at 4 bits, 8 at 8). So one 512-bit integer dot product takes 4 bytes of
//     each of 16 groups and its 16 lanes sum one group each: a block's scales meet its sums once,
//     not once per 4 groups (one row of 4-bit codes ~20% faster, the 8-bit head ~35%). The groups
//     after the last whole block follow one after another (byte_at).
//   scale_zero: [N, Ĝ, 2] bfloat16 (s, z), groups in order.
// The activations are rearranged once per call to match, as the partners of each 32-byte unit's
// low nibbles then of its high ones (code_ordered).
//
// Without AVX-512 BF16 the operator still exists as a scalar loop with the same sums, so the
// numbers never depend on the build; `fast()` tells the caller which one it got.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define KVFLOW_BF16_DOT 1
#if defined(__AVX512VNNI__)
#define KVFLOW_VNNI 1
#endif
#endif

namespace {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 8;
constexpr int64_t kPrefetchRows = 32;

inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline int64_t padded_groups(int64_t k) { return (k / kGroup + 1) / 2 * 2; }
inline int64_t row_bytes(int64_t k, int bits) { return padded_groups(k) * (bits == 4 ? 16 : 32); }
// The groups a row's blocks of 16 hold (see the top).
inline int64_t blocked_groups(int64_t k) { return padded_groups(k) / 16 * 16; }

// Where byte j of group g lies in a row of `group_bytes` (16: 4-bit codes, 32: 8-bit) a group.
inline int64_t byte_at(int64_t k, int64_t group_bytes, int64_t g, int64_t j) {
  if (g < blocked_groups(k)) return (g / 16) * 16 * group_bytes + (j / 4) * 64 + (g % 16) * 4 + j % 4;
  return g * group_bytes + j;
}

// The code of row n, input channel c.
inline int code(const uint8_t* w, int64_t k, int bits, int64_t n, int64_t c) {
  const uint8_t* row = w + n * row_bytes(k, bits);
  if (bits == 8) return row[byte_at(k, 32, c / kGroup, c % kGroup)];
  const uint8_t byte = row[byte_at(k, 16, c / kGroup, c % 16)];
  return (c % kGroup) < 16 ? (byte & 0x0F) : (byte >> 4);
}

// The activations of m rows in the codes' order, for the bfloat16 products: per 32-byte unit of a
// row's 4-bit codes, the partners of its bytes' low nibbles (x[j] for byte j of a group) then of
// their high ones (x[16 + j]); 8-bit codes, in a block, the partner of each byte (the same x for
// both nibbles), after the blocks, per pair of groups, [g0 x0..15, g1 x0..15] then
// [g0 x16..31, g1 x16..31]. Zeros for a padding group.
std::vector<uint16_t> code_ordered(const c10::BFloat16* x, int64_t m, int64_t k, int bits) {
  const int64_t groups = k / kGroup, x_stride = padded_groups(k) * 32, blocked = blocked_groups(k);
  std::vector<uint16_t> xr(m * x_stride, 0);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t j = 0; j < kGroup; j += 4) {  // runs of 4 bytes' partners stay together
        int64_t at;
        if (bits == 4) {
          const int64_t byte = byte_at(k, 16, g, j % 16);
          at = (byte / 32) * 64 + (j / 16) * 32 + byte % 32;
        } else {
          at = g < blocked ? byte_at(k, 32, g, j) : (g / 2) * 64 + (j / 16) * 32 + (g % 2) * 16 + j % 16;
        }
        std::memcpy(xr.data() + r * x_stride + at, x + r * k + g * kGroup + j, 4 * sizeof(uint16_t));
      }
  return xr;
}

// Each activation row's per-group sums, in float: [M, G].
std::vector<float> group_sums(const c10::BFloat16* x, int64_t m, int64_t k) {
  std::vector<float> sums(m * (k / kGroup), 0.0f);
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t g = 0; g < m * (k / kGroup); ++g) {  // a bfloat16 widens to float by a 16-bit shift
    const __m512i bits = _mm512_loadu_si512(x + g * kGroup);
    const __m512 low = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    const __m512 high = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
    sums[g] = _mm512_reduce_add_ps(_mm512_add_ps(low, high));
  }
#else
  for (int64_t c = 0; c < m * k; ++c) sums[c / kGroup] += widen(x[c]);
#endif
  return sums;
}

void rows_scalar(c10::BFloat16* out, const c10::BFloat16* x, int64_t m, const float* sums,
                 const uint8_t* w, const c10::BFloat16* sz, int64_t n0, int64_t n1, int64_t n_out, int64_t k, int bits) {
  const int64_t groups = k / kGroup;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < m; ++r) {
      float acc = 0.0f;
      for (int64_t g = 0; g < groups; ++g) {
        float dot = 0.0f;
        for (int64_t i = 0; i < kGroup; ++i) dot += code(w, k, bits, n, g * kGroup + i) * widen(x[r * k + g * kGroup + i]);
        const c10::BFloat16* pair = sz + (n * padded_groups(k) + g) * 2;
        const float s = widen(pair[0]), z = widen(pair[1]);
        acc += s * dot + (z - (bits == 4 ? 8.0f : 128.0f) * s) * sums[r * groups + g];
      }
      out[r * n_out + n] = static_cast<c10::BFloat16>(acc);
    }
}

#ifdef KVFLOW_BF16_DOT
// A code becomes a bfloat16 by OR-ing it into the bits of a power of two: 0x4300 | u is the
// bfloat16 of 128 + u (u < 128: the mantissa's 7 bits count ones), and 0x4500 | h that of
// 2048 + 16·h (h < 16: at 2^11 they count sixteens). No table, no shuffle: the dot products carry
// the bias, 128·Σx (and 2048·Σx for an 8-bit code's high nibble), and the offset term takes it
// back. Each biased product is still exact in float.
constexpr float kLowBias = 128.0f, kHighBias = 2048.0f;

// The weights and (s, z) pairs of R rows kPrefetchRows ahead of `wr` / `szr`, requested now:
// the hardware prefetcher alone left the loops waiting on memory at half the bandwidth.
inline void prefetch_ahead(const uint8_t* wr, const uint16_t* szr, int64_t w_stride, int64_t pairs, int rows) {
  for (int64_t ahead = 0; ahead < rows * w_stride; ahead += 64)
    _mm_prefetch(reinterpret_cast<const char*>(wr + kPrefetchRows * w_stride + ahead), _MM_HINT_T0);
  for (int64_t ahead = 0; ahead < rows * pairs * 8; ahead += 64)
    _mm_prefetch(reinterpret_cast<const char*>(szr + kPrefetchRows * pairs * 4) + ahead, _MM_HINT_T0);
}

// acc + Σ_g (z − offset_per_s·s)·sums[g] for one weight row's (s, z) pairs, 16 groups at a time (a
// 32-bit lane holds one group's pair).
inline __m512 add_zeros_term(__m512 acc, const uint16_t* szr, const float* sums, int64_t groups, float offset_per_s) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t g0 = 0; g0 < groups; g0 += 16) {
    const __mmask16 live = static_cast<__mmask16>((1u << std::min<int64_t>(16, groups - g0)) - 1);
    const __m512i pair = _mm512_maskz_loadu_epi32(live, szr + 2 * g0);
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
    acc = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(offset_per_s), s, z), _mm512_maskz_loadu_ps(live, sums + g0), acc);
  }
  return acc;
}

// s of the groups a row's 32-byte unit u of its blocks holds, as floats, one per lane of
// vdpbf16ps's output (a lane sums two adjacent bytes' products): the unit holds 4 bytes of each
// of 8 groups, lanes 2i and 2i + 1 group i's. szr: the row's (s, z) pairs; units_per_block: 8 at
// 4 bits, 16 at 8.
inline __m512 block_unit_scales(const uint16_t* szr, int64_t u, int64_t units_per_block) {
  const uint16_t* first = szr + 2 * (16 * (u / units_per_block) + 8 * (u % 2));  // the unit's first group
  const __m256i eight = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m512i lanes = _mm512_permutexvar_epi32(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
                                                 _mm512_castsi256_si512(eight));
  return _mm512_castsi512_ps(_mm512_slli_epi32(lanes, 16));  // s, the pair's low half, as a float
}

// s of the pair of groups 2p, 2p + 1 after the blocks: lanes 0-7 and 8-15.
inline __m512 pair_scales(const uint16_t* szr, int64_t p) {
  const int32_t* pair_sz = reinterpret_cast<const int32_t*>(szr + p * 4);
  const __m512i both = _mm512_mask_set1_epi32(_mm512_set1_epi32(pair_sz[0]), 0xFF00, pair_sz[1]);
  return _mm512_castsi512_ps(_mm512_slli_epi32(both, 16));
}

// A block's 32-byte unit u times M rows of activations, into acc: its codes as biased bfloat16s
// (low nibbles, then high ones), each against its partners in xr (x_stride apart per row).
template <int M, int BITS>
inline void block_unit_bf16(__m512* acc, const uint8_t* wr, const uint16_t* xr, int64_t x_stride, const uint16_t* szr,
                            int64_t u) {
  const __m512i low4 = _mm512_set1_epi16(0x0F), low_bias = _mm512_set1_epi16(0x4300),
                high_bias = _mm512_set1_epi16(0x4500);
  const __m512 s16 = block_unit_scales(szr, u, BITS == 4 ? 8 : 16);
  const __m512i b16 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + u * 32)));
  const __m512i lo = _mm512_ternarylogic_epi32(b16, low4, low_bias, 0xEA);  // (b & 0x0F) | bias
  const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(b16, 4), BITS == 4 ? low_bias : high_bias);
  for (int r = 0; r < M; ++r) {
    // 4-bit: 64 partners a unit, the low nibbles' then the high ones'; 8-bit: 32, shared.
    const uint16_t* xp = xr + r * x_stride + u * (BITS == 4 ? 64 : 32);
    const __m512bh x_lo = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xp));
    const __m512bh x_hi = reinterpret_cast<__m512bh>(_mm512_loadu_si512(BITS == 4 ? xp + 32 : xp));
    const __m512 dot = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(lo), x_lo),
                                        reinterpret_cast<__m512bh>(hi), x_hi);
    acc[r] = _mm512_fmadd_ps(dot, s16, acc[r]);
  }
}

// Rows n0..n1 for M activation rows (xr: rearranged, see the top). A step covers two groups:
// 4-bit, 32 bytes; 8-bit, 64 bytes (read as two 32-byte halves of nibbles).
template <int M, int BITS>
void rows_bf16(c10::BFloat16* out, const uint16_t* xr, const float* sums, const uint8_t* w,
               const c10::BFloat16* sz, int64_t n0, int64_t n1, int64_t n_out, int64_t k) {
  const int64_t groups = k / kGroup, pairs = padded_groups(k) / 2, w_stride = row_bytes(k, BITS);
  const __m512i low4 = _mm512_set1_epi16(0x0F), low_bias = _mm512_set1_epi16(0x4300),
                high_bias = _mm512_set1_epi16(0x4500);
  // z − c·s per group, less the codes' bias: s·Σ(bias + u)·x = s·Σu·x + bias·s·Σx.
  const float offset_per_s = (BITS == 4 ? 8.0f + kLowBias : 128.0f + kLowBias + kHighBias);
  const int64_t x_stride = pairs * 64;  // bf16 values per rearranged row (a partial pair padded)
  const int64_t blocked = blocked_groups(k), block_units = blocked * (BITS == 4 ? 16 : 32) / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wr = w + n * w_stride;
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(sz) + n * pairs * 4;
    prefetch_ahead(wr, szr, w_stride, pairs, 1);
    __m512 acc[M];
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < block_units; ++u) block_unit_bf16<M, BITS>(acc, wr, xr, x_stride, szr, u);
    for (int64_t p = blocked / 2; p < pairs; ++p) {
      const __m512 s16 = pair_scales(szr, p);
      __m512i codes[BITS == 4 ? 2 : 4];
      if constexpr (BITS == 4) {
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + p * 32));
        const __m512i b16 = _mm512_cvtepu8_epi16(bytes);  // [g0 bytes 0..15, g1 bytes 0..15]
        codes[0] = _mm512_ternarylogic_epi32(b16, low4, low_bias, 0xEA);  // (b & 0x0F) | bias
        codes[1] = _mm512_or_si512(_mm512_srli_epi16(b16, 4), low_bias);
      } else {
        // 8-bit: bytes [g0 0..31, g1 0..31]; as 4-bit-style halves: [g0 0..15, g1 0..15] and [g0 16..31, g1 16..31].
        const __m256i g0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + p * 64));
        const __m256i g1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + p * 64 + 32));
        const __m512i a = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(g0, g1, 0x20));
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_permute2x128_si256(g0, g1, 0x31));
        codes[0] = _mm512_ternarylogic_epi32(a, low4, low_bias, 0xEA);
        codes[1] = _mm512_ternarylogic_epi32(b, low4, low_bias, 0xEA);
        codes[2] = _mm512_or_si512(_mm512_srli_epi16(a, 4), high_bias);
        codes[3] = _mm512_or_si512(_mm512_srli_epi16(b, 4), high_bias);
      }
      for (int r = 0; r < M; ++r) {
        const uint16_t* xp = xr + r * x_stride + p * 64;
        const __m512bh x_lo = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xp));
        const __m512bh x_hi = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xp + 32));
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(codes[0]), x_lo);
        dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(codes[1]), x_hi);
        if constexpr (BITS == 8) {
          dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(codes[2]), x_lo);
          dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(codes[3]), x_hi);
        }
        acc[r] = _mm512_fmadd_ps(dot, s16, acc[r]);
      }
    }
    for (int r = 0; r < M; ++r)  // Σ_g (z − (c + bias)·s)·Σx
      out[r * n_out + n] = static_cast<c10::BFloat16>(
          _mm512_reduce_add_ps(add_zeros_term(acc[r], szr, sums + r * groups, groups, offset_per_s)));
  }
}

// Weight rows n0..n1 for one activation row: `block(rows, n, wr, szr)` takes rows n..n+R together
// (R a compile-time 4, then 1 for the last few; wr, szr: row n's codes and (s, z) pairs, the rows
// kPrefetchRows ahead already requested), so every row gets the same arithmetic whichever block,
// and whichever thread's share, it falls in.
template <typename Block>
inline void in_fours(int64_t n0, int64_t n1, const uint8_t* w, const c10::BFloat16* sz, int64_t w_stride,
                     int64_t pairs, Block&& block) {
  const auto run = [&](auto rows, int64_t n) {
    const uint8_t* wr = w + n * w_stride;
    const uint16_t* szr = reinterpret_cast<const uint16_t*>(sz) + n * pairs * 4;
    prefetch_ahead(wr, szr, w_stride, pairs, decltype(rows)::value);
    block(rows, n, wr, szr);
  };
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) run(std::integral_constant<int, 4>{}, n);
  for (; n < n1; ++n) run(std::integral_constant<int, 1>{}, n);
}

// One activation row, four weight rows at a time: the activations are loaded once for the four,
// and four independent sums are in flight (one row at a time was ~10% slower).
void rows1_bf16(c10::BFloat16* out, const uint16_t* xr, const float* sums, const uint8_t* w,
                const c10::BFloat16* sz, int64_t n0, int64_t n1, int64_t k) {
  const int64_t groups = k / kGroup, pairs = padded_groups(k) / 2, w_stride = row_bytes(k, 4);
  const int64_t blocked = blocked_groups(k);
  const __m512i low4 = _mm512_set1_epi16(0x0F), low_bias = _mm512_set1_epi16(0x4300);
  in_fours(n0, n1, w, sz, w_stride, pairs, [=](auto rows, int64_t n, const uint8_t* wr, const uint16_t* szr) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < blocked / 2; ++u)
      for (int r = 0; r < R; ++r) block_unit_bf16<1, 4>(acc + r, wr + r * w_stride, xr, 0, szr + r * pairs * 4, u);
    for (int64_t p = blocked / 2; p < pairs; ++p) {
      const __m512bh x_lo = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + p * 64));
      const __m512bh x_hi = reinterpret_cast<__m512bh>(_mm512_loadu_si512(xr + p * 64 + 32));
      for (int r = 0; r < R; ++r) {
        const __m512 s16 = pair_scales(szr + r * pairs * 4, p);
        const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + r * w_stride + p * 32));
        const __m512i b16 = _mm512_cvtepu8_epi16(bytes);
        const __m512i c0 = _mm512_ternarylogic_epi32(b16, low4, low_bias, 0xEA);
        const __m512i c1 = _mm512_or_si512(_mm512_srli_epi16(b16, 4), low_bias);
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), reinterpret_cast<__m512bh>(c0), x_lo);
        dot = _mm512_dpbf16_ps(dot, reinterpret_cast<__m512bh>(c1), x_hi);
        acc[r] = _mm512_fmadd_ps(dot, s16, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      out[n + r] = static_cast<c10::BFloat16>(
          _mm512_reduce_add_ps(add_zeros_term(acc[r], szr + r * pairs * 4, sums, groups, 8.0f + kLowBias)));
  });
}

#ifdef KVFLOW_VNNI
// One activation row, four weight rows at a time, with integer dot products. vpdpbusd multiplies
// 64 unsigned bytes by 64 signed ones and adds them in fours into 32-bit lanes for the issue cost
// of a third of one vdpbf16ps, which multiplies 32. The codes are bytes as they are (4-bit ones
// with the nibbles masked out, no widening); the activations of each group of 32 become two
// int8 levels, x ≈ a·q1 + (a/254)·q2 with a = max|x| / 127, whose sum misses x by at most half a
// step of the second level, max|x| / 64,516 (the bfloat16 activations themselves hold 1 part in
// 256): both levels' integer dot products are exact, and they meet in float, scaled by a and s.
// Layout per call, in the codes' order (see the top), 64 bytes per group, a's as floats per lane:
//   a block (16 groups, 1,024 bytes): per run of dot products, for each level, the partners of
//     the run's bytes: [x 4t..4t+3 of g0, of g1, ... g15] at 8 bits; at 4 bits, those of the low
//     nibbles, then those of the high ones (x 16 + 4t..): 4 runs of 256 bytes, or 8 of 128. Its
//     a: 16 floats per level, lane i group i's, at 128 floats a block;
//   after the blocks, 4-bit codes per 4 groups (a chunk of 64 code bytes, 256 bytes): for each
//     level, [g0 x0..15, g1 x0..15, g2 x0..15, g3 x0..15] then x16..31 likewise; 16 floats per
//     level (lane i: group i / 4's a) at 32 a chunk. 8-bit codes per 2 groups (128 bytes): for
//     each level, [g0 x0..31, g1 x0..31]; 16 floats per level (lanes 0-7 g0's a, 8-15 g1's).
// A missing group (an odd pair count) has zero activations and is never loaded.
struct Int8Levels {
  std::vector<int8_t> xq;
  std::vector<float> a;
  std::vector<float> sums;   // [Ĝ]: Σ of the levels' x, for the zeros' term (the product is then
                             // exactly the dequantized weights' product with the levels' x)
};

Int8Levels int8_levels(const c10::BFloat16* x, int64_t k, int bits) {
  const int64_t groups = k / kGroup, blocked = blocked_groups(k), slots = padded_groups(k) + 4;
  Int8Levels out{std::vector<int8_t>(slots * 64, 0), std::vector<float>(slots * 16, 0.0f),
                 std::vector<float>(padded_groups(k), 0.0f)};
  // Group g's a of each level: a block's lane g % 16, or its lanes of a chunk (4-bit) or pair (8-bit).
  const auto set_a = [&](int64_t g, float a1, float a2) {
    for (int64_t level = 0; level < 2; ++level) {
      const float a = level == 0 ? a1 : a2;
      if (g < blocked) out.a[(g / 16) * 128 + level * 16 + g % 16] = a;
      else if (bits == 4) std::fill_n(out.a.begin() + (g / 4) * 32 + level * 16 + (g % 4) * 4, 4, a);
      else std::fill_n(out.a.begin() + (g / 2) * 32 + level * 16 + (g % 2) * 8, 8, a);
    }
  };
  // Group g's 16 levels of one half (x 16·half..16·half + 15) of one level, where they go.
  const auto put = [&](int64_t g, int64_t level, int64_t half, const int8_t* q) {
    int8_t* xq = out.xq.data();
    if (g < blocked && bits == 4) {
      for (int64_t t = 0; t < 4; ++t)
        std::memcpy(xq + (g / 16) * 1024 + t * 256 + level * 128 + half * 64 + (g % 16) * 4, q + 4 * t, 4);
    } else if (g < blocked) {
      for (int64_t t = 4 * half; t < 4 * half + 4; ++t)
        std::memcpy(xq + (g / 16) * 1024 + t * 128 + level * 64 + (g % 16) * 4, q + 4 * (t % 4), 4);
    } else if (bits == 4) {
      std::memcpy(xq + (g / 4) * 256 + level * 128 + half * 64 + (g % 4) * 16, q, 16);
    } else {
      std::memcpy(xq + (g / 2) * 128 + level * 64 + (g % 2) * 32 + half * 16, q, 16);
    }
  };
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i bits = _mm512_loadu_si512(x + g * kGroup);  // x0..31 as bfloat16 pairs
    // x0..15 and x16..31 in float: a pair's low half holds the even element, its high half the odd.
    const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
    const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(bits, high_half));
    const __m512i order_lo = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i order_hi = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
    const __m512 v[2] = {_mm512_permutex2var_ps(even, order_lo, odd), _mm512_permutex2var_ps(even, order_hi, odd)};
    constexpr int kNotFinite = 0x01 | 0x08 | 0x10 | 0x80;  // quiet NaN, +inf, -inf, signalling NaN
    if (_mm512_fpclass_ps_mask(v[0], kNotFinite) | _mm512_fpclass_ps_mask(v[1], kNotFinite)) {
      // No level holds it: the group's a is NaN, so its products and every output are NaN, as
      // the float product's would be (levels of zero, not garbage from converting NaN).
      set_a(g, NAN, NAN);
      out.sums[g] = NAN;
      continue;
    }
    const float biggest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
    if (biggest == 0.0f) continue;  // codes of zero, a of zero: the group adds nothing
    const float a = biggest / 127.0f, a2 = a / 254.0f;
    int32_t sum1 = 0, sum2 = 0;
    for (int half = 0; half < 2; ++half) {
      const __m512 q1 = _mm512_roundscale_ps(_mm512_div_ps(v[half], _mm512_set1_ps(a)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m512 rest = _mm512_fnmadd_ps(q1, _mm512_set1_ps(a), v[half]);
      const __m512i q2 = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_div_ps(rest, _mm512_set1_ps(a2))),
                                                           _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
      const __m512i q1i = _mm512_cvtps_epi32(q1);
      alignas(16) int8_t levels[2][16];
      _mm_store_si128(reinterpret_cast<__m128i*>(levels[0]), _mm512_cvtsepi32_epi8(q1i));
      _mm_store_si128(reinterpret_cast<__m128i*>(levels[1]), _mm512_cvtsepi32_epi8(q2));
      put(g, 0, half, levels[0]);
      put(g, 1, half, levels[1]);
      sum1 += _mm512_reduce_add_epi32(q1i);
      sum2 += _mm512_reduce_add_epi32(q2);
    }
    out.sums[g] = a * static_cast<float>(sum1) + a2 * static_cast<float>(sum2);
    set_a(g, a, a2);
  }
  return out;
}

// The end of block b for R weight rows: each lane holds one group's exact integer sums, one per
// level (i1, i2), which meet a and a/254, then the group's s; and the zeros' term (z − c·s)·Σx
// over the levels' x. Once for 16 groups.
template <int R>
inline void add_block(__m512* acc, const __m512i* i1, const __m512i* i2, const float* all_a, const float* level_sums,
                      const uint16_t* szr, int64_t pairs, int64_t b, float c) {
  const __m512i high_half = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  const __m512 a1 = _mm512_loadu_ps(all_a + b * 128), a2 = _mm512_loadu_ps(all_a + b * 128 + 16);
  const __m512 sums = _mm512_loadu_ps(level_sums + b * 16);
  for (int r = 0; r < R; ++r) {
    const __m512i pair = _mm512_loadu_si512(szr + r * pairs * 4 + b * 32);  // 16 groups' (s, z)
    const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
    const __m512 z = _mm512_castsi512_ps(_mm512_and_si512(pair, high_half));
    const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i2[r]), a2, _mm512_mul_ps(_mm512_cvtepi32_ps(i1[r]), a1));
    acc[r] = _mm512_fmadd_ps(_mm512_fnmadd_ps(_mm512_set1_ps(c), s, z), sums, _mm512_fmadd_ps(dot, s, acc[r]));
  }
}

// BITS = 4: a block is 4 runs of 64 code bytes, each byte's nibbles against their own partners
// (x[4t..] and x[16 + 4t..]); the groups after the blocks go 4 at a time (a chunk: 4 lanes a
// group). BITS = 8 (the Q8_0 head): 8 runs on the code bytes as they are; after the blocks, two
// groups per 64 bytes.
template <int BITS>
void rows1_int8(c10::BFloat16* out, const Int8Levels& levels, const uint8_t* w, const c10::BFloat16* sz, int64_t n0,
                int64_t n1, int64_t k) {
  constexpr int64_t kRuns = BITS == 4 ? 4 : 8, kRunLevels = BITS == 4 ? 256 : 128;  // a run's levels, bytes
  constexpr float kCenter = BITS == 4 ? 8.0f : 128.0f;
  const int64_t groups = k / kGroup, pairs = padded_groups(k) / 2, w_stride = row_bytes(k, BITS);
  const int64_t blocked = blocked_groups(k);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane i: group i / 4
  const int8_t* all_xq = levels.xq.data();
  const float *all_a = levels.a.data(), *level_sums = levels.sums.data();
  in_fours(n0, n1, w, sz, w_stride, pairs, [=](auto rows, int64_t n, const uint8_t* wr, const uint16_t* szr) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    // A block: its runs of dot products leave each lane one group's exact sum per level; then,
    // once for the 16 groups, a·(sum) + a2·(sum) times s, and the zeros' term.
    for (int64_t b = 0; b < blocked / 16; ++b) {
      __m512i i1[R], i2[R];
      for (int r = 0; r < R; ++r) i1[r] = i2[r] = _mm512_setzero_si512();
      for (int64_t t = 0; t < kRuns; ++t) {
        // The run's levels: 4-bit, level 1's low- and high-nibble partners, then level 2's; 8-bit,
        // level 1's, then level 2's.
        __m512i x[kRunLevels / 64];
        for (int64_t j = 0; j < kRunLevels / 64; ++j)
          x[j] = _mm512_loadu_si512(all_xq + b * 1024 + t * kRunLevels + 64 * j);
        for (int r = 0; r < R; ++r) {
          const __m512i bytes = _mm512_loadu_si512(wr + r * w_stride + b * kRuns * 64 + t * 64);
          if constexpr (BITS == 4) {
            const __m512i lo = _mm512_and_si512(bytes, low4);
            const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
            i1[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i1[r], lo, x[0]), hi, x[1]);
            i2[r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(i2[r], lo, x[2]), hi, x[3]);
          } else {
            i1[r] = _mm512_dpbusd_epi32(i1[r], bytes, x[0]);
            i2[r] = _mm512_dpbusd_epi32(i2[r], bytes, x[1]);
          }
        }
      }
      add_block<R>(acc, i1, i2, all_a, level_sums, szr, pairs, b, kCenter);
    }
    if constexpr (BITS == 4) {
      for (int64_t c = blocked / 4; c < (groups + 3) / 4; ++c) {  // 4 groups at a time
        const int8_t* xq = all_xq + c * 256;
        const __m512i x1_lo = _mm512_loadu_si512(xq), x1_hi = _mm512_loadu_si512(xq + 64);
        const __m512i x2_lo = _mm512_loadu_si512(xq + 128), x2_hi = _mm512_loadu_si512(xq + 192);
        const __m512 a1 = _mm512_loadu_ps(all_a + c * 32), a2 = _mm512_loadu_ps(all_a + c * 32 + 16);
        const int64_t live_groups = std::min<int64_t>(4, groups - 4 * c);
        const __mmask64 live = live_groups == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * live_groups)) - 1;
        for (int r = 0; r < R; ++r) {
          const __m512i bytes = _mm512_maskz_loadu_epi8(live, wr + r * w_stride + c * 64);
          const __m512i lo = _mm512_and_si512(bytes, low4);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
          const __m512i i1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x1_lo), hi, x1_hi);
          const __m512i i2 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x2_lo), hi, x2_hi);
          const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i2), a2, _mm512_mul_ps(_mm512_cvtepi32_ps(i1), a1));
          // The 4 groups' (s, z) pairs, 16 bytes; lane i takes group i / 4's s as a float.
          const __m512i four = _mm512_broadcast_i32x4(
              _mm_maskz_loadu_epi32(static_cast<__mmask8>((1u << live_groups) - 1), szr + r * pairs * 4 + c * 8));
          const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_permutexvar_epi32(spread, four), 16));
          acc[r] = _mm512_fmadd_ps(dot, s, acc[r]);
        }
      }
    } else {
      for (int64_t p = blocked / 2; p < pairs; ++p) {  // groups 2p and 2p + 1 (a padding one: zeros)
        const int8_t* xq = all_xq + p * 128;
        const __m512i x1 = _mm512_loadu_si512(xq), x2 = _mm512_loadu_si512(xq + 64);
        const __m512 a1 = _mm512_loadu_ps(all_a + p * 32), a2 = _mm512_loadu_ps(all_a + p * 32 + 16);
        for (int r = 0; r < R; ++r) {
          const __m512i bytes = _mm512_loadu_si512(wr + r * w_stride + p * 64);
          const __m512i i1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes, x1);
          const __m512i i2 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), bytes, x2);
          const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i2), a2, _mm512_mul_ps(_mm512_cvtepi32_ps(i1), a1));
          acc[r] = _mm512_fmadd_ps(dot, pair_scales(szr + r * pairs * 4, p), acc[r]);
        }
      }
    }
    for (int r = 0; r < R; ++r)  // the zeros' term over the levels' x, for the groups after the blocks
      out[n + r] = static_cast<c10::BFloat16>(_mm512_reduce_add_ps(
          add_zeros_term(acc[r], szr + r * pairs * 4 + 2 * blocked, level_sums + blocked, groups - blocked, kCenter)));
  });
}
#endif

// One activation row of 8-bit codes, four weight rows at a time, in float: a code becomes a float
// by widening and converting (exact), and products are float multiply-adds. vdpbf16ps, which
// takes over two cycles here, would need four per 64 codes (an 8-bit code is two bfloat16
// nibbles); this needs four multiply-adds, which issue two a cycle. xf: x in float in the codes'
// order (each code byte's partner). In a block, 16 bytes are 4 bytes of 4 groups, so each quarter
// of a run keeps its own sums until the block's end, where they meet their groups' scales.
void rows1_u8_f32(c10::BFloat16* out, const float* xf, const float* sums, const uint8_t* w, const c10::BFloat16* sz,
                  int64_t n0, int64_t n1, int64_t k) {
  const int64_t groups = k / kGroup, pairs = padded_groups(k) / 2, w_stride = row_bytes(k, 8);
  const int64_t blocked = blocked_groups(k);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // lane i: group i / 4
  const auto widened = [](const uint8_t* codes) {
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  };
  in_fours(n0, n1, w, sz, w_stride, pairs, [=](auto rows, int64_t n, const uint8_t* wr, const uint16_t* szr) {
    constexpr int R = decltype(rows)::value;
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocked / 16; ++b) {
      __m512 part[R][4];  // quarter q: 4 bytes of each of groups 4q..4q + 3
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) part[r][q] = _mm512_setzero_ps();
      for (int64_t t = 0; t < 8; ++t)
        for (int q = 0; q < 4; ++q) {
          const __m512 x = _mm512_loadu_ps(xf + b * 512 + t * 64 + q * 16);
          for (int r = 0; r < R; ++r)
            part[r][q] = _mm512_fmadd_ps(widened(wr + r * w_stride + b * 512 + t * 64 + q * 16), x, part[r][q]);
        }
      for (int r = 0; r < R; ++r)
        for (int q = 0; q < 4; ++q) {
          const uint16_t* quarter = szr + r * pairs * 4 + (16 * b + 4 * q) * 2;  // groups 4q..4q + 3's (s, z)
          const __m512i four = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(quarter)));
          const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_permutexvar_epi32(spread, four), 16));
          acc[r] = _mm512_fmadd_ps(part[r][q], s, acc[r]);
        }
    }
    for (int64_t g = blocked; g < groups; ++g) {
      const __m512 x0 = _mm512_loadu_ps(xf + g * kGroup), x1 = _mm512_loadu_ps(xf + g * kGroup + 16);
      for (int r = 0; r < R; ++r) {
        const uint8_t* codes = wr + r * w_stride + g * kGroup;
        const int32_t pair = *reinterpret_cast<const int32_t*>(szr + r * pairs * 4 + 2 * g);
        const __m512 s = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_set1_epi32(pair), 16));
        acc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(widened(codes + 16), x1, _mm512_mul_ps(widened(codes), x0)), s, acc[r]);
      }
    }
    for (int r = 0; r < R; ++r)
      out[n + r] = static_cast<c10::BFloat16>(
          _mm512_reduce_add_ps(add_zeros_term(acc[r], szr + r * pairs * 4, sums, groups, 128.0f)));
  });
}

template <int BITS>
void rows_bf16_any(int64_t m, c10::BFloat16* out, const uint16_t* xr, int64_t x_stride,
                   const float* sums, const uint8_t* w, const c10::BFloat16* sz,
                   int64_t n0, int64_t n1, int64_t n_out, int64_t k) {
  if constexpr (BITS == 4) {  // (one row of 8-bit codes takes rows1_u8_f32)
    if (m == 1) return rows1_bf16(out, xr, sums, w, sz, n0, n1, k);
  }
  for (int64_t r0 = 0; r0 < m; r0 += 4) {  // four rows per pass over the weights
    const float* part = sums + r0 * (k / kGroup);
    const uint16_t* x = xr + r0 * x_stride;
    c10::BFloat16* o = out + r0 * n_out;
    switch (std::min<int64_t>(4, m - r0)) {
      case 1: rows_bf16<1, BITS>(o, x, part, w, sz, n0, n1, n_out, k); break;
      case 2: rows_bf16<2, BITS>(o, x, part, w, sz, n0, n1, n_out, k); break;
      case 3: rows_bf16<3, BITS>(o, x, part, w, sz, n0, n1, n_out, k); break;
      default: rows_bf16<4, BITS>(o, x, part, w, sz, n0, n1, n_out, k);
    }
  }
}
#endif

bool has_int8_levels() {
#ifdef KVFLOW_VNNI
  return true;
#else
  return false;
#endif
}

bool fast() {
#ifdef KVFLOW_BF16_DOT
  return true;
#else
  return false;
#endif
}

// How a call computes (quant/int4_gemv.py: SCALAR, BF16_PRODUCTS, INT8_LEVELS): the scalar loop;
// bfloat16 products throughout; or, for one row of 4-bit codes where the CPU has AVX-512 VNNI,
// the two int8 levels (rows1_int8; other calls take the bfloat16 products).
constexpr int64_t kScalar = 0, kBf16Products = 1, kInt8Levels = 2;

// out [M, N] = x [M, K] · Wᵀ, bfloat16, W as at the top, computed as `path` says.
void int4_gemv(at::Tensor out, const at::Tensor& x, const at::Tensor& w, const at::Tensor& scale_zero, int64_t bits,
               int64_t path) {
  TORCH_CHECK(bits == 4 || bits == 8, "int4_gemv: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(path >= kScalar && path <= kInt8Levels, "int4_gemv: path must be 0 (scalar), 1 (bfloat16 products) or 2 "
              "(int8 levels at one row), not ", path);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "int4_gemv: x and out must be bfloat16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.is_contiguous(), "int4_gemv: x and out must be contiguous 2-D");
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "int4_gemv: 1 to ", kMaxRows, " rows, not ", m);
  TORCH_CHECK(k % kGroup == 0, "int4_gemv: input width ", k, " is not a multiple of ", kGroup);
  TORCH_CHECK(out.size(0) == m, "int4_gemv: out must have x's rows");
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == n * row_bytes(k, static_cast<int>(bits)),
              "int4_gemv: weights must be contiguous uint8 of ", n, " padded rows");
  TORCH_CHECK(scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.numel() == n * padded_groups(k) * 2,
              "int4_gemv: scale_zero must be contiguous bfloat16 [N, K / 32 rounded up to even, 2]");
  const auto* xp = x.data_ptr<c10::BFloat16>();
  auto* o = out.data_ptr<c10::BFloat16>();
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = scale_zero.data_ptr<c10::BFloat16>();
  // Output rows per task: a layer of a few hundred rows still goes to both threads.
  const int64_t grain = std::max<int64_t>(16, 16384 / std::max<int64_t>(k, 1));
#ifdef KVFLOW_VNNI
  if (path == kInt8Levels && m == 1) {  // its zeros' term takes the levels' own sums
    const Int8Levels levels = int8_levels(xp, k, static_cast<int>(bits));
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      if (bits == 4) rows1_int8<4>(o, levels, wp, szp, n0, n1, k);
      else rows1_int8<8>(o, levels, wp, szp, n0, n1, k);
    });
    return;
  }
#endif
  const std::vector<float> sums = group_sums(xp, m, k);
#ifdef KVFLOW_BF16_DOT
  if (path != kScalar) {
    if (m == 1 && bits == 8) {
      std::vector<float> xf(padded_groups(k) * kGroup, 0.0f);  // in the codes' order
      for (int64_t c = 0; c < k; ++c) xf[byte_at(k, 32, c / kGroup, c % kGroup)] = widen(xp[c]);
      at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
        rows1_u8_f32(o, xf.data(), sums.data(), wp, szp, n0, n1, k);
      });
      return;
    }
    const int64_t x_stride = padded_groups(k) * 32;
    const std::vector<uint16_t> xr = code_ordered(xp, m, k, static_cast<int>(bits));
    at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
      if (bits == 4) rows_bf16_any<4>(m, o, xr.data(), x_stride, sums.data(), wp, szp, n0, n1, n, k);
      else rows_bf16_any<8>(m, o, xr.data(), x_stride, sums.data(), wp, szp, n0, n1, n, k);
    });
    return;
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t n0, int64_t n1) {
    rows_scalar(o, xp, m, sums.data(), wp, szp, n0, n1, n, k, static_cast<int>(bits));
  });
}

// Rows `ids` of W as `out` [len(ids), K] (float32 or bfloat16): an embedding lookup. Each weight
// is s·(u − c) + z in float, then out's dtype: the numbers of int4_gemv.py's dequantize, since
// (u − c)·s, an integer of ≤ 8 bits times a bfloat16, is exact in float and only the add rounds
// (fused or not).
void rows(at::Tensor out, const at::Tensor& ids, const at::Tensor& w, const at::Tensor& scale_zero, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "int4_gemv rows: bits must be 4 or 8, not ", bits);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous(), "int4_gemv rows: ids are contiguous int64 [T]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) && out.size(1) % kGroup == 0 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "int4_gemv rows: out is contiguous float32 or bfloat16 [T, K], K a multiple of 32");
  const int64_t k = out.size(1), n = w.numel() / std::max<int64_t>(row_bytes(k, static_cast<int>(bits)), 1);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == n * row_bytes(k, static_cast<int>(bits)) &&
                  scale_zero.scalar_type() == at::kBFloat16 && scale_zero.is_contiguous() &&
                  scale_zero.numel() == n * padded_groups(k) * 2,
              "int4_gemv rows: w and scale_zero are an Int4Gemv's of width ", k);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < ids.size(0); ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < n, "int4_gemv rows: id ", id[t], " is outside [0, ", n, ")");
  const auto* wp = w.data_ptr<uint8_t>();
  const auto* szp = scale_zero.data_ptr<c10::BFloat16>();
  const float c = bits == 4 ? 8.0f : 128.0f;
  float* out_f = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  c10::BFloat16* out_bf16 = out_f == nullptr ? out.data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, ids.size(0), 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t ch = 0; ch < k; ++ch) {
        const c10::BFloat16* pair = szp + (id[t] * padded_groups(k) + ch / kGroup) * 2;
        const float value = (static_cast<float>(code(wp, k, static_cast<int>(bits), id[t], ch)) - c) * widen(pair[0]) +
                            widen(pair[1]);
        if (out_f != nullptr) out_f[t * k + ch] = value;
        else out_bf16[t * k + ch] = static_cast<c10::BFloat16>(value);
      }
  });
}

}  // namespace

TORCH_LIBRARY(kvflow_int4_gemv, m) {
  m.def("int4_gemv(Tensor(a!) out, Tensor x, Tensor w, Tensor scale_zero, int bits, int path) -> ()");
  m.def("rows(Tensor(a!) out, Tensor ids, Tensor w, Tensor scale_zero, int bits) -> ()");
  m.def("fast() -> bool", &fast);
  m.def("has_int8_levels() -> bool", &has_int8_levels);
}

TORCH_LIBRARY_IMPL(kvflow_int4_gemv, CPU, m) {
  m.impl("int4_gemv", &int4_gemv);
  m.impl("rows", &rows);
}
