// A decode step of a Llama-family model as one C++ call (worker/cpu_decode.py builds it; see there
// for which models it takes): each projection on the kernel its layer's plan names for the step's
// row count, kvflow's few-row int4/int8 GEMV or the panel kernel's bf16 products.
//
// It calls the same operators as cpu_decode.py's Python loop, in the same order, on the same
// kinds of buffers, so its numbers are that loop's bit for bit. What it saves is the Python
// between them: at batch 1 a SmolLM2 token is ~300 small calls, and each paid a few microseconds
// of interpreter, dispatch and new views, ~2 ms of a ~10 ms token; at 16 rows on panels, ~12 µs a
// product of the ~40 µs it takes. Here an operator is found once (by name, through the dispatcher:
// no kernel is linked in twice), buffers and views are made once per step and reused by every
// layer.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace {

using at::Tensor;

template <typename Signature>
c10::TypedOperatorHandle<Signature> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// The operators, looked up at the first step: their libraries are loaded by then (the Python
// side loads them before it builds the step).
struct Ops {
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&, const c10::optional<Tensor>&, const Tensor&, double)> rms_norm =
      find<void(Tensor&, const Tensor&, const c10::optional<Tensor>&, const Tensor&, double)>("kvflow_cpu_ops::rms_norm");
  c10::TypedOperatorHandle<void(Tensor&, const Tensor&)> silu_and_mul =
      find<void(Tensor&, const Tensor&)>("kvflow_cpu_ops::silu_and_mul");
  c10::TypedOperatorHandle<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)> rotary =
      find<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>("kvflow_cpu_ops::rotary");
  c10::TypedOperatorHandle<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)> write_kv =
      find<void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&)>("kvflow_cpu_kv::write_kv");
  // An int8 / fp8 (E4M3, E5M2) cache (kv_quant.py): quantized in the same pass; nothing read back in a decode.
  using WriteQuantized = void(Tensor&, Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              const c10::optional<Tensor>&, const c10::optional<Tensor>&);
  c10::TypedOperatorHandle<WriteQuantized> write_kv_quantized =
      find<WriteQuantized>("kvflow_cpu_kv::write_kv_quantized");
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                const Tensor&, const Tensor&, int64_t, double, bool)>
      attend = find<void(Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&, const Tensor&, int64_t, double, bool)>("kvflow_cpu::paged_attention");
};

const Ops& ops() {
  static const Ops found;
  return found;
}

// The products' operators, looked up on the first step that calls them: a machine without
// AVX-512 BF16 builds no panel kernel, and a model on panels never asks for the GEMV.
using Gemv = void(Tensor, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t);
const c10::TypedOperatorHandle<Gemv>& gemv_op() {
  static const auto found = find<Gemv>("kvflow_int4_gemv::int4_gemv");
  return found;
}

using Panels = void(Tensor, const Tensor&, const Tensor&, const c10::optional<Tensor>&, bool, bool);
const c10::TypedOperatorHandle<Panels>& panels_op() {
  static const auto found = find<Panels>("kvflow_panel_linear::linear");
  return found;
}

// How a product runs (worker/cpu_decode.py's GEMV, PANELS, GATED_PANELS, from the layer's kernel
// plan): kvflow's GEMV on (codes, scale_zero) with a code width and path; the panel kernel on
// panels; or, for gate_up only, the panel kernel's SiLU(gate)·up on gated panels.
enum ProductKind : int64_t { kGemv = 0, kPanels = 1, kGatedPanels = 2 };

// Per layer: input norm, post norm, key cache, value cache, then (weight, scale_zero) of qkv, o,
// gate_up and down (scale_zero unused on panels); per product three ints: kind, bits, path.
constexpr int64_t kTensorsPerLayer = 12, kProducts = 4, kIntsPerProduct = 3;
constexpr int64_t kInputNorm = 0, kPostNorm = 1, kKeyCache = 2, kValueCache = 3;
enum Product : int64_t { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Products {
  const Tensor* tensors;  // the layer's
  const int64_t* ints;    // the layer's
  bool tiles;             // panels on AMX tiles

  // y = x Wᵀ of product p (never gated).
  void plain(Tensor& y, const Tensor& x, int64_t p) const {
    const Tensor& weight = tensors[4 + 2 * p];
    const int64_t* spec = ints + p * kIntsPerProduct;
    if (spec[0] == kGemv)
      gemv_op().call(y, x, weight, tensors[5 + 2 * p], spec[1], spec[2]);
    else
      panels_op().call(y, x, weight, c10::nullopt, false, tiles);
  }
  // act = SiLU(x W_gateᵀ) · (x W_upᵀ): in one product on gated panels, else gate_up's product into
  // `gate_up` and the activation kernel.
  void gated(Tensor& act, const Tensor& x, Tensor& gate_up) const {
    if (ints[kGateUp * kIntsPerProduct] == kGatedPanels) {
      panels_op().call(act, x, tensors[4 + 2 * kGateUp], c10::nullopt, true, tiles);
      return;
    }
    plain(gate_up, x, kGateUp);
    ops().silu_and_mul.call(act, gate_up);
  }
};

void check_products(at::TensorList layer_tensors, at::IntArrayRef product_ints) {
  TORCH_CHECK(layer_tensors.size() % kTensorsPerLayer == 0, "llama_step: ", kTensorsPerLayer, " tensors per layer");
  const int64_t layers = static_cast<int64_t>(layer_tensors.size()) / kTensorsPerLayer;
  TORCH_CHECK(static_cast<int64_t>(product_ints.size()) == layers * kProducts * kIntsPerProduct, "llama_step: ",
              kProducts * kIntsPerProduct, " ints per layer (kind, bits, path of each product)");
  for (int64_t l = 0; l < layers; ++l) {
    for (int64_t p = 0; p < kProducts; ++p) {
      const int64_t kind = product_ints[(l * kProducts + p) * kIntsPerProduct];
      TORCH_CHECK(kind == kGemv || kind == kPanels || (kind == kGatedPanels && p == kGateUp),
                  "llama_step: layer ", l, " product ", p, " has no kind ", kind);
    }
  }
}

// hidden [rows, width]: the step's embeddings (the first layer's residual stream, updated in
// place); out [rows, width]: the final norm's output. act_width: the MLP's intermediate width;
// attention_tiles: paged attention's scores may run on AMX tiles (cpu_paged.use_tiles);
// product_tiles: the panels multiply on AMX tiles.
void llama_step(Tensor& out, Tensor& hidden, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                const Tensor& query_start_loc, const Tensor& requests, at::TensorList layer_tensors,
                at::IntArrayRef product_ints, const Tensor& final_norm, double eps, int64_t heads, int64_t kv_heads,
                int64_t head_dim, double scale, int64_t act_width, bool attention_tiles, bool product_tiles) {
  check_products(layer_tensors, product_ints);
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && out.sizes() == hidden.sizes(),
              "llama_step: hidden and out are contiguous [rows, width]");
  const Ops& op = ops();
  const int64_t layers = static_cast<int64_t>(layer_tensors.size()) / kTensorsPerLayer;
  const int64_t rows = hidden.size(0), q_size = heads * head_dim, kv_size = kv_heads * head_dim;
  const auto like = hidden.options();
  Tensor normed = at::empty_like(hidden);
  Tensor qkv = at::empty({rows, q_size + 2 * kv_size}, like);
  Tensor q = qkv.narrow(1, 0, q_size).view({rows, heads, head_dim});
  Tensor k = qkv.narrow(1, q_size, kv_size).view({rows, kv_heads, head_dim});
  Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({rows, kv_heads, head_dim});
  Tensor attended = at::empty({rows, heads, head_dim}, like);
  Tensor attended_rows = attended.view({rows, q_size});
  Tensor projected = at::empty_like(hidden);  // o's output, then down's
  Tensor act = at::empty({rows, act_width}, like);
  Tensor gate_up = at::empty({rows, 2 * act_width}, like);
  const c10::optional<Tensor> residual(hidden);
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* t = layer_tensors.data() + l * kTensorsPerLayer;
    const Products products{t, product_ints.data() + l * kProducts * kIntsPerProduct, product_tiles};
    Tensor key_cache = t[kKeyCache], value_cache = t[kValueCache];
    // The first layer's input is the embeddings themselves, which are its residual stream.
    op.rms_norm.call(normed, l == 0 ? hidden : projected, l == 0 ? c10::nullopt : residual, t[kInputNorm], eps);
    products.plain(qkv, normed, kQkv);
    op.rotary.call(q, k, positions, cos, sin);
    if (key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn ||
        key_cache.scalar_type() == at::kFloat8_e5m2)
      op.write_kv_quantized.call(key_cache, value_cache, k, v, slot_mapping, c10::nullopt, c10::nullopt);
    else
      op.write_kv.call(key_cache, value_cache, k, v, slot_mapping);
    op.attend.call(attended, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, 0, scale,
                   attention_tiles);
    products.plain(projected, attended_rows, kO);
    op.rms_norm.call(normed, projected, residual, t[kPostNorm], eps);
    products.gated(act, normed, gate_up);
    products.plain(projected, act, kDown);
  }
  op.rms_norm.call(out, projected, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_decode, m) {
  m.def("llama_step(Tensor(a!) out, Tensor(b!) hidden, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor requests, Tensor[] layer_tensors, "
        "int[] product_ints, Tensor final_norm, float eps, int heads, int kv_heads, int head_dim, float scale, "
        "int act_width, bool attention_tiles, bool product_tiles) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_decode, CPU, m) {
  m.impl("llama_step", &llama_step);
}
