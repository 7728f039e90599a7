"""W8A8 FP8 linear layers for GPUs with FP8 arithmetic (compute capability 8.9 and later: Ada, Hopper and on):
an FP8 checkpoint's e4m3 weight kept as stored, with its scales, and the activations quantized to e4m3 as they
arrive (dynamic), so the product runs on FP8 tensor cores (fp8_gemm.py) and the weights take half a 16-bit
model's memory and bandwidth. Elsewhere such layers are dequantized at load (fp8_format.py).

    block checkpoints (``weight_block_size`` (bn, bk), DeepSeek-V3 / Qwen3-FP8): ``weight_scale [N, ceil(K / bk)]``,
        each block's scale repeated on its bn rows, so that fused q/k/v and gate/up stay consecutive rows whatever
        their sizes (a K-block's scale per row costs 4 bytes per bk weights); activations per token and bk
        columns; the block-wise Triton GEMM
    otherwise: ``weight_scale [N, 1]`` per output row (a per-tensor scale is the same one on every row);
        activations per token; ``torch._scaled_mm``
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
from torch import nn

_SCALED_MM_MULTIPLE = 16  # torch._scaled_mm wants K and N in multiples of 16
_FP8_DOT_K = 16  # the block GEMM's K tiles: a multiple of 16 columns inside one scale block


class Fp8Layout(NamedTuple):
    """How an Fp8Linear's weight is scaled: ``block_k`` columns per scale (block checkpoints), or one scale per
    output row (None)."""

    block_k: int | None


def kernel_takes_fp8(layout: Fp8Layout, in_features: int, out_features: int) -> bool:
    """Whether the FP8 GEMMs take a layer of this shape and layout (else it is dequantized at load)."""
    if layout.block_k is not None:
        return layout.block_k % _FP8_DOT_K == 0
    return in_features % _SCALED_MM_MULTIPLE == 0 and out_features % _SCALED_MM_MULTIPLE == 0


def gpu_runs_fp8(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA GPU with FP8 tensor cores (compute capability 8.9 or later)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.is_available() and \
        torch.cuda.get_device_capability(device) >= (8, 9)


@functools.cache
def scaled_mm_runs(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` with per-token and per-row scales gives ``dtype`` here: which output dtypes
    its row-wise kernel writes depends on the torch release and the GPU (some write bfloat16 only), so a
    per-row FP8 layer is kept only where a tiny product runs; elsewhere it is dequantized at load."""
    from services.worker.quantization.fp8_gemm import scaled_mm_fp8

    weight = torch.zeros(16, 16, device=device).to(torch.float8_e4m3fn)
    try:
        scaled_mm_fp8(torch.ones(1, 16, dtype=dtype, device=device), weight, torch.ones(16, 1, device=device))
    except (RuntimeError, NotImplementedError):
        return False
    return True


class Fp8Linear(nn.Module):
    """``y = x W^T + b`` with ``W [N, K]`` held as ``weight`` (float8_e4m3fn) and ``weight_scale`` (float32, per
    output row and block of ``layout.block_k`` columns, or per output row)."""

    # Kept whatever the model's dtype (the loader leaves them so): the weight too, unlike Int8Linear's int8 one,
    # since float8 counts as floating point and would otherwise be cast to the model's dtype.
    keeps_dtype = ("weight", "weight_scale")

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: Fp8Layout):
        from services.worker.quantization import fp8_gemm  # Triton, once a layer is built

        super().__init__()
        self._gemm = fp8_gemm
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        k_blocks = 1 if layout.block_k is None else -(-in_features // layout.block_k)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(out_features, k_blocks, dtype=torch.float32),
                                         requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Module, layout: Fp8Layout) -> "Fp8Linear | None":
        """One in the place of ``linear`` (its shape and bias), or None where the FP8 GEMMs cannot take it."""
        if not kernel_takes_fp8(layout, linear.in_features, linear.out_features):
            return None
        return cls(linear.in_features, linear.out_features, linear.bias is not None, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (float) -> ``[..., N]`` in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        block_k = self.layout.block_k
        if block_k is None:
            y = self._gemm.scaled_mm_fp8(flat, self.weight, self.weight_scale, self.bias, x.dtype)
        else:  # scales per row: blocks one row tall
            codes, x_scales = self._gemm.quantize_fp8_per_token_group(flat, block_k)
            y = self._gemm.w8a8_block_fp8_matmul(codes, x_scales, self.weight, self.weight_scale, (1, block_k),
                                                 x.dtype, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"block_k={self.layout.block_k}, bias={self.bias is not None}"
