"""The formats' published arithmetic from stored integers (or FP8 values) back to a float32 weight
``[out, in]``: what transformers would compute with, and what the loader writes when a layer runs in float.

    integer codes:  w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)]   (z = 0 when symmetric)
    FP8:            w[n, k] = float(q[n, k]) * s  (s per tensor, per output row, or per block)

where ``g(k)`` is column k's group: ``k // group_size``, or a checkpoint's ``g_idx[k]`` (GPTQ's act-order).
"""

from __future__ import annotations

import math

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def group_index(in_features: int, group_size: int | None, g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """Each input column's group ``[in]`` (long): ``g_idx`` when stored, else runs of ``group_size`` (None:
    one group, a scale per output row)."""
    if g_idx is not None:
        if tuple(g_idx.shape) != (in_features,):
            raise ValueError(f"g_idx has shape {tuple(g_idx.shape)}, expected ({in_features},)")
        return g_idx.long()
    if group_size is None:
        return torch.zeros(in_features, dtype=torch.long)
    return torch.arange(in_features) // group_size


def grouped_dequantize(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                       groups: torch.Tensor) -> torch.Tensor:
    """``codes [out, in]`` (integers), ``scales`` and ``zeros`` ``[out, num_groups]``, ``groups [in]`` ->
    float32 ``[out, in]``."""
    num_groups = int(groups.max()) + 1 if groups.numel() else 0
    if scales.dim() != 2 or scales.shape[0] != codes.shape[0] or scales.shape[1] < num_groups:
        raise ValueError(f"scales have shape {tuple(scales.shape)}, expected ({codes.shape[0]}, {num_groups})")
    if zeros is not None and zeros.shape != scales.shape:
        raise ValueError(f"zero points have shape {tuple(zeros.shape)}, expected {tuple(scales.shape)}")
    shifted = codes.float() if zeros is None else codes.float() - zeros.float()[:, groups]
    return shifted * scales.float()[:, groups]


def per_row_scale(scale: torch.Tensor, rows: int, what: str) -> torch.Tensor:
    """A per-tensor (one value) or per-output-row scale as float32 ``[rows, 1]``."""
    if scale.numel() == 1:
        return scale.float().reshape(1, 1).expand(rows, 1).contiguous()
    if scale.numel() == rows and scale.dim() <= 2 and (scale.dim() < 2 or scale.shape[1] == 1):
        return scale.float().reshape(rows, 1)
    raise ValueError(f"{what} has shape {tuple(scale.shape)}: neither one value nor one per output row ({rows})")


def block_dequantize(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``values [out, in]`` times one scale per ``block`` (rows, columns) tile; edge tiles may be partial."""
    out, inp = values.shape
    expected = (math.ceil(out / block[0]), math.ceil(inp / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"block scales have shape {tuple(scale.shape)}, expected {expected} for a {out} x {inp} "
                         f"weight in {block[0]} x {block[1]} blocks")
    tiles = scale.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return values.float() * tiles[:out, :inp]


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """An FP8 weight with its scale: per block, per tensor or per output row."""
    if weight.dtype not in FP8_DTYPES:
        raise ValueError(f"weight is {weight.dtype}, expected FP8 ({', '.join(map(str, FP8_DTYPES))})")
    if block is not None:
        return block_dequantize(weight, scale, block)
    return weight.float() * per_row_scale(scale, weight.shape[0], "weight_scale")


def fp8_weight_and_scales(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, module: str
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """An e4m3 weight ``[out, in]`` as stored, and its scales as an Fp8Linear holds them (fp8_linear.py): one per
    output row ``[out, 1]``, or each block's repeated on its rows ``[out, ceil(in / block columns)]``."""
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{module}.weight is {weight.dtype}; FP8 layers run from torch.float8_e4m3fn")
    rows, columns = weight.shape
    if block is None:
        return weight, per_row_scale(scale, rows, f"{module}.weight_scale")
    expected = (math.ceil(rows / block[0]), math.ceil(columns / block[1]))
    if tuple(scale.shape) != expected:
        raise ValueError(f"{module}: block scales have shape {tuple(scale.shape)}, expected {expected}")
    return weight, scale.float().repeat_interleave(block[0], dim=0)[:rows].contiguous()


def int8_dequantize(weight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None) -> torch.Tensor:
    """An int8 weight with a scale (and zero point) per tensor or per output row."""
    if weight.dtype != torch.int8:
        raise ValueError(f"weight is {weight.dtype}, expected torch.int8")
    rows = weight.shape[0]
    shifted = weight.float() if zero is None else weight.float() - per_row_scale(zero, rows, "weight_zero_point")
    return shifted * per_row_scale(scale, rows, "weight_scale")


def fp8_round_per_row(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A float weight -> (float8_e4m3fn ``[out, in]``, float32 scales ``[out, 1]``): --quantization fp8 on a
    float checkpoint, each row scaled so its largest value is e4m3's largest (448)."""
    weight = weight.float()
    scale = (weight.abs().amax(dim=1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max).clamp_min(1e-12)
    return (weight / scale).to(torch.float8_e4m3fn), scale
