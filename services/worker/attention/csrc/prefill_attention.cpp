// Causal prefill attention for CPUs with AVX-512 or AVX2 (simd.h): one sequence's new tokens over its paged context (the
// cached prefix, if any, and themselves), float32 or bfloat16, head sizes that are multiples of 16.
//
// torch's fused CPU kernel (SDPA) runs the bench prompts (a few hundred tokens) at 40-60 GFLOPS here; this
// one is laid out as a small matrix multiply. For each KV head, its keys and values go once into buffers [keys, D]
// (float32; kPairs' keys as words of two bfloat16). A work item is one query head and kRows = kLanes query rows,
// transposed so that a vector holds one dimension of every row. For each tile of kKeys keys (16 with AVX-512, where
// 24 measured slower; 12 with AVX2: with the query vector and a broadcast, 14 of its 16 registers) it computes
// the kKeys vectors of scores with one fused multiply-add per (key, dimension): a broadcast key element times the
// rows' query values of that dimension. With the rows in the lanes, the online softmax (running maximum and sum
// per row) is whole-vector arithmetic, with no sum or maximum across lanes (when each row had a vector of scores,
// those reductions took about 45 % of the kernel's samples). The output rows take the tile's value rows, each
// row's weight broadcast. Tiles past a row's own position are skipped, and the diagonal tile is masked. With
// AVX512-BF16, bfloat16 keys and queries stay bfloat16, a pair of dimensions to a 32-bit word, and the scores
// take one dot-product instruction per pair (kPairs).
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
constexpr int64_t kRows = simd::kLanes;                   // query rows per work item: a lane each
constexpr int64_t kKeys = simd::kLanes == 16 ? 16 : 12;  // keys per tile: a vector of scores (over the rows) each

// bfloat16 scores by AVX512-BF16's dot product of pairs (vdpbf16ps: 32 products into 16 float32 sums, each
// product exact, each sum rounded as an FMA's): half the instructions of widening to float32 and one FMA per
// dimension. Keys and queries are then kept as pairs of dimensions, one 32-bit word per pair, and the query
// unscaled (the scale multiplies the scores).
#if PAGEDSERVE_SIMD == 512 && defined(__AVX512BF16__)
template <typename T>
constexpr bool kPairs = std::is_same_v<T, c10::BFloat16>;
#else
template <typename T>
constexpr bool kPairs = false;
#endif
// What a key or query buffer holds per dimension (float32) or pair of dimensions (two bfloat16).
template <typename T>
using KeyWord = std::conditional_t<kPairs<T>, uint32_t, float>;
template <typename T, int kD>
constexpr int64_t kKeyWords = kPairs<T> ? kD / 2 : kD;  // words per key

// KV head kv's keys j0 .. j0 + kKeys - 1 into kf[j * kKeyWords + w] (w: a dimension, or a pair of them, KeyWord)
// and their values into vf[j * kD + d], float32; keys past the context zero. Rows stay rows: the scores take a
// key's words one at a time, broadcast (tile_scores).
template <typename T, int kD>
void widen_key_tile(KeyWord<T>* kf, float* vf, int64_t j0, const T* key_cache, const T* value_cache,
                    const int32_t* table, int64_t kv, const PrefillShape& s) {
  constexpr int64_t kWords = kKeyWords<T, kD>;
  for (int64_t j = j0; j < j0 + kKeys; ++j) {
    KeyWord<T>* keys = kf + j * kWords;
    float* values = vf + j * kD;
    if (j >= s.context_len) {
      std::fill(keys, keys + kWords, KeyWord<T>{0});
      std::fill(values, values + kD, 0.f);
      continue;
    }
    const int64_t at = table[j / s.block_size] * s.cache_block_stride + (j % s.block_size) * s.cache_token_stride +
                       kv * s.cache_head_stride;
    if constexpr (kPairs<T>) {
      std::memcpy(keys, key_cache + at, kD * sizeof(T));  // a pair of bfloat16 is one word
    }
    for (int64_t c = 0; c < kD; c += simd::kLanes) {
      if constexpr (!kPairs<T>) simd::store(keys + c, simd::load(key_cache + at + c));
      simd::store(values + c, simd::load(value_cache + at + c));
    }
  }
}

// scores[j] = key j's dot products with the kRows query rows (a lane each), for keys k0 .. k0 + kKeys - 1 of kf
// (as widen_key_tile writes it), qt the rows transposed (qt[w][r]: scaled float32, or kPairs' unscaled words).
// One vector load of a query word serves every key of the tile, each key's word broadcast to the rows.
template <typename T, int kD>
inline void tile_scores(Vec (&scores)[kKeys], const KeyWord<T>* kf, int64_t k0,
                        const KeyWord<T> (&qt)[kKeyWords<T, kD>][kRows], float scale) {
  constexpr int64_t kWords = kKeyWords<T, kD>;
  const KeyWord<T>* keys = kf + k0 * kWords;
  for (int64_t j = 0; j < kKeys; ++j) scores[j] = simd::zero();
#if PAGEDSERVE_SIMD == 512 && defined(__AVX512BF16__)
  if constexpr (kPairs<T>) {
    for (int64_t w = 0; w < kWords; ++w) {
      const __m512bh rows = (__m512bh)_mm512_load_si512(qt[w]);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kKeys; ++j) {
        scores[j] = _mm512_dpbf16_ps(scores[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(keys[j * kWords + w])),
                                     rows);
      }
    }
    for (int64_t j = 0; j < kKeys; ++j) scores[j] = simd::mul(scores[j], simd::broadcast(scale));
    return;
  }
#endif
  if constexpr (!kPairs<T>) {
    for (int64_t d = 0; d < kD; ++d) {
      const Vec rows = simd::load(qt[d]);
#pragma GCC unroll 16
      for (int64_t j = 0; j < kKeys; ++j) {
        scores[j] = simd::fmadd(simd::broadcast(keys[j * kWords + d]), rows, scores[j]);
      }
    }
  }
}

// One work item: query head h, rows [r0, r0 + kRows) (those past query_len computed, not written). The rows are
// the lanes of every vector of the softmax, so its maxima, sums and rescaling are whole-vector operations, with
// no reduction across lanes.
template <typename T, int kD>
void attend_rows(T* out, const T* query, const KeyWord<T>* kf, const float* vf, int64_t h, int64_t r0,
                 const PrefillShape& s) {
  constexpr int64_t kWords = kKeyWords<T, kD>;
  const int64_t offset = s.context_len - s.query_len;
  alignas(64) KeyWord<T> qt[kWords][kRows];
  alignas(64) float acc[kRows][kD] = {};
  // A tile's weights p[j][r], key by key; p[kKeys] the rows' rescaling (e^(old max - new max)).
  alignas(64) float p[kKeys + 1][kRows];
  alignas(64) float sums[kRows];
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = std::min(r0 + r, s.query_len - 1);  // (rows past the end repeat the last one)
    const T* src = query + row * s.q_row_stride + h * s.q_head_stride;
    for (int64_t w = 0; w < kWords; ++w) {
      if constexpr (kPairs<T>) {
        std::memcpy(&qt[w][r], src + 2 * w, sizeof(KeyWord<T>));
      } else {
        qt[w][r] = static_cast<float>(src[w]) * s.scale;
      }
    }
  }
  Vec max = simd::broadcast(-std::numeric_limits<float>::infinity()), sum = simd::zero();
  const int64_t last_key = offset + std::min(r0 + kRows, s.query_len) - 1;  // the last row's own position
  for (int64_t k0 = 0; k0 <= last_key; k0 += kKeys) {
    Vec scores[kKeys];
    tile_scores<T, kD>(scores, kf, k0, qt, s.scale);
    // Key k0 + j is seen by the rows from lane k0 + j - offset - r0 on (the row's own position and later ones);
    // below the diagonal every row sees every key. The first tile's key 0 is seen by every row.
    const bool all_seen = k0 + kKeys - 1 <= offset + r0;
    if (!all_seen) {
      for (int64_t j = 0; j < kKeys; ++j) {
        scores[j] = simd::keep_from(scores[j], k0 + j - offset - r0, -std::numeric_limits<float>::infinity());
      }
    }
    Vec tile_max = scores[0];
    for (int64_t j = 1; j < kKeys; ++j) tile_max = simd::max(tile_max, scores[j]);
    const Vec new_max = simd::max(max, tile_max);
    for (int64_t j = 0; j < kKeys; ++j) simd::store(p[j], simd::sub(scores[j], new_max));
    simd::store(p[kKeys], simd::sub(max, new_max));  // (-inf at the first tile: its clamped e^ is ~1e-38)
    float* flat = &p[0][0];
#pragma omp simd
    for (int64_t i = 0; i < (kKeys + 1) * kRows; ++i) flat[i] = pagedserve_cpu::exp_clamped(flat[i]);
    // Unseen keys' weights are exactly 0 (their -inf scores came out of the clamped exponential as e^-87).
    Vec tile_sum = simd::zero();
    for (int64_t j = 0; j < kKeys; ++j) {
      if (!all_seen) simd::store(p[j], simd::keep_from(simd::load(p[j]), k0 + j - offset - r0, 0.f));
      tile_sum = simd::add(tile_sum, simd::load(p[j]));
    }
    const Vec rescale = simd::load(p[kKeys]);
    sum = simd::fmadd(sum, rescale, tile_sum);
    max = new_max;
    for (int64_t c = 0; c < kD; c += simd::kLanes) {
      Vec out_rows[kRows];
#pragma GCC unroll 16
      for (int64_t r = 0; r < kRows; ++r) out_rows[r] = simd::mul(simd::load(acc[r] + c), simd::broadcast(p[kKeys][r]));
      for (int64_t j = 0; j < kKeys; ++j) {
        const Vec values = simd::load(vf + (k0 + j) * kD + c);
#pragma GCC unroll 16
        for (int64_t r = 0; r < kRows; ++r) out_rows[r] = simd::fmadd(simd::broadcast(p[j][r]), values, out_rows[r]);
      }
      for (int64_t r = 0; r < kRows; ++r) simd::store(acc[r] + c, out_rows[r]);
    }
  }
  simd::store(sums, sum);
  for (int64_t r = 0; r < kRows && r0 + r < s.query_len; ++r) {
    T* dst = out + (r0 + r) * s.out_row_stride + h * s.out_head_stride;
    const float inv = 1.f / sums[r];
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
  const std::unique_ptr<KeyWord<T>[]> kf(new KeyWord<T>[s.num_kv_heads * padded * kWords]);
  const std::unique_ptr<float[]> vf(new float[s.num_kv_heads * padded * kD]);
  // One parallel region per call (each costs a fork and a join of the threads): every head's keys widened, then
  // every head's rows attended.
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t item = 0; item < s.num_kv_heads * key_tiles; ++item) {
      const int64_t kv = item / key_tiles;
      widen_key_tile<T, kD>(kf.get() + kv * padded * kWords, vf.get() + kv * padded * kD, item % key_tiles * kKeys,
                            key_cache, value_cache, table, kv, s);
    }
    // A KV head at a time (both threads read the same head's keys), and within it the last rows, which see the
    // most keys, first.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < s.num_kv_heads * head_items; ++item) {
      const int64_t kv = item / head_items, tile = tiles - 1 - item % head_items / group;
      attend_rows<T, kD>(out, query, kf.get() + kv * padded * kWords, vf.get() + kv * padded * kD,
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
