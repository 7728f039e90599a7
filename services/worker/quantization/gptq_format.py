"""quant_method "gptq" (AutoGPTQ / GPTQModel): 4- or 8-bit weights packed along the input,
``qweight [in * bits / 32, out]``, zero points packed along the output, ``qzeros [groups, out * bits / 32]``,
float16 ``scales [groups, out]`` and each input column's group ``g_idx [in]`` (act-order, desc_act, permutes
them):  w[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n].

checkpoint_format "gptq" (v1, the common one) stores each zero point minus one; "gptq_v2" stores it as it is.
"""

from __future__ import annotations

import torch

from services.worker.quantization.config_fields import field, positive_group_size
from services.worker.quantization.dequantize import grouped_dequantize, group_index
from services.worker.quantization.linear_format import LinearFormat, StoredLinear
from services.worker.quantization.packing import PACKED_BITS, unpack_int32
from services.worker.quantization.wna16_linear import PackedLayout, kernel_takes


class GptqFormat(LinearFormat):
    method = "gptq"
    markers = frozenset({"qweight"})
    suffixes = frozenset({"qweight", "qzeros", "scales", "g_idx"})

    def __init__(self, bits: int, group_size: int | None, desc_act: bool, zeros_minus_one: bool):
        self.bits, self.group_size, self.desc_act, self.zeros_minus_one = bits, group_size, desc_act, zeros_minus_one

    @classmethod
    def from_config(cls, raw: dict) -> "GptqFormat":
        where = "quantization_config (gptq)"
        bits = field(raw, "bits", kind=int, allowed=PACKED_BITS, where=where)
        group_size = positive_group_size(field(raw, "group_size", kind=int, where=where), where)
        desc_act = field(raw, "desc_act", default=False, kind=bool, where=where)
        version = field(raw, "checkpoint_format", default="gptq", kind=str, allowed=("gptq", "gptq_v2"), where=where)
        return cls(bits, group_size, desc_act, version == "gptq")

    def dequantized(self, stored: StoredLinear) -> torch.Tensor:
        codes, scales, zeros = self.wna16_parts(stored)
        groups = group_index(codes.shape[1], self.group_size, stored.get("g_idx"))
        return grouped_dequantize(codes, scales, zeros, groups)

    def wna16_layout(self, module: str, suffixes: frozenset[str]) -> PackedLayout | None:
        """In order (act-order permutes the groups), in groups the kernel takes."""
        fits = not self.desc_act and kernel_takes(self.bits, self.group_size)
        return PackedLayout(self.bits, self.group_size) if fits else None

    def wna16_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Codes ``[out, in]``, scales and zero points ``[out, groups]``, output-major (any bit width)."""
        codes = unpack_int32(stored.need("qweight"), self.bits, 0)  # [in, out]
        scales = stored.need("scales")
        zeros = unpack_int32(stored.need("qzeros"), self.bits, 1)[:, :scales.shape[1]]
        if self.zeros_minus_one:
            zeros = zeros + 1
        return codes.t(), scales.t(), zeros.t()

    def describe(self) -> str:
        group = self.group_size or "whole rows"
        return f"gptq ({self.bits}-bit, group {group}{', act-order' if self.desc_act else ''})"
