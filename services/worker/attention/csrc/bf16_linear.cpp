// bfloat16 projections y = x W^T + b on CPUs with AVX512-BF16's dot-product instruction (vdpbf16ps) and no AMX.
// Built at run time with the other kernels (services/worker/attention/cpu_kernels.py); used by
// services/worker/models/packed_linear.py.
//
// Why not oneDNN, which PackedLinear uses elsewhere: at a decode step's row counts every layer's weights come from
// memory (the step's K/V stream evicts them) and oneDNN's blocked kernels stall on them. Measured on a Zen 4 (2
// threads, the bench workload, benchmarks/projection_shapes.py): the run's projections 11.4-11.8 s against
// oneDNN's 12.7. Alone (benchmarks/cpu_linear.py) it is within a few percent of oneDNN at every size the engine
// runs, faster at the smallest.
//
// The weights are packed once into panels of kPanel output columns: panel p holds columns [p kPanel,
// (p + 1) kPanel) as [K / 2 pairs][kPanel columns][2], so one 64-byte load gives 16 columns' values at input
// dimensions 2k and 2k + 1, the operand vdpbf16ps multiplies with a broadcast pair of x. A panel (K kPanel
// values: 64 KiB at K = 512) is read from start to end, which the hardware prefetchers stream. Output columns
// past N (the last panel's padding) are zero weights, never stored. Each output is accumulated in float32 over
// the input dimensions in pairs, in order, then rounded to bfloat16 (to nearest even) after the bias is added.
// vdpbf16ps counts subnormal inputs (below 1.2e-38) as zero and flushes subnormal sums: no weight or activation of a
// working model is that small.

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

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define PAGEDSERVE_BF16_LINEAR 1
#include <immintrin.h>
#else
#define PAGEDSERVE_BF16_LINEAR 0
#endif

namespace {

constexpr int64_t kPanel = 64;   // output columns a panel: 4 vectors of 16 float32 accumulators per row
constexpr int64_t kRows = 6;     // rows a micro-kernel call: 6 x 4 accumulators + 4 weight vectors + 1 broadcast
constexpr int64_t kRowBlock = 192;  // rows whose x (K values each) a thread keeps in L2 while sweeping the panels

// weight [N, K] bfloat16 -> [ceil(N / kPanel), K / 2, kPanel, 2], columns past N zero.
at::Tensor pack_bf16_linear_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "weight must be a 2-d bfloat16 CPU tensor");
  TORCH_CHECK(weight.size(1) % 2 == 0, "the input dimension must be even, got ", weight.size(1));
  const at::Tensor w = weight.contiguous();
  const int64_t n = w.size(0), k = w.size(1), panels = (n + kPanel - 1) / kPanel;
  at::Tensor packed = at::empty({panels, k / 2, kPanel, 2}, w.options());
  const uint16_t* src = static_cast<const uint16_t*>(w.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(packed.data_ptr());
#pragma omp parallel for
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t pair = 0; pair < k / 2; ++pair) {
      uint16_t* out = dst + (p * (k / 2) + pair) * kPanel * 2;
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t column = p * kPanel + c;
        out[2 * c] = column < n ? src[column * k + 2 * pair] : 0;
        out[2 * c + 1] = column < n ? src[column * k + 2 * pair + 1] : 0;
      }
    }
  }
  return packed;
}

#if PAGEDSERVE_BF16_LINEAR

// Which of vector j's 16 columns lie within the panel's first `cols`.
inline __mmask16 columns_kept(int64_t cols, int j) {
  const int64_t kept = std::clamp<int64_t>(cols - 16 * j, 0, 16);
  return kept == 16 ? __mmask16(0xFFFF) : __mmask16((1u << kept) - 1);
}

// Rows [0, kR) of x (row stride x_stride) times one panel, plus bias (float32, the panel's first; nullptr: none),
// into out's columns [0, cols) (cols <= kPanel).
template <int kR>
inline void panel_rows(const uint16_t* x, int64_t x_stride, const uint16_t* panel, int64_t pairs, const float* bias,
                       c10::BFloat16* out, int64_t out_stride, int64_t cols) {
  __m512 acc[kR][4];
  for (int j = 0; j < 4; ++j) {
    acc[0][j] = bias != nullptr ? _mm512_maskz_loadu_ps(columns_kept(cols, j), bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 1; r < kR; ++r) acc[r][j] = acc[0][j];
  }
  for (int64_t pair = 0; pair < pairs; ++pair) {
    const uint16_t* w = panel + pair * kPanel * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w), w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64), w3 = (__m512bh)_mm512_loadu_si512(w + 96);
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r) {
      int32_t two;  // x's values at 2 pair and 2 pair + 1, as one 32-bit lane
      std::memcpy(&two, x + r * x_stride + 2 * pair, sizeof two);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(two);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xv, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xv, w3);
    }
  }
  for (int r = 0; r < kR; ++r) {
    for (int j = 0; j < 4; ++j) {
      _mm256_mask_storeu_epi16(out + r * out_stride + 16 * j, columns_kept(cols, j),
                               (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
    }
  }
}

// Rows [0, rows) of x times one panel, kRows at a time.
inline void panel_block(const uint16_t* x, int64_t x_stride, int64_t rows, const uint16_t* panel, int64_t pairs,
                        const float* bias, c10::BFloat16* out, int64_t out_stride, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) {
    panel_rows<kRows>(x + r * x_stride, x_stride, panel, pairs, bias, out + r * out_stride, out_stride, cols);
  }
  const uint16_t* xr = x + r * x_stride;
  c10::BFloat16* o = out + r * out_stride;
  switch (rows - r) {
    case 5: panel_rows<5>(xr, x_stride, panel, pairs, bias, o, out_stride, cols); break;
    case 4: panel_rows<4>(xr, x_stride, panel, pairs, bias, o, out_stride, cols); break;
    case 3: panel_rows<3>(xr, x_stride, panel, pairs, bias, o, out_stride, cols); break;
    case 2: panel_rows<2>(xr, x_stride, panel, pairs, bias, o, out_stride, cols); break;
    case 1: panel_rows<1>(xr, x_stride, panel, pairs, bias, o, out_stride, cols); break;
    default: break;
  }
}

#endif

// out [T, N] = x [T, K] (unit stride along K) times the packed weight, plus bias (float32 [N], or none: the
// bias a bfloat16 layer adds, widened once by the caller).
void bf16_linear(at::Tensor out, const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "x must be bfloat16 [tokens, in_features] with unit stride along in_features");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kPanel && packed.size(3) == 2 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(1) * 2 == x.size(1),
              "packed must be pack_bf16_linear_weight's output for in_features = x.shape[1]");
  const int64_t tokens = x.size(0), n = out.size(1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == tokens && out.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
                  n <= panels * kPanel && n > (panels - 1) * kPanel,
              "out must be contiguous bfloat16 [tokens, out_features] for the packed weight's out_features");
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n && bias->is_contiguous() &&
                                     bias->scalar_type() == at::kFloat && bias->device().is_cpu()),
              "bias must be contiguous float32 [out_features] on the CPU");
  for (const at::Tensor* t : {&std::as_const(out), &x, &packed}) TORCH_CHECK(t->device().is_cpu(), "every tensor must be on the CPU");
#if PAGEDSERVE_BF16_LINEAR
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;  // (added before the one rounding)
  const uint16_t* xs = static_cast<const uint16_t*>(x.data_ptr());
  const uint16_t* w = static_cast<const uint16_t*>(packed.data_ptr());
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  const int64_t x_stride = x.stride(0);
  // Each thread takes a share of the panels, for all rows, so that it reads its weights from memory once; where
  // there are fewer panels than threads, the threads of a panel share split the rows.
#pragma omp parallel if (tokens * n * pairs > 16384)
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
          panel_block(xs + first * x_stride, x_stride, rows, w + p * pairs * kPanel * 2, pairs,
                      b == nullptr ? nullptr : b + p * kPanel, o + first * n + p * kPanel, n,
                      std::min(kPanel, n - p * kPanel));
        }
      }
    }
  }
#else
  TORCH_CHECK(false, "bf16_linear needs a build for a CPU with AVX512-BF16 (see has_bf16_linear)");
#endif
}

bool has_bf16_linear() { return PAGEDSERVE_BF16_LINEAR; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedserve_cpu, m) {
  m.def("pack_bf16_linear_weight(Tensor weight) -> Tensor");
  m.def("bf16_linear(Tensor(a!) out, Tensor x, Tensor packed, Tensor? bias) -> ()");
  m.def("has_bf16_linear() -> bool", &has_bf16_linear);  // (no tensor: a kernel for every backend)
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("pack_bf16_linear_weight", &pack_bf16_linear_weight);
  m.impl("bf16_linear", &bf16_linear);
}
