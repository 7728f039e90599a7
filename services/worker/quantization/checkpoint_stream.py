"""The checkpoint's tensors as the model loads them: each quantized layer's tensors gathered (they may come
in any order, from any shard) and converted by its format (linear_format.py); every other tensor as it is.

Which layers are quantized, and which of their tensors to wait for, is known before the first tensor is read:
the names are listed first (cheap: safetensors' header).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import torch

from services.worker.quantization.dequantize import fp8_round_per_row
from services.worker.quantization.linear_format import LinearFormat, StoredLinear
from services.worker.quantization.packing import pack_rows
from services.worker.quantization.stored_layers import FP8, INT8, WNA16
from services.worker.quantization.wna16_linear import SUFFIXES as WNA16_SUFFIXES

# Stored-quantized dtypes: a weight in one of these without its scales would load as meaningless numbers.
_QUANTIZED_DTYPES = (torch.int8, torch.int32, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2)


def quantized_layers(names: Iterable[str], fmt: LinearFormat) -> dict[str, frozenset[str]]:
    """Layer name -> the suffixes the checkpoint stores for it, for each layer holding any of the format's
    tensors besides ``weight`` (one holding only some of them is then refused naming the missing one)."""
    stored: dict[str, set[str]] = {}
    for name in names:
        module, _, suffix = name.rpartition(".")
        if suffix in fmt.suffixes:
            stored.setdefault(module, set()).add(suffix)
    return {module: frozenset(suffixes) for module, suffixes in stored.items() if suffixes - {"weight"}}


def converted_weights(weights: Iterable[tuple[str, torch.Tensor]], layers: dict[str, frozenset[str]],
                      fmt: LinearFormat, kept: Mapping[str, str] = MappingProxyType({})
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each of ``layers`` converted once all its tensors have come; ``kept``: the layers the
    model holds as stored (stored_layers.py): INT8 (Int8Linear: the int8 weight and scales pass through), WNA16
    (WNA16Linear: codes repacked output-major, with scales and zero points), FP8 (Fp8Linear: the e4m3 weight,
    scales per row); the others are dequantized."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        module, _, suffix = name.rpartition(".")
        if module in layers and suffix in fmt.suffixes:
            parts = pending.setdefault(module, {})
            parts[suffix] = tensor
            if parts.keys() == layers[module]:
                stored = StoredLinear(module, pending.pop(module), fmt.method)
                how = kept.get(module)
                if how == WNA16:
                    bits = fmt.wna16_layout(module, layers[module]).bits
                    yield from wna16_tensors(module, bits, *fmt.wna16_parts(stored))
                elif how == FP8:
                    yield from fp8_tensors(module, *fmt.fp8_parts(stored))
                else:
                    yield from fmt.converted(stored, how == INT8)
        elif fmt.quantizes_float_weight(name):
            if kept.get(module) == FP8:
                yield from fp8_tensors(module, *fp8_round_per_row(tensor))
            else:
                yield name, fmt.quantized_on_load(tensor)
        else:
            if suffix == "weight" and tensor.dtype in _QUANTIZED_DTYPES:
                raise ValueError(f"{name} is stored as {tensor.dtype}, but the checkpoint has none of "
                                 f"{', '.join(sorted(fmt.markers))} for it")
            yield name, tensor
    if pending:  # the listing promised tensors the files did not hold
        module, parts = next(iter(pending.items()))
        raise ValueError(f"{module}: only {', '.join(sorted(parts))} of {', '.join(sorted(layers[module]))} found")


def fp8_tensors(module: str, weight: torch.Tensor, scales: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """An Fp8Linear's tensors: its e4m3 weight ``[out, in]`` and scales ``[out, 1 or k_blocks]``."""
    yield f"{module}.weight", weight
    yield f"{module}.weight_scale", scales


def wna16_tensors(module: str, bits: int, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """A WNA16Linear's tensors from a layer's codes ``[out, in]``, scales and zero points ``[out, groups]``."""
    for suffix, tensor in zip(WNA16_SUFFIXES, (pack_rows(codes, bits), scales, zeros.float())):
        yield f"{module}.{suffix}", tensor
