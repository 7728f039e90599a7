"""quant_method "compressed-tensors" (llm-compressor's checkpoints): each config group names its target
layers and how their weights (and input activations) are quantized; the group's format says how they are
stored:

- int-quantized / naive-quantized: int8 ``weight`` with ``weight_scale`` per tensor or output row (and
  ``weight_zero_point`` when asymmetric). W8A8 with dynamic per-token int8 activations runs as int8
  (models/int8_linear.py); without activation quantization it is dequantized at load.
- float-quantized: FP8 ``weight`` with ``weight_scale`` per tensor, row or block; upcast at load, activations
  unquantized, or kept FP8 on GPUs with FP8 arithmetic (as fp8_format.py).
- pack-quantized: 4- or 8-bit integers packed 32 bits at a time along the input (``weight_packed``),
  ``weight_scale [out, groups]``, ``weight_shape``, and when asymmetric ``weight_zero_point`` packed along the
  output; ``weight_g_idx`` with act-order. Dequantized at load (W4A16, W8A16), or kept packed for the GPU's
  GEMM (wna16_linear.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from services.worker.quantization.config_fields import field
from services.worker.quantization.dequantize import (FP8_DTYPES, block_dequantize, fp8_dequantize, group_index,
                                                     fp8_weight_and_scales, grouped_dequantize, int8_dequantize,
                                                     per_row_scale)
from services.worker.quantization.linear_format import LinearFormat, StoredLinear
from services.worker.quantization.packing import PACKED_BITS, unpack_int32
from services.worker.quantization.fp8_linear import Fp8Layout
from services.worker.quantization.wna16_linear import PackedLayout, kernel_takes

FORMATS = ("int-quantized", "naive-quantized", "float-quantized", "pack-quantized")
WEIGHT_STRATEGIES = ("tensor", "channel", "group", "block")
FP8_STRATEGIES = ("tensor", "channel", "block")  # what an Fp8Linear holds


@dataclass(frozen=True)
class WeightArgs:
    num_bits: int
    type: str  # "int" or "float"
    symmetric: bool
    strategy: str
    group_size: int | None
    block: tuple[int, int] | None


@dataclass(frozen=True)
class Scheme:
    """One config group: its targets, storage format and weight arguments; ``int8_tokens``: activations
    quantized to int8 per token as they come (W8A8 int8)."""
    targets: tuple[str, ...]
    format: str
    weights: WeightArgs
    int8_tokens: bool
    static_int8: bool = False  # those int8 activations scaled by the checkpoint's input_scale, not per token

    def matches(self, module: str, by_name: bool) -> bool:
        """Whether the group targets ``module``: by its name (a regex "re:..." or the name itself), or,
        ``by_name`` False, by its class (every layer here is a Linear)."""
        if not by_name:
            return "Linear" in self.targets
        return any(re.match(t[3:], module) if t.startswith("re:") else module == t or module.endswith("." + t)
                   for t in self.targets if t != "Linear")


class CompressedTensorsFormat(LinearFormat):
    method = "compressed-tensors"
    markers = frozenset({"weight_scale", "weight_packed"})
    suffixes = frozenset({"weight", "weight_scale", "weight_zero_point", "weight_packed", "weight_shape",
                          "weight_g_idx", "input_scale"})

    def __init__(self, schemes: tuple[Scheme, ...]):
        self.schemes = schemes

    @classmethod
    def from_config(cls, raw: dict) -> "CompressedTensorsFormat":
        where = "quantization_config (compressed-tensors)"
        groups = field(raw, "config_groups", kind=dict, where=where)
        default_format = field(raw, "format", default=None, kind=str, where=where)
        schemes = tuple(_scheme(name, group, default_format, f"{where} config_groups.{name}")
                        for name, group in groups.items())
        if not schemes:
            raise ValueError(f"{where}: config_groups is empty")
        if any(s.int8_tokens for s in schemes) and len(schemes) > 1:
            raise ValueError(f"{where}: W8A8 int8 mixed with other schemes is not supported; one config group is")
        return cls(schemes)

    @property
    def runs_int8(self) -> bool:
        return self.schemes[0].int8_tokens

    @property
    def static_int8(self) -> bool:
        return self.schemes[0].static_int8

    def scheme_of(self, module: str) -> Scheme:
        for by_name in (True, False):
            for scheme in self.schemes:
                if scheme.matches(module, by_name):
                    return scheme
        raise ValueError(f"{module} is stored quantized, but no config group of its compressed-tensors "
                         "quantization_config targets it")

    def converted(self, stored: StoredLinear, keep_int8: bool) -> list[tuple[str, torch.Tensor]]:
        if keep_int8 and self.scheme_of(stored.module).int8_tokens:
            weight = stored.need("weight")
            if weight.dtype != torch.int8:
                raise ValueError(f"{stored.module}.weight is {weight.dtype}, expected torch.int8")
            scale = per_row_scale(stored.need("weight_scale"), weight.shape[0], f"{stored.module}.weight_scale")
            tensors = [(f"{stored.module}.weight", weight), (f"{stored.module}.weight_scale", scale)]
            if self.scheme_of(stored.module).static_int8:
                tensors.append((f"{stored.module}.input_scale", _static_scale(stored)))
            return tensors
        return super().converted(stored, False)

    def dequantized(self, stored: StoredLinear) -> torch.Tensor:
        scheme = self.scheme_of(stored.module)
        args, scale = scheme.weights, stored.need("weight_scale")
        if scheme.format == "pack-quantized":
            return _unpacked(stored, args, scale)
        weight = stored.need("weight")
        if weight.dtype in FP8_DTYPES:
            return fp8_dequantize(weight, scale, args.block if args.strategy == "block" else None)
        if args.strategy == "group":
            groups = group_index(weight.shape[1], args.group_size, stored.get("weight_g_idx"))
            return grouped_dequantize(weight, scale, stored.get("weight_zero_point"), groups)
        if args.strategy == "block":
            return block_dequantize(weight.float() - _zero(stored), scale, args.block)
        return int8_dequantize(weight, scale, stored.get("weight_zero_point"))

    def wna16_layout(self, module: str, suffixes: frozenset[str]) -> PackedLayout | None:
        """pack-quantized groups the kernel takes, in order (no g_idx)."""
        if "weight_g_idx" in suffixes:
            return None
        scheme = self.scheme_of(module)
        args = scheme.weights
        fits = scheme.format == "pack-quantized" and args.strategy == "group"
        return PackedLayout(args.num_bits, args.group_size) if fits and kernel_takes(args.num_bits, args.group_size) \
            else None

    def wna16_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _packed_parts(stored, self.scheme_of(stored.module).weights, stored.need("weight_scale"))

    def fp8_layout(self, module: str, suffixes: frozenset[str]) -> Fp8Layout | None:
        """float-quantized (FP8) weights, scaled per tensor, row or block."""
        scheme = self.scheme_of(module)
        args = scheme.weights
        if scheme.format != "float-quantized" or args.type != "float" or args.strategy not in FP8_STRATEGIES:
            return None
        return Fp8Layout(args.block[1] if args.strategy == "block" else None)

    def fp8_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor]:
        args = self.scheme_of(stored.module).weights
        return fp8_weight_and_scales(stored.need("weight"), stored.need("weight_scale"),
                                     args.block if args.strategy == "block" else None, stored.module)

    def describe(self) -> str:
        kinds = sorted({f"{s.format} {s.weights.type}{s.weights.num_bits} {s.weights.strategy}"
                        + (" with int8 per-token activations" if s.int8_tokens else "") for s in self.schemes})
        return f"compressed-tensors ({'; '.join(kinds)})"


def _static_scale(stored: StoredLinear) -> torch.Tensor:
    """A layer's calibrated input scale, float32 [1]: one positive value."""
    scale = stored.need("input_scale").float().reshape(-1)
    if scale.numel() != 1 or not bool(scale[0] > 0):
        raise ValueError(f"{stored.module}.input_scale must be one positive value, got {scale.tolist()[:4]}")
    return scale


def _zero(stored: StoredLinear) -> torch.Tensor | float:
    zero = stored.get("weight_zero_point")
    return 0.0 if zero is None else zero.float()


def _unpacked(stored: StoredLinear, args: WeightArgs, scale: torch.Tensor) -> torch.Tensor:
    codes, scale, zeros = _packed_parts(stored, args, scale)
    group_size = args.group_size if args.strategy == "group" else None
    groups = group_index(codes.shape[1], group_size, stored.get("weight_g_idx"))
    return grouped_dequantize(codes, scale, zeros, groups)


def _packed_parts(stored: StoredLinear, args: WeightArgs, scale: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack-quantized: unsigned codes ``[out, in]`` from the words, scales and zero points ``[out, groups]``;
    the signed values were stored shifted by 2^(bits-1), so an absent zero point is that shift."""
    shape = stored.need("weight_shape")
    rows, columns = (int(v) for v in shape.tolist())
    codes = unpack_int32(stored.need("weight_packed"), args.num_bits, 1)[:, :columns]
    if codes.shape[0] != rows:
        raise ValueError(f"{stored.module}.weight_packed holds {codes.shape[0]} rows, weight_shape says {rows}")
    if scale.dim() == 1 or scale.numel() == 1:
        scale = per_row_scale(scale, rows, f"{stored.module}.weight_scale")
    packed_zero = stored.get("weight_zero_point")
    if args.symmetric or packed_zero is None:
        if not args.symmetric:
            stored.need("weight_zero_point")
        zeros = torch.full(scale.shape, 1 << (args.num_bits - 1), dtype=torch.int32)
    else:
        zeros = unpack_int32(packed_zero, args.num_bits, 0)[:rows]
    return codes, scale, zeros


def _scheme(name: str, group: dict, default_format: str | None, where: str) -> Scheme:
    if not isinstance(group, dict):
        raise ValueError(f"{where} must be an object")
    targets = tuple(field(group, "targets", kind=list, where=where))
    fmt = field(group, "format", default=default_format, kind=str, allowed=FORMATS, where=where)
    if fmt is None:
        raise ValueError(f"{where}: no format, here or at the top of quantization_config")
    weights = _weight_args(field(group, "weights", kind=dict, where=where), fmt, f"{where}.weights")
    acts = group.get("input_activations")
    int8 = _int8_activations(acts, weights, f"{where}.input_activations")
    return Scheme(targets, fmt, weights, int8 is not None, int8 == "static")


def _weight_args(raw: dict, fmt: str, where: str) -> WeightArgs:
    kind = field(raw, "type", default="int", kind=str, allowed=("int", "float"), where=where)
    bits = field(raw, "num_bits", kind=int, allowed=PACKED_BITS if fmt == "pack-quantized" else (8,), where=where)
    strategy = field(raw, "strategy", default="tensor", kind=str, allowed=WEIGHT_STRATEGIES, where=where)
    group_size = field(raw, "group_size", default=None, kind=int, where=where) if strategy == "group" else None
    if strategy == "group" and (group_size is None or group_size <= 0):
        raise ValueError(f"{where}: strategy 'group' needs a positive group_size, got {group_size!r}")
    block = field(raw, "block_structure", default=None, kind=list, where=where) if strategy == "block" else None
    if strategy == "block" and (block is None or len(block) != 2 or not all(isinstance(b, int) and b > 0
                                                                           for b in block)):
        raise ValueError(f"{where}: strategy 'block' needs block_structure [rows, columns], got {block!r}")
    if (kind == "float") != (fmt == "float-quantized") and fmt != "naive-quantized":
        raise ValueError(f"{where}: {kind} weights cannot be stored {fmt}")
    if kind == "float" and strategy == "group":
        raise ValueError(f"{where}: group-wise FP8 weights are not supported; tensor, channel and block are")
    return WeightArgs(bits, kind, field(raw, "symmetric", default=True, kind=bool, where=where), strategy, group_size,
                      tuple(block) if block else None)


def _int8_activations(acts: dict | None, weights: WeightArgs, where: str) -> str | None:
    """How activations are quantized to int8: "dynamic" (per token, as they come) or "static" (the checkpoint's
    per-tensor input_scale); None: not at all (FP8 activations run unquantized on the CPU path, as
    fp8_format.py says). Anything else is refused."""
    if acts is None:
        return None
    kind = field(acts, "type", default="int", kind=str, allowed=("int", "float"), where=where)
    if kind == "float":
        return None
    field(acts, "num_bits", kind=int, allowed=(8,), where=where)
    dynamic = field(acts, "dynamic", default=False, kind=(bool, str), where=where)
    if dynamic not in (True, False):
        raise ValueError(f"{where}: dynamic {dynamic!r} is not supported; true (per token) and false (a static "
                         "per-tensor scale) are")
    field(acts, "strategy", default="tensor", kind=str, allowed=("token",) if dynamic else ("tensor",), where=where)
    if not field(acts, "symmetric", default=True, kind=bool, where=where):
        raise ValueError(f"{where}: asymmetric int8 activations are not supported; symmetric ones are")
    if weights.type != "int" or weights.strategy not in ("tensor", "channel") or not weights.symmetric:
        raise ValueError(f"{where}: int8 activations need symmetric int8 weights per tensor or channel, got "
                         f"{weights.type} {weights.strategy}")
    return "dynamic" if dynamic else "static"
