"""Which of a quantized checkpoint's layers the model holds as they are stored, rather than dequantized at load:

    INT8   W8A8 int8 (models/int8_linear.py): oneDNN or the reference on a CPU, the Triton int8 GEMM on a GPU
    WNA16  4- and 8-bit weight-only codes, repacked (wna16_linear.py): the Triton GEMM, on one rank
    FP8    e4m3 weights with per-row or per-block scales (fp8_linear.py): torch._scaled_mm or the block-wise
           Triton GEMM, on one rank, on GPUs with FP8 arithmetic (--quantization fp8 on a float checkpoint too)

Decided before the model is materialized, from the checkpoint's tensor names alone.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from services.worker.quantization.fp8_linear import Fp8Layout, Fp8Linear, gpu_runs_fp8, scaled_mm_runs
from services.worker.quantization.linear_format import LinearFormat
from services.worker.quantization.wna16_linear import PackedLayout, WNA16Linear

INT8, WNA16, FP8 = "int8", "wna16", "fp8"


def keep_stored_layers(model, fmt: LinearFormat, layers: dict[str, frozenset[str]], names: Iterable[str],
                       device: torch.device, dtype: torch.dtype, single_rank: bool, triton_gemms: bool
                       ) -> dict[str, str]:
    """Replace the model's projections (on the meta device) by the layers that hold ``fmt``'s tensors as stored;
    checkpoint layer -> INT8, WNA16 or FP8 for each so kept. ``layers``: the quantized layers and their
    tensors (checkpoint_stream.quantized_layers); ``names``: every tensor's name; ``dtype``: the model's;
    ``triton_gemms``: the GPU's kernels run (on a CPU, only the tests ask for them, through the
    interpreter)."""
    kept = dict.fromkeys(model.use_int8_linears(layers, fmt.static_int8), INT8) if fmt.runs_int8 else {}
    if not (triton_gemms and single_rank):
        return kept
    kept.update(dict.fromkeys(model.use_stored_layouts(_wna16_layouts(fmt, layers), WNA16Linear.replacing), WNA16))
    if device.type != "cuda" or gpu_runs_fp8(device):
        layouts = _fp8_layouts(fmt, layers, names)
        if not scaled_mm_runs(dtype, device):  # per-row layers need _scaled_mm to give dtype (tensors on device)
            layouts = {module: layout for module, layout in layouts.items() if layout.block_k is not None}
        fp8 = model.use_stored_layouts(layouts, Fp8Linear.replacing)
        kept.update(dict.fromkeys(fp8, FP8))
    return kept


def _wna16_layouts(fmt: LinearFormat, layers: dict[str, frozenset[str]]) -> dict[str, PackedLayout]:
    """Each quantized layer the weight-only GEMM can run as stored -> its bits and group size."""
    layouts = {module: fmt.wna16_layout(module, suffixes) for module, suffixes in layers.items()}
    return {module: layout for module, layout in layouts.items() if layout is not None}


def _fp8_layouts(fmt: LinearFormat, layers: dict[str, frozenset[str]], names: Iterable[str]
                 ) -> dict[str, Fp8Layout]:
    """Each layer that can stay FP8 -> how it is scaled: stored FP8, or a float weight rounded to FP8 at load."""
    layouts = {module: fmt.fp8_layout(module, suffixes) for module, suffixes in layers.items()}
    layouts.update({name.rpartition(".")[0]: Fp8Layout(None) for name in names if fmt.quantizes_float_weight(name)})
    return {module: layout for module, layout in layouts.items() if layout is not None}
