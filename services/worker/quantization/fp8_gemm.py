"""W8A8 FP8 GEMMs for GPUs with FP8 arithmetic (compute capability 8.9 and later): ``y = x @ W.T`` with the
weight kept as the checkpoint's e4m3 codes and the activations quantized to e4m3 as they arrive (dynamic), so
both operands enter the tensor cores as FP8. What ``Fp8Linear`` (fp8_linear.py) runs.

The layouts are quant_method "fp8"'s, as the checkpoint stores them (nothing repacked), with the published
arithmetic ``w = fp8 * scale`` (dequantize.py's ``fp8_dequantize``):

    weight          [N, K] float8_e4m3fn, output-major (fused q/k/v and gate/up are consecutive rows)
    weight_scale    block checkpoints (DeepSeek-V3, Qwen3-FP8; stored as ``weight_scale_inv``, the factor that
                    multiplies): [ceil(N / bn), ceil(K / bk)] float32, one per bn x bk block (edge blocks partial);
                    otherwise [1] (per tensor) or [N, 1] (per output row) float32
    codes           [M, K] float8_e4m3fn: the activations, quantized per token and K group at run time
    x_scales        [M, ceil(K / bk)] float32 (block path), or [M, 1] (per token)

Block path (``w8a8_block_fp8_matmul``, Triton), as DeepSeek-V3 and vLLM compute it:

    y[t, n] = sum_kb  x_scale[t, kb] * w_scale[n // bn, kb] * sum_{k in block kb} codes[t, k] * weight[n, k]

Every K tile lies inside one scale block (BLOCK_K divides bk), so each tile's dot of FP8 codes is scaled by
its two block scales and added to a float32 accumulator. A product of two e4m3 values is exact in float32
(4 + 4 significant bits), so the only roundings are float32 ones: the tile's sum, the scaling and the
accumulation, then the output's. On sm_90 Triton lets the FP8 MMA accumulate one tl.dot (here at most 128
terms) at its own reduced precision (``max_num_imprecise_acc``); adding each 128-deep partial into float32
is DeepSeek-V3's promotion interval.

Per-tensor / per-row path (``scaled_mm_fp8``): the activations per token, then ``torch._scaled_mm``
(cuBLAS / CUTLASS on CUDA; PyTorch also has a CPU implementation).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.block_moves import require

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max  # 448
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OUT_DTYPES = ACTIVATION_DTYPES
_TINY_AMAX = 1e-10  # a group of zeros: scale amax / 448 stays positive, its codes are 0 whatever it is
# Tiles (BLOCK_M, BLOCK_N, warps) by batch: decode steps are a few tokens and the weight tile is what costs
# (mma.sync, m16); prefill chunks take a 64-row tile, wgmma's height on sm_90, with 8 warps (4 spill on sm_89:
# 255 registers). BLOCK_K: the largest of 128 / 64 / 32 / 16 that divides bk (128 for every shipped
# checkpoint: a 128-byte row of codes per load). Shared memory per stage: (BLOCK_M + BLOCK_N) x BLOCK_K bytes,
# 10 KB and 24 KB at bk = 128. Compiled for sm_89 / sm_90 (Triton 3.9, bf16 out, K 4096): 80 registers, no
# spills, 20 KB (decode); 189 / 128 registers, no spills, 48 / 72 KB (prefill; sm_90's dot a wgmma).
DECODE_TILE, PREFILL_TILE = (16, 64, 4), (64, 128, 8)


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (float) -> (float8_e4m3fn codes ``[M, K]``, float32 scales ``[M, ceil(K / group)]``):
    each token's run of ``group`` columns (the last one partial) scaled so its largest magnitude is e4m3's
    largest, ``scale = amax / 448``, ``code = e4m3(x / scale)`` (round to nearest even), as DeepSeek-V3's and
    vLLM's per-token-group quantization."""
    require(x.dim() == 2 and x.dtype in ACTIVATION_DTYPES,
            f"x must be 2-D {ACTIVATION_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    require(isinstance(group, int) and group > 0, f"group must be a positive int, got {group!r}")
    m, k = x.shape
    groups = -(-k // group)
    x = x.float()
    padded = x if k == groups * group else torch.nn.functional.pad(x, (0, groups * group - k))
    amax = padded.view(m, groups, group).abs().amax(dim=2)
    scales = amax.clamp_min(_TINY_AMAX) / E4M3_MAX
    per_column = scales.repeat_interleave(group, dim=1)[:, :k] if groups > 1 else scales
    codes = (x / per_column).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes, scales


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, 1]``): one group per token."""
    return quantize_fp8_per_token_group(x, max(1, x.shape[-1]) if x.dim() == 2 else 1)


# M (the step's token count) changes with every batch: a binary of its own for the counts divisible by 16 (or
# for 1) would compile in the middle of serving.
#
# No interpreter flag (unlike wna16_gemm's DOT_FP32): Triton's interpreter (3.9) computes an FP8 x FP8 dot by
# widening both tiles to float16 (exact for e4m3) and ``np.matmul(a, b, dtype=float32)``, i.e. exact products
# summed in float32, which is what the kernel promises; so the interpreted tests run the very tl.dot on FP8
# tiles that the GPU compiles.
@triton.jit(do_not_specialize=["M"])
def _w8a8_block_fp8_kernel(
    codes_ptr,  # [M, K] float8_e4m3fn: the activations' codes
    x_scales_ptr,  # [M, ceil(K / BK)] float32: a scale per token and K block
    weight_ptr,  # [N, K] float8_e4m3fn: the weight's codes, output-major
    w_scales_ptr,  # [ceil(N / BN), ceil(K / BK)] float32: a scale per BN x BK block of the weight
    bias_ptr,  # [N] float (any float dtype) when HAS_BIAS; otherwise a stand-in never read
    y_ptr,  # [M, N] output, out_dtype
    M, N, K,
    stride_cm, stride_ck,
    stride_xsm, stride_xsk,
    stride_wn, stride_wk,
    stride_wsn, stride_wsk,
    stride_b,
    stride_ym, stride_yn,
    BN: tl.constexpr, BK: tl.constexpr,  # the weight's scale block (rows, columns)
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,  # BLOCK_K divides BK
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    scale_rows = cols // BN  # each output column's row of weight scales (N may be ragged against BN)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        k = start + ks
        k_ok = k < K  # the last block may be partial: masked codes are 0 and add nothing
        a = tl.load(codes_ptr + rows[:, None] * stride_cm + k[None, :] * stride_ck,
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]: the weight tile transposed in place (K stays the contiguous dimension, the
        # K-major operand FP8 MMAs take)
        w = tl.load(weight_ptr + cols[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        block = start // BK  # the tile's K block: BLOCK_K divides BK, so one per tile
        x_scale = tl.load(x_scales_ptr + rows * stride_xsm + block * stride_xsk, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scales_ptr + scale_rows * stride_wsn + block * stride_wsk, mask=col_ok, other=0.0)
        acc += tl.dot(a, w) * (x_scale[:, None] * w_scale[None, :])  # FP8 x FP8 -> float32
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :] * stride_yn, acc.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def block_k_tile(bk: int) -> int:
    """The K tile for scale blocks ``bk`` columns wide: the largest of 128, 64, 32, 16 that divides it."""
    return next(t for t in (128, 64, 32, 16) if bk % t == 0)


def tiles(m: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for a batch of ``m`` tokens."""
    return DECODE_TILE if m <= DECODE_TILE[0] else PREFILL_TILE


def w8a8_block_fp8_matmul(codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                          weight_scales: torch.Tensor, block: tuple[int, int], out_dtype: torch.dtype,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``codes [M, K]`` e4m3 (scaled per token and ``bk`` columns by ``x_scales``) times ``weight [N, K]`` e4m3
    (scaled per ``block = (bn, bk)`` by ``weight_scales``), transposed, plus ``bias [N]``: ``[M, N]`` in
    ``out_dtype``."""
    _check_block(codes, x_scales, weight, weight_scales, block, out_dtype, bias)
    m, k = codes.shape
    n = weight.shape[0]
    y = torch.empty(m, n, dtype=out_dtype, device=codes.device)
    if m == 0 or n == 0:
        return y
    block_m, block_n, warps = tiles(m)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a8_block_fp8_kernel[grid](
        codes, x_scales, weight, weight_scales, weight_scales if bias is None else bias, y, m, n, k,
        codes.stride(0), codes.stride(1), x_scales.stride(0), x_scales.stride(1), weight.stride(0),
        weight.stride(1), weight_scales.stride(0), weight_scales.stride(1), 0 if bias is None else bias.stride(0),
        y.stride(0), y.stride(1), BN=block[0], BK=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k_tile(block[1]), num_warps=warps)
    return y


def _check_block(codes: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                 block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None) -> None:
    """What the kernel assumes, said before a launch could read out of bounds."""
    require(codes.dim() == 2 and codes.dtype == E4M3,
            f"codes must be 2-D {E4M3} [M, K], got {codes.dtype} {tuple(codes.shape)}")
    require(weight.dim() == 2 and weight.dtype == E4M3,
            f"weight must be 2-D {E4M3} [N, K], got {weight.dtype} {tuple(weight.shape)}")
    require(len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block),
            f"block must be two positive sizes (bn, bk), got {block!r}")
    bn, bk = block
    require(bk % 16 == 0, f"the block's K size ({bk}) must be a multiple of 16: whole K tiles of the FP8 dot")
    (m, k), n = codes.shape, weight.shape[0]
    require(weight.shape[1] == k, f"K differs: codes have {k} columns, weight {weight.shape[1]}")
    k_blocks = -(-k // bk)
    require(tuple(x_scales.shape) == (m, k_blocks) and x_scales.dtype == torch.float32,
            f"x_scales must be torch.float32 {(m, k_blocks)} (one per token and {bk} columns), got "
            f"{x_scales.dtype} {tuple(x_scales.shape)}")
    expected = (-(-n // bn), k_blocks)
    require(tuple(weight_scales.shape) == expected and weight_scales.dtype == torch.float32,
            f"weight_scales must be torch.float32 {expected} (one per {bn} x {bk} block, edges partial), got "
            f"{weight_scales.dtype} {tuple(weight_scales.shape)}")
    require(out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    require(bias is None or (tuple(bias.shape) == (n,) and bias.is_floating_point()),
            f"bias must be a float [{n}], got {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    others = [x_scales, weight, weight_scales] + ([] if bias is None else [bias])
    require(all(t.device == codes.device for t in others),
            f"every tensor must be on codes' device ({codes.device}), got {sorted({str(t.device) for t in others})}")


def row_scales(weight_scale: torch.Tensor, n: int) -> torch.Tensor:
    """A per-tensor (``[]``/``[1]``) or per-row (``[N, 1]``/``[N]``) weight scale as float32 ``[1, N]``,
    contiguous: the column scales ``torch._scaled_mm`` takes (a per-tensor one cannot pair with the
    activations' per-token scales there)."""
    return weight_scale.float().reshape(1, -1).expand(1, n).contiguous()


def scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                  bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x [M, K]`` (float) quantized per token to e4m3, times ``weight [N, K]`` e4m3 scaled per tensor or per
    row, transposed, plus ``bias [N]``: ``[M, N]`` in ``out_dtype`` (default x's) through ``torch._scaled_mm``.

    16-bit outputs take row-wise scaling directly (``scale_a [M, 1]``, ``scale_b [1, N]``). A float32 output
    runs the product with unit tensor-wise scales into float32 and applies the scales afterwards, in float32:
    on CUDA, row-wise scaling gives float32 only on sm_90 with cuBLAS 12.9 (CUTLASS's row-wise kernel writes
    bf16/fp16). The bias is added to the result, not passed in: its dtype rules differ between those kernels.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_scaled_mm(x, weight, weight_scale, bias, out_dtype)
    m, n = x.shape[0], weight.shape[0]
    if m == 0:
        return torch.empty(0, n, dtype=out_dtype, device=x.device)
    codes, x_scale = quantize_fp8_per_token(x)
    w_scale = row_scales(weight_scale, n)
    if out_dtype == torch.float32:
        one = torch.ones((), dtype=torch.float32, device=x.device)
        y = torch._scaled_mm(codes, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        y = y.mul_(x_scale).mul_(w_scale)
    else:
        y = torch._scaled_mm(codes, weight.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)
    return y if bias is None else y.add_(bias.to(out_dtype))


def _check_scaled_mm(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> None:
    """What torch._scaled_mm needs on CUDA, said here on every device (its own errors differ by backend)."""
    require(x.dim() == 2 and x.dtype in ACTIVATION_DTYPES,
            f"x must be 2-D {ACTIVATION_DTYPES}, got {x.dtype} {tuple(x.shape)}")
    require(weight.dim() == 2 and weight.dtype == E4M3,
            f"weight must be 2-D {E4M3} [N, K], got {weight.dtype} {tuple(weight.shape)}")
    (m, k), n = x.shape, weight.shape[0]
    require(weight.shape[1] == k, f"K differs: x has {k} columns, weight {weight.shape[1]}")
    require(k % 16 == 0 and n % 16 == 0 and k > 0 and n > 0,
            f"K ({k}) and N ({n}) must be positive multiples of 16 (torch._scaled_mm on CUDA)")
    require(weight.stride() == (k, 1), f"weight must be row-major [N, K] (its transpose is the column-major "
                                       f"operand torch._scaled_mm takes), got strides {weight.stride()}")
    per_tensor = weight_scale.numel() == 1 and weight_scale.dim() <= 1
    per_row = tuple(weight_scale.shape) in ((n, 1), (n,))
    require(weight_scale.dtype == torch.float32 and (per_tensor or per_row),
            f"weight_scale must be torch.float32, [1] (per tensor) or [{n}, 1] (per row), got {weight_scale.dtype} "
            f"{tuple(weight_scale.shape)}")
    require(out_dtype in OUT_DTYPES, f"out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    require(bias is None or (tuple(bias.shape) == (n,) and bias.is_floating_point()),
            f"bias must be a float [{n}], got {None if bias is None else (bias.dtype, tuple(bias.shape))}")
    others = [weight, weight_scale] + ([] if bias is None else [bias])
    require(all(t.device == x.device for t in others),
            f"every tensor must be on x's device ({x.device}), got {sorted({str(t.device) for t in others})}")
