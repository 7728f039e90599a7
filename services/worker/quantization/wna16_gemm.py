"""A W4A16 / W8A16 GEMM for GPUs (Triton): ``y = x @ W.T`` with ``W`` held as 4- or 8-bit codes and dequantized
tile by tile inside the kernel, so the weights cross the memory bus at half a byte or one byte each instead of two.

One layout serves GPTQ, AWQ and compressed-tensors (the loader repacks each into it): compressed-tensors'
pack-quantized one, output-major so that fused q/k/v and gate/up are consecutive rows. With b bits and
P = 32 / b codes per word:

    codes   [N, K / P] int32: P unsigned b-bit codes per word, code k at bits b * (k % P)
    scales  [N, K / G] (the activations' dtype)
    zeros   [N, K / G] (the activations' dtype): each group's zero point, a whole number in 0..2^b - 1

and ``w[n, k] = (code[n, k] - zero[n, k // G]) * scale[n, k // G]``, exactly what dequantize.py computes.
Act-order checkpoints (a permuted g_idx) are not taken: the loader dequantizes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton_attention import interpreter_enabled
from services.worker.block_moves import require
from services.worker.quantization.wna16_linear import BITS, BLOCK_K

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M, BLOCK_N = 16, 64  # BLOCK_K (wna16_linear.py): whole words of either width, and divides the group


# M (the step's token count) changes with every batch: a binary of its own for the counts divisible by 16 (or
# for 1) would compile in the middle of serving.
@triton.jit(do_not_specialize=["M"])
def _wna16_kernel(
    x_ptr,  # [M, K] activations
    codes_ptr,  # [N, K * BITS / 32] int32: packed codes, 32 / BITS per word along K
    scales_ptr,  # [N, K / GROUP] activations' dtype
    zeros_ptr,  # [N, K / GROUP] activations' dtype: zero points (whole numbers)
    y_ptr,  # [M, N] output, activations' dtype
    M, N, K,
    stride_xm, stride_xk,
    stride_cn, stride_ck,
    stride_sn, stride_sg,  # scales and zeros share strides
    stride_ym, stride_yn,
    GROUP: tl.constexpr,  # columns per scale
    BITS: tl.constexpr,  # 4 or 8: bits per code
    IEEE_DOT: tl.constexpr,  # float32 activations: full-precision dot, not TF32
    DOT_FP32: tl.constexpr,  # upcast the operands (the interpreter's dot mishandles bfloat16)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    per_word: tl.constexpr = 32 // BITS
    shifts = (ks % per_word) * BITS  # code k's place in its word
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        k_ok = k < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]: each word is loaded once per code it holds (cached), then shifted apart.
        words = tl.load(codes_ptr + cols[None, :] * stride_cn + (k // per_word)[:, None] * stride_ck,
                        mask=k_ok[:, None] & col_ok[None, :], other=0)
        codes = (words >> shifts[:, None]) & ((1 << BITS) - 1)
        group = start // GROUP  # BLOCK_K divides GROUP: one group per step
        scale = tl.load(scales_ptr + cols * stride_sn + group * stride_sg, mask=col_ok, other=0.0)
        zero = tl.load(zeros_ptr + cols * stride_sn + group * stride_sg, mask=col_ok, other=0.0)
        w = ((codes.to(tl.float32) - zero.to(tl.float32)[None, :]) * scale.to(tl.float32)[None, :]).to(x.dtype)
        if IEEE_DOT:
            acc += tl.dot(x, w, input_precision="ieee")
        elif DOT_FP32:
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def wna16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int, bits: int = 4) -> torch.Tensor:
    """``x [M, K]`` times the dequantized ``[N, K]`` weight, transposed: ``[M, N]`` in x's dtype."""
    _check(x, codes, scales, zeros, group_size, bits)
    m, k = x.shape
    n = codes.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _wna16_kernel[grid](
        x, codes, scales, zeros, y, m, n, k, x.stride(0), x.stride(1), codes.stride(0), codes.stride(1),
        scales.stride(0), scales.stride(1), y.stride(0), y.stride(1), GROUP=group_size, BITS=bits,
        IEEE_DOT=x.dtype == torch.float32, DOT_FP32=x.dtype == torch.bfloat16 and interpreter_enabled(),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y


def _check(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
           bits: int) -> None:
    """What the kernel assumes, said before a launch could read out of bounds."""
    require(bits in BITS, f"codes of {bits} bits are not taken; taken: {BITS}")
    require(x.dim() == 2 and x.dtype in ACTIVATION_DTYPES, f"x must be 2-D {ACTIVATION_DTYPES}, got {x.dtype} "
                                                           f"{tuple(x.shape)}")
    k, per_word = x.shape[1], 32 // bits
    require(k % per_word == 0, f"K ({k}) must be a multiple of {per_word}: whole words of {bits}-bit codes")
    require(group_size % BLOCK_K == 0 and k % group_size == 0,
            f"the group size ({group_size}) must be a multiple of {BLOCK_K} that divides K ({k})")
    require(codes.dtype == torch.int32 and codes.dim() == 2 and codes.shape[1] * per_word == k,
            f"codes must be int32 [N, {k // per_word}], got {codes.dtype} {tuple(codes.shape)}")
    groups = (codes.shape[0], k // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        require(tuple(t.shape) == groups and t.dtype == x.dtype, f"{name} must be {x.dtype} {groups}, got "
                                                                 f"{t.dtype} {tuple(t.shape)}")
    require(scales.stride() == zeros.stride(), "scales and zeros must share strides")
    require(all(t.device == x.device for t in (codes, scales, zeros)), "every tensor must be on x's device")
