// y = x Wᵀ on AMX tiles for bfloat16 x [M, K] and W [N, K], for the row counts of decode steps.
//
// oneDNN's bf16 products at 1-512 rows streamed SmolLM2's weights at 15-17 GB/s where this CPU
// reads 23-25 (2026-11-27, 30 layers' weights cycling, 16 rows: 14.9 ms against 9.3 here; 128
// rows: 28 against 21). Here the weight is laid out once as tile operands, one 16-column panel
// after another: panel n holds, for each 32-wide slice of K, the B tile of those columns (16 rows
// of K pairs x 16 columns x 2). A unit of work is two panels (32 output columns), or for the
// gated form a gate panel and the up panel of the same columns; a thread streams its units' panels
// once, in order, and multiplies each by every 32 rows of x (A tiles loaded where x lies), four
// float tiles accumulating over K in order. So each output's sum runs over K in the same order
// whatever M is: a row's result never depends on the other rows.
//
// The gated form is SiLU(x W_gateᵀ) * (x W_upᵀ) as oneDNN's two epilogues give it: SiLU of the
// float sum, rounded to bfloat16, times the up product's float sum, rounded.
//
// Tiles: 0-3 = C (rows 0-15 and 16-31 of the block x the unit's two panels), 4, 5 = A, 6, 7 = B.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "kvflow_amx.h"
#include "kvflow_avx512.h"
#define KVFLOW_LINEAR_AMX 1
#endif

namespace {

constexpr int64_t kTileBytes = 1024;  // one B tile: 16 K pairs x 16 columns x 2 bfloat16

#ifdef KVFLOW_LINEAR_AMX
inline void store_bf16(c10::BFloat16* dst, __m512 v) {
  const __m256bh rounded = _mm512_cvtneps_pbh(v);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(rounded));
}

inline __m512 round_bf16(__m512 v) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(v)); }

// SiLU(g) = g · σ(g) on 16 lanes, from e = e^-|g| (never overflows): σ(g) = 1 / (1 + e) for g >= 0,
// e / (1 + e) below.
inline __m512 silu16(__m512 g) {
  const __m512 e = kvflow_avx512::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __mmask16 negative = _mm512_cmplt_ps_mask(g, _mm512_setzero_ps());
  const __m512 numerator = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), negative, e);
  return _mm512_mul_ps(g, _mm512_div_ps(numerator, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

struct Operands {
  const c10::BFloat16* x;     // [M, K], rows ldx apart
  int64_t ldx;
  const c10::BFloat16* tail;  // the last rows when M % 16 != 0, zero-padded to 16: [16, K]
  int64_t m, k;
  const char* panels;         // 16-column panels, K / 32 tiles each
  const float* bias;          // [N] or null
  c10::BFloat16* y;           // [M, N_out], contiguous
  int64_t n_out;
};

// Where the A tiles of rows [16 b, 16 b + 16) start, and their row stride in bytes.
struct RowBlock {
  const c10::BFloat16* rows;
  int64_t stride;
};

inline RowBlock row_block(const Operands& op, int64_t block) {
  if (op.tail != nullptr && (block + 1) * 16 > op.m) return {op.tail, op.k * 2};
  return {op.x + block * 16 * op.ldx, op.ldx * 2};
}

// C tiles 0, 1 (and 2, 3 for a second 16-row block) = rows of blocks b, b + 1 x panels p0, p1.
inline void multiply(const Operands& op, int64_t block, bool two, const char* p0, const char* p1) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const RowBlock a0 = row_block(op, block), a1 = two ? row_block(op, block + 1) : a0;
  for (int64_t kb = 0; kb < op.k / 32; ++kb) {
    _tile_loadd(6, p0 + kb * kTileBytes, 64);
    _tile_loadd(7, p1 + kb * kTileBytes, 64);
    _tile_loadd(4, a0.rows + kb * 32, a0.stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a1.rows + kb * 32, a1.stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// c: [32 rows][32 floats] as the C tiles were stored (rows 64 floats apart would waste L1).
inline void store_c(float* c, bool two) {
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  if (two) {
    _tile_stored(2, c + 16 * 32, 128);
    _tile_stored(3, c + 16 * 32 + 16, 128);
  }
}

// Units [begin, end), unit after unit: each unit's two panels stay in L1 while every 32-row block
// of x meets them. Where output rows lie a page or more apart (an LM head's are 98 KB), units go
// in groups of 8 instead, each 32-row block meeting every unit of the group before the next block
// does: the group's panels (~300 KB for K = 576) stay in L2, and a block writes the group's columns
// of its 32 rows, where unit after unit wrote 64 bytes to each of 128 pages per unit and missed the
// TLB on nearly every row (SmolLM2's head at 128 rows, cache hot: 5.4 -> 3.9-4.5 ms; grouped, the
// layers' products lost ~15%).
inline int64_t group_units(const Operands& op) { return op.n_out * 2 >= 4096 ? 8 : 1; }

template <typename Unit>
void run_units(const Operands& op, int64_t begin, int64_t end, Unit&& unit) {
  alignas(64) float c[32 * 32];
  const int64_t blocks = (op.m + 15) / 16, group = group_units(op);
  for (int64_t g0 = begin; g0 < end; g0 += group)
    for (int64_t b = 0; b < blocks; b += 2) {
      const bool two = b + 1 < blocks;
      const int64_t rows = std::min<int64_t>(two ? 32 : 16, op.m - b * 16);
      for (int64_t u = g0; u < std::min(end, g0 + group); ++u) unit(u, b, two, rows, c);
    }
}

// Plain: a unit is panels 2u and 2u + 1 (the last may be alone), output columns 32u on.
void plain_units(const Operands& op, int64_t panels, int64_t begin, int64_t end) {
  const int64_t panel_bytes = op.k / 32 * kTileBytes;
  run_units(op, begin, end, [&](int64_t u, int64_t b, bool two, int64_t rows, float* c) {
    const int64_t first = 2 * u, width = std::min<int64_t>(2, panels - first);
    const char* p0 = op.panels + first * panel_bytes;
    const char* p1 = width == 2 ? p0 + panel_bytes : p0;  // a lone panel: the second product is unused
    multiply(op, b, two, p0, p1);
    store_c(c, two);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t h = 0; h < width; ++h) {
        __m512 v = _mm512_loadu_ps(c + r * 32 + h * 16);
        if (op.bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(op.bias + (first + h) * 16));
        store_bf16(op.y + (b * 16 + r) * op.n_out + (first + h) * 16, v);
      }
  });
}

// Gated: unit u is gate panel u and up panel u (stored one after the other), output columns 16u on.
void gated_units(const Operands& op, int64_t begin, int64_t end) {
  const int64_t panel_bytes = op.k / 32 * kTileBytes;
  run_units(op, begin, end, [&](int64_t u, int64_t b, bool two, int64_t rows, float* c) {
    const char* gate = op.panels + 2 * u * panel_bytes;
    multiply(op, b, two, gate, gate + panel_bytes);
    store_c(c, two);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 g = _mm512_loadu_ps(c + r * 32), up = _mm512_loadu_ps(c + r * 32 + 16);
      const __m512 act = round_bf16(silu16(g));
      store_bf16(op.y + (b * 16 + r) * op.n_out + u * 16, _mm512_mul_ps(act, up));
    }
  });
}
#endif

bool available() {
#ifdef KVFLOW_LINEAR_AMX
  return kvflow_amx::permitted();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] Wᵀ (+ bias) for W packed as `panels` [N / 16, K / 32, 16, 32]; gated: panels
// [I / 16, 2, K / 32, 16, 32] (gate, up) and y [M, I] = SiLU(x W_gateᵀ) * (x W_upᵀ).
void linear(at::Tensor y, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
            bool gated) {
  TORCH_CHECK(available(), "amx_linear: no AMX here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "amx_linear: x is [M, K] bfloat16, unit-stride rows");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous(), "amx_linear: panels are contiguous bfloat16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && panels.size(-1) == 32 && panels.size(-2) == 16 && panels.size(-3) == k / 32,
              "amx_linear: panels [..., K / 32, 16, 32] for x's K, a multiple of 32");
  TORCH_CHECK(!gated || (panels.dim() == 5 && panels.size(1) == 2), "amx_linear: gated panels are [I / 16, 2, K / 32, 16, 32]");
  TORCH_CHECK(gated || panels.dim() == 4, "amx_linear: panels are [N / 16, K / 32, 16, 32]");
  const int64_t n_out = panels.size(0) * 16;  // 16 columns a panel, or a (gate, up) pair of panels
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() && y.size(0) == m && y.size(1) == n_out,
              "amx_linear: y is a contiguous [M, N] bfloat16 tensor");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(!gated && bias->numel() == n_out, "amx_linear: bias is [N], for the plain product");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return;
#ifdef KVFLOW_LINEAR_AMX
  at::Tensor tail;
  if (m % 16 != 0) {  // the last rows, zero-padded to a whole A tile
    tail = at::zeros({16, k}, x.options());
    tail.narrow(0, 0, m % 16).copy_(x.narrow(0, m - m % 16, m % 16));
  }
  const Operands op{x.data_ptr<c10::BFloat16>(), x.stride(0), tail.defined() ? tail.data_ptr<c10::BFloat16>() : nullptr,
                    m, k, reinterpret_cast<const char*>(panels.data_ptr<c10::BFloat16>()),
                    bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>(), n_out};
  // Each thread streams a contiguous range of units: its share of the weight, read once.
  const int64_t units = gated ? panels.size(0) : (panels.size(0) + 1) / 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    kvflow_amx::configure_full_tiles();
    if (gated)
      gated_units(op, begin, end);
    else
      plain_units(op, panels.size(0), begin, end);
    _tile_release();
  });
#endif
}

}  // namespace

TORCH_LIBRARY(kvflow_amx_linear, m) {
  m.def("linear(Tensor(a!) y, Tensor x, Tensor panels, Tensor? bias, bool gated) -> ()");
  m.def("available() -> bool", &available);
}

TORCH_LIBRARY_IMPL(kvflow_amx_linear, CPU, m) { m.impl("linear", &linear); }
