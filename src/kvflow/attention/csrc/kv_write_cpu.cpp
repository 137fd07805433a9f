// The new tokens' K and V stored into the paged pool on CPU: one pass, straight from the
// [tokens, kv_heads, head_dim] projections (any token and head strides) into the head-major
// blocks [num_blocks, kv_heads, block_size, head_dim].
//
// Torch's path (index_put through a transposed view, after splitting slots into blocks and
// offsets and dropping the rows of negative slots) costs about a millisecond a layer on a W1
// step; this is a memcpy per (token, head). A negative slot writes nothing (padding); a slot
// past the pool is refused before anything is written.
//
// `write_kv_quantized` stores into a quantized cache (kv_quant.py's packed rows: a block's codes,
// then its bfloat16 scales) the bits kv_quant.quantize makes, step for step: the scale is
// amax x (1 + 2^-8) / qmax in float, at least bfloat16's smallest normal, rounded to bfloat16;
// each code is x / scale rounded to nearest even (int8) or converted (E4M3, E5M2), within +-qmax.
// The clamp to +-qmax comes before the conversion, so c10's E5M2 overflow to infinity (from
// 61440 up) is never reached; a NaN stays NaN (0x7F, or 0xFF with its sign), as in torch.
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
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>

#include "kvflow_avx512.h"
#define KVFLOW_AVX512 1
#endif

namespace {

#if defined(KVFLOW_AVX512)
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const c10::BFloat16* x) {
  const __m512i bits = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(bits, 16));
}
inline void store16(float* y, __m512 v) { _mm512_storeu_ps(y, v); }
// 16 finite floats within +-qmax to codes of a format with `Mantissa` bits and exponent bias
// `Bias` (E4M3: 3, 7; E5M2: 2, 15), c10's Float8 rounding step for step: below the format's
// smallest normal by one float addition that rounds to the subnormal's place, else by adding
// half a unit of the code's last place less one, plus the kept mantissa's lowest bit (to
// nearest, ties to even). No NaN or infinity comes here (quantize_vector16 sends those away).
template <int Mantissa, int Bias>
inline __m128i fp8_codes16(__m512 y) {
  constexpr int kDrop = 23 - Mantissa;  // float mantissa bits the code does not keep
  const __m512i bits = _mm512_castps_si512(y);
  const __m512i sign = _mm512_and_si512(bits, _mm512_set1_epi32(static_cast<int32_t>(0x80000000u)));
  const __m512i a = _mm512_xor_si512(bits, sign);
  // 2^(1 - Bias) x 2^kDrop: adding it leaves the subnormal code in the float's low bits.
  const __m512i denorm = _mm512_set1_epi32((127 - Bias + kDrop + 1) << 23);
  const __m512i sub = _mm512_sub_epi32(
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(denorm))), denorm);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a, kDrop), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_set1_epi32(
      static_cast<int32_t>((static_cast<uint32_t>(Bias - 127) << 23) + ((1u << (kDrop - 1)) - 1)));
  const __m512i normal = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a, bias), odd), kDrop);
  const __mmask16 small = _mm512_cmplt_epu32_mask(a, _mm512_set1_epi32((127 - Bias + 1) << 23));
  const __m512i code = _mm512_or_si512(_mm512_mask_blend_epi32(small, normal, sub), _mm512_srli_epi32(sign, 24));
  return _mm512_cvtepi32_epi8(code);
}
#endif

// What each code type needs: its largest code and, for the fp8 formats, the AVX-512 encode and
// decode (the decode by way of halves, `halves`: codes in a half's places, 1 / kHalfScale their value).
template <typename code_t>
struct CodeFormat;
template <>
struct CodeFormat<int8_t> {
  static constexpr float kMax = 127.0f;
};
template <>
struct CodeFormat<c10::Float8_e4m3fn> {
  static constexpr float kMax = 448.0f;
#if defined(KVFLOW_AVX512)
  static constexpr float kHalfScale = 256.0f;  // halves carry E4M3 values / 256 (bias 15 against 7)
  static __m128i codes16(__m512 y) { return fp8_codes16<3, 7>(y); }
  static __m512i halves(__m512i words) { return kvflow_avx512::fp8_halves_low(words); }
#endif
};
template <>
struct CodeFormat<c10::Float8_e5m2> {
  static constexpr float kMax = 57344.0f;
#if defined(KVFLOW_AVX512)
  static constexpr float kHalfScale = 1.0f;  // an E5M2 code is a half's top byte
  static __m128i codes16(__m512 y) { return fp8_codes16<2, 15>(y); }
  static __m512i halves(__m512i words) { return kvflow_avx512::e5m2_halves_low(words); }
#endif
};

#if defined(KVFLOW_AVX512)
// 16 fp8 codes to floats of 1 / kHalfScale their value (exact): their bits in a half's places.
template <typename code_t>
inline __m512 fp8_values16(__m128i codes) {
  const __m512i words = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(codes));
  return _mm512_cvtph_ps(_mm512_castsi512_si256(CodeFormat<code_t>::halves(words)));
}
inline void store16(c10::BFloat16* y, __m512 v) {  // rounded to nearest even, as c10::BFloat16 (no NaN here)
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm512_cvtepi32_epi16(rounded));
}
#endif

void write_kv(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.is_contiguous(),
              "write_kv: key_cache and value_cache are contiguous [num_blocks, kv_heads, block_size, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv: slot_mapping is contiguous int64");
  const int64_t num_blocks = key_cache.size(0), heads = key_cache.size(1), block_size = key_cache.size(2),
                dim = key_cache.size(3), tokens = slot_mapping.numel();
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == dim &&
                    t->stride(2) == 1 && t->scalar_type() == key_cache.scalar_type(),
                "write_kv: key and value are [tokens, kv_heads, head_dim] in the cache's dtype, head_dim contiguous");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_blocks * block_size, "write_kv: slot ", slots[t], " is past the pool of ",
                num_blocks * block_size, " slots");
  const int64_t item = key.element_size();
  const size_t row_bytes = static_cast<size_t>(dim * item);
  const char* sources[2] = {static_cast<const char*>(key.data_ptr()), static_cast<const char*>(value.data_ptr())};
  const int64_t token_strides[2] = {key.stride(0) * item, value.stride(0) * item};
  const int64_t head_strides[2] = {key.stride(1) * item, value.stride(1) * item};
  char* caches[2] = {static_cast<char*>(key_cache.data_ptr()), static_cast<char*>(value_cache.data_ptr())};
  at::parallel_for(0, tokens, std::max<int64_t>(1, 32768 / std::max<int64_t>(heads * dim, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (slots[t] < 0) continue;
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t row = (block * heads + h) * block_size + offset;
          std::memcpy(caches[which] + row * row_bytes, sources[which] + t * token_strides[which] + h * head_strides[which],
                      row_bytes);
        }
    }
  });
}

constexpr float kScaleMargin = 1.0f + 1.0f / 256.0f;  // kv_quant._SCALE_ROUNDING_MARGIN

// The smallest scale: bfloat16's smallest normal (an all-zero vector still gets a positive scale).
inline float min_scale() { return static_cast<float>(std::numeric_limits<c10::BFloat16>::min()); }

#if defined(KVFLOW_AVX512)
// quantize_vector 16 numbers at a time, for float and bfloat16 vectors of a multiple of 16 numbers;
// false (nothing written) for a vector holding a NaN, whose scale the scalar path makes as torch does.
template <typename code_t, typename scalar_t>
bool quantize_vector16(const scalar_t* x, int64_t dim, code_t* codes, c10::BFloat16* scale_out, scalar_t* back) {
  constexpr float qmax = CodeFormat<code_t>::kMax;
  __m512 m = _mm512_setzero_ps();
  __mmask16 nan = 0;
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 v = load16(x + d);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    m = _mm512_max_ps(m, _mm512_abs_ps(v));
  }
  if (nan != 0) return false;
  const float factor = static_cast<float>(static_cast<double>(kScaleMargin) / qmax);
  const c10::BFloat16 scale(std::max(_mm512_reduce_max_ps(m) * factor, min_scale()));
  *scale_out = scale;
  const __m512 s = _mm512_set1_ps(static_cast<float>(scale));
  const __m512 hi = _mm512_set1_ps(qmax), lo = _mm512_set1_ps(-qmax);
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 y = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(load16(x + i), s), lo), hi);
    __m128i q;
    __m512 value;  // code x scale
    if constexpr (std::is_same_v<code_t, int8_t>) {
      const __m512i whole = _mm512_cvtps_epi32(_mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      q = _mm512_cvtepi32_epi8(whole);
      value = _mm512_mul_ps(_mm512_cvtepi32_ps(whole), s);
    } else {
      q = CodeFormat<code_t>::codes16(y);
      value = _mm512_mul_ps(fp8_values16<code_t>(q), _mm512_mul_ps(s, _mm512_set1_ps(CodeFormat<code_t>::kHalfScale)));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + i), q);
    if (back != nullptr) store16(back + i, value);
  }
  return true;
}
#endif

// One vector of `dim` numbers → codes and its scale (see the file's comment); `back`, where
// given, receives code x scale in the input's dtype (kv_quant.round_trip: what the cache now
// gives back, for a prompt's attention to its own keys).
template <typename code_t, typename scalar_t>
void quantize_vector(const scalar_t* x, int64_t dim, code_t* codes, c10::BFloat16* scale_out, scalar_t* back) {
#if defined(KVFLOW_AVX512)
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>)
    if (dim % 16 == 0 && quantize_vector16(x, dim, codes, scale_out, back)) return;
#endif
  constexpr float qmax = CodeFormat<code_t>::kMax;
  float amax = 0.f;
  for (int64_t d = 0; d < dim; ++d) {
    const float a = std::fabs(static_cast<float>(x[d]));
    if (std::isnan(a)) {  // a NaN anywhere makes the amax NaN, as torch's; a later number must not replace it
      amax = a;
      break;
    }
    amax = std::max(amax, a);
  }
  const float product = amax * static_cast<float>(static_cast<double>(kScaleMargin) / qmax);
  const c10::BFloat16 scale(std::isnan(product) ? product : std::max(product, min_scale()));
  *scale_out = scale;
  const float s = static_cast<float>(scale);
  for (int64_t d = 0; d < dim; ++d) {
    const float y = std::min(std::max(static_cast<float>(x[d]) / s, -qmax), qmax);
    if constexpr (std::is_same_v<code_t, int8_t>) codes[d] = static_cast<int8_t>(std::nearbyint(y));
    else codes[d] = static_cast<code_t>(y);
    if (back != nullptr) back[d] = static_cast<scalar_t>(static_cast<float>(codes[d]) * s);
  }
}

template <typename code_t, typename scalar_t>
void write_quantized_typed(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                           const int64_t* slots, int64_t tokens, int64_t heads, int64_t dim, int64_t block_size,
                           const at::Tensor* key_back, const at::Tensor* value_back) {
  const int64_t row = key_cache.size(2);
  code_t* caches[2] = {static_cast<code_t*>(key_cache.data_ptr()), static_cast<code_t*>(value_cache.data_ptr())};
  const scalar_t* sources[2] = {key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>()};
  const int64_t token_strides[2] = {key.stride(0), value.stride(0)}, head_strides[2] = {key.stride(1), value.stride(1)};
  scalar_t* backs[2] = {key_back ? key_back->data_ptr<scalar_t>() : nullptr,
                        value_back ? value_back->data_ptr<scalar_t>() : nullptr};
  at::parallel_for(0, tokens, std::max<int64_t>(1, 4096 / std::max<int64_t>(heads * dim, 1)), [&](int64_t begin, int64_t end) {
    std::vector<code_t> scratch(dim + 2);  // a padding row's codes: read back, not stored
    for (int64_t t = begin; t < end; ++t) {
      const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
      if (slots[t] < 0 && backs[0] == nullptr) continue;
      for (int which = 0; which < 2; ++which)
        for (int64_t h = 0; h < heads; ++h) {
          code_t* packed = caches[which] + (block * heads + h) * row;
          code_t* codes = slots[t] < 0 ? scratch.data() : packed + offset * dim;
          c10::BFloat16* scale = slots[t] < 0 ? reinterpret_cast<c10::BFloat16*>(scratch.data() + dim)
                                              : reinterpret_cast<c10::BFloat16*>(packed + block_size * dim) + offset;
          quantize_vector(sources[which] + t * token_strides[which] + h * head_strides[which], dim, codes, scale,
                          backs[which] ? backs[which] + (t * heads + h) * dim : nullptr);
        }
    }
  });
}

// The quantized store; key_back and value_back (contiguous [tokens, kv_heads, head_dim] of the
// input's dtype), where given, receive what the cache gives back for each row (padding rows too).
void write_kv_quantized(at::Tensor& key_cache, at::Tensor& value_cache, const at::Tensor& key, const at::Tensor& value,
                        const at::Tensor& slot_mapping, const std::optional<at::Tensor>& key_back,
                        const std::optional<at::Tensor>& value_back) {
  const at::ScalarType codes = key_cache.scalar_type();
  TORCH_CHECK((codes == at::kChar || codes == at::kFloat8_e4m3fn || codes == at::kFloat8_e5m2) && key_cache.dim() == 3 &&
                  key_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.is_contiguous() &&
                  value_cache.scalar_type() == codes,
              "write_kv_quantized: key_cache and value_cache are contiguous int8, float8_e4m3fn or float8_e5m2 "
              "[num_blocks, kv_heads, block_size * (head_dim + 2)]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(),
              "write_kv_quantized: slot_mapping is contiguous int64");
  const int64_t num_blocks = key_cache.size(0), heads = key_cache.size(1), tokens = slot_mapping.numel();
  const int64_t dim = key.dim() == 3 ? key.size(2) : 0;
  TORCH_CHECK(dim > 0 && key_cache.size(2) % (dim + 2) == 0, "write_kv_quantized: the cache's rows are not block_size x (",
              dim, " + 2) bytes");
  const int64_t block_size = key_cache.size(2) / (dim + 2);
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads && t->size(2) == dim && t->stride(2) == 1 &&
                    t->scalar_type() == key.scalar_type(),
                "write_kv_quantized: key and value are [tokens, kv_heads, head_dim] of one dtype, head_dim contiguous");
  }
  TORCH_CHECK(key_back.has_value() == value_back.has_value(), "write_kv_quantized: key_back and value_back go together");
  for (const std::optional<at::Tensor>* t : {&key_back, &value_back})
    TORCH_CHECK(!t->has_value() || ((*t)->sizes() == key.sizes() && (*t)->is_contiguous() &&
                                    (*t)->scalar_type() == key.scalar_type()),
                "write_kv_quantized: key_back and value_back are contiguous, of key's shape and dtype");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] < num_blocks * block_size, "write_kv_quantized: slot ", slots[t], " is past the pool of ",
                num_blocks * block_size, " slots");
  const at::Tensor* kb = key_back.has_value() ? &*key_back : nullptr;
  const at::Tensor* vb = value_back.has_value() ? &*value_back : nullptr;
#define KVFLOW_WRITE(code_t, scalar_t) \
  write_quantized_typed<code_t, scalar_t>(key_cache, value_cache, key, value, slots, tokens, heads, dim, block_size, kb, vb)
#define KVFLOW_WRITE_CODES(code_t)                                                            \
  switch (key.scalar_type()) {                                                                \
    case at::kFloat: KVFLOW_WRITE(code_t, float); break;                                      \
    case at::kBFloat16: KVFLOW_WRITE(code_t, c10::BFloat16); break;                           \
    case at::kHalf: KVFLOW_WRITE(code_t, c10::Half); break;                                   \
    default: TORCH_CHECK(false, "write_kv_quantized: unsupported dtype ", key.scalar_type()); \
  }
  if (codes == at::kChar) {
    KVFLOW_WRITE_CODES(int8_t)
  } else if (codes == at::kFloat8_e4m3fn) {
    KVFLOW_WRITE_CODES(c10::Float8_e4m3fn)
  } else {
    KVFLOW_WRITE_CODES(c10::Float8_e5m2)
  }
#undef KVFLOW_WRITE_CODES
#undef KVFLOW_WRITE
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_kv, m) {
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.def("write_kv_quantized(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, "
        "Tensor slot_mapping, Tensor(c!)? key_back=None, Tensor(d!)? value_back=None) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_kv, CPU, m) {
  m.impl("write_kv", &write_kv);
  m.impl("write_kv_quantized", &write_kv_quantized);
}
