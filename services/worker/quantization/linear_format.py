"""What every quantized checkpoint format says about one linear layer: which tensors it stores beside (or
instead of) ``weight``, and how they become the tensors the model loads.

A layer is quantized when the checkpoint holds any of the format's tensors for it besides ``weight`` (a
scale, packed weights); the loader gathers all of that layer's ``suffixes`` (checkpoint_stream.py) and asks the format
for the converted tensors: a float32 weight (the format's published dequantization), or, for a layer the
model runs in int8, the int8 weight and its per-row scale.
"""

from __future__ import annotations

import torch

from services.worker.quantization.fp8_linear import Fp8Layout
from services.worker.quantization.wna16_linear import PackedLayout


class StoredLinear:
    """The tensors the checkpoint holds for one quantized layer, by suffix."""

    def __init__(self, module: str, tensors: dict[str, torch.Tensor], method: str):
        self.module, self.tensors, self.method = module, tensors, method

    def need(self, *suffixes: str) -> torch.Tensor:
        """The first of ``suffixes`` stored (several: names that mean the same), or a clear error."""
        for suffix in suffixes:
            if suffix in self.tensors:
                return self.tensors[suffix]
        names = " or ".join(f"{self.module}.{s}" for s in suffixes)
        raise ValueError(f"missing tensor {names}: a {self.method} checkpoint stores it for each quantized layer")

    def get(self, suffix: str) -> torch.Tensor | None:
        return self.tensors.get(suffix)


class LinearFormat:
    """One quantization method's storage of linear layers. Subclasses set the class attributes and
    ``dequantized``; ``describe`` is what the worker logs once at start."""

    method = ""
    markers: frozenset[str] = frozenset()  # the scales or packed weights a quantized layer cannot lack
    suffixes: frozenset[str] = frozenset()  # all of a quantized layer's tensors (its bias aside)

    def dequantized(self, stored: StoredLinear) -> torch.Tensor:
        """The layer's weight as float32 ``[out, in]``."""
        raise NotImplementedError

    def converted(self, stored: StoredLinear, keep_int8: bool) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs for the model: ``keep_int8`` where the model holds the layer as Int8Linear."""
        if keep_int8:
            raise ValueError(f"{stored.module}: a {self.method} layer cannot run in int8")
        return [(f"{stored.module}.weight", self.dequantized(stored))]

    @property
    def runs_int8(self) -> bool:
        """Whether the model runs this format's layers as W8A8 int8 (else in float, dequantized at load)."""
        return False

    @property
    def static_int8(self) -> bool:
        """Whether those int8 activations take the checkpoint's input_scale (else one scale per token)."""
        return False

    def wna16_layout(self, module: str, suffixes: frozenset[str]) -> PackedLayout | None:
        """The bits and group size when a layer stored with these tensors can run in the weight-only GEMM
        (wna16_linear.py) as it is stored; None: it is dequantized at load."""
        return None

    def wna16_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(unsigned codes ``[out, in]``, scales and zero points ``[out, groups]``) of a layer wna16_layout took."""
        raise NotImplementedError

    def fp8_layout(self, module: str, suffixes: frozenset[str]) -> Fp8Layout | None:
        """How a layer stored with these tensors is scaled when it can stay FP8 (fp8_linear.py, on GPUs with FP8
        arithmetic); None: it is dequantized at load."""
        return None

    def fp8_parts(self, stored: StoredLinear) -> tuple[torch.Tensor, torch.Tensor]:
        """(e4m3 weight ``[out, in]``, float32 scales ``[out, 1]`` or ``[out, k_blocks]``) of a layer fp8_layout
        took: the tensors an Fp8Linear holds."""
        raise NotImplementedError

    def quantizes_float_weight(self, name: str) -> bool:
        """Whether a float weight of this name is quantized at load (--quantization on a float checkpoint)."""
        return False

    def quantized_on_load(self, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def describe(self) -> str:
        return self.method
