// Paged decode attention's inner loops in vector registers (included by cpu_attention.cpp; used when the build
// targets AVX-512 or AVX2, simd.h, and the cache holds the query's own float32 or bfloat16; with AVX2 bfloat16
// only, as decode_for_head_size says).
//
// The generic loops walk a token at a time over every query head, accumulating into memory; these walk one
// block of tokens at a time, and within it a pair of query heads at a time (heads of one KV head) where the
// registers hold them, so their queries (pass 1) or output accumulators (pass 2) stay in registers across the
// block's tokens, and each K or V row is loaded and widened once per pair. The same arithmetic as the generic
// loops up to the order of float additions. Rows are read 2 x kLanes values at a time (simd::load_two): a bfloat16
// row's even values, then its odd ones, so q and acc hold each head's values in that order (simd::split_position).
#pragma once

#include "simd.h"

#if PAGEDSERVE_SIMD

#include <type_traits>

namespace pagedserve_cpu {

// Asks for one KV head's row of a later block (into L2: into L1 it would evict the block in use).
template <int kD, typename T>
inline void prefetch_head_row(const T* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t offset = 0; offset < kD * static_cast<int64_t>(sizeof(T)); offset += 64) __builtin_prefetch(p + offset, 0, 1);
}

using simd::Vec;
constexpr int kLanes = simd::kLanes;

// How many query heads of a group one sweep over a block's rows serves: each K or V row is loaded (and, in
// bfloat16, widened) once for all of them, their queries or accumulators in registers. Two where their
// 2 x kD / kLanes registers are at most half of them (AVX-512: head sizes 64 and 128; AVX2's 16 registers
// hold no pair of the head sizes compiled, 64 and up), else one.
template <int kD>
constexpr int64_t kHeadsPerSweep = 2 * kD / kLanes <= simd::kRegisters / 2 ? 2 : 1;

// Pass 1 for the tokens [first, first + count) of one block: scores[h][t] for query heads h0 .. h0 + kH - 1
// (of KV head kv). `rows`: the block's row for its first token, at KV head 0; strides in elements. `next`: the
// next block's rows, whose row of each token swept is prefetched (nullptr: none).
template <int kD, int kH, typename T>
inline void sweep_scores(const float* q, int64_t h0, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, float* scores, int64_t n, int64_t t0,
                         const T* next) {
  static_assert(kD % (2 * kLanes) == 0, "rows are read 2 x kLanes values at a time");
  Vec qv[kH][kD / kLanes];
#pragma GCC unroll 16
  for (int c = 0; c < kD / kLanes; ++c) {
    for (int i = 0; i < kH; ++i) qv[i][c] = simd::load(q + (h0 + i) * kD + kLanes * c);
  }
  for (int64_t t = first; t < first + count; ++t) {
    if (next != nullptr) prefetch_head_row<kD>(next + t * token_stride + kv * head_stride);
    const T* k = rows + t * token_stride + kv * head_stride;
    Vec acc[kH], lo, hi;
    simd::load_two(k, lo, hi);
    for (int i = 0; i < kH; ++i) acc[i] = simd::fmadd(qv[i][1], hi, simd::mul(qv[i][0], lo));
#pragma GCC unroll 16
    for (int c = 2; c < kD / kLanes; c += 2) {
      simd::load_two(k + kLanes * c, lo, hi);
      for (int i = 0; i < kH; ++i) acc[i] = simd::fmadd(qv[i][c + 1], hi, simd::fmadd(qv[i][c], lo, acc[i]));
    }
    for (int i = 0; i < kH; ++i) scores[(h0 + i) * n + t0 + t - first] = simd::reduce_add(acc[i]);
  }
}

// sweep(heads, h0, next) over the query heads of KV head kv: pairs, then one, as std::integral_constant heads;
// the first sweep gets `next` (it prefetches the KV head's rows of a later block), the others nullptr.
template <int kD, typename T, typename Sweep>
inline void for_each_sweep(int64_t group, int64_t kv, const T* next, Sweep&& sweep) {
  constexpr int64_t kH = kHeadsPerSweep<kD>;
  int64_t g = 0;
  for (; g + kH <= group; g += kH) sweep(std::integral_constant<int, kH>{}, kv * group + g, g == 0 ? next : nullptr);
  for (; g < group; ++g) sweep(std::integral_constant<int, 1>{}, kv * group + g, g == 0 ? next : nullptr);
}

template <int kD, typename T>
inline void block_scores(const float* q, int64_t group, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, float* scores, int64_t n, int64_t t0,
                         const T* next) {
  for_each_sweep<kD>(group, kv, next, [&](auto heads, int64_t h0, const T* prefetch) {
    sweep_scores<kD, decltype(heads)::value>(q, h0, kv, rows, first, count, token_stride, head_stride, scores, n,
                                             t0, prefetch);
  });
}

// Pass 2 for the same tokens: acc[h] += p[h][t] v_t for query heads h0 .. h0 + kH - 1.
template <int kD, int kH, typename T>
inline void sweep_values(float* acc, int64_t h0, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, const float* scores, int64_t n, int64_t t0,
                         const T* next) {
  static_assert(kD % (2 * kLanes) == 0, "rows are read 2 x kLanes values at a time");
  Vec av[kH][kD / kLanes];
#pragma GCC unroll 16
  for (int c = 0; c < kD / kLanes; ++c) {
    for (int i = 0; i < kH; ++i) av[i][c] = simd::load(acc + (h0 + i) * kD + kLanes * c);
  }
  for (int64_t t = first; t < first + count; ++t) {
    Vec p[kH];
    for (int i = 0; i < kH; ++i) p[i] = simd::broadcast(scores[(h0 + i) * n + t0 + t - first]);
    if (next != nullptr) prefetch_head_row<kD>(next + t * token_stride + kv * head_stride);
    const T* v = rows + t * token_stride + kv * head_stride;
#pragma GCC unroll 16
    for (int c = 0; c < kD / kLanes; c += 2) {
      Vec lo, hi;
      simd::load_two(v + kLanes * c, lo, hi);
      for (int i = 0; i < kH; ++i) {
        av[i][c] = simd::fmadd(p[i], lo, av[i][c]);
        av[i][c + 1] = simd::fmadd(p[i], hi, av[i][c + 1]);
      }
    }
  }
#pragma GCC unroll 16
  for (int c = 0; c < kD / kLanes; ++c) {
    for (int i = 0; i < kH; ++i) simd::store(acc + (h0 + i) * kD + kLanes * c, av[i][c]);
  }
}

template <int kD, typename T>
inline void block_values(float* acc, int64_t group, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, const float* scores, int64_t n, int64_t t0,
                         const T* next) {
  for_each_sweep<kD>(group, kv, next, [&](auto heads, int64_t h0, const T* prefetch) {
    sweep_values<kD, decltype(heads)::value>(acc, h0, kv, rows, first, count, token_stride, head_stride, scores, n,
                                             t0, prefetch);
  });
}

}  // namespace pagedserve_cpu

#endif  // PAGEDSERVE_SIMD
