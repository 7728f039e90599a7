// Stores a step's new K/V rows in their cache slots for the CPU backend: what torch_ref.write_kv's index_put
// does, as one copy per token and pool. Measured on the bench model, index_put spent ~50 us a layer call on
// what is a few kilobytes a token. Built at run time with the other sources by cpu_kernels.py.
//
// Any dtype (float32, bfloat16, an FP8 cache's codes): the rows are copied as bytes. A token's heads must lie
// next to each other in key/value (a [tokens, heads * head_dim] projection output viewed per head qualifies).

#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

// Below this many bytes a single thread is faster than waking the pool.
constexpr int64_t kParallelBytes = 1 << 18;

void check_pools(const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& key,
                 const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes() && value_cache.scalar_type() == key_cache.scalar_type(),
              "key_cache and value_cache must be contiguous [num_blocks, block_size, kv_heads, head_dim] of one dtype");
  const int64_t tokens = slot_mapping.numel();
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK_VALUE(t->dim() == 3 && t->size(0) == tokens && t->size(1) == key_cache.size(2) &&
                    t->size(2) == key_cache.size(3) && t->scalar_type() == key_cache.scalar_type(),
                "key and value must be [tokens, kv_heads, head_dim] of the cache's shape and dtype");
    TORCH_CHECK_VALUE(t->stride(2) == 1 && t->stride(1) == t->size(2),
                "key and value need each token's heads next to each other (strides [any, head_dim, 1])");
  }
  TORCH_CHECK_VALUE(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.is_contiguous(),
              "slot_mapping must be contiguous int64 [tokens]");
  for (const auto* t : {&key_cache, &value_cache, &key, &value, &slot_mapping}) {
    TORCH_CHECK_VALUE(t->device().is_cpu(), "every tensor must be on the CPU");
  }
}

// key_cache[slot_mapping[t]] = key[t] and the same for values, slots counted over the pool's flattened
// [num_blocks * block_size] token rows.
void write_kv(at::Tensor key_cache, at::Tensor value_cache, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  check_pools(key_cache, value_cache, key, value, slot_mapping);
  const int64_t tokens = slot_mapping.numel(), num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // before the parallel loop: an exception cannot leave it
    TORCH_CHECK_INDEX(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pool (", num_slots,
                      " slots)");
  }
  const int64_t element = key_cache.element_size(), row_bytes = key_cache.size(2) * key_cache.size(3) * element;
  char* k_pool = static_cast<char*>(key_cache.data_ptr());
  char* v_pool = static_cast<char*>(value_cache.data_ptr());
  const char* k_rows = static_cast<const char*>(key.data_ptr());
  const char* v_rows = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * element, v_stride = value.stride(0) * element;
#pragma omp parallel for if (tokens * row_bytes > kParallelBytes)
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(k_pool + slots[t] * row_bytes, k_rows + t * k_stride, row_bytes);
    std::memcpy(v_pool + slots[t] * row_bytes, v_rows + t * v_stride, row_bytes);
  }
}

}  // namespace

// A fragment: cpu_attention.cpp holds the namespace's TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("write_kv(Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("write_kv", &write_kv); }
