// A decode step of a Llama-family model as one C++ call (worker/cpu_decode.py builds it; see there
// for which models it takes): its projections all on kvflow's few-row int4/int8 GEMV
// (`llama_step`), or all on the panel kernel's bf16 products (`llama_step_panels`).
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
  // An int8 / fp8 cache (kv_quant.py): quantized in the same pass; nothing read back in a decode.
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

// The step's buffers and the layers' loop, whatever computes the four products. `Products` has
// qkv(out, in, t, l), o(out, in, t, l), gated(act, in, t, l) (SiLU(in W_gateᵀ) · in W_upᵀ) and
// down(out, in, t, l) for layer l's tensors t; kTensors a layer, its norms at kInputNorm and
// kPostNorm, its key and value caches last.
template <typename Products>
void run_layers(Tensor& out, Tensor& hidden, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                const Tensor& query_start_loc, const Tensor& requests, at::TensorList layer_tensors,
                const Tensor& final_norm, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
                int64_t act_width, bool attention_tiles, const Products& products) {
  constexpr int64_t per_layer = Products::kTensors;
  TORCH_CHECK(layer_tensors.size() % per_layer == 0, "llama_step: ", per_layer, " tensors per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && out.sizes() == hidden.sizes(),
              "llama_step: hidden and out are contiguous [rows, width]");
  const Ops& op = ops();
  const int64_t layers = static_cast<int64_t>(layer_tensors.size()) / per_layer;
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
  const c10::optional<Tensor> residual(hidden);
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* t = layer_tensors.data() + l * per_layer;
    const Tensor& input_norm = t[Products::kInputNorm];
    const Tensor& post_norm = t[Products::kPostNorm];
    Tensor key_cache = t[per_layer - 2], value_cache = t[per_layer - 1];
    // The first layer's input is the embeddings themselves, which are its residual stream.
    op.rms_norm.call(normed, l == 0 ? hidden : projected, l == 0 ? c10::nullopt : residual, input_norm, eps);
    products.qkv(qkv, normed, t, l);
    op.rotary.call(q, k, positions, cos, sin);
    if (key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn)
      op.write_kv_quantized.call(key_cache, value_cache, k, v, slot_mapping, c10::nullopt, c10::nullopt);
    else
      op.write_kv.call(key_cache, value_cache, k, v, slot_mapping);
    op.attend.call(attended, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, 0, scale,
                   attention_tiles);
    products.o(projected, attended_rows, t, l);
    op.rms_norm.call(normed, projected, residual, post_norm, eps);
    products.gated(act, normed, t, l);
    products.down(projected, act, t, l);
  }
  op.rms_norm.call(out, projected, residual, final_norm, eps);
}

// kvflow's GEMV: per layer input norm, qkv (codes, scale_zero), o (codes, scale_zero), post norm,
// gate_up (codes, scale_zero), down (codes, scale_zero), key cache, value cache; the code widths
// of qkv, o, gate_up and down in `bits`. gate_up's product goes to a buffer, then SiLU·up.
struct GemvProducts {
  static constexpr int64_t kTensors = 12, kBits = 4, kInputNorm = 0, kPostNorm = 5;
  const int64_t* bits;
  int64_t path;
  Tensor gate_up;
  void qkv(Tensor& y, const Tensor& x, const Tensor* t, int64_t l) const { gemv_op().call(y, x, t[1], t[2], bits[l * kBits], path); }
  void o(Tensor& y, const Tensor& x, const Tensor* t, int64_t l) const { gemv_op().call(y, x, t[3], t[4], bits[l * kBits + 1], path); }
  void gated(Tensor& act, const Tensor& x, const Tensor* t, int64_t l) const {
    gemv_op().call(gate_up, x, t[6], t[7], bits[l * kBits + 2], path);
    ops().silu_and_mul.call(act, gate_up);
  }
  void down(Tensor& y, const Tensor& x, const Tensor* t, int64_t l) const { gemv_op().call(y, x, t[8], t[9], bits[l * kBits + 3], path); }
};

// The panel kernel (quant/panel_linear.py): per layer input norm, qkv panels, o panels, post norm,
// gate_up's gated panels, down panels, key cache, value cache. `tiles`: on AMX tiles.
struct PanelProducts {
  static constexpr int64_t kTensors = 8, kInputNorm = 0, kPostNorm = 3;
  bool tiles;
  void qkv(Tensor& y, const Tensor& x, const Tensor* t, int64_t) const { panels_op().call(y, x, t[1], c10::nullopt, false, tiles); }
  void o(Tensor& y, const Tensor& x, const Tensor* t, int64_t) const { panels_op().call(y, x, t[2], c10::nullopt, false, tiles); }
  void gated(Tensor& act, const Tensor& x, const Tensor* t, int64_t) const { panels_op().call(act, x, t[4], c10::nullopt, true, tiles); }
  void down(Tensor& y, const Tensor& x, const Tensor* t, int64_t) const { panels_op().call(y, x, t[5], c10::nullopt, false, tiles); }
};

// hidden [rows, width]: the step's embeddings (the first layer's residual stream, updated in
// place); out [rows, width]: the final norm's output. The sizes: q, k and v widths of the fused
// projection, the gate_up output's width; gemv_path: how the GEMVs compute (quant/int4_gemv.py:
// SCALAR, BF16_PRODUCTS, INT8_LEVELS); attention_tiles: paged attention's scores may run on AMX
// tiles (cpu_paged.use_tiles).
void llama_step(Tensor& out, Tensor& hidden, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                const Tensor& query_start_loc, const Tensor& requests, at::TensorList layer_tensors,
                at::IntArrayRef layer_bits, const Tensor& final_norm, double eps, int64_t heads, int64_t kv_heads,
                int64_t head_dim, double scale, int64_t gate_up_width, int64_t gemv_path, bool attention_tiles) {
  TORCH_CHECK(static_cast<int64_t>(layer_bits.size()) * GemvProducts::kTensors ==
                  static_cast<int64_t>(layer_tensors.size()) * GemvProducts::kBits,
              "llama_step: ", GemvProducts::kTensors, " tensors and ", GemvProducts::kBits, " code widths per layer");
  const GemvProducts products{layer_bits.data(), gemv_path, at::empty({hidden.size(0), gate_up_width}, hidden.options())};
  run_layers(out, hidden, positions, cos, sin, slot_mapping, block_tables, seq_lens, query_start_loc, requests,
             layer_tensors, final_norm, eps, heads, kv_heads, head_dim, scale, gate_up_width / 2, attention_tiles,
             products);
}

// The same step with every product on the panel kernel's bf16 panels (PanelProducts); act_width:
// the MLP's intermediate width; product_tiles: the panels multiply on AMX tiles.
void llama_step_panels(Tensor& out, Tensor& hidden, const Tensor& positions, const Tensor& cos, const Tensor& sin,
                       const Tensor& slot_mapping, const Tensor& block_tables, const Tensor& seq_lens,
                       const Tensor& query_start_loc, const Tensor& requests, at::TensorList layer_tensors,
                       const Tensor& final_norm, double eps, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       double scale, int64_t act_width, bool attention_tiles, bool product_tiles) {
  run_layers(out, hidden, positions, cos, sin, slot_mapping, block_tables, seq_lens, query_start_loc, requests,
             layer_tensors, final_norm, eps, heads, kv_heads, head_dim, scale, act_width, attention_tiles,
             PanelProducts{product_tiles});
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_decode, m) {
  m.def("llama_step(Tensor(a!) out, Tensor(b!) hidden, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor requests, Tensor[] layer_tensors, "
        "int[] layer_bits, Tensor final_norm, float eps, int heads, int kv_heads, int head_dim, float scale, "
        "int gate_up_width, int gemv_path, bool attention_tiles) -> ()");
  m.def("llama_step_panels(Tensor(a!) out, Tensor(b!) hidden, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor requests, "
        "Tensor[] layer_tensors, Tensor final_norm, float eps, int heads, int kv_heads, int head_dim, float scale, "
        "int act_width, bool attention_tiles, bool product_tiles) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_decode, CPU, m) {
  m.impl("llama_step", &llama_step);
  m.impl("llama_step_panels", &llama_step_panels);
}
