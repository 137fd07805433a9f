// The elementwise chains between the matmuls, one pass each over their rows, on CPU.
//
// Torch runs RMSNorm as seven kernels over float32 temporaries (upcast, square, mean, rsqrt,
// scale, downcast, weight), RoPE as six, SiLU(gate)·up as two; on a small model these memory-
// bound chains cost more than the matmuls. Here a row is read once and written once, and the
// arithmetic rounds exactly where torch's ops round (to float after every operation, to the
// model dtype where the torch code casts), so both paths compute the same numbers. The build
// passes -ffp-contract=off for this reason: a fused multiply-add would round once, not twice.
// Rows are spread over torch's thread pool; the loops over a row are left to the vectoriser.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// bfloat16 <-> float as bit arithmetic the compiler vectorises (c10's conversions branch on NaN).
inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;  // a bfloat16 is a float's top half
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename scalar_t>
inline scalar_t narrow(float v);
template <>
inline float narrow<float>(float v) { return v; }
template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float v) {  // round to nearest even, as torch; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Rows per task: torch's own grain (32768 elements), so that a kernel goes parallel only where
// the torch ops it replaces would. A decode step's rows then run on the calling thread: a
// parallel region per op, over 100 a step, cost milliseconds each on a loaded machine, where
// the waiting thread loses its time slice.
inline int64_t grain(int64_t row_width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(row_width, 1)); }

template <typename scalar_t>
void rms_norm_rows(scalar_t* out, const scalar_t* x, int64_t x_stride, scalar_t* residual, int64_t res_stride,
                   const scalar_t* weight, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* xr = x + row * x_stride;
      scalar_t* orow = out + row * width;
      if (residual != nullptr) {
        // The sum is rounded to the model dtype (torch's add does) and becomes the new residual.
        scalar_t* rr = residual + row * res_stride;
        for (int64_t i = 0; i < width; ++i) rr[i] = narrow<scalar_t>(widen(xr[i]) + widen(rr[i]));
        xr = rr;
      }
      // mean(x²) as torch takes it: a float sum (here accumulated in double, so that its one
      // rounding lands where torch's pairwise float sum almost always does), divided by width.
      double sum = 0.0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < width; ++i) {
        const float v = widen(xr[i]);
        sum += static_cast<double>(v * v);
      }
      const float mean = static_cast<float>(sum) / static_cast<float>(width);
      const float inv_rms = 1.0f / std::sqrt(mean + eps);
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = narrow<scalar_t>(widen(xr[i]) * inv_rms);
        orow[i] = narrow<scalar_t>(widen(weight[i]) * widen(normed));
      }
    }
  });
}

// e^x in plain arithmetic the compiler vectorises (std::exp is a scalar libm call per element,
// which made SiLU·up slower than torch's vectorised kernel): x = n ln2 + r, e^r from a degree-6
// polynomial on |r| <= ln2 / 2 (Cephes' expf coefficients, within 2 ulp), 2^n put into the
// exponent bits. Past the float range: 0 below, infinity above, as expf gives.
inline float vector_exp(float x) {
  const float clamped = std::min(std::max(x, -87.3f), 88.7f);
  // n = round(x / ln2) by the 1.5 * 2^23 trick: std::floor kept GCC from vectorising the loop.
  const float n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float er = p * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float e = er * scale;
  return x > 88.7f ? std::numeric_limits<float>::infinity() : (x < -87.3f ? 0.0f : e);
}

template <typename scalar_t>
void silu_and_mul_rows(scalar_t* out, const scalar_t* gate_up, int64_t stride, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const scalar_t* gate = gate_up + row * stride;
      const scalar_t* up = gate + width;
      scalar_t* orow = out + row * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = widen(gate[i]);
        const scalar_t act = narrow<scalar_t>(g / (1.0f + vector_exp(-g)));  // F.silu's result, rounded
        orow[i] = narrow<scalar_t>(widen(act) * widen(up[i]));
      }
    }
  });
}

// Rotate-half RoPE on one [tokens, heads, head_dim] tensor in place.
template <typename scalar_t>
void rotate_rows(scalar_t* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t token_stride,
                 int64_t head_stride, const int64_t* positions, const float* cos, const float* sin,
                 int64_t max_positions) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(positions[t] >= 0 && positions[t] < max_positions, "rotary: position ", positions[t],
                " is outside the table of ", max_positions);
  at::parallel_for(0, tokens * heads, grain(head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      scalar_t* row = x + t * token_stride + h * head_stride;
      const float* c = cos + positions[t] * half;
      const float* s = sin + positions[t] * half;
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = widen(row[i]), x2 = widen(row[i + half]);
        row[i] = narrow<scalar_t>(x1 * c[i] - x2 * s[i]);
        row[i + half] = narrow<scalar_t>(x2 * c[i] + x1 * s[i]);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with contiguous rows");
}

#define DISPATCH(dtype, NAME, ...)                                                  \
  switch (dtype) {                                                                  \
    case at::kFloat: { using scalar_t = float; __VA_ARGS__; break; }                \
    case at::kBFloat16: { using scalar_t = c10::BFloat16; __VA_ARGS__; break; }     \
    default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);                \
  }

void rms_norm(at::Tensor& out, const at::Tensor& x, const c10::optional<at::Tensor>& residual,
              const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes(), "rms_norm: out is a contiguous x-shaped tensor");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight is [width], contiguous");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: x, weight and out share one dtype");
  if (residual.has_value()) {
    check_rows(*residual, "rms_norm: residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "rms_norm: residual is x's shape and dtype");
  }
  DISPATCH(x.scalar_type(), "rms_norm",
           rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), x.stride(0),
                                   residual ? residual->data_ptr<scalar_t>() : nullptr,
                                   residual ? residual->stride(0) : 0, weight.data_ptr<scalar_t>(), x.size(0),
                                   x.size(1), static_cast<float>(eps)));
}

void silu_and_mul(at::Tensor& out, const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up's width is even (gate, then up)");
  TORCH_CHECK(out.is_contiguous() && out.size(0) == gate_up.size(0) && out.size(1) == gate_up.size(1) / 2 &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_and_mul: out is a contiguous [rows, width / 2] tensor of gate_up's dtype");
  DISPATCH(gate_up.scalar_type(), "silu_and_mul",
           silu_and_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), gate_up.stride(0),
                                       gate_up.size(0), out.size(1)));
}

void rotary(at::Tensor& q, at::Tensor& k, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "rotary: positions are contiguous int64");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
                  sin.scalar_type() == at::kFloat && sin.is_contiguous(),
              "rotary: cos and sin are contiguous float32 [max_positions, head_dim / 2]");
  for (const at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->dim() == 3 && t->stride(2) == 1 && t->size(0) == positions.numel() &&
                    t->size(2) == 2 * cos.size(1) && t->scalar_type() == q.scalar_type(),
                "rotary: q and k are [tokens, heads, head_dim] of one dtype, head_dim contiguous");
    DISPATCH(t->scalar_type(), "rotary",
             rotate_rows<scalar_t>(t->data_ptr<scalar_t>(), t->size(0), t->size(1), t->size(2), t->stride(0),
                                   t->stride(1), positions.data_ptr<int64_t>(), cos.data_ptr<float>(),
                                   sin.data_ptr<float>(), cos.size(0)));
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // widened: a bfloat16 is a float's top half
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// The index of a row's largest value, the first of equals; where the row has a NaN, the first
// NaN's (torch's max(dim) does the same). One pass finds the maximum, a second its first place.
// bfloat16 rows are compared widened, which keeps their order: no float copy of the logits.
template <typename scalar_t>
int64_t first_argmax_row(const scalar_t* row, int64_t width) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t c = 0;
#if defined(__AVX512F__)
  __m512 best16[4] = {_mm512_set1_ps(best), _mm512_set1_ps(best), _mm512_set1_ps(best), _mm512_set1_ps(best)};
  __mmask16 unordered = 0;
  for (; c + 64 <= width; c += 64)  // four independent maxima: the loop is not one latency chain
    for (int j = 0; j < 4; ++j) {
      const __m512 v = load16(row + c + 16 * j);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best16[j] = _mm512_max_ps(best16[j], v);
    }
  for (; c + 16 <= width; c += 16) {
    const __m512 v = load16(row + c);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best16[0] = _mm512_max_ps(best16[0], v);
  }
  nan = unordered != 0;
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(best16[0], best16[1]), _mm512_max_ps(best16[2], best16[3])));
#endif
  for (; c < width; ++c) {
    const float v = widen(row[c]);
    nan |= v != v;
    best = std::max(best, v);
  }
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(best);
  for (; i + 16 <= width; i += 16) {
    const __m512 v = load16(row + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(v, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < width; ++i) {
    const float v = widen(row[i]);
    if (nan ? v != v : v == best) return i;
  }
  return 0;
}

void first_argmax(at::Tensor& out, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "first_argmax: x is [rows, width], rows contiguous");
  TORCH_CHECK(x.size(1) > 0, "first_argmax: rows must not be empty");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == x.size(0) && out.is_contiguous(),
              "first_argmax: out is contiguous int64 [rows]");
  int64_t* idx = out.data_ptr<int64_t>();
  const int64_t width = x.size(1), stride = x.stride(0);
  DISPATCH(x.scalar_type(), "first_argmax", {
    const scalar_t* rows = x.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), 1, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) idx[r] = first_argmax_row(rows + r * stride, width);
    });
  });
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_ops, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor(b!)? residual, Tensor weight, float eps) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor cos, Tensor sin) -> ()");
  m.def("first_argmax(Tensor(a!) out, Tensor x) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_ops, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary", &rotary);
  m.impl("first_argmax", &first_argmax);
}
