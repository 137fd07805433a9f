// AVX-512 pieces shared by kvflow's CPU kernels (attention/csrc/paged_attention_cpu.cpp,
// attention/csrc/kv_write_cpu.cpp, quant/csrc/panel_linear_cpu.cpp). Included only where the
// compiler targets AVX-512 (the includer checks __AVX512F__). A change here names new builds of
// every kernel (cpu_extension.build_name hashes this folder's headers).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace kvflow_avx512 {

// 1 / k! in float, each factor exact (k <= 10).
constexpr float inverse_factorial(int k) {
  float f = 1.0f;
  for (int i = 2; i <= k; ++i) f *= static_cast<float>(i);
  return 1.0f / f;
}

// e^x on 16 lanes for x <= 0 (a score less its row's maximum, or -|x|): 2^n · e^r with n =
// round(x / ln 2) and |r| <= ln 2 / 2 (ln 2 in two parts, Cody and Waite), e^r by its Taylor
// polynomial to r^Degree: 7, a relative error under 2^-23; 5, under 2^-16, for results rounded
// to bfloat16 (2^-9) right after. Below -87 the result is clamped to e^-87 ~ 1.6e-38 instead of a
// subnormal or 0.
template <int Degree = 7>
inline __m512 exp_nonpositive16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 round = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), round), round);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860682030941723212e-6f), r);
  __m512 p = _mm512_set1_ps(inverse_factorial(Degree));
  for (int k = Degree - 1; k >= 0; --k) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(inverse_factorial(k)));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// E4M3 codes in the low byte of each 16-bit lane, as halves of 1/256 their value (exact): the
// sign to bit 15, exponent and mantissa to bits 7-13, so that a half's bias of 15 against E4M3's
// 7 is the factor 2^8; subnormal codes become subnormal halves, which the convert widens exactly.
inline __m512i fp8_halves_low(__m512i x) {
  const __m512i sign = _mm512_slli_epi16(x, 8), rest = _mm512_and_si512(_mm512_slli_epi16(x, 7), _mm512_set1_epi16(0x3F80));
  return _mm512_ternarylogic_epi32(sign, rest, _mm512_set1_epi16(static_cast<int16_t>(0x8000)), 0xEC);  // (a & c) | b
}

// E5M2 codes in the low byte of each 16-bit lane, as halves of their value (exact): an E5M2
// number is the top byte of a half (same bias, same exponent width), so a shift is the whole
// conversion, subnormals included.
inline __m512i e5m2_halves_low(__m512i x) { return _mm512_slli_epi16(x, 8); }

}  // namespace kvflow_avx512
