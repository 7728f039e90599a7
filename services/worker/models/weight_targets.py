"""Where each Hugging Face checkpoint tensor goes in our model: its fused weight, and this rank's part.

Our model fuses q/k/v and gate/up into one matrix each, and stacks the experts of a sparse layer, so
one parameter receives several checkpoint tensors, each into its own rows. With tensor parallelism a
rank takes its rows of the column-parallel layers (q/k/v, gate/up: by their outputs) and its columns of
the row-parallel ones (o_proj, down_proj: by their inputs); see tensor_parallel.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from services.worker.quantization.wna16_linear import SUFFIXES as WNA16_SUFFIXES, WNA16Linear
from services.worker.tensor_parallel import TensorParallel

HF_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")  # gate, up, down
# A fused layer's tensors, split by rows: a float or int8 layer's weight (and int8's scales), or a WNA16Linear's.
FUSED_SUFFIXES = ("weight", "bias", "weight_scale", *WNA16_SUFFIXES)


class Target:
    """Where a checkpoint tensor goes: rows [start, start + rows) of ``param``, from the checkpoint's
    slice ``part`` along ``dim`` (this rank's share, of the checkpoint's ``whole`` along it; None: all)."""

    __slots__ = ("param", "start", "rows", "dim", "part", "whole")

    def __init__(self, param: torch.Tensor, start: int, rows: int, dim: int = 0, part: slice | None = None,
                 whole: int = 0):
        self.param, self.start, self.rows, self.dim, self.part, self.whole = param, start, rows, dim, part, whole

    def source_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape."""
        shape = [self.rows, *self.param.shape[1:]]
        if self.part is not None:
            shape[self.dim] = self.whole
        return tuple(shape)

    def copy_from(self, tensor: torch.Tensor) -> None:
        if self.part is not None:
            tensor = tensor[self.part] if self.dim == 0 else tensor[:, self.part]
        self.param[self.start:self.start + self.rows].copy_(tensor)


class WeightTargets(dict):
    """HF name -> ``Target``, or None for a tensor another rank loads (a row-parallel bias: rank 0's)."""

    def __init__(self, tp: TensorParallel):
        super().__init__()
        self.tp = tp

    def whole(self, name: str, tensor: torch.Tensor) -> None:
        self[name] = Target(tensor, 0, tensor.shape[0])

    def parts(self, prefix: str, suffix: str, fused: torch.Tensor, names: Iterable[str], sizes: Iterable[int],
              replicas: Iterable[int]) -> None:
        """Consecutive rows of ``fused`` from ``{prefix}.{name}.{suffix}``, each this rank's ``size`` rows of
        it (``replicas``: how many ranks hold the same rows, for KV heads shared by ranks)."""
        start = 0
        for name, size, shared in zip(names, sizes, replicas):
            whole_rows = size * self.tp.size // shared
            self[f"{prefix}.{name}.{suffix}"] = Target(fused, start, size, 0, self.tp.rows(whole_rows, shared),
                                                       whole_rows)
            start += size

    def input_scales(self, prefix: str, linear: nn.Module, names: Iterable[str]) -> None:
        """A static-int8 layer's input scale per fused part, ``{prefix}.{name}.input_scale``, whole on every
        rank (each part's input is the same whole activation)."""
        scales = getattr(linear, "input_scale", None)
        if scales is not None:
            for i, name in enumerate(names):
                self[f"{prefix}.{name}.input_scale"] = Target(scales, i, 1)

    def columns(self, name: str, tensor: torch.Tensor) -> None:
        """This rank's inputs of a row-parallel layer's weight."""
        whole_columns = tensor.shape[1] * self.tp.size
        self[name] = Target(tensor, 0, tensor.shape[0], 1, self.tp.rows(whole_columns), whole_columns)

    def row_parallel(self, name: str, linear: nn.Linear, has_bias: bool) -> None:
        """A row-parallel layer: its weight's columns; its bias whole on rank 0, which alone adds it. (An
        WNA16Linear is only built on one rank: its tensors whole.)"""
        if isinstance(linear, WNA16Linear):
            for suffix in WNA16_SUFFIXES:
                self.whole(f"{name}.{suffix}", getattr(linear, suffix))
        else:
            self.columns(f"{name}.weight", linear.weight)
        if getattr(linear, "weight_scale", None) is not None:  # an int8 layer's: one per output row, all here
            self.whole(f"{name}.weight_scale", linear.weight_scale)
        self.input_scales(name.rpartition(".")[0], linear, [name.rpartition(".")[2]])
        if linear.bias is not None:
            self.whole(f"{name}.bias", linear.bias)
        elif has_bias:
            self[f"{name}.bias"] = None

    def mlp(self, prefix: str, gate_up: nn.Linear, down: nn.Linear, has_bias: bool) -> None:
        """A SwiGLU MLP stored as gate_proj, up_proj and down_proj."""
        inter = gate_up.out_features // 2
        for suffix in FUSED_SUFFIXES:
            fused = getattr(gate_up, suffix, None)
            if fused is not None:
                self.parts(prefix, suffix, fused, HF_MLP_NAMES[:2], [inter, inter], [1, 1])
        self.input_scales(prefix, gate_up, HF_MLP_NAMES[:2])
        self.row_parallel(f"{prefix}.down_proj", down, has_bias)

    def experts(self, prefix: str, w13: torch.Tensor, w2: torch.Tensor, names: tuple[str, str, str]) -> None:
        """Stacked experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]`` from ``{prefix}.{e}.{gate|up|down}.weight``."""
        gate, up, down = names
        inter = w2.shape[2]
        for e in range(w13.shape[0]):
            self.parts(f"{prefix}.{e}", "weight", w13[e], [gate, up], [inter, inter], [1, 1])
            self.columns(f"{prefix}.{e}.{down}.weight", w2[e])


def unfuse_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], qkv_rows: tuple[int, int, int]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint that stores q/k/v or gate/up as one tensor each (Phi-3's ``self_attn.qkv_proj`` and
    ``mlp.gate_up_proj``), as the separate tensors the targets name; ``qkv_rows``: the whole model's q, k
    and v rows. Every other tensor passes as it is."""
    for name, tensor in weights:
        if ".self_attn.qkv_proj." in name:
            if tensor.shape[0] != sum(qkv_rows):
                raise ValueError(f"weight {name!r} has {tensor.shape[0]} rows, expected q, k and v's {sum(qkv_rows)}")
            for part, rows in zip(("q_proj", "k_proj", "v_proj"), tensor.split(list(qkv_rows))):
                yield name.replace(".qkv_proj.", f".{part}."), rows
        elif ".mlp.gate_up_proj." in name:
            if tensor.shape[0] % 2:
                raise ValueError(f"weight {name!r} has an odd number of rows ({tensor.shape[0]}): not gate and up")
            gate, up = tensor.chunk(2)
            yield name.replace(".gate_up_proj.", ".gate_proj."), gate
            yield name.replace(".gate_up_proj.", ".up_proj."), up
        else:
            yield name, tensor
