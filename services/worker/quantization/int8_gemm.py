"""A W8A8 int8 GEMM for GPUs (Triton): ``y = x @ W.T`` with both operands held as int8 codes, the integer
product accumulated exactly in int32 by the tensor cores (int8 x int8 -> int32 MMA, sm_80 and later), the
scales applied once per output element afterwards. What ``Int8Linear`` (models/int8_linear.py) runs on CUDA.

The layout is compressed-tensors' W8A8 int8 scheme, as the loader leaves it (nothing repacked):

    weight        [N, K] int8: symmetric codes in -128..127 (the format writes -128), output-major, so that
                  fused q/k/v and gate/up are consecutive rows
    weight_scale  [N, 1] float32: one scale per output row
    codes         [M, K] int8: the activations quantized per token at run time (``quantize_per_token``)
    row_scales    [M, 1] float32: one scale per token

and ``y[t, n] = row_scales[t] * weight_scale[n] * sum_k codes[t, k] * weight[n, k] (+ bias[n])``, the sum
exact in int32 (|sum| <= 128 * 128 * K: no overflow below K = 131072), the scales and bias applied in
float32 in the epilogue, then one rounding to the output dtype: the float32 result is the exact one to
float32 rounding, as int8_linear's ``w8a8_reference`` in float64 says.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.block_moves import require
from services.worker.models.int8_linear import quantize_per_token

OUT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# BLOCK_M 16: decode batches are a few tokens, and the weight tile is what costs. BLOCK_K 128: a 128-byte row of
# int8 codes per load, four k-steps of the int8 MMA (k = 32). Shared memory at three stages: 3 x (16 + 64) x 128 B.
BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 128


# M (the step's token count) changes with every batch: a binary of its own for the counts divisible by 16 (or
# for 1) would compile in the middle of serving.
#
# No interpreter flag (unlike wna16_gemm's DOT_FP32): Triton's interpreter (3.9) computes an int8 x int8 dot with
# an int32 accumulator as ``np.matmul(a, b, dtype=int32) + acc``, i.e. in int32, exactly, as the GPU does; the
# tests check it with full-range codes (-128 included) whose sums overflow int16 and float16, and with unit
# scales, where the output must equal the integer product bit for bit. The interpreted tests run this arithmetic.
@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    codes_ptr,  # [M, K] int8: the activations' per-token codes
    row_scales_ptr,  # [M, 1] float32: each token's scale
    weight_ptr,  # [N, K] int8: the weight's codes, output-major
    weight_scale_ptr,  # [N, 1] float32: each output row's scale
    bias_ptr,  # [N] float (any float dtype) when HAS_BIAS; otherwise a stand-in never read
    y_ptr,  # [M, N] output, out_dtype
    M, N, K,
    stride_cm, stride_ck,
    stride_rm,  # row_scales' row stride
    stride_wn, stride_wk,
    stride_sn,  # weight_scale's row stride
    stride_b,
    stride_ym, stride_yn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        k_ok = k < K  # the K tail: masked codes are 0 and add nothing
        a = tl.load(codes_ptr + rows[:, None] * stride_cm + k[None, :] * stride_ck,
                    mask=row_ok[:, None] & k_ok[None, :], other=0)
        # [BLOCK_K, BLOCK_N]: the weight tile transposed in place (K stays the contiguous dimension)
        w = tl.load(weight_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0)
        acc = tl.dot(a, w, acc)  # int8 x int8 -> int32, exact
    row_scale = tl.load(row_scales_ptr + rows * stride_rm, mask=row_ok, other=0.0)
    col_scale = tl.load(weight_scale_ptr + cols * stride_sn, mask=col_ok, other=0.0)
    y = acc.to(tl.float32) * row_scale[:, None] * col_scale[None, :]
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def w8a8_int8_matmul(codes: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor,
                     weight_scale: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """``codes [M, K]`` int8 times ``weight [N, K]`` int8, transposed, scaled per row and per column, plus
    ``bias [N]``: ``[M, N]`` in ``out_dtype``, written into ``out`` when given (any strides)."""
    _check(codes, row_scales, weight, weight_scale, bias, out_dtype, out)
    m, k = codes.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=codes.device) if out is None else out
    if m == 0 or n == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _w8a8_kernel[grid](
        codes, row_scales, weight, weight_scale, weight_scale if bias is None else bias, y, m, n, k,
        codes.stride(0), codes.stride(1), row_scales.stride(0), weight.stride(0), weight.stride(1),
        weight_scale.stride(0), 0 if bias is None else bias.stride(0), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def int8_matmul_with_quantization(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                  bias: torch.Tensor | None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` (float) -> ``[..., N]`` in x's dtype: x quantized per token, or by a checkpoint's static
    ``input_scale`` (int8_linear's own ``quantize_per_token``), then the int8 GEMM. ``Int8Linear.forward`` on
    CUDA."""
    require(x.dtype in OUT_DTYPES, f"x must be one of {OUT_DTYPES}, got {x.dtype}")
    n = weight.shape[0]
    codes, row_scales = quantize_per_token(x.reshape(-1, x.shape[-1]), input_scale)
    row_scales = row_scales.contiguous()  # a static scale comes expanded
    y = w8a8_int8_matmul(codes, row_scales, weight, weight_scale, bias, x.dtype)
    return y.view(*x.shape[:-1], n)


def _check(codes: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
           bias: torch.Tensor | None, out_dtype: torch.dtype, out: torch.Tensor | None) -> None:
    """What the kernel assumes, said before a launch could read out of bounds."""
    require(codes.dim() == 2 and codes.dtype == torch.int8,
            f"codes must be 2-D torch.int8 [M, K], got {codes.dtype} {tuple(codes.shape)}")
    require(weight.dim() == 2 and weight.dtype == torch.int8,
            f"weight must be 2-D torch.int8 [N, K], got {weight.dtype} {tuple(weight.shape)}")
    (m, k), n = codes.shape, weight.shape[0]
    require(weight.shape[1] == k, f"K differs: codes have {k} columns, weight {weight.shape[1]}")
    require(tuple(row_scales.shape) == (m, 1) and row_scales.dtype == torch.float32,
            f"row_scales must be torch.float32 {(m, 1)}, got {row_scales.dtype} {tuple(row_scales.shape)}")
    require(tuple(weight_scale.shape) == (n, 1) and weight_scale.dtype == torch.float32,
            f"weight_scale must be torch.float32 {(n, 1)}, got {weight_scale.dtype} {tuple(weight_scale.shape)}")
    require(bias is None or (tuple(bias.shape) == (n,) and bias.is_floating_point()),
            f"bias must be a float [{n}], got {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    require(out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    require(out is None or (tuple(out.shape) == (m, n) and out.dtype == out_dtype),
            f"out must be {out_dtype} {(m, n)}, got {None if out is None else (out.dtype, tuple(out.shape))}")
    others = [row_scales, weight, weight_scale] + [t for t in (bias, out) if t is not None]
    require(all(t.device == codes.device for t in others),
            f"every tensor must be on codes' device ({codes.device}), got "
            f"{sorted({str(t.device) for t in others})}")
