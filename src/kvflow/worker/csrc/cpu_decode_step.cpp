// A decode step of a Llama-family model whose projections all run kvflow's few-row int4/int8
// GEMV, as one C++ call (worker/cpu_decode.py builds it; see there for which models it takes).
//
// It calls the same operators as cpu_decode.py's Python loop, in the same order, on the same
// kinds of buffers, so its numbers are that loop's bit for bit. What it saves is the Python
// between them: at batch 1 a SmolLM2 token is ~300 small calls, and each paid a few microseconds
// of interpreter, dispatch and new views, ~2 ms of a ~10 ms token. Here an operator is found once
// (by name, through the dispatcher: no kernel is linked in twice), buffers and views are made
// once per step and reused by every layer.
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
  c10::TypedOperatorHandle<void(Tensor, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)> gemv =
      find<void(Tensor, const Tensor&, const Tensor&, const Tensor&, int64_t, int64_t)>("kvflow_int4_gemv::int4_gemv");
};

const Ops& ops() {
  static const Ops found;
  return found;
}

// Per layer, in `layer_tensors`: input norm, qkv (codes, scale_zero), o (codes, scale_zero), post
// norm, gate_up (codes, scale_zero), down (codes, scale_zero), key cache, value cache; in
// `layer_bits`, the code width of qkv, o, gate_up and down.
constexpr int64_t kTensorsPerLayer = 12, kBitsPerLayer = 4;

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
  const int64_t layers = static_cast<int64_t>(layer_tensors.size()) / kTensorsPerLayer;
  TORCH_CHECK(layers * kTensorsPerLayer == static_cast<int64_t>(layer_tensors.size()) &&
                  layers * kBitsPerLayer == static_cast<int64_t>(layer_bits.size()),
              "llama_step: ", kTensorsPerLayer, " tensors and ", kBitsPerLayer, " code widths per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && out.sizes() == hidden.sizes(),
              "llama_step: hidden and out are contiguous [rows, width]");
  const Ops& op = ops();
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
  Tensor gate_up = at::empty({rows, gate_up_width}, like);
  Tensor act = at::empty({rows, gate_up_width / 2}, like);
  const c10::optional<Tensor> residual(hidden);
  for (int64_t l = 0; l < layers; ++l) {
    const Tensor* t = layer_tensors.data() + l * kTensorsPerLayer;
    const int64_t* bits = layer_bits.data() + l * kBitsPerLayer;
    Tensor key_cache = t[10], value_cache = t[11];
    // The first layer's input is the embeddings themselves, which are its residual stream.
    op.rms_norm.call(normed, l == 0 ? hidden : projected, l == 0 ? c10::nullopt : residual, t[0], eps);
    op.gemv.call(qkv, normed, t[1], t[2], bits[0], gemv_path);
    op.rotary.call(q, k, positions, cos, sin);
    if (key_cache.scalar_type() == at::kChar || key_cache.scalar_type() == at::kFloat8_e4m3fn)
      op.write_kv_quantized.call(key_cache, value_cache, k, v, slot_mapping, c10::nullopt, c10::nullopt);
    else
      op.write_kv.call(key_cache, value_cache, k, v, slot_mapping);
    op.attend.call(attended, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc, requests, 0, scale,
                   attention_tiles);
    op.gemv.call(projected, attended_rows, t[3], t[4], bits[1], gemv_path);
    op.rms_norm.call(normed, projected, residual, t[5], eps);
    op.gemv.call(gate_up, normed, t[6], t[7], bits[2], gemv_path);
    op.silu_and_mul.call(act, gate_up);
    op.gemv.call(projected, act, t[8], t[9], bits[3], gemv_path);
  }
  op.rms_norm.call(out, projected, residual, final_norm, eps);
}

}  // namespace

TORCH_LIBRARY(kvflow_cpu_decode, m) {
  m.def("llama_step(Tensor(a!) out, Tensor(b!) hidden, Tensor positions, Tensor cos, Tensor sin, Tensor slot_mapping, "
        "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor requests, Tensor[] layer_tensors, "
        "int[] layer_bits, Tensor final_norm, float eps, int heads, int kv_heads, int head_dim, float scale, "
        "int gate_up_width, int gemv_path, bool attention_tiles) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_decode, CPU, m) { m.impl("llama_step", &llama_step); }
