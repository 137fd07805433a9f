// The new tokens' K and V stored into the paged pool on CPU: one pass, straight from the
// [tokens, kv_heads, head_dim] projections (any token and head strides) into the head-major
// blocks [num_blocks, kv_heads, block_size, head_dim].
//
// Torch's path (index_put through a transposed view, after splitting slots into blocks and
// offsets and dropping the rows of negative slots) costs about a millisecond a layer on a W1
// step; this is a memcpy per (token, head). A negative slot writes nothing (padding); a slot
// past the pool is refused before anything is written.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace

TORCH_LIBRARY(kvflow_cpu_kv, m) {
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(kvflow_cpu_kv, CPU, m) { m.impl("write_kv", &write_kv); }
