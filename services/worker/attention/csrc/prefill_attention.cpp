// Causal prefill attention for CPUs with AVX-512 or AVX2 (simd.h): one sequence's new tokens over its paged context (the
// cached prefix, if any, and themselves), float32 or bfloat16, head sizes that are multiples of 16.
//
// torch's fused CPU kernel (SDPA) runs the bench prompts (a few hundred tokens) at 40-60 GFLOPS here; this
// one is laid out as a small matrix multiply. For each KV head, its keys go once into a float32 buffer
// transposed ([D, keys]) and its values into one [keys, D]. A work item is one query head and kRows query rows
// (16 with AVX-512, 12 with AVX2: the rows' scores and two more fill the vector registers); for each tile of
// kLanes keys it computes the kRows x kLanes scores with one fused multiply-add per (row, dimension): a
// broadcast query element times the tile's keys' values of that dimension. An online softmax (running maximum and
// sum per row) turns them into weights, and the output rows take the tile's value rows the same way. Tiles past a
// row's own position are skipped, and the diagonal tile is masked. With AVX512-BF16, bfloat16 keys stay bfloat16,
// transposed a pair of dimensions at a time, and the scores take one dot-product instruction per pair (kPairs).
//
// Query row i sits at position context_len - query_len + i and sees keys 0 .. that position. The block table
// is the sequence's, its new tokens' K/V already written to the pools; or, for a prompt's first chunk, the
// "pools" are the step's new K/V rows as one block.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <omp.h>
#include <torch/library.h>

#include "simd.h"
#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>

namespace {

struct PrefillShape {
  int64_t query_len, context_len;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  int64_t q_row_stride, q_head_stride;      // query [L, H, D], unit stride along D
  int64_t out_row_stride, out_head_stride;  // out [L, H, D], unit stride along D
  int64_t cache_block_stride, cache_token_stride, cache_head_stride;  // pools [N, B, Hkv, D], K and V alike
  float scale;
};

#if PAGEDSERVE_SIMD

using pagedserve_cpu::simd::Vec;
namespace simd = pagedserve_cpu::simd;
constexpr int64_t kRows = simd::kLanes == 16 ? 16 : 12;  // query rows per work item
constexpr int64_t kKeys = simd::kLanes;                   // keys per tile: one vector of scores per row

// bfloat16 scores by AVX512-BF16's dot product of pairs (vdpbf16ps: 32 products into 16 float32 sums, each
// product exact, each sum rounded as an FMA's): half the instructions of widening to float32 and one FMA per
// dimension. Keys are then kept as pairs of dimensions, one 32-bit word per key and pair, and the query unscaled
// (the scale multiplies the scores).
#if PAGEDSERVE_SIMD == 512 && defined(__AVX512BF16__)
template <typename T>
constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kPairs = false;
#endif
// What a transposed key buffer holds per key and dimension (float32) or pair of dimensions (two bfloat16).
template <typename T>
using KeyWord = std::conditional_t<kPairs<T>, uint32_t, float>;
template <typename T, int kD>
constexpr int64_t kKeyWords = kPairs<T> ? kD / 2 : kD;  // words per key

// KV head kv's keys j0 .. j0 + kKeys - 1 into kt[w * padded + j] (w: a dimension, or a pair of them, KeyWord) and
// their values into vf[j * kD + d], float32; keys past the context zero. Each key row goes with vector loads into a
// small buffer, then out a word at a time: one vector store of kKeys keys per word, where a key at a time scattered
// kD scalar stores over kD cache lines (measured in the engine: a quarter of the kernel's time in bfloat16).
template <typename T, int kD>
void widen_key_tile(KeyWord<T>* kt, float* vf, int64_t padded, int64_t j0, const T* key_cache, const T* value_cache,
                    const int32_t* table, int64_t kv, const PrefillShape& s) {
  constexpr int64_t kWords = kKeyWords<T, kD>;
  alignas(64) KeyWord<T> keys[kKeys][kWords];
  for (int64_t i = 0; i < kKeys; ++i) {
    const int64_t j = j0 + i;
    float* values = vf + j * kD;
    if (j >= s.context_len) {
      std::fill(keys[i], keys[i] + kWords, KeyWord<T>{0});
      std::fill(values, values + kD, 0.f);
      continue;
    }
    const int64_t at = table[j / s.block_size] * s.cache_block_stride + (j % s.block_size) * s.cache_token_stride +
                       kv * s.cache_head_stride;
    if constexpr (kPairs<T>) {
      std::memcpy(keys[i], key_cache + at, kD * sizeof(T));  // a pair of bfloat16 is one word
    }
    for (int64_t c = 0; c < kD; c += simd::kLanes) {
      if constexpr (!kPairs<T>) simd::store(keys[i] + c, simd::load(key_cache + at + c));
      simd::store(values + c, simd::load(value_cache + at + c));
    }
  }
  for (int64_t w = 0; w < kWords; ++w) {
    KeyWord<T>* dst = kt + w * padded + j0;
#pragma omp simd
    for (int64_t i = 0; i < kKeys; ++i) dst[i] = keys[i][w];
  }
}

// scores[r] = the kRows query rows' dot products with keys k0 .. k0 + kKeys - 1 (kt as widen_key_tile writes it;
// q as attend_rows holds it: scaled float32 rows, or kPairs' unscaled words).
template <typename T, int kD>
inline void tile_scores(Vec* scores, const KeyWord<T>* kt, int64_t padded, int64_t k0,
                        const KeyWord<T> (&q)[kRows][kKeyWords<T, kD>], float scale) {
  for (int64_t r = 0; r < kRows; ++r) scores[r] = simd::zero();
#if PAGEDSERVE_SIMD == 512 && defined(__AVX512BF16__)
  if constexpr (kPairs<T>) {
    for (int64_t w = 0; w < kD / 2; ++w) {
      const __m512bh keys = (__m512bh)_mm512_loadu_si512(kt + w * padded + k0);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) {
        scores[r] = _mm512_dpbf16_ps(scores[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r][w])), keys);
      }
    }
    for (int64_t r = 0; r < kRows; ++r) scores[r] = simd::mul(scores[r], simd::broadcast(scale));
    return;
  }
#endif
  if constexpr (!kPairs<T>) {
    for (int64_t d = 0; d < kD; ++d) {
      const Vec keys = simd::load(kt + d * padded + k0);
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) scores[r] = simd::fmadd(simd::broadcast(q[r][d]), keys, scores[r]);
    }
  }
}

// One work item: query head h, rows [r0, r0 + kRows) (those past query_len computed, not written).
template <typename T, int kD>
void attend_rows(T* out, const T* query, const KeyWord<T>* kt, const float* vf, int64_t padded, int64_t h, int64_t r0,
                 const PrefillShape& s) {
  const int64_t offset = s.context_len - s.query_len;
  alignas(64) KeyWord<T> q[kRows][kKeyWords<T, kD>];
  alignas(64) float acc[kRows][kD] = {};
  alignas(64) float p[kRows][kKeys];
  float max[kRows], sum[kRows] = {};
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = std::min(r0 + r, s.query_len - 1);  // (rows past the end repeat the last one)
    const T* src = query + row * s.q_row_stride + h * s.q_head_stride;
    if constexpr (kPairs<T>) {
      std::memcpy(q[r], src, kD * sizeof(T));
    } else {
      for (int64_t d = 0; d < kD; ++d) q[r][d] = static_cast<float>(src[d]) * s.scale;
    }
    max[r] = -std::numeric_limits<float>::infinity();
  }
  const int64_t last_key = offset + std::min(r0 + kRows, s.query_len) - 1;  // the last row's own position
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    Vec scores[kRows];
    tile_scores<T, kD>(scores, kt, padded, k0, q, s.scale);
    const bool all_seen = k0 + kKeys - 1 <= offset + r0;  // below the diagonal: no row masks any of these keys
    for (int64_t r = 0; r < kRows; ++r) {
      // Keys past the row's own position weigh nothing (the row's first key, 0, is always seen): their
      // weight comes out of the exponential as 0 (the score -inf, clamped to e^-87 below, then dropped).
      const int64_t seen = all_seen ? kKeys : offset + r0 + r - k0 + 1;  // the tile's first `seen` keys
      const Vec seen_scores = simd::keep_first(scores[r], seen, -std::numeric_limits<float>::infinity());
      const float new_max = std::max(max[r], simd::reduce_max(seen_scores));
      simd::store(p[r], simd::sub(scores[r], simd::broadcast(new_max)));
      const float rescale = pagedserve_cpu::exp_clamped(max[r] - new_max);  // (~0 at the first tile)
#pragma omp simd
      for (int64_t j = 0; j < kKeys; ++j) p[r][j] = pagedserve_cpu::exp_clamped(p[r][j]);
      const Vec weights = simd::keep_first(simd::load(p[r]), seen, 0.f);
      simd::store(p[r], weights);
      const float tile_sum = simd::reduce_add(weights);
      sum[r] = sum[r] * rescale + tile_sum;
      max[r] = new_max;
      if (rescale != 1.f) {
#pragma omp simd
        for (int64_t d = 0; d < kD; ++d) acc[r][d] *= rescale;
      }
    }
    for (int64_t c = 0; c < kD; c += simd::kLanes) {
      Vec out_rows[kRows];
      for (int64_t r = 0; r < kRows; ++r) out_rows[r] = simd::load(acc[r] + c);
      for (int64_t j = 0; j < kKeys; ++j) {
        const Vec values = simd::load(vf + (k0 + j) * kD + c);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kRows; ++r) out_rows[r] = simd::fmadd(simd::broadcast(p[r][j]), values, out_rows[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) simd::store(acc[r] + c, out_rows[r]);
    }
  }
  for (int64_t r = 0; r < kRows && r0 + r < s.query_len; ++r) {
    T* dst = out + (r0 + r) * s.out_row_stride + h * s.out_head_stride;
    const float inv = 1.f / sum[r];
    for (int64_t d = 0; d < kD; ++d) dst[d] = static_cast<T>(acc[r][d] * inv);
  }
}

template <typename T, int kD>
void prefill(T* out, const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
             const PrefillShape& s) {
  const int64_t padded = (s.context_len + kKeys - 1) / kKeys * kKeys;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t tiles = (s.query_len + kRows - 1) / kRows;
  const int64_t key_tiles = padded / kKeys, head_items = group * tiles;
  // Every KV head's, left unset (every element is written below; zeroing tens of MiB for a long context would
  // be a serial pass before the parallel region).
  constexpr int64_t kWords = kKeyWords<T, kD>;
  const std::unique_ptr<KeyWord<T>[]> kt(new KeyWord<T>[s.num_kv_heads * kWords * padded]);
  const std::unique_ptr<float[]> vf(new float[s.num_kv_heads * padded * kD]);
  // One parallel region per call (each costs a fork and a join of the threads): every head's keys widened, then
  // every head's rows attended.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.num_kv_heads * key_tiles; ++item) {
      const int64_t kv = item / key_tiles;
      widen_key_tile<T, kD>(kt.get() + kv * kWords * padded, vf.get() + kv * padded * kD, padded,
                            item % key_tiles * kKeys, key_cache, value_cache, table, kv, s);
    }
    // A KV head at a time (both threads read the same head's keys), and within it the last rows, which see the
    // most keys, first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < s.num_kv_heads * head_items; ++item) {
      const int64_t kv = item / head_items, tile = tiles - 1 - item % head_items / group;
      attend_rows<T, kD>(out, query, kt.get() + kv * kWords * padded, vf.get() + kv * padded * kD, padded,
                         kv * group + item % head_items % group, tile * kRows, s);
    }
  }
}

template <typename T>
void prefill_for_head_size(T* out, const T* query, const T* key_cache, const T* value_cache, const int32_t* table,
                           const PrefillShape& s) {
  switch (s.head_dim) {
    case 64: return prefill<T, 64>(out, query, key_cache, value_cache, table, s);
    case 128: return prefill<T, 128>(out, query, key_cache, value_cache, table, s);
    case 256: return prefill<T, 256>(out, query, key_cache, value_cache, table, s);
    default: TORCH_CHECK_VALUE(false, "prefill_attention takes head sizes 64, 128 and 256, not ", s.head_dim);
  }
}

#endif  // PAGEDSERVE_SIMD

void prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_table, int64_t context_len,
                       double scale) {
#if PAGEDSERVE_SIMD
  TORCH_CHECK_VALUE(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 && out.stride(2) == 1,
                    "query and out must be [L, H, D] with unit stride along D");
  TORCH_CHECK_VALUE(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes() &&
                        key_cache.strides() == value_cache.strides() && key_cache.stride(3) == 1 &&
                        key_cache.size(3) == query.size(2),
                    "key_cache and value_cache must be [N, B, Hkv, D] alike, unit stride along D, with the "
                    "query's D");
  TORCH_CHECK_VALUE(query.scalar_type() == key_cache.scalar_type() && out.scalar_type() == query.scalar_type() &&
                        value_cache.scalar_type() == query.scalar_type(),
                    "query, out and the pools must share one dtype");
  TORCH_CHECK_VALUE(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK_VALUE(block_table.dim() == 1 && block_table.scalar_type() == at::kInt && block_table.is_contiguous(),
                    "block_table must be a contiguous int32 vector");
  const int64_t block_size = key_cache.size(1);
  TORCH_CHECK_VALUE(query.size(0) >= 1 && context_len >= query.size(0) &&
                        context_len <= block_table.numel() * block_size,
                    "context length ", context_len, " must cover the ", query.size(0),
                    " new tokens and fit the block table");
  const auto* table = block_table.data_ptr<int32_t>();
  const int64_t blocks_used = (context_len + block_size - 1) / block_size;
  for (int64_t b = 0; b < blocks_used; ++b) {
    TORCH_CHECK_INDEX(table[b] >= 0 && table[b] < key_cache.size(0), "block id ", table[b], " is outside the pool");
  }
  const PrefillShape shape{query.size(0),        context_len,          query.size(1),        key_cache.size(2),
                           query.size(2),        block_size,           query.stride(0),      query.stride(1),
                           out.stride(0),        out.stride(1),        key_cache.stride(0),  key_cache.stride(1),
                           key_cache.stride(2),  static_cast<float>(scale)};
  switch (query.scalar_type()) {
    case at::kFloat:
      return prefill_for_head_size(out.data_ptr<float>(), query.data_ptr<float>(), key_cache.data_ptr<float>(),
                                   value_cache.data_ptr<float>(), table, shape);
    case at::kBFloat16:
      return prefill_for_head_size(out.data_ptr<c10::BFloat16>(), query.data_ptr<c10::BFloat16>(),
                                   key_cache.data_ptr<c10::BFloat16>(), value_cache.data_ptr<c10::BFloat16>(), table,
                                   shape);
    default:
      TORCH_CHECK_VALUE(false, "prefill_attention supports float32 and bfloat16, not ", query.scalar_type());
  }
#else
  TORCH_CHECK(false, "prefill_attention needs a build for AVX-512 or AVX2");
#endif
}

bool has_prefill_attention() {
#if PAGEDSERVE_SIMD
  return true;
#else
  return false;
#endif
}

}  // namespace

// A fragment: cpu_attention.cpp holds the namespace's TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_table, int context_len, float scale) -> ()");
  m.def("has_prefill_attention() -> bool", &has_prefill_attention);  // (no tensor: a kernel for every backend)
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
