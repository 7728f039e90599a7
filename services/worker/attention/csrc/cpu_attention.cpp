// Paged decode attention for CPUs: each sequence's one new query attends over its K/V blocks where they
// lie in the pool, so K and V cross the memory bus once (a gather into a contiguous buffer followed by
// SDPA moves them three times). Built at run time by services/worker/attention/cpu_kernels.py.
//
// A work item is one sequence (or, with few sequences, one KV head of one): the query heads that
// share a KV head are handled together so each K/V row is read once for all of them. Items are
// dealt out longest context first, dynamically, on torch's own OpenMP pool (the extension links
// the libgomp torch already loaded).
// With a float32 or bfloat16 cache on AVX-512 or AVX2 (simd.h, decode_attention_blocked), K and V can be read together,
// a block at a time, under an online softmax; the caller says whether (`blocked`: cpu_kernels.decode_reads_blocks
// says which is faster on which CPU). Otherwise (FP8 codes, float16, other CPUs, or not `blocked`) scores for the
// whole context are kept (context x group floats per thread), so the softmax is exact two-pass: pass 1 reads K,
// pass 2 reads V. With a sliding window the context is the
// sequence's last `window` tokens; with a soft cap each score s becomes cap * tanh(s / cap).
// An FP8 cache (kv_quant.py) holds codes: each KV head's row is decoded once per token (fp8_to_float),
// K's scale comes folded into `scale` and V's multiplies the output.

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <omp.h>
#include <torch/library.h>

#include "decode_blocks.h"
#include "vec_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// FP8 codes decoded with integer and float operations only (no table, no branch), so the dot products
// around them still vectorize: a normal code's exponent is rebiased into a float32's (e4m3: 7 -> 127,
// e5m2: 15 -> 127); a subnormal one (exponent 0) is its mantissa times the format's smallest step.
template <int kMantissaBits, int kRebias, int kSubnormalExponent>
inline float fp8_to_float(uint8_t code) {
  const uint32_t magnitude = code & 0x7Fu;
  const uint32_t exponent = magnitude >> kMantissaBits;
  uint32_t bits = ((code & 0x80u) << 24) | ((magnitude + (kRebias << kMantissaBits)) << (23 - kMantissaBits));
  float normal;
  std::memcpy(&normal, &bits, sizeof(normal));
  const float mantissa = static_cast<float>(magnitude & ((1u << kMantissaBits) - 1));
  const float subnormal = std::ldexp(1.0f, kSubnormalExponent) * ((code & 0x80u) ? -mantissa : mantissa);
  return exponent == 0 ? subnormal : normal;
}
inline float to_float(c10::Float8_e4m3fn x) { return fp8_to_float<3, 120, -9>(x.x); }
inline float to_float(c10::Float8_e5m2 x) { return fp8_to_float<2, 112, -16>(x.x); }

// Blocks sit anywhere in the pool, so the hardware prefetchers cannot know the next one: while the
// kernel works on token t of a block it asks for token t of the block after it.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset, 0, 3);
}

struct DecodeShape {
  int64_t num_items;      // decode sequences
  int64_t num_heads;      // query heads
  int64_t num_kv_heads;   // KV heads
  int64_t head_dim;
  int64_t block_size;
  int64_t q_row_stride, q_head_stride;      // query [T, H, D], unit stride along D
  int64_t out_row_stride, out_head_stride;  // out [T, H, D], unit stride along D
  int64_t cache_block_stride, cache_token_stride, cache_head_stride;  // pools [N, B, Hkv, D], contiguous
  int64_t table_stride;   // block_tables [S, max_blocks]
  float scale;
  int64_t window;         // keys seen per query, itself included; 0: all of them
  float softcap;          // 0: scores uncapped
  float v_scale;          // what the output is multiplied by: an FP8 cache's V scale, else 1
  bool blocked;           // K and V a block at a time where decode_attention_blocked takes the cache, else two passes
};

// visit(row, i) for the i-th of a sequence's tokens begin..len-1 in order, where row points at the
// token's KV head `first_kv` in `cache`; while at token t of a block, prefetches token t of the next block.
template <typename T, typename Visit>
inline void for_each_token(const T* cache, const int32_t* table, int64_t begin, int64_t len, int64_t first_kv,
                           int64_t row_bytes, const DecodeShape& s, Visit&& visit) {
  for (int64_t b = begin / s.block_size; b * s.block_size < len; ++b) {
    const int64_t start = b * s.block_size;
    const T* block = cache + table[b] * s.cache_block_stride + first_kv * s.cache_head_stride;
    const T* next = start + s.block_size < len
        ? cache + table[b + 1] * s.cache_block_stride + first_kv * s.cache_head_stride : nullptr;
    const int64_t count = std::min(s.block_size, len - start);
    for (int64_t t = std::max<int64_t>(begin - start, 0); t < count; ++t) {
      if (next != nullptr) prefetch_row(next + t * s.cache_token_stride, row_bytes);
      visit(block + t * s.cache_token_stride, start + t - begin);
    }
  }
}

// A work item: `heads` consecutive KV heads, from `first_kv`, of one decode's sequence.
struct WorkItem {
  int64_t row;       // the decode's query row
  int64_t first_kv;  // its first KV head
  int64_t len;       // the sequence's context
  int64_t begin;     // its first key seen (a window's start, else 0)
  const int32_t* table;
};

inline WorkItem work_item(int64_t item, int64_t splits, int64_t heads, const int64_t* rows, const int64_t* seqs,
                          const int32_t* seq_lens, const int32_t* block_tables, const DecodeShape& s) {
  const int64_t i = item / splits, seq = seqs[i], len = seq_lens[seq];
  return {rows[i], (item % splits) * heads, len, s.window > 0 ? std::max<int64_t>(0, len - s.window) : 0,
          block_tables + seq * s.table_stride};
}

// The item's `width` query heads, scaled, as float32 rows of D into q, value d of a row at position(d) in it.
template <typename T, typename Position>
inline void load_query(float* q, const T* query, const WorkItem& w, int64_t width, int64_t group, int64_t D,
                       const DecodeShape& s, Position&& position) {
  for (int64_t h = 0; h < width; ++h) {
    const T* src = query + w.row * s.q_row_stride + (w.first_kv * group + h) * s.q_head_stride;
    for (int64_t d = 0; d < D; ++d) q[h * D + position(d)] = to_float(src[d]) * s.scale;
  }
}

// One KV head's row of FP8 codes as floats (kD: the head size when known at compile time, else 0).
template <int kD, typename C>
inline void decode_row(float* dst, const C* codes, int64_t D) {
  const int64_t size = kD > 0 ? kD : D;
#pragma omp simd
  for (int64_t d = 0; d < size; ++d) dst[d] = to_float(codes[d]);
}

// kD: the head size as a compile-time constant (the common ones), so the per-token dot products and
// updates unroll completely; 0 for any other size, read from `s` at run time (several times slower).
template <typename T, typename C, int kD>
void decode_attention(T* out, const T* query, const C* key_cache, const C* value_cache,
                      const int32_t* block_tables, const int32_t* seq_lens, const int64_t* rows,
                      const int64_t* seqs, const DecodeShape& s) {
  constexpr bool kCoded = std::is_same_v<C, c10::Float8_e4m3fn> || std::is_same_v<C, c10::Float8_e5m2>;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t D = kD > 0 ? kD : s.head_dim;
  // A work item covers `heads` consecutive KV heads of one sequence. All of them when there are
  // enough sequences to keep every thread busy: a token's K (or V) row for all heads is one
  // contiguous run, which the hardware prefetchers stream; one head at a time reads 1/Hkv of each
  // row at a stride and runs several times slower. With few sequences, one head per item.
  const int64_t heads = s.num_items >= 4 * omp_get_max_threads() ? s.num_kv_heads : 1;
  const int64_t splits = s.num_kv_heads / heads;
  const int64_t row_bytes = heads * s.cache_head_stride * static_cast<int64_t>(sizeof(C));
#pragma omp parallel
  {
    const int64_t width = heads * group;  // query heads per item
    std::vector<float> q(width * D), acc(width * D), inv_sum(width), scores, decoded(D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < s.num_items * splits; ++item) {
      const WorkItem w = work_item(item, splits, heads, rows, seqs, seq_lens, block_tables, s);
      const int64_t row = w.row, first_kv = w.first_kv, len = w.len, begin = w.begin;
      const int64_t n = len - begin;  // keys seen
      const int32_t* table = w.table;
      load_query(q.data(), query, w, width, group, D, s, [](int64_t d) { return d; });
      scores.resize(width * n);

      // Pass 1: scores[h][t] = q_h . k_t for the item's query heads h. FP8 codes are decoded once per KV
      // head into `decoded`, not once per query head sharing it (grouped-query attention reads each group times).
      for_each_token(key_cache, table, begin, len, first_kv, row_bytes, s, [&](const C* k_row, int64_t t) {
        for (int64_t h = 0; h < width; ++h) {
          const C* k = k_row + (h / group) * s.cache_head_stride;
          const float* qh = q.data() + h * D;
          float dot = 0.f;
          if constexpr (kCoded) {
            if (h % group == 0) decode_row<kD>(decoded.data(), k, D);
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * decoded[d];
          } else {
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qh[d] * to_float(k[d]);
          }
          scores[h * n + t] = dot;
        }
      });
      if (s.softcap > 0.f) {
        for (float& score : scores) score = s.softcap * std::tanh(score / s.softcap);
      }
      // Softmax numerators in place; 1/sum is applied to the output.
      for (int64_t h = 0; h < width; ++h) {
        float* sh = scores.data() + h * n;
        float max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max)
        for (int64_t t = 0; t < n; ++t) max = std::max(max, sh[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < n; ++t) {
          sh[t] = pagedserve_cpu::exp_clamped(sh[t] - max);
          sum += sh[t];
        }
        inv_sum[h] = 1.f / sum;
      }
      // Pass 2: acc[h] = sum_t p[h][t] v_t.
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_token(value_cache, table, begin, len, first_kv, row_bytes, s, [&](const C* v_row, int64_t t) {
        for (int64_t h = 0; h < width; ++h) {
          const C* v = v_row + (h / group) * s.cache_head_stride;
          const float p = scores[h * n + t];
          float* ah = acc.data() + h * D;
          if constexpr (kCoded) {
            if (h % group == 0) decode_row<kD>(decoded.data(), v, D);
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * decoded[d];
          } else {
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ah[d] += p * to_float(v[d]);
          }
        }
      });
      for (int64_t h = 0; h < width; ++h) {
        T* dst = out + row * s.out_row_stride + (first_kv * group + h) * s.out_head_stride;
        const float factor = inv_sum[h] * s.v_scale;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[h * D + d] * factor);
      }
    }
  }
}

#if PAGEDSERVE_SIMD
// visit(k_rows, v_rows, first, count, k_next, v_next) for each block holding the item's tokens begin..len-1:
// its tokens first..first+count-1, the rows pointing at its token 0, KV head `first_kv`, in each pool; and the
// same rows of the block kBlocksAhead on, for the sweeps to prefetch a row at a time as they go; past the item's
// last block, the first blocks of the item the thread runs next (`following()`, asked only then: nullptr when
// there is none, and no prefetch).
// 2 blocks on read 20-22 GB/s of scattered bfloat16 blocks here, 1 block 17, 3 blocks 12-17: the hardware
// prefetchers lose the stream at every block, and a whole block's prefetches issued at once fill the miss buffers
// and stall the loads of the block in use (measured: the kernel then reads memory and computes by turns, at half
// the bandwidth). Going on into the next item's blocks took 3-4 % off a step of 200 decodes of 370 keys.
constexpr int64_t kBlocksAhead = 2;

// Where the rows of the item's i-th block (from its first key's) lie in a pool, at its first KV head; -1: it has
// fewer blocks.
inline int64_t block_offset(const WorkItem& w, int64_t i, const DecodeShape& s) {
  const int64_t b = w.begin / s.block_size + i;
  return b * s.block_size < w.len ? w.table[b] * s.cache_block_stride + w.first_kv * s.cache_head_stride : -1;
}

template <typename T, typename Following, typename Visit>
inline void for_each_block(const T* key_cache, const T* value_cache, const WorkItem& w, Following&& following,
                           const DecodeShape& s, Visit&& visit) {
  const int64_t blocks = (w.len + s.block_size - 1) / s.block_size - w.begin / s.block_size;
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t start = (w.begin / s.block_size + i) * s.block_size;
    const int64_t first = std::max<int64_t>(w.begin - start, 0);
    const int64_t here = block_offset(w, i, s);
    const int64_t ahead = i + kBlocksAhead;
    const WorkItem* owner = ahead < blocks ? &w : following();  // whose block lies kBlocksAhead on
    const int64_t next = owner == nullptr ? -1 : block_offset(*owner, ahead < blocks ? ahead : ahead - blocks, s);
    visit(key_cache + here, value_cache + here, first, std::min(s.block_size, w.len - start) - first,
          next >= 0 ? key_cache + next : nullptr, next >= 0 ? value_cache + next : nullptr);
  }
}

using pagedserve_cpu::simd::split_position;

// decode_attention for a float32 or bfloat16 cache with AVX-512 or AVX2, in one pass over K and V together (an online
// softmax: each block's scores rescale the running maximum, sum and output), a block at a time: its K and V rows
// are read while still in cache, and a query head's query (or output) stays in registers across the block
// (decode_blocks.h). Work items as decode_attention's.
template <typename T, int kD>
void decode_attention_blocked(T* out, const T* query, const T* key_cache, const T* value_cache,
                              const int32_t* block_tables, const int32_t* seq_lens, const int64_t* rows,
                              const int64_t* seqs, const DecodeShape& s) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t heads = s.num_items >= 4 * omp_get_max_threads() ? s.num_kv_heads : 1;
  const int64_t splits = s.num_kv_heads / heads;
  const int64_t num_work = s.num_items * splits;
  // Items are dealt out dynamically; a thread claims its next one as its current one nears its end, so that it
  // knows whose blocks to prefetch (for_each_block), and no sooner: an item claimed early could wait while other
  // threads run out of work (a lone decode split by KV heads over many threads).
  std::atomic<int64_t> unclaimed{0};
#pragma omp parallel
  {
    const int64_t width = heads * group;
    std::vector<float> q(width * kD), acc(width * kD), max(width), sum(width), scores(width * s.block_size);
    std::optional<int64_t> claimed;  // the next item, once claimed
    WorkItem next{};
    auto following = [&]() -> const WorkItem* {
      if (!claimed) {
        claimed = unclaimed.fetch_add(1);
        if (*claimed < num_work) next = work_item(*claimed, splits, heads, rows, seqs, seq_lens, block_tables, s);
      }
      return *claimed < num_work ? &next : nullptr;
    };
    for (int64_t item = unclaimed.fetch_add(1); item < num_work;
         item = claimed ? *claimed : unclaimed.fetch_add(1)) {
      claimed.reset();
      const WorkItem w = work_item(item, splits, heads, rows, seqs, seq_lens, block_tables, s);
      const int64_t row = w.row, first_kv = w.first_kv;
      // (each head's values in the order the sweeps read a K or V row, decode_blocks.h)
      load_query(q.data(), query, w, width, group, kD, s, split_position<T>);
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(max.begin(), max.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      for_each_block(key_cache, value_cache, w, following, s,
                     [&](const T* k_rows, const T* v_rows, int64_t first, int64_t count, const T* k_next,
                         const T* v_next) {
        const int64_t bs = s.block_size;
        for (int64_t kv = 0; kv < heads; ++kv) {
          pagedserve_cpu::block_scores<kD>(q.data(), group, kv, k_rows, first, count, s.cache_token_stride,
                                           s.cache_head_stride, scores.data(), bs, 0, k_next);
        }
        for (int64_t h = 0; h < width; ++h) {
          float* sh = scores.data() + h * bs;
          if (s.softcap > 0.f) {
            for (int64_t t = 0; t < count; ++t) sh[t] = s.softcap * std::tanh(sh[t] / s.softcap);
          }
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < count; ++t) block_max = std::max(block_max, sh[t]);
          const float new_max = std::max(max[h], block_max);
          const float rescale = pagedserve_cpu::exp_clamped(max[h] - new_max);  // (~0 at the first block: max was -inf)
          float block_sum = 0.f;
#pragma omp simd reduction(+ : block_sum)
          for (int64_t t = 0; t < count; ++t) {
            sh[t] = pagedserve_cpu::exp_clamped(sh[t] - new_max);
            block_sum += sh[t];
          }
          sum[h] = sum[h] * rescale + block_sum;
          max[h] = new_max;
          if (rescale != 1.f) {
#pragma omp simd
            for (int64_t d = 0; d < kD; ++d) acc[h * kD + d] *= rescale;
          }
        }
        for (int64_t kv = 0; kv < heads; ++kv) {
          pagedserve_cpu::block_values<kD>(acc.data(), group, kv, v_rows, first, count,
                                           s.cache_token_stride, s.cache_head_stride, scores.data(), bs, 0, v_next);
        }
      });
      for (int64_t h = 0; h < width; ++h) {
        T* dst = out + row * s.out_row_stride + (first_kv * group + h) * s.out_head_stride;
        const float factor = s.v_scale / sum[h];
        for (int64_t d = 0; d < kD; ++d) dst[d] = static_cast<T>(acc[h * kD + split_position<T>(d)] * factor);
      }
    }
  }
}
#endif  // PAGEDSERVE_SIMD

template <typename T, typename C>
void decode_for_head_size(T* out, const T* query, const C* key_cache, const C* value_cache,
                          const int32_t* block_tables, const int32_t* seq_lens, const int64_t* rows,
                          const int64_t* seqs, const DecodeShape& s) {
#if PAGEDSERVE_SIMD
  constexpr bool kHasBlocked = std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, float>;
  if constexpr (std::is_same_v<C, T> && kHasBlocked) {
    if (s.blocked) {
      switch (s.head_dim) {
        case 64: return decode_attention_blocked<T, 64>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
        case 128: return decode_attention_blocked<T, 128>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
        case 256: return decode_attention_blocked<T, 256>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
        default: break;
      }
    }
  }
#endif
  switch (s.head_dim) {
    case 64: return decode_attention<T, C, 64>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
    case 128: return decode_attention<T, C, 128>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
    case 256: return decode_attention<T, C, 256>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
    default: return decode_attention<T, C, 0>(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs, s);
  }
}

// The query's dtype T; the cache's: T, or FP8 codes.
template <typename T>
void decode_for_cache_type(T* out, const T* query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                           const int32_t* block_tables, const int32_t* seq_lens, const int64_t* rows,
                           const int64_t* seqs, const DecodeShape& s) {
  switch (key_cache.scalar_type()) {
    case at::kFloat8_e4m3fn:
      return decode_for_head_size(out, query, key_cache.data_ptr<c10::Float8_e4m3fn>(),
                                  value_cache.data_ptr<c10::Float8_e4m3fn>(), block_tables, seq_lens, rows, seqs, s);
    case at::kFloat8_e5m2:
      return decode_for_head_size(out, query, key_cache.data_ptr<c10::Float8_e5m2>(),
                                  value_cache.data_ptr<c10::Float8_e5m2>(), block_tables, seq_lens, rows, seqs, s);
    default:
      return decode_for_head_size(out, query, key_cache.data_ptr<T>(), value_cache.data_ptr<T>(), block_tables,
                                  seq_lens, rows, seqs, s);
  }
}

void check_layout(const at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                  const at::Tensor& rows, const at::Tensor& seqs) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must both be [tokens, heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "query and out need unit stride along head_dim");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache must both be [num_blocks, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "the KV pools must be contiguous");
  TORCH_CHECK(key_cache.size(3) == query.size(2), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  const bool fp8 = key_cache.scalar_type() == at::kFloat8_e4m3fn || key_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && value_cache.scalar_type() == key_cache.scalar_type() &&
                  (fp8 || key_cache.scalar_type() == query.scalar_type()),
              "query and out must share one dtype, and the KV pools either it or one FP8 format");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.stride(1) == 1,
              "block_tables must be int32 [num_seqs, max_blocks] with unit stride along blocks");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be contiguous int32");
  TORCH_CHECK(rows.scalar_type() == at::kLong && seqs.scalar_type() == at::kLong && rows.is_contiguous() &&
                  seqs.is_contiguous() && rows.numel() == seqs.numel(),
              "rows and seqs must be contiguous int64 of one length");
  for (const auto* t : {&out, &query, &key_cache, &value_cache, &block_tables, &seq_lens, &rows, &seqs}) {
    TORCH_CHECK(t->device().is_cpu(), "every tensor must be on the CPU");
  }
}

// Every index the kernel follows, checked before any thread reads through it (a bad plan must be
// an error, not a read or write outside the tensors): O(blocks in use), microseconds per call.
void check_indices(int64_t num_tokens, int64_t num_blocks, int64_t block_size, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& rows, const at::Tensor& seqs) {
  TORCH_CHECK_VALUE(seq_lens.numel() == block_tables.size(0), "seq_lens has ", seq_lens.numel(),
                    " entries for ", block_tables.size(0), " block table rows");
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const auto* row_ptr = rows.data_ptr<int64_t>();
  const auto* seq_ptr = seqs.data_ptr<int64_t>();
  const int64_t capacity = block_tables.size(1) * block_size;
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK_INDEX(row_ptr[i] >= 0 && row_ptr[i] < num_tokens, "row ", row_ptr[i], " is outside the ",
                      num_tokens, " query rows");
    TORCH_CHECK_INDEX(seq_ptr[i] >= 0 && seq_ptr[i] < block_tables.size(0), "sequence ", seq_ptr[i],
                      " is outside the ", block_tables.size(0), " block table rows");
    const int64_t len = lens[seq_ptr[i]];
    TORCH_CHECK_VALUE(len > 0 && len <= capacity, "sequence ", seq_ptr[i], " has context length ", len,
                      "; its block table holds 1 to ", capacity, " tokens");
    const int32_t* table = tables + seq_ptr[i] * block_tables.stride(0);
    for (int64_t b = 0; b * block_size < len; ++b) {
      TORCH_CHECK_INDEX(table[b] >= 0 && table[b] < num_blocks, "block id ", table[b], " of sequence ",
                        seq_ptr[i], " is outside the pool of ", num_blocks, " blocks");
    }
  }
}

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, const at::Tensor& rows, const at::Tensor& seqs,
                            double scale, int64_t window, double softcap, double v_scale, bool blocked) {
  check_layout(out, query, key_cache, value_cache, block_tables, seq_lens, rows, seqs);
  TORCH_CHECK_VALUE(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0: none)");
  check_indices(query.size(0), key_cache.size(0), key_cache.size(1), block_tables, seq_lens, rows, seqs);
  const DecodeShape shape{rows.numel(),          query.size(1),         key_cache.size(2),
                          query.size(2),         key_cache.size(1),     query.stride(0),
                          query.stride(1),       out.stride(0),         out.stride(1),
                          key_cache.stride(0),   key_cache.stride(1),   key_cache.stride(2),
                          block_tables.stride(0), static_cast<float>(scale), window,
                          static_cast<float>(softcap), static_cast<float>(v_scale), blocked};
  const auto* tables = block_tables.data_ptr<int32_t>();
  const auto* lens = seq_lens.data_ptr<int32_t>();
  const auto* row_ptr = rows.data_ptr<int64_t>();
  const auto* seq_ptr = seqs.data_ptr<int64_t>();
  switch (query.scalar_type()) {
    case at::kFloat:
      decode_for_cache_type(out.data_ptr<float>(), query.data_ptr<float>(), key_cache, value_cache, tables, lens,
                            row_ptr, seq_ptr, shape);
      break;
    case at::kBFloat16:
      decode_for_cache_type(out.data_ptr<c10::BFloat16>(), query.data_ptr<c10::BFloat16>(), key_cache, value_cache,
                            tables, lens, row_ptr, seq_ptr, shape);
      break;
    case at::kHalf:
      decode_for_cache_type(out.data_ptr<c10::Half>(), query.data_ptr<c10::Half>(), key_cache, value_cache, tables,
                            lens, row_ptr, seq_ptr, shape);
      break;
    default:
      TORCH_CHECK(false, "paged_decode_attention supports float32, bfloat16 and float16, not ",
                  query.scalar_type());
  }
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
        "Tensor block_tables, Tensor seq_lens, Tensor rows, Tensor seqs, float scale, int window, "
        "float softcap, float v_scale, bool blocked) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
