"""Linear layers with their weights pre-arranged for oneDNN's CPU matmul.

``F.linear`` in float32 on the CPU goes to MKL, which on AMD processors measured here runs at
about 200 GFLOPS against oneDNN's ~450 on the same shapes (``benchmarks/cpu_linear.py``):
oneDNN uses AVX-512 wherever the CPU has it, and a weight reordered once into its blocked layout
is not re-packed on every call. vLLM's CPU backend does the same through its own oneDNN binding.

Packing happens once, after the checkpoint is loaded; the packed layer replaces the module in
place, and the original weight is dropped, except where something else still holds it (a tied
embedding). float32 and bfloat16 are packed (bfloat16 where oneDNN runs it natively, AVX-512 or
AMX): bfloat16 ``F.linear`` reaches oneDNN too, but re-packs the weight on every call, which costs
a third or more at the row counts of decode steps (64 rows: 235 against 368 GFLOPS; the same
results). oneDNN's float16 reorder needs CPU features many machines lack.
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.cpu_tuning import runs_emulated

# oneDNN chooses its blocking for a typical row count; any row count still works.
ROWS_HINT = 256


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.float32, torch.bfloat16) and not runs_emulated(dtype, device)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` held in oneDNN's blocked layout."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (any strides) -> ``[..., out]``."""
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear_layers(model: nn.Module, skip: tuple[nn.Module, ...] = ()) -> int:
    """Replace every ``nn.Linear`` inside ``model`` (but inside the modules of ``skip``) by a ``PackedLinear``;
    returns how many."""
    replaced = 0
    skipped = {id(module) for part in skip for module in part.modules()}
    for parent in list(model.modules()):
        if id(parent) in skipped:
            continue
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
