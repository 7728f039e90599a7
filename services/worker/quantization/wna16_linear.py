"""Weight-only (W4A16 / W8A16) linear layers for GPUs: the weight kept as 4- or 8-bit codes with a scale and zero
point per group, and multiplied by the Triton GEMM that dequantizes it tile by tile (wna16_gemm.py), so the
weights take a quarter or half of a 16-bit model's memory and bandwidth. The loader builds one for each dense
projection a weight-only checkpoint (GPTQ without act-order, AWQ, compressed-tensors pack-quantized) stores with
groups the kernel takes, when the model runs on a GPU on one rank; elsewhere those layers are dequantized at
load."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

# The GEMM's K tile (wna16_gemm.py): a group must hold whole tiles. Here, so that reading a checkpoint needs
# no Triton (the kernel is imported when a WNA16Linear is built).
BLOCK_K = 64
BITS = (4, 8)  # code widths the GEMM takes: whole codes per 32-bit word
SUFFIXES = ("wna16_codes", "wna16_scales", "wna16_zeros")  # a WNA16Linear's tensors


class PackedLayout(NamedTuple):
    """How a layer's codes are held for the GEMM: bits per code and columns per group."""

    bits: int
    group_size: int


def kernel_takes(bits: int, group_size: int | None, in_features: int | None = None) -> bool:
    """Whether the GEMM takes codes of this width in groups of this size (a multiple of its K tile; whole rows
    have no groups here)."""
    fits = bits in BITS and group_size is not None and group_size % BLOCK_K == 0
    return fits and (in_features is None or in_features % group_size == 0)


class WNA16Linear(nn.Module):
    """``y = x W^T + b`` with ``W [N, K]`` held as ``wna16_codes [N, K * bits / 32]`` (int32, 32 / bits codes per
    word along K), ``wna16_scales`` and ``wna16_zeros [N, K / group]`` (the model's dtype)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, layout: PackedLayout):
        from services.worker.quantization.wna16_gemm import wna16_matmul  # Triton, once a layer is built

        super().__init__()
        self._matmul = wna16_matmul
        self.in_features, self.out_features, self.layout = in_features, out_features, layout
        groups = in_features // layout.group_size
        self.wna16_codes = nn.Parameter(torch.empty(out_features, in_features * layout.bits // 32, dtype=torch.int32),
                                        requires_grad=False)
        self.wna16_scales = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.wna16_zeros = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    @classmethod
    def replacing(cls, linear: nn.Module, layout: PackedLayout) -> "WNA16Linear | None":
        """One in the place of ``linear`` (its shape and bias), or None where its inputs are not whole groups."""
        if linear.in_features % layout.group_size:
            return None
        return cls(linear.in_features, linear.out_features, linear.bias is not None, layout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` -> ``[..., N]`` in x's dtype."""
        flat = x.reshape(-1, self.in_features)
        y = self._matmul(flat, self.wna16_codes, self.wna16_scales, self.wna16_zeros, self.layout.group_size,
                         self.layout.bits)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.layout.bits}, " \
               f"group_size={self.layout.group_size}, bias={self.bias is not None}"
