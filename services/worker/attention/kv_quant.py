"""An FP8 KV cache (--kv-cache-dtype fp8, fp8_e4m3 or fp8_e5m2, vLLM's values): K and V stored as 8-bit
floats, each layer's K (and V) divided by its own scale so that its range fits the format, and read back
times it. A block takes half the bytes of a 16-bit cache's (a quarter of float32's), so the same memory holds
twice (four times) the blocks; block moves (swap, copy-on-write, prefix caching) copy bytes as before.

The scales are the checkpoint's where it has them (``self_attn.k_scale`` / ``v_scale``, as llm-compressor
writes them; older FP8 checkpoints' ``k_proj.output_scale`` / ``v_proj.output_scale``; ``kv_scale`` for both),
else 1.0, as vLLM's default; with --calculate-kv-scales, measured from the first batch. Values beyond the
format's largest are clamped to it.

Every backend computes the same thing: attention over K and V dequantized as ``float(code) * scale``, which
tests/worker/test_fp8_kv_cache.py checks against the reference attention over exactly those values. The
kernels fold K's scale into the softmax scale and V's into the output, rather than scaling every element.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pools' dtype for --kv-cache-dtype ``name`` ("auto": the model's)."""
    return model_dtype if name == "auto" else KV_CACHE_DTYPES[name]


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_KV_DTYPES


@dataclass(frozen=True)
class KVScales:
    """Each layer's K and V scale (what a stored code is multiplied by)."""
    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> "KVScales":
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def of(self, layer: int) -> tuple[float, float]:
        return self.k[layer], self.v[layer]

    def of_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        """The scales this step's new ``k`` and ``v`` are stored with: fixed ones."""
        return self.of(layer)


class MeasuredKVScales:
    """--calculate-kv-scales: each layer's scales from the first K and V it stores (their largest magnitude
    over the format's largest value), then fixed, so every later code means the same."""

    def __init__(self, num_layers: int, dtype: torch.dtype):
        self.largest = torch.finfo(dtype).max
        self.found: list[tuple[float, float] | None] = [None] * num_layers

    def of_step(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[float, float]:
        if self.found[layer] is None:
            self.found[layer] = (self._measured(k), self._measured(v))
        return self.found[layer]

    def forget(self) -> None:
        """Measure again from the next batch (after a start-up's warm-up passes over made-up inputs)."""
        self.found = [None] * len(self.found)

    def _measured(self, x: torch.Tensor) -> float:
        return max(x.abs().max().item() / self.largest, 1e-8) if x.numel() else 1.0


def quantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """``x / scale`` in the cache's FP8 format, clamped to its range (float32 arithmetic)."""
    largest = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-largest, largest).to(dtype)


def dequantize_kv(codes: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """What the cache holds, as ``dtype``: float(code) * scale."""
    return (codes.float() * scale).to(dtype)


_CHECKPOINT_SCALE = re.compile(r"(?:.*\.)?layers\.(\d+)\.self_attn\.(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)")


def checkpoint_kv_scale(name: str) -> tuple[int, str] | None:
    """(layer, "k", "v" or "kv") for a checkpoint's KV-cache scale tensor; None for any other name."""
    match = _CHECKPOINT_SCALE.fullmatch(name)
    if match is None:
        return None
    return int(match[1]), match[2] or match[3]


def scales_from_checkpoint(found: dict[tuple[int, str], float], num_layers: int) -> KVScales:
    """Each layer's scales from what the checkpoint held ((layer, k|v|kv) -> value), 1.0 where it held none."""
    def scale(layer: int, which: str) -> float:
        return float(found.get((layer, which), found.get((layer, "kv"), 1.0)))

    return KVScales(tuple(scale(i, "k") for i in range(num_layers)), tuple(scale(i, "v") for i in range(num_layers)))
