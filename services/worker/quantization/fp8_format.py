"""quant_method "fp8": FP8 e4m3 weights with a scale per tensor or per output row (``weight_scale``), or per
128 x 128 block (``weight_scale_inv``, as DeepSeek-V3 and Qwen3-FP8 ship them: despite its name, the factor
that multiplies); activation scales static (``input_scale``) or dynamic.

On the CPU (and GPUs without FP8 arithmetic, or several ranks) the weights are upcast once at load and
activations stay in the model's dtype: vLLM's weight-only FP8. On GPUs with FP8 arithmetic they stay FP8 and
run W8A8 with dynamic activation scales (fp8_linear.py). ``input_scale`` is read and not applied.
"""

from __future__ import annotations

import re

import torch

from services.worker.quantization.config_fields import field
from services.worker.quantization.dequantize import fp8_dequantize, fp8_round_per_row, fp8_weight_and_scales
from services.worker.quantization.fp8_linear import Fp8Layout
from services.worker.quantization.linear_format import LinearFormat, StoredLinear

# The decoder's projections: what --quantization fp8 quantizes in a float checkpoint.
PROJECTION = re.compile(r".*\.(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj\.weight$")


class Fp8Format(LinearFormat):
    method = "fp8"
    markers = frozenset({"weight_scale", "weight_scale_inv"})
    suffixes = frozenset({"weight", "weight_scale", "weight_scale_inv", "input_scale"})

    def __init__(self, block: tuple[int, int] | None = None, activation_scheme: str = "dynamic",
                 on_load: bool = False):
        """``block``: weight_block_size (None: a scale per tensor or row); ``on_load``: a float checkpoint that
        --quantization fp8 quantizes per output row as it loads."""
        self.block, self.activation_scheme, self.on_load = block, activation_scheme, on_load

    @classmethod
    def from_config(cls, raw: dict) -> "Fp8Format":
        where = "quantization_config (fp8)"
        field(raw, "fmt", default="e4m3", kind=str, allowed=("e4m3",), where=where)
        scheme = field(raw, "activation_scheme", default="dynamic", kind=str, allowed=("dynamic", "static"),
                       where=where)
        block = field(raw, "weight_block_size", default=None, kind=list, where=where)
        if block is not None and (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"{where}: weight_block_size must be two positive sizes, got {block!r}")
        return cls(tuple(block) if block else None, scheme)

    def dequantized(self, stored: StoredLinear) -> torch.Tensor:
        if self.block is not None:
            return fp8_dequantize(stored.need("weight"), stored.need("weight_scale_inv", "weight_scale"), self.block)
        return fp8_dequantize(stored.need("weight"), stored.need("weight_scale", "weight_scale_inv"), None)

    def fp8_layout(self, module: str, suffixes: frozenset[str]) -> Fp8Layout | None:
        return Fp8Layout(self.block[1] if self.block is not None else None)

    def fp8_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor]:
        if self.block is not None:
            scale = stored.need("weight_scale_inv", "weight_scale")
        else:
            scale = stored.need("weight_scale", "weight_scale_inv")
        return fp8_weight_and_scales(stored.need("weight"), scale, self.block, stored.module)

    def quantizes_float_weight(self, name: str) -> bool:
        return self.on_load and PROJECTION.fullmatch(name) is not None

    def quantized_on_load(self, weight: torch.Tensor) -> torch.Tensor:
        return fp8_dequantize(*fp8_round_per_row(weight), None)

    def describe(self) -> str:
        scales = f"{self.block[0]} x {self.block[1]} blocks" if self.block else "per tensor or row"
        how = "quantized at load, per row" if self.on_load else f"scales {scales}"
        return f"fp8 ({how}; {self.activation_scheme} activations)"
