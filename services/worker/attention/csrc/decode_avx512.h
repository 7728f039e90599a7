// Paged decode attention's inner loops with AVX-512 (included by cpu_attention.cpp; used when the build
// targets AVX-512 and the cache holds the query's own float32 or bfloat16).
//
// The generic loops walk a token at a time over every query head, accumulating into memory; these walk one
// block of tokens at a time, and within it one query head at a time, so a head's query (pass 1) or its
// output accumulator (pass 2) stays in registers across the block's tokens. The block's K (or V) rows come
// from memory for the first head and from L1 for the others. The same arithmetic as the generic loops up to
// the order of float additions.
#pragma once

#if defined(__AVX512F__)

#include <immintrin.h>

#include <c10/util/BFloat16.h>

namespace pagedserve_cpu {

// 16 consecutive values as float32 lanes.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  // A bfloat16 is the high half of a float32: widen to 32 bits, shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// q . k over kD dimensions (q already scaled, float32).
template <int kD, typename T>
inline float dot_row(const __m512 (&q)[kD / 16], const T* k) {
  __m512 acc = _mm512_mul_ps(q[0], load16(k));
#pragma GCC unroll 16
  for (int c = 1; c < kD / 16; ++c) acc = _mm512_fmadd_ps(q[c], load16(k + 16 * c), acc);
  return _mm512_reduce_add_ps(acc);
}

// Pass 1 for the tokens [first, first + count) of one block: scores[h][t] for query heads h of KV head kv.
// `rows`: the block's row for its first token, at KV head 0; `token_stride`, `head_stride` in elements.
template <int kD, typename T>
inline void block_scores(const float* q, int64_t group, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, float* scores, int64_t n, int64_t t0) {
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kv * group + g;
    __m512 qv[kD / 16];
#pragma GCC unroll 16
    for (int c = 0; c < kD / 16; ++c) qv[c] = _mm512_loadu_ps(q + h * kD + 16 * c);
    float* sh = scores + h * n + t0;
    for (int64_t t = first; t < first + count; ++t) {
      sh[t - first] = dot_row<kD>(qv, rows + t * token_stride + kv * head_stride);
    }
  }
}

// Pass 2 for the same tokens: acc[h] += p[h][t] v_t for query heads h of KV head kv.
template <int kD, typename T>
inline void block_values(float* acc, int64_t group, int64_t kv, const T* rows, int64_t first, int64_t count,
                         int64_t token_stride, int64_t head_stride, const float* scores, int64_t n, int64_t t0) {
  for (int64_t g = 0; g < group; ++g) {
    const int64_t h = kv * group + g;
    float* ah = acc + h * kD;
    __m512 av[kD / 16];
#pragma GCC unroll 16
    for (int c = 0; c < kD / 16; ++c) av[c] = _mm512_loadu_ps(ah + 16 * c);
    const float* ph = scores + h * n + t0;
    for (int64_t t = first; t < first + count; ++t) {
      const __m512 p = _mm512_set1_ps(ph[t - first]);
      const T* v = rows + t * token_stride + kv * head_stride;
#pragma GCC unroll 16
      for (int c = 0; c < kD / 16; ++c) av[c] = _mm512_fmadd_ps(p, load16(v + 16 * c), av[c]);
    }
#pragma GCC unroll 16
    for (int c = 0; c < kD / 16; ++c) _mm512_storeu_ps(ah + 16 * c, av[c]);
  }
}

}  // namespace pagedserve_cpu

#endif  // __AVX512F__
