// Causal attention of a prompt's queries to its keys, for bfloat16 and head_dim 64: a fresh
// prompt's, or a chunk's that follows a cached prefix (its queries the keys' last ones). On AMX
// tiles where the CPU has them, else on AVX-512 BF16 dot products (`vdpbf16ps`).
//
// SDPA's flash kernel ran at ~0.13 TFLOP/s in W1's prefill steps on AMX (31% of them), and at
// 20-30 GFLOP/s on a CPU without AMX (26% of W1's prefill steps there). Here each unit of work is
// 16 queries of one head. Keys are laid out once per KV head as the products' B operand: K
// transposed to dimension pairs x keys (for Q·Kᵀ), V interleaved by key pairs (for P·V); a tile
// multiply and a `vdpbf16ps` with a broadcast pair take the same layout. Two passes over the keys
// the queries see, 32 at a time: the first computes the scores, keeps them and takes each row's
// maximum, the second exp(s - max) as bfloat16 probabilities P (one exp per score; the sums in
// float), then P·V in float. The output is divided by the sums at the end. Scores and sums are
// float; P is rounded to bfloat16 for its multiply, as SDPA's bfloat16 kernel rounds it. The two
// ways differ only in the order of a product's float sums.
//
// Tiles: 0, 1 = scores of 16 queries x 2 x 16 keys; 2 = A (Q rows, then P); 3 = B (K or V); 4..7 =
// the output, 16 queries x 4 x 16 dimensions. Dot products: 16 rows' scores over 16 keys stay in
// 16 registers while each key pair's row of K is loaded once; P·V runs four query rows at a time,
// their 4 x 16 dimensions' sums in registers over all the keys.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include "kvflow_avx512.h"
#define KVFLOW_PROMPT_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "kvflow_amx.h"
#define KVFLOW_PROMPT_AMX 1
#endif
#endif

namespace {

constexpr int64_t kHeadDim = 64;

#ifdef KVFLOW_PROMPT_BF16
// exp(s - max) of the scores, to r^5: the probabilities are rounded to bfloat16 right after.
inline __m512 exp16(__m512 x) { return kvflow_avx512::exp_nonpositive16<5>(x); }

// Lanes of the 16 keys from k0 that query position `pos` sees (k <= pos; every such key exists).
inline __mmask16 seen(int64_t k0, int64_t pos) {
  const int64_t hi = pos + 1 - k0;
  return hi <= 0 ? 0 : hi >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << hi) - 1);
}

struct Layout {  // one KV head's keys and values as tile operands
  std::vector<uint32_t> k;  // [key block of 16][chunk of 32 dims][16 pairs][16 keys]
  std::vector<uint32_t> v;  // [key block of 32][slice of 16 dims][16 key pairs][16 dims]
};

// A head's layout for len positions, zero where no key lies (lay_out fills it).
void size_for(Layout& out, int64_t len) {
  const int64_t blocks32 = (len + 31) / 32;
  out.k.assign(blocks32 * 2 * 2 * 256, 0u);
  out.v.assign(blocks32 * 4 * 256, 0u);
}

// Positions [t0, t1) of a head's keys and values into `out` (sized by size_for).
void lay_out(Layout& out, const c10::BFloat16* key, const c10::BFloat16* value, int64_t t0, int64_t t1, int64_t token_stride) {
  for (int64_t t = t0; t < t1; ++t) {
    const auto* words = reinterpret_cast<const uint32_t*>(key + t * token_stride);
    uint32_t* block = out.k.data() + (t / 16) * 2 * 256;
    for (int64_t c = 0; c < 2; ++c)
      for (int64_t kp = 0; kp < 16; ++kp) block[c * 256 + kp * 16 + t % 16] = words[c * 16 + kp];
    const auto* bits = reinterpret_cast<const uint16_t*>(value + t * token_stride);
    auto* pairs = reinterpret_cast<uint16_t*>(out.v.data() + (t / 32) * 4 * 256);
    const int64_t kp = (t % 32) / 2, half = t % 2;
    for (int64_t d = 0; d < kHeadDim; ++d) pairs[((d / 16) * 256 + kp * 16 + d % 16) * 2 + half] = bits[d];
  }
}

#ifdef KVFLOW_PROMPT_AMX
// Scores of the 16 query rows in `q_tile` (bfloat16, 64 dimensions, rows 128 bytes apart) against
// the 32 keys of block b32, into s[16][32] (unscaled).
inline void scores32_tiles(float* s, const c10::BFloat16* q_tile, const Layout& layout, int64_t b32) {
  const uint32_t* k = layout.k.data() + b32 * 2 * 2 * 256;
  _tile_zero(0);
  _tile_zero(1);
  for (int c = 0; c < 2; ++c) {
    _tile_loadd(2, q_tile + c * 32, 128);
    _tile_loadd(3, k + (0 * 2 + c) * 256, 64);
    _tile_dpbf16ps(0, 2, 3);
    _tile_loadd(3, k + (1 * 2 + c) * 256, 64);
    _tile_dpbf16ps(1, 2, 3);
  }
  _tile_stored(0, s, 128);
  _tile_stored(1, s + 16, 128);
}

// o[16][64] = P·V for the probabilities p [end32][16 rows][32 keys] (bfloat16).
inline void values_tiles(float* o, const c10::BFloat16* p, const Layout& layout, int64_t end32) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t b32 = 0; b32 < end32; ++b32) {
    _tile_loadd(2, p + b32 * 512, 64);
    const uint32_t* v = layout.v.data() + b32 * 4 * 256;
    _tile_loadd(3, v + 0 * 256, 64);
    _tile_dpbf16ps(4, 2, 3);
    _tile_loadd(3, v + 1 * 256, 64);
    _tile_dpbf16ps(5, 2, 3);
    _tile_loadd(3, v + 2 * 256, 64);
    _tile_dpbf16ps(6, 2, 3);
    _tile_loadd(3, v + 3 * 256, 64);
    _tile_dpbf16ps(7, 2, 3);
  }
  _tile_stored(4, o + 0, kHeadDim * 4);
  _tile_stored(5, o + 16, kHeadDim * 4);
  _tile_stored(6, o + 32, kHeadDim * 4);
  _tile_stored(7, o + 48, kHeadDim * 4);
}
#endif

inline __m512bh as_pairs(__m512i x) { return reinterpret_cast<__m512bh&>(x); }

// scores32_tiles on dot products: each of the 16 rows' sums over 16 keys in a register, a K row
// (one dimension pair of 16 keys) loaded once for all rows, each row's pair broadcast.
inline void scores32_dots(float* s, const c10::BFloat16* q_tile, const Layout& layout, int64_t b32) {
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q_tile);  // [16 rows][32 dimension pairs]
  for (int half = 0; half < 2; ++half) {
    const uint32_t* k = layout.k.data() + (b32 * 2 + half) * 2 * 256;  // [chunk of 32 dims][16 pairs][16 keys]
    __m512 acc[16];
    for (auto& a : acc) a = _mm512_setzero_ps();
    for (int kp = 0; kp < 32; ++kp) {
      const __m512bh keys = as_pairs(_mm512_loadu_si512(k + kp * 16));
      for (int r = 0; r < 16; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], keys, as_pairs(_mm512_set1_epi32(static_cast<int>(pairs[r * 32 + kp]))));
    }
    for (int r = 0; r < 16; ++r) _mm512_storeu_ps(s + r * 32 + half * 16, acc[r]);
  }
}

// values_tiles on dot products, for the first `rows` rows: four rows at a time, their 4 x 16
// dimensions' sums in registers over all the keys; each key pair's values loaded once per four rows.
inline void values_dots(float* o, const c10::BFloat16* p, const Layout& layout, int64_t end32, int64_t rows) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    __m512 acc[4][4];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t b32 = 0; b32 < end32; ++b32) {
      const uint32_t* v = layout.v.data() + b32 * 4 * 256;  // [slice of 16 dims][16 key pairs][16 dims]
      const uint32_t* probs = reinterpret_cast<const uint32_t*>(p + b32 * 512);  // [16 rows][16 key pairs]
      for (int kp = 0; kp < 16; ++kp) {
        __m512bh values[4];
        for (int d = 0; d < 4; ++d) values[d] = as_pairs(_mm512_loadu_si512(v + d * 256 + kp * 16));
        for (int r = 0; r < 4; ++r) {
          const __m512bh pair = as_pairs(_mm512_set1_epi32(static_cast<int>(probs[(r0 + r) * 16 + kp])));
          for (int d = 0; d < 4; ++d) acc[r][d] = _mm512_dpbf16_ps(acc[r][d], values[d], pair);
        }
      }
    }
    for (int r = 0; r < 4; ++r)
      for (int d = 0; d < 4; ++d) _mm512_storeu_ps(o + (r0 + r) * kHeadDim + d * 16, acc[r][d]);
  }
}

// The two ways of scores32 and values, chosen at compile time.
template <bool kTiles>
inline void scores32(float* s, const c10::BFloat16* q_tile, const Layout& layout, int64_t b32) {
#ifdef KVFLOW_PROMPT_AMX
  if constexpr (kTiles) return scores32_tiles(s, q_tile, layout, b32);
#endif
  scores32_dots(s, q_tile, layout, b32);
}

template <bool kTiles>
inline void values(float* o, const c10::BFloat16* p, const Layout& layout, int64_t end32, int64_t rows) {
#ifdef KVFLOW_PROMPT_AMX
  if constexpr (kTiles) return values_tiles(o, p, layout, end32);
#endif
  values_dots(o, p, layout, end32, rows);
}

// Queries [q0, q0 + 16) of the n_queries of one head, at positions offset + q0 on (query i sees
// keys [0, offset + i]); on tiles (kTiles) or dot products.
template <bool kTiles>
void attend16(c10::BFloat16* out, int64_t out_token_stride, const c10::BFloat16* query, int64_t q_token_stride,
              const Layout& layout, int64_t q0, int64_t n_queries, int64_t offset, float scale) {
  alignas(64) c10::BFloat16 q_tile[16 * kHeadDim];
  thread_local std::vector<float> saved;  // each 32 keys' scores [16][32], from pass 1 to pass 2
  thread_local std::vector<c10::BFloat16> p;  // each 32 keys' probabilities [16][32]
  alignas(64) float o[16 * kHeadDim];
  const int64_t rows = std::min<int64_t>(16, n_queries - q0);
  std::memset(q_tile, 0, sizeof(q_tile));
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(q_tile + r * kHeadDim, query + (q0 + r) * q_token_stride, kHeadDim * sizeof(c10::BFloat16));
  const int64_t last = offset + q0 + rows - 1;  // the last query's position: keys beyond it are unseen
  const int64_t end32 = last / 32 + 1;
  saved.resize(end32 * 16 * 32);
  p.resize(end32 * 16 * 32);
  const __m512 factor = _mm512_set1_ps(scale);
  // Per-row maxima and sums are kept 16 lanes wide and reduced once at the end of their pass.
  __m512 lanes[16];
  float row_max[16], row_sum[16];
  for (auto& l : lanes) l = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  // 1. Each row's maximum scaled score.
  for (int64_t b32 = 0; b32 < end32; ++b32) {
    float* s = saved.data() + b32 * 512;
    scores32<kTiles>(s, q_tile, layout, b32);
    for (int64_t r = 0; r < rows; ++r)
      for (int half = 0; half < 2; ++half) {
        const __mmask16 live = seen(b32 * 32 + half * 16, offset + q0 + r);
        lanes[r] = _mm512_mask_max_ps(lanes[r], live, lanes[r], _mm512_mul_ps(_mm512_loadu_ps(s + r * 32 + half * 16), factor));
      }
  }
  for (int64_t r = 0; r < 16; ++r) {
    row_max[r] = _mm512_reduce_max_ps(lanes[r]);
    lanes[r] = _mm512_setzero_ps();
  }
  // 2. P = exp(s - max) in bfloat16 and its float row sums, then P·V.
  for (int64_t b32 = 0; b32 < end32; ++b32) {
    const float* s = saved.data() + b32 * 512;
    c10::BFloat16* pb = p.data() + b32 * 512;
    for (int64_t r = 0; r < 16; ++r) {
      for (int half = 0; half < 2; ++half) {
        const int64_t k0 = b32 * 32 + half * 16;
        const __mmask16 live = r < rows ? seen(k0, offset + q0 + r) : 0;
        __m512 e = _mm512_setzero_ps();
        if (live != 0) {
          const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(s + r * 32 + half * 16), factor, _mm512_set1_ps(row_max[r]));
          e = _mm512_maskz_mov_ps(live, exp16(x));
        }
        const __m256bh rounded = _mm512_cvtneps_pbh(e);
        // the sum of what P·V multiplies: the rounded probabilities
        lanes[r] = _mm512_add_ps(lanes[r], _mm512_cvtpbh_ps(rounded));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + r * 32 + half * 16), reinterpret_cast<const __m256i&>(rounded));
      }
    }
  }
  for (int64_t r = 0; r < 16; ++r) row_sum[r] = _mm512_reduce_add_ps(lanes[r]);
  values<kTiles>(o, p.data(), layout, end32, rows);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 inv = _mm512_set1_ps(row_sum[r] > 0.f ? 1.f / row_sum[r] : 0.f);
    for (int64_t d = 0; d < kHeadDim; d += 16) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * kHeadDim + d), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (q0 + r) * out_token_stride + d),
                          reinterpret_cast<const __m256i&>(rounded));
    }
  }
}
#endif

// The kernel runs here: built for AVX-512 BF16.
bool available() {
#ifdef KVFLOW_PROMPT_BF16
  return true;
#else
  return false;
#endif
}

// It may multiply on AMX tiles here: built for them, and Linux hands them out.
bool has_tiles() {
#ifdef KVFLOW_PROMPT_AMX
  return kvflow_amx::permitted();
#else
  return false;
#endif
}

// out [n, H, 64] = causal attention of q [n, H, 64] to k, v [L, Hkv, 64], all bfloat16 with unit
// stride in the last dimension; the queries are the last n of the L positions (n = L: a fresh
// prompt; n < L: a chunk after a cached prefix of L - n). On AMX tiles if `tiles` (has_tiles()
// must be true), else on dot products.
void prompt_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      bool tiles) {
  TORCH_CHECK(available(), "prompt_attention: built without AVX-512 BF16");
  TORCH_CHECK(!tiles || has_tiles(), "prompt_attention: tiles=True, but no AMX here");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.sizes() == q.sizes(), "prompt_attention: [L, heads, 64]");
  TORCH_CHECK(q.size(2) == kHeadDim && k.size(2) == kHeadDim && v.size(2) == kHeadDim, "prompt_attention: head_dim 64");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "prompt_attention: bfloat16");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1 &&
                  k.stride(0) == v.stride(0) && k.stride(1) == v.stride(1),
              "prompt_attention: unit-stride rows, k and v laid out alike");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && k.size(0) >= q.size(0) && v.sizes() == k.sizes(),
              "prompt_attention: shapes (q [n, H, 64] for the last n of k's and v's L positions)");
#ifdef KVFLOW_PROMPT_BF16
  const int64_t len = k.size(0), n_queries = q.size(0), heads = q.size(1), kv_heads = k.size(1), group = heads / kv_heads;
  std::vector<Layout> layouts(kv_heads);
  for (auto& layout : layouts) size_for(layout, len);
  const auto* kp = k.data_ptr<c10::BFloat16>();
  const auto* vp = v.data_ptr<c10::BFloat16>();
  // Units of 32 positions of one KV head (not a head each: SmolLM2's 3 heads left one of two
  // threads idle a third of the time).
  const int64_t spans = (len + 31) / 32;
  at::parallel_for(0, kv_heads * spans, 1, [&](int64_t begin, int64_t end) {
    for (int64_t unit = begin; unit < end; ++unit) {
      const int64_t h = unit / spans, t0 = unit % spans * 32;
      lay_out(layouts[h], kp + h * k.stride(1), vp + h * v.stride(1), t0, std::min(len, t0 + 32), k.stride(0));
    }
  });
  const int64_t blocks = (n_queries + 15) / 16;
  const auto* qp = q.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  // Units (head, query block). A block's cost grows with its position (causal), and parallel_for
  // hands each thread a contiguous range of units, so the blocks are taken last, first, second
  // last, second, ...: every range mixes long and short ones.
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    const auto attend = [&](auto run) {
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t h = unit % heads, i = unit / heads;
        const int64_t qb = i % 2 == 0 ? blocks - 1 - i / 2 : i / 2;
        run(op + h * out.stride(1), out.stride(0), qp + h * q.stride(1), q.stride(0), layouts[h / group], qb * 16,
            n_queries, len - n_queries, static_cast<float>(scale));
      }
    };
#ifdef KVFLOW_PROMPT_AMX
    if (tiles) {
      kvflow_amx::configure_full_tiles();
      attend(attend16<true>);
      _tile_release();
      return;
    }
#endif
    attend(attend16<false>);
  });
#endif
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_prompt, m) {
  m.def("prompt_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, bool tiles) -> ()");
  m.def("available() -> bool", &available);
  m.def("has_tiles() -> bool", &has_tiles);
}

TORCH_LIBRARY_IMPL(kvflow_cpu_prompt, CPU, m) { m.impl("prompt_attention", &prompt_attention); }
