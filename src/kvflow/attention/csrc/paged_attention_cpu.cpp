// Attention over the paged KV cache on CPU, reading K and V in place from their blocks.
//
// One work item is (request, KV head): the G = H / Hkv query heads that share the KV head, for
// every query of the request, walk the request's blocks once. A block's keys and values are
// widened to float once (for all those queries), each query's scores over the keys it may see
// (causal, and its sliding window) get an online softmax (running max and sum, rescaled once
// per block), and the probability-weighted values accumulate in float. Keys no query sees are
// never read: a block's unwritten tail, padding entries of the block table and blocks a window
// released hold whatever bits the pool had, and reading them would let 0 x NaN into the sum.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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

// ar[d] += Σ_t p[t] · v[t][d], 16 columns at a time: the 16 sums stay in a register over all the
// keys (the plain loop over d loads and stores ar once per key).
inline void accumulate_values(float* ar, const float* p, const float* values, int64_t t_lo, int64_t t_hi, int64_t head_dim) {
  int64_t d0 = 0;
  for (; d0 + 16 <= head_dim; d0 += 16) {
    float a[16];
#pragma omp simd
    for (int dd = 0; dd < 16; ++dd) a[dd] = ar[d0 + dd];
    for (int64_t t = t_lo; t < t_hi; ++t) {
      const float pt = p[t];
      const float* vt = values + t * head_dim + d0;
#pragma omp simd
      for (int dd = 0; dd < 16; ++dd) a[dd] += pt * vt[dd];
    }
#pragma omp simd
    for (int dd = 0; dd < 16; ++dd) ar[d0 + dd] = a[dd];
  }
  for (int64_t t = t_lo; t < t_hi && d0 < head_dim; ++t)
    for (int64_t d = d0; d < head_dim; ++d) ar[d] += p[t] * values[t * head_dim + d];
}

template <typename scalar_t>
void attend_item(scalar_t* out, const scalar_t* query, const scalar_t* key_cache, const scalar_t* value_cache,
                 const int64_t* table, int64_t table_width, int64_t num_blocks, int64_t seq_len, int64_t q_start, int64_t q_len, int64_t kv_head,
                 int64_t group, int64_t head_dim, int64_t block_size, int64_t window, float scale,
                 int64_t q_token_stride, int64_t q_head_stride, int64_t o_token_stride, int64_t o_head_stride,
                 int64_t c_block_stride, int64_t c_head_stride, int64_t c_pos_stride) {
  const int64_t n_rows = q_len * group;  // row r: query r / group, head kv_head * group + r % group
  const int64_t first_pos = seq_len - q_len;
  std::vector<float> q(n_rows * head_dim), acc(n_rows * head_dim, 0.f), keys(block_size * head_dim),
      values(block_size * head_dim), scores(block_size), probs(block_size);
  std::vector<float> run_max(n_rows, -std::numeric_limits<float>::infinity()), run_sum(n_rows, 0.f);
  for (int64_t r = 0; r < n_rows; ++r) {
    const scalar_t* src = query + (q_start + r / group) * q_token_stride + (kv_head * group + r % group) * q_head_stride;
    widen(src, q.data() + r * head_dim, head_dim);
    for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] *= scale;
  }
  // Keys any query of this request sees: [lowest, seq_len).
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, first_pos - window + 1) : 0;
  for (int64_t block = lowest / block_size; block * block_size < seq_len; ++block) {
    const int64_t start = block * block_size;
    const int64_t lo = std::max(start, lowest), hi = std::min(start + block_size, seq_len);
    TORCH_CHECK(block < table_width && table[block] >= 0 && table[block] < num_blocks, "paged_attention: block table entry ", table[block],
                " for visible keys is not a block of the cache");
    const int64_t offset = table[block] * c_block_stride + kv_head * c_head_stride;
    for (int64_t t = lo; t < hi; ++t) {
      widen(key_cache + offset + (t - start) * c_pos_stride, keys.data() + (t - start) * head_dim, head_dim);
      widen(value_cache + offset + (t - start) * c_pos_stride, values.data() + (t - start) * head_dim, head_dim);
    }
    for (int64_t r = 0; r < n_rows; ++r) {
      const int64_t pos = first_pos + r / group;
      const int64_t k_lo = window > 0 ? std::max(lo, pos - window + 1) : lo, k_hi = std::min(hi, pos + 1);
      if (k_lo >= k_hi) continue;
      const int64_t t_lo = k_lo - start, t_hi = k_hi - start;
      const float* qr = q.data() + r * head_dim;
      float* sc = scores.data();
      float* pr = probs.data();
      for (int64_t t = t_lo; t < t_hi; ++t) sc[t] = dot(qr, keys.data() + t * head_dim, head_dim);
      float block_max = -std::numeric_limits<float>::infinity();
      for (int64_t t = t_lo; t < t_hi; ++t) block_max = std::max(block_max, sc[t]);
      float* ar = acc.data() + r * head_dim;
      const float new_max = std::max(run_max[r], block_max);
      const float correction = std::exp(run_max[r] - new_max);  // exp(-inf) = 0 on the first block
      float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t t = t_lo; t < t_hi; ++t) {
        pr[t] = exp_nonpositive(sc[t] - new_max);
        block_sum += pr[t];
      }
      run_sum[r] = run_sum[r] * correction + block_sum;
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) ar[d] *= correction;
      accumulate_values(ar, pr, values.data(), t_lo, t_hi, head_dim);
      run_max[r] = new_max;
    }
  }
  for (int64_t r = 0; r < n_rows; ++r) {
    scalar_t* dst = out + (q_start + r / group) * o_token_stride + (kv_head * group + r % group) * o_head_stride;
    const float inv = run_sum[r] > 0.f ? 1.f / run_sum[r] : 0.f;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[r * head_dim + d] * inv);
  }
}

template <typename scalar_t>
void paged_attention_typed(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, const at::Tensor& requests, int64_t window, double scale) {
  const int64_t heads = query.size(1), head_dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1), block_size = key_cache.size(2);
  const int64_t group = heads / kv_heads, n_items = requests.size(0) * kv_heads;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* starts = query_start_loc.data_ptr<int64_t>();
  const int64_t* reqs = requests.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  const int64_t table_stride = block_tables.stride(0);
  at::parallel_for(0, n_items, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = reqs[item / kv_heads], kv_head = item % kv_heads;
      attend_item<scalar_t>(out_ptr, q_ptr, k_ptr, v_ptr, tables + b * table_stride, block_tables.size(1), key_cache.size(0), lens[b], starts[b],
                            starts[b + 1] - starts[b], kv_head, group, head_dim, block_size, window,
                            static_cast<float>(scale), query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2));
    }
  });
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                     const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& requests, int64_t window, double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [tokens, heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.strides() == key_cache.strides(),
              "key/value cache: [blocks, kv_heads, block_size, head_dim], one layout");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, out and cache share one dtype");
  TORCH_CHECK(query.size(1) % key_cache.size(1) == 0 && query.size(2) == key_cache.size(3), "head shapes disagree");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc, &requests})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->stride(-1) == 1, "index tensors are contiguous int64");
  switch (query.scalar_type()) {
    case at::kFloat: paged_attention_typed<float>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale); break;
    case at::kBFloat16: paged_attention_typed<c10::BFloat16>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale); break;
    case at::kHalf: paged_attention_typed<c10::Half>(out, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, window, scale); break;
    default: TORCH_CHECK(false, "paged_attention: unsupported dtype ", query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu, m) {
  m.def("paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor seq_lens, Tensor query_start_loc, Tensor requests, int window, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
