// w8a8's two passes around oneDNN's int8 GEMM, on CPU: rounding each activation row to uint8
// codes with its own scale, and applying that scale to the GEMM's output row.
//
// With torch ops the rounding took five passes over float32 temporaries (abs, amax, divide,
// round, clamp, cast) and cost more than int8 saved over bfloat16 (docs/performance-journal.md, "W1
// throughput of int8 and w8a8"). Here a row is read twice while it sits in L1 (its maximum, then
// its codes) and written once. The codes are round(x · (127 / max|x|)) + 128, uint8 with zero
// point 128: the unsigned source x signed weights that VNNI's vpdpbusd multiplies. The
// multiplier is the float reciprocal of the scale, as the torch reference computes it
// (quant/w8a8.py), so both give the same codes; rounding is to nearest even, as torch.round.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) {  // a bfloat16 is a float's top half
  const uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

inline c10::BFloat16 to_bf16(float v) {  // round to nearest even, as torch; NaN stays NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(v != v ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Rows per task: a few tens of thousands of elements each, so that a decode step's handful of
// rows stays on the calling thread (a parallel region costs more than it splits there).
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1)); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

inline uint8_t code(float v, float inverse) {
  // |v · inverse| <= 127 up to one rounding of the product: the clamp keeps the code in range.
  const float q = std::min(std::max(std::nearbyint(v * inverse), -127.f), 127.f);
  return static_cast<uint8_t>(static_cast<int32_t>(q) + 128);
}

// A row holding NaN or infinity gets scale NaN (its codes are 128, zero): its output row is NaN,
// as the torch path's, never a finite value that hides the fault; the other rows are untouched.
template <typename scalar_t>
void quantize_row(uint8_t* out, float* scale_out, const scalar_t* row, int64_t width) {
  int64_t i = 0;
  float peak = 0.f;
  bool finite = true;
#if defined(__AVX512F__)
  __m512 peaks = _mm512_setzero_ps();
  const __m512 infinity = _mm512_set1_ps(INFINITY);
  __mmask16 non_finite = 0;
  for (; i + 16 <= width; i += 16) {
    const __m512 magnitude = _mm512_abs_ps(load16(row + i));
    non_finite |= _mm512_cmp_ps_mask(magnitude, infinity, _CMP_NLT_UQ);  // NaN or infinity
    peaks = _mm512_max_ps(peaks, magnitude);
  }
  peak = _mm512_reduce_max_ps(peaks);
  finite = non_finite == 0;
#endif
  for (; i < width; ++i) {
    const float magnitude = std::fabs(widen(row[i]));
    finite = finite && std::isfinite(magnitude);
    peak = std::max(peak, magnitude);
  }
  if (!finite) {
    std::memset(out, 128, width);
    *scale_out = NAN;
    return;
  }
  const float scale = peak > 0.f ? peak / 127.f : 1.f;
  const float inverse = 1.f / scale;
  i = 0;
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(inverse), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  const __m512i zero_point = _mm512_set1_epi32(128);
  for (; i + 16 <= width; i += 16) {
    __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(load16(row + i), factor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    const __m512i codes = _mm512_add_epi32(_mm512_cvtps_epi32(q), zero_point);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(codes));
  }
#endif
  for (; i < width; ++i) out[i] = code(widen(row[i]), inverse);
  *scale_out = scale;
}

template <typename scalar_t>
void quantize_rows_impl(uint8_t* codes, float* scales, const scalar_t* x, int64_t stride, int64_t rows,
                        int64_t width) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) quantize_row(codes + r * width, scales + r, x + r * stride, width);
  });
}

void quantize_rows(at::Tensor& codes, at::Tensor& scales, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "quantize_rows: x must be [rows, width] with unit stride");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.sizes() == x.sizes(),
              "quantize_rows: codes must be contiguous uint8 of x's shape");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == x.size(0),
              "quantize_rows: scales must be contiguous float32, one per row");
  auto* c = codes.data_ptr<uint8_t>();
  auto* s = scales.data_ptr<float>();
  if (x.scalar_type() == at::kBFloat16) {
    quantize_rows_impl(c, s, x.data_ptr<c10::BFloat16>(), x.stride(0), x.size(0), x.size(1));
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_rows: x must be float32 or bfloat16");
    quantize_rows_impl(c, s, x.data_ptr<float>(), x.stride(0), x.size(0), x.size(1));
  }
}

inline void scale_row(c10::BFloat16* y, float scale, int64_t width) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  const __m512 factor = _mm512_set1_ps(scale);
  for (; i + 16 <= width; i += 16) {
    const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(load16(y + i), factor));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), reinterpret_cast<const __m256i&>(rounded));
  }
#endif
  for (; i < width; ++i) y[i] = to_bf16(widen(y[i]) * scale);
}

inline void scale_row(float* y, float scale, int64_t width) {
  for (int64_t i = 0; i < width; ++i) y[i] *= scale;
}

template <typename scalar_t>
void scale_rows_impl(scalar_t* y, const float* scales, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) scale_row(y + r * width, scales[r], width);
  });
}

// y[r, :] *= scales[r] in place. For bfloat16 that rounds the GEMM's already rounded output once
// more, far below int8's own error.
void scale_rows_(at::Tensor& y, const at::Tensor& scales) {
  TORCH_CHECK(y.dim() == 2 && y.is_contiguous(), "scale_rows_: y must be contiguous [rows, width]");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == y.size(0),
              "scale_rows_: scales must be contiguous float32, one per row");
  const int64_t rows = y.size(0), width = y.size(1);
  const float* s = scales.data_ptr<float>();
  if (y.scalar_type() == at::kBFloat16) {
    scale_rows_impl(y.data_ptr<c10::BFloat16>(), s, rows, width);
  } else {
    TORCH_CHECK(y.scalar_type() == at::kFloat, "scale_rows_: y must be float32 or bfloat16");
    scale_rows_impl(y.data_ptr<float>(), s, rows, width);
  }
}

// out[r, :] = q[r, :] · scale[r], rounded once to the dtype out and scale share: int8 weight-only
// layers' rows for a dense product (q is exact in bfloat16, so this is torch's q.to(bf16) * scale
// in one pass).
template <typename scalar_t>
void dequantize_rows_impl(scalar_t* out, const int8_t* q, const scalar_t* scale, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float s = widen(scale[r]);
      const int8_t* qr = q + r * width;
      scalar_t* o = out + r * width;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        const __m512 factor = _mm512_set1_ps(s);
        for (; i + 16 <= width; i += 16) {
          const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + i))));
          const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(v, factor));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), reinterpret_cast<const __m256i&>(rounded));
        }
      }
#endif
      for (; i < width; ++i) {
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          o[i] = to_bf16(static_cast<float>(qr[i]) * s);
        } else {
          o[i] = static_cast<float>(qr[i]) * s;
        }
      }
    }
  });
}

void dequantize_rows(at::Tensor& out, const at::Tensor& q, const at::Tensor& scale) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == at::kChar,
              "dequantize_rows: q must be contiguous int8 [rows, width]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "dequantize_rows: out must be contiguous, q's shape");
  TORCH_CHECK(scale.is_contiguous() && scale.numel() == q.size(0) && scale.scalar_type() == out.scalar_type(),
              "dequantize_rows: one scale per row, in out's dtype");
  const int64_t rows = q.size(0), width = q.size(1);
  const int8_t* qp = q.data_ptr<int8_t>();
  if (out.scalar_type() == at::kBFloat16) {
    dequantize_rows_impl(out.data_ptr<c10::BFloat16>(), qp, scale.data_ptr<c10::BFloat16>(), rows, width);
  } else {
    TORCH_CHECK(out.scalar_type() == at::kFloat, "dequantize_rows: bfloat16 or float32 out and scale");
    dequantize_rows_impl(out.data_ptr<float>(), qp, scale.data_ptr<float>(), rows, width);
  }
}

}  // namespace

TORCH_LIBRARY(kvflow_int8_rows, m) {
  m.def("quantize_rows(Tensor(a!) codes, Tensor(b!) scales, Tensor x) -> ()");
  m.def("scale_rows_(Tensor(a!) y, Tensor scales) -> ()");
  m.def("dequantize_rows(Tensor(a!) out, Tensor q, Tensor scale) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_int8_rows, CPU, m) {
  m.impl("quantize_rows", &quantize_rows);
  m.impl("scale_rows_", &scale_rows_);
  m.impl("dequantize_rows", &dequantize_rows);
}
