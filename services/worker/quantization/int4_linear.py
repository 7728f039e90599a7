"""W4A16 linear layers for GPUs: the weight kept as 4-bit codes with a scale and zero point per group, and
multiplied by the Triton GEMM that dequantizes it tile by tile (int4_gemm.py), so the weights take a quarter
of a 16-bit model's memory and bandwidth. The loader builds one for each dense projection a W4A16 checkpoint
(GPTQ without act-order, AWQ, compressed-tensors pack-quantized) stores with groups the kernel takes, when
the model runs on a GPU on one rank; elsewhere those layers are dequantized at load."""

from __future__ import annotations

import torch
from torch import nn

# The GEMM's K tile (int4_gemm.py): a group must hold whole tiles. Here, so that reading a checkpoint needs
# no Triton (the kernel is imported when an Int4Linear is built).
BLOCK_K = 64


def kernel_takes_group(group_size: int | None, in_features: int | None = None) -> bool:
    """Whether the GEMM takes groups of this size (a multiple of its K tile; whole rows have no groups here)."""
    fits = group_size is not None and group_size % BLOCK_K == 0
    return fits and (in_features is None or in_features % group_size == 0)


class Int4Linear(nn.Module):
    """``y = x W^T + b`` with ``W [N, K]`` held as ``int4_codes [N, K / 8]`` (int32, eight codes per word along
    K), ``int4_scales`` and ``int4_zeros [N, K / group]`` (the model's dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group_size: int):
        from services.worker.quantization.int4_gemm import w4a16_matmul  # Triton, once a layer is built

        super().__init__()
        self._matmul = w4a16_matmul
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        groups = in_features // group_size
        self.int4_codes = nn.Parameter(torch.empty(out_features, in_features // 8, dtype=torch.int32),
                                       requires_grad=False)
        self.int4_scales = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.int4_zeros = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        y = self._matmul(flat, self.int4_codes, self.int4_scales, self.int4_zeros, self.group_size)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, " \
               f"bias={self.bias is not None}"
