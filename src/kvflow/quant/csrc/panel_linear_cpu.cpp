// y = x Wᵀ for bfloat16 x [M, K] and W [N, K] at the row counts of decode steps (and a server's
// mixed steps), on AMX tiles where the CPU has them, else on AVX-512 BF16 dot products.
//
// oneDNN's bf16 products at 1-512 rows fall short of the CPU's rate: on the Xeon (AMX) they
// streamed SmolLM2's weights at 15-17 GB/s where it reads 23-25 (2026-11-27, 30 layers' weights
// cycling, 16 rows: 14.9 ms against 9.3 here; 128 rows: 28 against 21); on the AMD EPYC (no AMX)
// they reached 50-60% of its bf16 rate at 16 rows (docs/performance-journal.md, stop 36). Here the weight
// is laid out once as tile operands, one 16-column panel after another: panel n holds, for each
// 32-wide slice of K, the B tile of those columns (16 rows of K pairs x 16 columns x 2). A unit of
// work is two panels (32 output columns), or for the gated form a gate panel and the up panel of
// the same columns; a thread streams its units' panels once, in order, and multiplies each by
// every block of rows of x while it is in cache. Each output's sum runs over K in one fixed order
// whatever M is (tile after tile, or pair after pair): a row's result never depends on the other
// rows.
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

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "kvflow_avx512.h"
#define KVFLOW_LINEAR_BF16 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include "kvflow_amx.h"
#define KVFLOW_LINEAR_AMX 1
#endif
#endif

namespace {

constexpr int64_t kTileBytes = 1024;  // one B tile: 16 K pairs x 16 columns x 2 bfloat16

#ifdef KVFLOW_LINEAR_BF16
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
  const c10::BFloat16* tail;  // tiles: the last rows when M % 16 != 0, zero-padded to 16: [16, K]
  int64_t m, k;
  const char* panels;         // 16-column panels, K / 32 tiles each
  const float* bias;          // [N] or null
  c10::BFloat16* y;           // [M, N_out], contiguous
  int64_t n_out;
};

// Where output rows lie a page or more apart (an LM head's are 98 KB), units go in groups of 8,
// each block of rows meeting every unit of the group before the next block does: the group's
// panels (~300 KB for K = 576) stay in L2, and a block writes the group's columns of its rows,
// where unit after unit wrote 64 bytes to each of 128 pages per unit and missed the TLB on nearly
// every row (SmolLM2's head at 128 rows on tiles, cache hot: 5.4 -> 3.9-4.5 ms; grouped, the
// layers' products lost ~15%).
inline int64_t group_units(const Operands& op) { return op.n_out * 2 >= 4096 ? 8 : 1; }

// Units [begin, end) in order (in groups, above), each meeting every block of rows while its
// panels are in cache: unit(u, first row, rows) for each block b of `block_rows(b)` rows.
template <typename BlockRows, typename Unit>
void run_units(const Operands& op, int64_t begin, int64_t end, int64_t blocks, BlockRows&& block_rows, Unit&& unit) {
  const int64_t group = group_units(op);
  for (int64_t g0 = begin; g0 < end; g0 += group)
    for (int64_t b = 0, row0 = 0; b < blocks; row0 += block_rows(b), ++b)
      for (int64_t u = g0; u < std::min(end, g0 + group); ++u) unit(u, row0, block_rows(b));
}

// The epilogues, on a unit's two columns' floats of one row: plain (bias, rounded) or gated.
inline void store_plain(const Operands& op, int64_t row, int64_t first, int64_t width, __m512 v0, __m512 v1) {
  c10::BFloat16* y = op.y + row * op.n_out + first * 16;
  if (op.bias != nullptr) v0 = _mm512_add_ps(v0, _mm512_loadu_ps(op.bias + first * 16));
  store_bf16(y, v0);
  if (width == 2) {
    if (op.bias != nullptr) v1 = _mm512_add_ps(v1, _mm512_loadu_ps(op.bias + first * 16 + 16));
    store_bf16(y + 16, v1);
  }
}

inline void store_gated(const Operands& op, int64_t row, int64_t u, __m512 gate, __m512 up) {
  store_bf16(op.y + row * op.n_out + u * 16, _mm512_mul_ps(round_bf16(silu16(gate)), up));
}

// -- dot products ----------------------------------------------------------------------------
// A panel's tile row i for K slice s is 16 columns' pair (2i, 2i + 1) of that slice: what
// `vdpbf16ps` multiplies by a broadcast pair of x. A block of up to kDotRows rows keeps its two
// columns' sums in registers (2 per row, 24 of the 32) while the unit's panels stream past once.
constexpr int64_t kDotRows = 12;

// Rows [row0, row0 + R) times a unit's panels p0, p1; then store(r, sums of p0's columns, sums of
// p1's) for each row r. `next`: the next unit's panels, prefetched into L2 as this one goes (or null).
template <int R, typename Store>
inline void dot_block(const Operands& op, int64_t row0, const char* p0, const char* p1, const char* next, Store&& store) {
  __m512 acc[R][2];
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const c10::BFloat16* x = op.x + row0 * op.ldx;
  for (int64_t kb = 0; kb < op.k / 32; ++kb) {
    const __m512i* w0 = reinterpret_cast<const __m512i*>(p0 + kb * kTileBytes);
    const __m512i* w1 = reinterpret_cast<const __m512i*>(p1 + kb * kTileBytes);
    const c10::BFloat16* xk = x + kb * 32;
    for (int i = 0; i < 16; ++i) {
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + i), b1 = (__m512bh)_mm512_loadu_si512(w1 + i);
      if (next != nullptr) {
        _mm_prefetch(next + kb * kTileBytes + i * 64, _MM_HINT_T1);
        _mm_prefetch(next + op.k / 32 * kTileBytes + kb * kTileBytes + i * 64, _MM_HINT_T1);
      }
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xk + r * op.ldx + 2 * i));
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      }
    }
  }
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) store(r, acc[r][0], acc[r][1]);
}

// The first block of rows prefetches the next unit's two panels (when the next unit has two), so
// that they stream in from memory while this one multiplies.
template <int R>
void dot_unit(const Operands& op, bool gated, int64_t panels, int64_t u, int64_t row0) {
  const int64_t panel_bytes = op.k / 32 * kTileBytes;
  const int64_t total = gated ? 2 * panels : panels;  // panels in all, gate and up counted apart
  const char* p0 = op.panels + 2 * u * panel_bytes;   // gated: the gate panel, then the up one
  const char* next = row0 == 0 && 2 * u + 3 < total ? p0 + 2 * panel_bytes : nullptr;
  if (gated) {
    dot_block<R>(op, row0, p0, p0 + panel_bytes, next,
                 [&](int r, __m512 gate, __m512 up) { store_gated(op, row0 + r, u, gate, up); });
    return;
  }
  const int64_t first = 2 * u, width = std::min<int64_t>(2, panels - first);
  dot_block<R>(op, row0, p0, width == 2 ? p0 + panel_bytes : p0, next,
               [&](int r, __m512 v0, __m512 v1) { store_plain(op, row0 + r, first, width, v0, v1); });
}

template <int R = kDotRows>
void dot_unit_rows(const Operands& op, bool gated, int64_t panels, int64_t u, int64_t row0, int64_t rows) {
  if constexpr (R > 1) {
    if (rows < R) return dot_unit_rows<R - 1>(op, gated, panels, u, row0, rows);
  }
  dot_unit<R>(op, gated, panels, u, row0);
}

void dot_units(const Operands& op, bool gated, int64_t panels, int64_t begin, int64_t end) {
  // rows split into blocks of nearly equal size, at most kDotRows each (16 rows: 8 + 8, not 12 + 4)
  const int64_t blocks = (op.m + kDotRows - 1) / kDotRows;
  const auto block_rows = [&](int64_t b) { return op.m * (b + 1) / blocks - op.m * b / blocks; };
  run_units(op, begin, end, blocks, block_rows, [&](int64_t u, int64_t row0, int64_t rows) {
    dot_unit_rows(op, gated, panels, u, row0, rows);
  });
}
#endif

#ifdef KVFLOW_LINEAR_AMX
// -- tiles -----------------------------------------------------------------------------------
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

// A block is 32 rows (two A tiles) or the last 16 or fewer.
void tile_units(const Operands& op, bool gated, int64_t panels, int64_t begin, int64_t end) {
  alignas(64) float c[32 * 32];
  const int64_t panel_bytes = op.k / 32 * kTileBytes, blocks = (op.m + 31) / 32;
  const auto block_rows = [&](int64_t b) { return std::min<int64_t>(32, op.m - b * 32); };
  run_units(op, begin, end, blocks, block_rows, [&](int64_t u, int64_t row0, int64_t rows) {
    const bool two = rows > 16;
    const char* p0 = op.panels + 2 * u * panel_bytes;  // gated: the gate panel, then the up one
    const int64_t first = 2 * u, width = gated ? 2 : std::min<int64_t>(2, panels - first);
    multiply(op, row0 / 16, two, p0, width == 2 ? p0 + panel_bytes : p0);  // a lone panel: the second product is unused
    store_c(c, two);
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 v0 = _mm512_loadu_ps(c + r * 32), v1 = _mm512_loadu_ps(c + r * 32 + 16);
      if (gated)
        store_gated(op, row0 + r, u, v0, v1);
      else
        store_plain(op, row0 + r, first, width, v0, v1);
    }
  });
}
#endif

// The dot-product kernel is built here (AVX-512 BF16).
bool available() {
#ifdef KVFLOW_LINEAR_BF16
  return true;
#else
  return false;
#endif
}

// It may multiply on AMX tiles here: built for them, and Linux hands them out.
bool has_tiles() {
#ifdef KVFLOW_LINEAR_AMX
  return kvflow_amx::permitted();
#else
  return false;
#endif
}

// y [M, N] = x [M, K] Wᵀ (+ bias) for W packed as `panels` [N / 16, K / 32, 16, 32]; gated: panels
// [I / 16, 2, K / 32, 16, 32] (gate, up) and y [M, I] = SiLU(x W_gateᵀ) * (x W_upᵀ). On AMX tiles
// if `tiles` (has_tiles() must hold), else on dot products.
void linear(at::Tensor y, const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
            bool gated, bool tiles) {
  TORCH_CHECK(available(), "panel_linear: built without AVX-512 BF16 here");
  TORCH_CHECK(!tiles || has_tiles(), "panel_linear: tiles=True, but no AMX here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "panel_linear: x is [M, K] bfloat16, unit-stride rows");
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous(), "panel_linear: panels are contiguous bfloat16");
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK(k % 32 == 0 && panels.size(-1) == 32 && panels.size(-2) == 16 && panels.size(-3) == k / 32,
              "panel_linear: panels [..., K / 32, 16, 32] for x's K, a multiple of 32");
  TORCH_CHECK(!gated || (panels.dim() == 5 && panels.size(1) == 2), "panel_linear: gated panels are [I / 16, 2, K / 32, 16, 32]");
  TORCH_CHECK(gated || panels.dim() == 4, "panel_linear: panels are [N / 16, K / 32, 16, 32]");
  const int64_t n_out = panels.size(0) * 16;  // 16 columns a panel, or a (gate, up) pair of panels
  TORCH_CHECK(y.scalar_type() == at::kBFloat16 && y.is_contiguous() && y.size(0) == m && y.size(1) == n_out,
              "panel_linear: y is a contiguous [M, N] bfloat16 tensor");
  at::Tensor bias_f;
  if (bias.has_value()) {
    TORCH_CHECK(!gated && bias->numel() == n_out, "panel_linear: bias is [N], for the plain product");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  if (m == 0) return;
#ifdef KVFLOW_LINEAR_BF16
  at::Tensor tail;
  if (tiles && m % 16 != 0) {  // the last rows, zero-padded to a whole A tile
    tail = at::zeros({16, k}, x.options());
    tail.narrow(0, 0, m % 16).copy_(x.narrow(0, m - m % 16, m % 16));
  }
  const Operands op{x.data_ptr<c10::BFloat16>(), x.stride(0), tail.defined() ? tail.data_ptr<c10::BFloat16>() : nullptr,
                    m, k, reinterpret_cast<const char*>(panels.data_ptr<c10::BFloat16>()),
                    bias_f.defined() ? bias_f.data_ptr<float>() : nullptr, y.data_ptr<c10::BFloat16>(), n_out};
  // Each thread streams a contiguous range of units: its share of the weight, read once.
  const int64_t n_panels = panels.size(0), units = gated ? n_panels : (n_panels + 1) / 2;
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
#ifdef KVFLOW_LINEAR_AMX
    if (tiles) {
      kvflow_amx::configure_full_tiles();
      tile_units(op, gated, n_panels, begin, end);
      _tile_release();
      return;
    }
#endif
    dot_units(op, gated, n_panels, begin, end);
  });
#endif
}

}  // namespace

TORCH_LIBRARY(kvflow_panel_linear, m) {
  m.def("linear(Tensor(a!) y, Tensor x, Tensor panels, Tensor? bias, bool gated, bool tiles) -> ()");
  m.def("available() -> bool", &available);
  m.def("has_tiles() -> bool", &has_tiles);
}

TORCH_LIBRARY_IMPL(kvflow_panel_linear, CPU, m) { m.impl("linear", &linear); }
