// Fused elementwise layers for CPUs: RMSNorm (optionally with the residual add before it), neox rotary
// embedding, and SiLU-and-mul; also the int8 matmul's row quantization and epilogue, and the sampler's
// greedy argmax (exactly torch.argmax's choice). PyTorch runs each of these as several kernels, every one
// a full pass over memory with its own temporary; here each token's row is read once and written once. Built at run
// time together with cpu_attention.cpp by services/worker/attention/cpu_kernels.py.
//
// Each op reproduces the arithmetic of the PyTorch code in services/worker/models/layers.py (the Hugging
// Face order): the same operations per element, and the same roundings to bfloat16/float16 between
// them. The one difference is RMSNorm's sum of squares, whose summation order differs from torch's
// (last-bit differences). Rows are dealt out to torch's own OpenMP pool (the extension links the
// libgomp torch already loaded).

#include <ATen/core/Tensor.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

// No fused multiply-adds in this file: torch rounds every product before the add that follows it
// (q * cos + rotate_half(q) * sin is three kernels), and an FMA would skip that rounding.
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
// Jump threading copies what follows exp_clamped's clamp into each of its arms, and the vectorizer then
// computes every arm on every lane: SiLU's clamped arm, gate / (1 + e^88.3), is a subnormal for nearly
// every gate, and subnormals take the slow path. Without it SiLU-and-mul runs 3x faster (Zen 4, AVX-512).
#pragma GCC optimize("no-thread-jumps")
#endif

// After the pragma, so the shared math is compiled (and inlined) under the same rule.
#include "vec_math.h"

namespace {

using pagedserve_cpu::exp_clamped;
using pagedserve_cpu::float_of_bits;

// Below this many elements a single thread is faster than waking the pool (torch's own grain size).
constexpr int64_t kParallelGrain = 32768;

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}


// How each dtype is stored and converted to and from float. The conversions work on the bits without
// branches, so loops over them vectorize (c10::BFloat16 and c10::Half convert through structs and
// scalar intrinsics that GCC leaves scalar); both round to nearest even, as torch does.
struct Float32 {
  using Storage = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

struct BFloat16 {
  using Storage = uint16_t;
  static float load(uint16_t x) { return float_of_bits(static_cast<uint32_t>(x) << 16); }
  static uint16_t store(float x) {  // c10::BFloat16's rounding; NaN stays NaN
    const uint32_t u = bits_of(x);
    return std::isnan(x) ? uint16_t{0x7FC0} : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

// IEEE half <-> float without F16C, as c10 (after Maratyszcza's FP16 library) does where F16C is missing.
struct Float16 {
  using Storage = uint16_t;
  static float load(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
    const float normalized = float_of_bits((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float denormalized = float_of_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    return float_of_bits(sign | (two_w < (1u << 27) ? bits_of(denormalized) : bits_of(normalized)));
  }
  static uint16_t store(float x) {
    float base = (std::fabs(x) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = bits_of(x), shl1_w = w + w, sign = w & 0x80000000u;
    const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
    base = float_of_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t b = bits_of(base);
    const uint32_t nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
  }
};

// x rounded to the format and back: where torch stores an intermediate result in it (no-op for float).
template <typename Fmt>
inline float round_to(float x) { return Fmt::load(Fmt::store(x)); }

template <typename Fmt>
inline typename Fmt::Storage* data(const at::Tensor& t) {
  return static_cast<typename Fmt::Storage*>(t.data_ptr());
}

// Calls f(Fmt{}) with Fmt the format of `dtype`.
template <typename F>
void dispatch_float_types(at::ScalarType dtype, const char* op, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(Float32{});
    case at::kBFloat16: return f(BFloat16{});
    case at::kHalf: return f(Float16{});
    default: TORCH_CHECK(false, op, " supports float32, bfloat16 and float16, not ", dtype);
  }
}

// ---- RMSNorm ------------------------------------------------------------------------------------

// out = weight * T(x * rsqrt(mean(x^2) + eps)), the normalisation in float; x, weight, out of length n.
template <typename Fmt, typename S = typename Fmt::Storage>
inline void rms_norm_row(S* out, const S* x, const S* weight, int64_t n, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t d = 0; d < n; ++d) {
    const float v = Fmt::load(x[d]);
    sum += v * v;
  }
  const float inv_rms = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);  // torch's rsqrt is 1/sqrt
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) {
    out[d] = Fmt::store(Fmt::load(weight[d]) * round_to<Fmt>(Fmt::load(x[d]) * inv_rms));
  }
}

// Offset of row r of a tensor [..., n] with unit stride along n: r split over the leading dimensions.
inline int64_t row_offset(c10::IntArrayRef sizes, c10::IntArrayRef strides, int64_t r) {
  int64_t offset = 0;
  for (int64_t dim = static_cast<int64_t>(sizes.size()) - 2; dim >= 0; --dim) {
    offset += (r % sizes[dim]) * strides[dim];
    r /= sizes[dim];
  }
  return offset;
}

void check_norm(const at::Tensor& out, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, "x needs unit stride along its last dimension");
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous(), "out must be contiguous, shaped like x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1) && weight.is_contiguous(),
              "weight must be contiguous [hidden] with hidden = x.shape[-1]");
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "out, x and weight must share one dtype");
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu() && weight.device().is_cpu(),
              "every tensor must be on the CPU");
}

void rms_norm(at::Tensor out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(out, x, weight);
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  const bool contiguous = x.is_contiguous();
  const c10::IntArrayRef sizes = x.sizes(), strides = x.strides();
  dispatch_float_types(x.scalar_type(), "rms_norm", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const auto* src = data<Fmt>(x);
    const auto* w = data<Fmt>(weight);
    auto* dst = data<Fmt>(out);
#pragma omp parallel for if (rows * n > kParallelGrain)
    for (int64_t r = 0; r < rows; ++r) {
      const auto* row = src + (contiguous ? r * n : row_offset(sizes, strides, r));
      rms_norm_row<Fmt>(dst + r * n, row, w, n, static_cast<float>(eps));
    }
  });
}

// residual = residual + x (rounded to the dtype, as torch's add), then out = rms_norm(residual).
void fused_add_rms_norm(at::Tensor out, const at::Tensor& x, at::Tensor residual, const at::Tensor& weight,
                        double eps) {
  check_norm(out, x, weight);
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type() && residual.device().is_cpu(),
              "x and residual must be contiguous CPU tensors of one shape and dtype");
  const int64_t n = x.size(-1), rows = n == 0 ? 0 : x.numel() / n;
  dispatch_float_types(x.scalar_type(), "fused_add_rms_norm", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const auto* src = data<Fmt>(x);
    const auto* w = data<Fmt>(weight);
    auto* res = data<Fmt>(residual);
    auto* dst = data<Fmt>(out);
#pragma omp parallel for if (rows * n > kParallelGrain)
    for (int64_t r = 0; r < rows; ++r) {
      auto* res_row = res + r * n;
      const auto* x_row = src + r * n;
#pragma omp simd
      for (int64_t d = 0; d < n; ++d) res_row[d] = Fmt::store(Fmt::load(res_row[d]) + Fmt::load(x_row[d]));
      rms_norm_row<Fmt>(dst + r * n, res_row, w, n, static_cast<float>(eps));
    }
  });
}

// ---- rotary embedding ---------------------------------------------------------------------------

// One head in place, neox style: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1), with
// each product and the sum rounded to the dtype as torch's separate kernels round them.
template <typename Fmt, typename S = typename Fmt::Storage>
inline void rotate_head(S* x, const S* cos, const S* sin, int64_t half) {
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = Fmt::load(x[i]), x2 = Fmt::load(x[i + half]);
    const float lo = round_to<Fmt>(x1 * Fmt::load(cos[i])) + round_to<Fmt>(-x2 * Fmt::load(sin[i]));
    const float hi = round_to<Fmt>(x2 * Fmt::load(cos[i + half])) + round_to<Fmt>(x1 * Fmt::load(sin[i + half]));
    x[i] = Fmt::store(lo);
    x[i + half] = Fmt::store(hi);
  }
}

void check_rotary(const at::Tensor& positions, const at::Tensor& query, const at::Tensor& key,
                  const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && key.size(0) == query.size(0) && key.size(2) == query.size(2),
              "query and key must be [tokens, heads, head_dim] and [tokens, kv_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && key.stride(2) == 1, "query and key need unit stride along head_dim");
  TORCH_CHECK(query.size(2) % 2 == 0, "head_dim must be even");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == query.size(0) && positions.is_contiguous() &&
                  positions.scalar_type() == at::kLong,
              "positions must be contiguous int64 [tokens]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) == query.size(2) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous [max_positions, head_dim]");
  TORCH_CHECK(key.scalar_type() == query.scalar_type() && cos.scalar_type() == query.scalar_type() &&
                  sin.scalar_type() == query.scalar_type(),
              "query, key, cos and sin must share one dtype");
  for (const auto* t : {&positions, &query, &key, &cos, &sin}) {
    TORCH_CHECK(t->device().is_cpu(), "every tensor must be on the CPU");
  }
}

void rotary_embedding(const at::Tensor& positions, at::Tensor query, at::Tensor key, const at::Tensor& cos,
                      const at::Tensor& sin) {
  check_rotary(positions, query, key, cos, sin);
  const int64_t tokens = query.size(0), heads = query.size(1), kv_heads = key.size(1);
  const int64_t head_dim = query.size(2), half = head_dim / 2, max_positions = cos.size(0);
  const int64_t q_token = query.stride(0), q_head = query.stride(1), k_token = key.stride(0), k_head = key.stride(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {  // before the parallel loop: an exception cannot leave it
    TORCH_CHECK_INDEX(pos[t] >= 0 && pos[t] < max_positions, "position ", pos[t], " is outside the rotary table (",
                      max_positions, " positions)");
  }
  dispatch_float_types(query.scalar_type(), "rotary_embedding", [&](auto fmt) {
    using Fmt = decltype(fmt);
    auto* q = data<Fmt>(query);
    auto* k = data<Fmt>(key);
    const auto* cos_table = data<Fmt>(cos);
    const auto* sin_table = data<Fmt>(sin);
#pragma omp parallel for if (tokens * (heads + kv_heads) * head_dim > kParallelGrain)
    for (int64_t t = 0; t < tokens; ++t) {
      const auto* c = cos_table + pos[t] * head_dim;
      const auto* s = sin_table + pos[t] * head_dim;
      for (int64_t h = 0; h < heads; ++h) rotate_head<Fmt>(q + t * q_token + h * q_head, c, s, half);
      for (int64_t h = 0; h < kv_heads; ++h) rotate_head<Fmt>(k + t * k_token + h * k_head, c, s, half);
    }
  });
}

// ---- SiLU and mul -------------------------------------------------------------------------------

// out = T(silu(gate)) * up, gate_up [tokens, 2I] = [gate | up]: silu(x) = x / (1 + e^-x) in float,
// rounded to the dtype T, then the product rounded to T (torch's silu kernel, then its mul kernel).
void silu_and_mul(at::Tensor out, const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "gate_up must be [tokens, 2 * intermediate] with unit stride along its last dimension");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && out.size(1) * 2 == gate_up.size(1) &&
                  out.is_contiguous(),
              "out must be contiguous [tokens, intermediate]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "out and gate_up must share one dtype");
  TORCH_CHECK(out.device().is_cpu() && gate_up.device().is_cpu(), "every tensor must be on the CPU");
  const int64_t tokens = out.size(0), width = out.size(1), row_stride = gate_up.stride(0);
  dispatch_float_types(gate_up.scalar_type(), "silu_and_mul", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const auto* src = data<Fmt>(gate_up);
    auto* dst = data<Fmt>(out);
#pragma omp parallel for if (tokens * width > kParallelGrain)
    for (int64_t t = 0; t < tokens; ++t) {
      const auto* gate = src + t * row_stride;
      const auto* up = gate + width;
      auto* o = dst + t * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float g = Fmt::load(gate[i]);
        o[i] = Fmt::store(round_to<Fmt>(g / (1.f + exp_clamped(-g))) * Fmt::load(up[i]));
      }
    }
  });
}

// ---- Per-token int8 quantization (W8A8) -----------------------------------------------------------

// For oneDNN's int8 matmul, which takes unsigned activations with a zero point of 128: each row of x
// [tokens, n] scaled so its largest magnitude is 127, scale = max(amax / 127, 1e-12) (float32), or by
// static_scale where it is positive (a checkpoint's calibrated one), codes = clamp(round_half_even(x /
// scale), -127, 127) + 128. What int8_linear.quantize_per_token computes (then shifted), in one pass per
// row instead of ten kernels: x / scale is a true division, as torch's.
void quantize_rows_uint8(at::Tensor codes, at::Tensor scales, const at::Tensor& x, double static_scale) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, n] with unit stride along n");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.sizes() == x.sizes(),
              "codes must be contiguous uint8, shaped like x");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == x.size(0),
              "scales must be contiguous float32 [tokens, 1]");
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "every tensor must be on the CPU");
  const int64_t tokens = x.size(0), n = x.size(1), row_stride = x.stride(0);
  dispatch_float_types(x.scalar_type(), "quantize_rows_uint8", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const auto* src = data<Fmt>(x);
    auto* out = codes.data_ptr<uint8_t>();
    auto* row_scales = scales.data_ptr<float>();
#pragma omp parallel for if (tokens * n > kParallelGrain)
    for (int64_t t = 0; t < tokens; ++t) {
      const auto* row = src + t * row_stride;
      float amax = 0.f;
      if (static_scale <= 0) {
#pragma omp simd reduction(max : amax)
        for (int64_t i = 0; i < n; ++i) {
          amax = std::max(amax, std::fabs(Fmt::load(row[i])));
        }
      }
      const float scale = static_scale > 0 ? static_cast<float>(static_scale) : std::max(amax / 127.f, 1e-12f);
      row_scales[t] = scale;
      auto* o = out + t * n;
      // Clamped first (rounding then clamping to +-127 gives the same), then rounded half to even by
      // adding and taking away 1.5 * 2^23, where a float has no fraction bits left: unlike nearbyint, it
      // vectorizes.
      constexpr float kRound = 12582912.f;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float v = std::min(std::max(Fmt::load(row[i]) / scale, -127.f), 127.f);
        o[i] = static_cast<uint8_t>(static_cast<int32_t>((v + kRound) - kRound) + 128);
      }
    }
  });
}

// out = T(acc * row_scales[t] + bias): the int8 matmul's float32 product scaled by each token's activation
// scale (none given: 1, a static scale oneDNN applied), the bias added in float32, rounded once to out's
// dtype. What PyTorch's mul_, add_ and .to() do in three passes (and a temporary), in one; the multiply and
// the add may fuse into one rounding here.
void int8_epilogue(at::Tensor out, const at::Tensor& acc, const c10::optional<at::Tensor>& row_scales,
                   const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(acc.scalar_type() == at::kFloat && acc.dim() == 2 && acc.is_contiguous(),
              "acc must be contiguous float32 [tokens, n]");
  TORCH_CHECK(out.sizes() == acc.sizes() && out.is_contiguous(), "out must be contiguous, shaped like acc");
  const int64_t tokens = acc.size(0), n = acc.size(1);
  TORCH_CHECK(!row_scales || (row_scales->scalar_type() == at::kFloat && row_scales->is_contiguous() &&
                              row_scales->numel() == tokens),
              "row_scales must be contiguous float32 [tokens, 1]");
  TORCH_CHECK(!bias || (bias->scalar_type() == out.scalar_type() && bias->is_contiguous() && bias->numel() == n),
              "bias must be contiguous [n] of out's dtype");
  dispatch_float_types(out.scalar_type(), "int8_epilogue", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const float* src = acc.data_ptr<float>();
    const float* scales = row_scales ? row_scales->data_ptr<float>() : nullptr;
    const auto* b = bias ? data<Fmt>(*bias) : nullptr;
    auto* dst = data<Fmt>(out);
#pragma omp parallel for if (tokens * n > kParallelGrain)
    for (int64_t t = 0; t < tokens; ++t) {
      const float scale = scales ? scales[t] : 1.f;
      const float* row = src + t * n;
      auto* o = dst + t * n;
      if (b) {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = Fmt::store(row[i] * scale + Fmt::load(b[i]));
      } else {
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) o[i] = Fmt::store(row[i] * scale);
      }
    }
  });
}

// ---- Greedy argmax -------------------------------------------------------------------------------

// Whether x is the value a row's argmax looks for: its largest value, or (a row holding one) NaN, which
// torch.argmax orders above everything.
template <bool kNan>
inline bool is_target(float x, float largest) { return kNan ? x != x : x == largest; }

// The first position in x[0, n) holding the target: chunks a vector loop can test, then one scalar scan.
template <bool kNan, typename Fmt, typename S = typename Fmt::Storage>
int64_t first_target(const S* x, int64_t n, float largest) {
  constexpr int64_t kChunk = 256;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(n, start + kChunk);
    int hits = 0;
#pragma omp simd reduction(+ : hits)
    for (int64_t i = start; i < end; ++i) hits += is_target<kNan>(Fmt::load(x[i]), largest);
    if (hits) {
      for (int64_t i = start; i < end; ++i) {
        if (is_target<kNan>(Fmt::load(x[i]), largest)) return i;
      }
    }
  }
  return 0;  // not reached: the row's largest value (or its NaN) is in it
}

// torch.argmax of one row x[0, n), n > 0: the first of equal largest values, or the first NaN.
template <typename Fmt, typename S = typename Fmt::Storage>
int64_t argmax_row(const S* x, int64_t n) {
  float largest = -std::numeric_limits<float>::infinity();
  int nans = 0;
#pragma omp simd reduction(max : largest) reduction(+ : nans)
  for (int64_t i = 0; i < n; ++i) {
    const float v = Fmt::load(x[i]);
    largest = std::max(largest, v);  // a NaN may or may not win here: counted apart
    nans += v != v;
  }
  return nans ? first_target<true, Fmt>(x, n, largest) : first_target<false, Fmt>(x, n, largest);
}

// out[r] = argmax of row r of scores [rows, n] (n > 0, unit stride along n): the sampler's greedy tokens,
// read straight from the logits in the model's dtype (no float32 copy), the rows shared across threads.
void argmax_rows(at::Tensor out, const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0 && scores.stride(1) == 1,
              "scores must be [rows, n] with n > 0 and unit stride along n");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.size(0) == scores.size(0) &&
                  out.is_contiguous(),
              "out must be contiguous int64 [rows]");
  TORCH_CHECK(out.device().is_cpu() && scores.device().is_cpu(), "every tensor must be on the CPU");
  const int64_t rows = scores.size(0), n = scores.size(1), row_stride = scores.stride(0);
  dispatch_float_types(scores.scalar_type(), "argmax_rows", [&](auto fmt) {
    using Fmt = decltype(fmt);
    const auto* src = data<Fmt>(scores);
    int64_t* dst = out.data_ptr<int64_t>();
#pragma omp parallel for if (rows * n > kParallelGrain)
    for (int64_t r = 0; r < rows; ++r) dst[r] = argmax_row<Fmt>(src + r * row_stride, n);
  });
}

}  // namespace

// A fragment: cpu_attention.cpp holds the namespace's TORCH_LIBRARY block.
TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("rms_norm(Tensor(a!) out, Tensor x, Tensor weight, float eps) -> ()");
  m.def("fused_add_rms_norm(Tensor(a!) out, Tensor x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor gate_up) -> ()");
  m.def("quantize_rows_uint8(Tensor(a!) codes, Tensor(b!) scales, Tensor x, float static_scale) -> ()");
  m.def("int8_epilogue(Tensor(a!) out, Tensor acc, Tensor? row_scales, Tensor? bias) -> ()");
  m.def("argmax_rows(Tensor(a!) out, Tensor scores) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("quantize_rows_uint8", &quantize_rows_uint8);
  m.impl("int8_epilogue", &int8_epilogue);
  m.impl("argmax_rows", &argmax_rows);
}
