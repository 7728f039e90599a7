"""quant_method "awq" (AutoAWQ's GEMM layout): 4-bit weights ``qweight [in, out / 8]`` and zero points
``qzeros [in / group, out / 8]`` packed eight to an int32 in AWQ's interleaved order, with float16
``scales [in / group, out]``:  w[k, n] = (q[k, n] - z[k // group, n]) * s[k // group, n].
"""

from __future__ import annotations

import torch

from services.worker.quantization.config_fields import field, positive_group_size
from services.worker.quantization.wna16_linear import PackedLayout, kernel_takes
from services.worker.quantization.dequantize import grouped_dequantize, group_index
from services.worker.quantization.linear_format import LinearFormat, StoredLinear
from services.worker.quantization.packing import unpack_awq


class AwqFormat(LinearFormat):
    method = "awq"
    markers = frozenset({"qweight"})
    suffixes = frozenset({"qweight", "qzeros", "scales"})

    def __init__(self, group_size: int | None, zero_point: bool):
        self.group_size, self.zero_point = group_size, zero_point

    @classmethod
    def from_config(cls, raw: dict) -> "AwqFormat":
        where = "quantization_config (awq)"
        field(raw, "bits", "w_bit", kind=int, allowed=(4,), where=where)
        field(raw, "version", default="gemm", kind=str, allowed=("gemm", "GEMM"), where=where)
        group_size = positive_group_size(field(raw, "group_size", "q_group_size", kind=int, where=where), where)
        return cls(group_size, field(raw, "zero_point", default=True, kind=bool, where=where))

    def dequantized(self, stored: StoredLinear) -> torch.Tensor:
        codes, scales, zeros = self.wna16_parts(stored)
        return grouped_dequantize(codes, scales, zeros, group_index(codes.shape[1], self.group_size))

    def wna16_layout(self, module: str, suffixes: frozenset[str]) -> PackedLayout | None:
        return PackedLayout(4, self.group_size) if kernel_takes(4, self.group_size) else None

    def wna16_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes ``[out, in]``, scales and zero points ``[out, groups]`` (zeros without zero points)."""
        codes = unpack_awq(stored.need("qweight"))  # [in, out]
        scales = stored.need("scales")
        zeros = unpack_awq(stored.need("qzeros"))[:, :scales.shape[1]] if self.zero_point \
            else torch.zeros(scales.shape, dtype=torch.int32)
        return codes.t(), scales.t(), zeros.t()

    def describe(self) -> str:
        group = self.group_size or "whole rows"
        return f"awq (4-bit, group {group}, {'zero points' if self.zero_point else 'symmetric'})"
