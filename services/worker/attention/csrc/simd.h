// One vector of float32 lanes for the CPU kernels' hand-written inner loops, on whichever x86 vector unit the
// build targets (-march=native): AVX-512 (16 lanes, 32 registers) or AVX2 with FMA (8 lanes, 16 registers).
// AVX2 matters because AMD's server CPUs before Zen 4, and many cloud machines with them, have no AVX-512.
// PAGEDSERVE_SIMD is 0 on any other CPU; the kernels keep scalar loops (which the compiler vectorizes) for it.
#pragma once

#if defined(__AVX512F__)
#define PAGEDSERVE_SIMD 512
#elif defined(__AVX2__) && defined(__FMA__)
#define PAGEDSERVE_SIMD 256
#else
#define PAGEDSERVE_SIMD 0
#endif

#if PAGEDSERVE_SIMD

#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace pagedserve_cpu::simd {

#if PAGEDSERVE_SIMD == 512

using Vec = __m512;
constexpr int kLanes = 16;
constexpr int kRegisters = 32;

inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  // A bfloat16 is the high half of a float32: widen to 32 bits, shift into place.
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
// 2 x kLanes bfloat16 in one load, as two vectors: the even-indexed values (each shifted into its float's high
// half) and the odd-indexed ones (already there: a pair is one 32-bit lane, the odd value its high half). Two
// integer operations for 2 x kLanes values, where load() takes two per kLanes.
inline void load_split(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m512i raw = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float reduce_add(Vec v) { return _mm512_reduce_add_ps(v); }

// The mask of the first `kept` lanes (clamped to 0 .. kLanes).
inline __mmask16 first_lanes(int64_t kept) {
  const int64_t n = std::clamp<int64_t>(kept, 0, kLanes);
  return n == kLanes ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}
// v's lanes from `first` on (clamped to 0 .. kLanes), the others `fill`.
inline Vec keep_from(Vec v, int64_t first, float fill) {
  return _mm512_mask_blend_ps(first_lanes(first), v, _mm512_set1_ps(fill));
}
// The first `kept` lanes (clamped to 0 .. kLanes) from p, zero in the others; nothing past them is read.
inline Vec load_first(const float* p, int64_t kept) { return _mm512_maskz_loadu_ps(first_lanes(kept), p); }
// v's first `kept` lanes to p; the memory past them is left as it is.
inline void store_first(float* p, Vec v, int64_t kept) { _mm512_mask_storeu_ps(p, first_lanes(kept), v); }

#else  // AVX2

using Vec = __m256;
constexpr int kLanes = 8;
constexpr int kRegisters = 16;

inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline void load_split(const c10::BFloat16* p, Vec& even, Vec& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(float x) { return _mm256_set1_ps(x); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float reduce_add(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

inline __m256i first_lanes(int64_t kept) {  // (a lane is kept where its sign bit is set)
  const int32_t n = static_cast<int32_t>(std::clamp<int64_t>(kept, 0, kLanes));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline Vec keep_from(Vec v, int64_t first, float fill) {
  return _mm256_blendv_ps(v, _mm256_set1_ps(fill), _mm256_castsi256_ps(first_lanes(first)));
}
// (vmaskmovps is slow on AMD's cores, so whole vectors take the plain load and store)
inline Vec load_first(const float* p, int64_t kept) {
  return kept >= kLanes ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, first_lanes(kept));
}
inline void store_first(float* p, Vec v, int64_t kept) {
  if (kept >= kLanes) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, first_lanes(kept), v);
  }
}

#endif

// Two vectors from the 2 x kLanes values at p, in the order split_position gives: float32 in order (two loads);
// bfloat16 its even-indexed values, then its odd-indexed ones (load_split).
inline void load_two(const float* p, Vec& first, Vec& second) {
  first = load(p);
  second = load(p + kLanes);
}
inline void load_two(const c10::BFloat16* p, Vec& first, Vec& second) { load_split(p, first, second); }

// Where value d of a row of T sits once load_two has read the row, 2 x kLanes values at a time: float32's in
// place; bfloat16's within its chunk of 2 x kLanes, the even ones first.
template <typename T>
constexpr int64_t split_position(int64_t d) {
  if constexpr (std::is_same_v<T, float>) {
    return d;
  } else {
    const int64_t chunk = d - d % (2 * kLanes), r = d % (2 * kLanes);
    return chunk + (r % 2) * kLanes + r / 2;
  }
}

}  // namespace pagedserve_cpu::simd

#endif  // PAGEDSERVE_SIMD
