// Vectorizable math shared by the CPU kernels (included, so each kernel inlines it).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pagedserve_cpu {

inline float float_of_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// e^x in a form the compiler vectorizes (libm's expf is a scalar call): Cody-Waite reduction
// x = n ln2 + r, Cephes' degree-6 polynomial for e^r, 2^n put in the exponent bits. Within a few ulp
// of expf; x is clamped to [-87.3, 88.3] so that 2^n stays a normal float (no inf, no 0). n is rounded
// by adding and subtracting 1.5 * 2^23, which vectorizes everywhere (std::floor needs SSE4.1 to).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.3f), 88.3f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * float_of_bits(static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23);
}

}  // namespace pagedserve_cpu
