// Projections y = x W^T + b in float32 (AVX-512 or AVX2 FMA) and bfloat16 (AVX512-BF16's vdpbf16ps) on weights
// packed in panels. Built at run time with the other kernels (services/worker/attention/cpu_kernels.py); used by
// services/worker/models/packed_linear.py on CPUs where it was measured faster than oneDNN (its docstring says
// which).
//
// Why not oneDNN, which PackedLinear uses elsewhere: at a decode step's row counts every layer's weights come from
// memory (the step's K/V stream evicts them) and oneDNN's blocked kernels stall on them. Measured on a Zen 4 (2
// threads, the bench workload, benchmarks/projection_shapes.py): the run's bfloat16 projections 11.4-11.8 s
// against oneDNN's 12.7. Alone (benchmarks/cpu_linear.py) it is within a few percent of oneDNN at every size the
// engine runs, faster at the smallest. The AVX2 build (float32 only) ran the bench workload 7 % faster than oneDNN
// on a Zen 4 whose AVX-512 the hypervisor hid.
//
// The weights are packed once into panels of kPanel output columns: panel p holds columns [p kPanel,
// (p + 1) kPanel) as [K / G groups][kPanel columns][G], G the input dimensions one 32-bit lane holds (float32 1,
// bfloat16 2: the pair vdpbf16ps multiplies with a broadcast pair of x). One vector load gives kLanes columns of
// a group. kPanel is what the registers allow: 64 columns with AVX-512's 32, 16 with AVX2's 16. A panel (K kPanel
// values: 32-128 KiB at K = 512) is read from start to end, which the hardware prefetchers stream. Columns past N
// (the last panel's padding) are zero weights, never stored. Each output is accumulated in
// float32, from its bias, over the input dimensions in order (bfloat16: in pairs), then rounded once to the output
// dtype (bfloat16: to nearest even). vdpbf16ps counts subnormal inputs (below 1.2e-38) as zero and flushes
// subnormal sums: no weight or activation of a working model is that small.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "simd.h"

namespace {

#if PAGEDSERVE_SIMD
namespace simd = pagedserve_cpu::simd;
// Vectors of accumulators a row: kRows x kVectors accumulators, kVectors weight vectors and one broadcast fill the
// registers (AVX-512: 24 + 4 + 1 of 32; AVX2: 12 + 2 + 1 of 16).
constexpr int64_t kVectors = simd::kRegisters == 32 ? 4 : 2;
constexpr int64_t kPanel = kVectors * simd::kLanes;  // output columns a panel
#else
constexpr int64_t kPanel = 64;  // (packing only: this build has no kernel)
#endif
constexpr int64_t kRows = 6;        // rows a micro-kernel call
constexpr int64_t kRowBlock = 192;  // rows whose x (K values each) a thread keeps in L2 while sweeping the panels

// Input dimensions a 32-bit lane of a packed panel holds.
inline int64_t group_of(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

bool has_panel_linear(at::ScalarType dtype) {
#if PAGEDSERVE_SIMD
  if (dtype == at::kFloat) return true;
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
  return false;
}

// weight [N, K] -> [ceil(N / kPanel), K / G, kPanel, G], columns past N zero.
template <typename S>
void pack_panels(S* dst, const S* src, int64_t n, int64_t k, int64_t group) {
  const int64_t panels = (n + kPanel - 1) / kPanel;
#pragma omp parallel for
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t g = 0; g < k / group; ++g) {
      S* out = dst + (p * (k / group) + g) * kPanel * group;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t column = p * kPanel + c;
        for (int64_t j = 0; j < group; ++j) out[c * group + j] = column < n ? src[column * k + g * group + j] : S{0};
      }
    }
  }
}

at::Tensor pack_panel_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.device().is_cpu() &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be a 2-d float32 or bfloat16 CPU tensor");
  const int64_t group = group_of(weight.scalar_type());
  TORCH_CHECK(weight.size(1) % group == 0, "a bfloat16 weight's input dimension must be even, got ", weight.size(1));
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1);
  at::Tensor packed = at::empty({(n + kPanel - 1) / kPanel, k / group, kPanel, group}, w.options());
  if (group == 2) {
    pack_panels(static_cast<uint16_t*>(packed.data_ptr()), static_cast<const uint16_t*>(w.data_ptr()), n, k, group);
  } else {
    pack_panels(packed.data_ptr<float>(), w.data_ptr<float>(), n, k, group);
  }
  return packed;
}

#if PAGEDSERVE_SIMD

// How many of vector j's kLanes columns lie within the panel's first `cols`.
inline int64_t columns_kept(int64_t cols, int64_t j) { return cols - simd::kLanes * j; }

// How a dtype's group of input dimensions multiplies: W, kLanes columns of a group (one vector load, kValues
// values); X, a row's group broadcast to every lane; multiply_add, acc += X W over the group.
template <typename T>
struct Lanes;

template <>
struct Lanes<float> {
  using W = simd::Vec;
  static constexpr int64_t kValues = simd::kLanes;
  static W load(const float* w) { return simd::load(w); }
  static W broadcast(const float* x, int64_t g) { return simd::broadcast(x[g]); }
  static simd::Vec multiply_add(simd::Vec acc, W x, W w) { return simd::fmadd(x, w, acc); }
};

#if defined(__AVX512BF16__)
template <>
struct Lanes<c10::BFloat16> {
  using W = __m512bh;
  static constexpr int64_t kValues = 32;
  static W load(const c10::BFloat16* w) { return (__m512bh)_mm512_loadu_si512(w); }
  static W broadcast(const c10::BFloat16* x, int64_t g) {
    int32_t two;  // x's values at 2 g and 2 g + 1, as one 32-bit lane
    std::memcpy(&two, x + 2 * g, sizeof two);
    return (__m512bh)_mm512_set1_epi32(two);
  }
  static __m512 multiply_add(__m512 acc, W x, W w) { return _mm512_dpbf16_ps(acc, x, w); }
};
#endif

inline void store_columns(float* out, int64_t kept, simd::Vec v) { simd::store_first(out, v, kept); }
#if defined(__AVX512BF16__)
inline void store_columns(c10::BFloat16* out, int64_t kept, __m512 v) {
  _mm256_mask_storeu_epi16(out, simd::first_lanes(kept), (__m256i)_mm512_cvtneps_pbh(v));
}
#endif

// Rows [0, kR) of x (row stride x_stride) times one panel of `groups` groups, plus bias (float32, the panel's
// first; nullptr: none), into out's columns [0, cols) (cols <= kPanel).
template <int kR, typename T>
inline void panel_rows(const T* x, int64_t x_stride, const T* panel, int64_t groups, const float* bias, T* out,
                       int64_t out_stride, int64_t cols) {
  using L = Lanes<T>;
  simd::Vec acc[kR][kVectors];
#pragma GCC unroll 4
  for (int j = 0; j < kVectors; ++j) {
    acc[0][j] = bias != nullptr ? simd::load_first(bias + simd::kLanes * j, columns_kept(cols, j)) : simd::zero();
#pragma GCC unroll 6
    for (int r = 1; r < kR; ++r) acc[r][j] = acc[0][j];
  }
  for (int64_t g = 0; g < groups; ++g) {
    const T* w = panel + g * kVectors * L::kValues;
    typename L::W wv[kVectors];
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) wv[j] = L::load(w + j * L::kValues);
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r) {
      const typename L::W xv = L::broadcast(x + r * x_stride, g);
#pragma GCC unroll 4
      for (int j = 0; j < kVectors; ++j) acc[r][j] = L::multiply_add(acc[r][j], xv, wv[j]);
    }
  }
  for (int r = 0; r < kR; ++r) {
#pragma GCC unroll 4
    for (int j = 0; j < kVectors; ++j) {
      store_columns(out + r * out_stride + simd::kLanes * j, columns_kept(cols, j), acc[r][j]);
    }
  }
}

// Rows [0, rows) of x times one panel, kRows at a time.
template <typename T>
inline void panel_block(const T* x, int64_t x_stride, int64_t rows, const T* panel, int64_t groups,
                        const float* bias, T* out, int64_t out_stride, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    panel_rows<kRows>(x + r * x_stride, x_stride, panel, groups, bias, out + r * out_stride, out_stride, cols);
  }
  const T* xr = x + r * x_stride;
  T* o = out + r * out_stride;
  switch (rows - r) {
    case 5: panel_rows<5>(xr, x_stride, panel, groups, bias, o, out_stride, cols); break;
    case 4: panel_rows<4>(xr, x_stride, panel, groups, bias, o, out_stride, cols); break;
    case 3: panel_rows<3>(xr, x_stride, panel, groups, bias, o, out_stride, cols); break;
    case 2: panel_rows<2>(xr, x_stride, panel, groups, bias, o, out_stride, cols); break;
    case 1: panel_rows<1>(xr, x_stride, panel, groups, bias, o, out_stride, cols); break;
    default: break;
  }
}

// Each thread takes a share of the panels, for all rows, so that it reads its weights from memory once; where
// there are fewer panels than threads, the threads of a panel share split the rows.
template <typename T>
void multiply(T* out, const T* x, int64_t x_stride, const T* weights, const float* bias, int64_t tokens, int64_t n,
              int64_t groups, int64_t panels) {
  const int64_t panel_values = groups * kVectors * Lanes<T>::kValues;  // (a group: the loads panel_rows makes)
#pragma omp parallel if (tokens * n * groups > 16384)
  {
    const int64_t threads = omp_get_num_threads(), thread = omp_get_thread_num();
    const int64_t panel_shares = std::min(threads, panels), row_shares = threads / panel_shares;
    if (thread < panel_shares * row_shares) {
      const int64_t share = thread % panel_shares, rows_share = thread / panel_shares;
      const int64_t first_panel = share * panels / panel_shares, end_panel = (share + 1) * panels / panel_shares;
      const int64_t end_row = (rows_share + 1) * tokens / row_shares;
      for (int64_t first = rows_share * tokens / row_shares; first < end_row; first += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, end_row - first);
        for (int64_t p = first_panel; p < end_panel; ++p) {
          panel_block(x + first * x_stride, x_stride, rows, weights + p * panel_values, groups,
                      bias == nullptr ? nullptr : bias + p * kPanel, out + first * n + p * kPanel, n,
                      std::min(kPanel, n - p * kPanel));
        }
      }
    }
  }
}

#endif

// out [T, N] = x [T, K] (unit stride along K) times the packed weight of x's dtype, plus bias (float32 [N], or
// none: a bfloat16 layer's bias widened once by the caller).
void panel_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(has_panel_linear(dtype), "panel_linear has no kernel for ", dtype, " in this build (has_panel_linear)");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [tokens, in_features] with unit stride along in_features");
  const int64_t group = group_of(dtype);
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == group && packed.is_contiguous() &&
                  packed.scalar_type() == dtype && packed.size(1) * group == x.size(1),
              "packed must be pack_panel_weight's output for x's dtype and in_features");
  const int64_t tokens = x.size(0), n = out.size(1), panels = packed.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == tokens && out.is_contiguous() && out.scalar_type() == dtype &&
                  n <= panels * kPanel && n > (panels - 1) * kPanel,
              "out must be contiguous [tokens, out_features] of x's dtype, for the packed weight's out_features");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                                     bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "bias must be contiguous float32 [out_features] on the CPU");
  for (const at::Tensor* t : {&std::as_const(out), &x, &packed}) {
    TORCH_CHECK(t->device().is_cpu(), "every tensor must be on the CPU");
  }
#if PAGEDSERVE_SIMD
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  if (dtype == at::kFloat) {
    multiply(out.data_ptr<float>(), x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), b, tokens, n,
             packed.size(1), panels);
  }
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) {
    multiply(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), x.stride(0),
             packed.data_ptr<c10::BFloat16>(), b, tokens, n, packed.size(1), panels);
  }
#endif
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("pack_panel_weight(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("has_panel_linear(ScalarType dtype) -> bool", &has_panel_linear);  // (no tensor: for every backend)
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("pack_panel_weight", &pack_panel_weight);
  m.impl("panel_linear", &panel_linear);
}
