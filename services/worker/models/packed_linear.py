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

On a CPU with AVX512-BF16 but no AMX (AMD's Zen 4 and later, Intel's Cooper Lake) both dtypes run in the C++
kernel of csrc/panel_linear.cpp instead, on weights packed for it: at a decode step's row counts, where every
layer's weights come from memory, oneDNN's kernels stall on them (the bench workload's bfloat16 projections: 12.7 s
in oneDNN, 11.4-11.8 s in the kernel, benchmarks/projection_shapes.py). Where AMX multiplies bfloat16, oneDNN's tiles
are faster; and the kernel was measured against oneDNN only on Zen 4 and Zen 5, so other AVX-512 CPUs keep oneDNN.
On a CPU without AVX-512 float32 runs in the kernel's AVX2 build, for the same reason: a Zen 4 whose AVX-512 the
hypervisor hid ran the bench workload 7 % faster with it (632.7 against 589.6 tok/s, medians of 3 alternated runs).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.cpu_tuning import has_amx, has_avx512, runs_emulated
from services.worker.models import cpu_layers

# oneDNN chooses its blocking for a typical row count; any row count still works.
ROWS_HINT = 256
EXACT_ROWS = 32  # row counts run as they are (padded_rows)
SIZES_PER_OCTAVE = 16  # padded sizes from one power of two to the next (a power of two, at most EXACT_ROWS)


def padded_rows(rows: int) -> int:
    """The row count a product of ``rows`` rows runs at: ``rows`` up to EXACT_ROWS, above that the next of
    SIZES_PER_OCTAVE sizes between two powers of two (at most a sixteenth more rows).

    oneDNN compiles a kernel for every row count it meets and caches it: 2-4 ms a projection of the bench model
    in bfloat16 with AMX, where the product itself takes 0.1-0.5 ms. A decode batch changes size nearly every
    step, so the engine compiled on most steps (measured on a Xeon with AMX: the bench workload in bfloat16 ran
    about 5 % faster padded; float32 no faster or slower) and, serving long enough, would cycle through more
    shapes than oneDNN's cache holds. Padding bounds them to 161 up to 8192 rows. Small row counts stay
    exact: there reading the weights sets the time, and 16 float32 rows take twice as long as one.
    """
    if rows <= EXACT_ROWS:
        return rows
    step = 1 << ((rows - 1).bit_length() - SIZES_PER_OCTAVE.bit_length())  # SIZES_PER_OCTAVE steps an octave
    return (rows + step - 1) // step * step


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype in (torch.float32, torch.bfloat16) and not runs_emulated(dtype, device)


def uses_panel_kernel(weight: torch.Tensor) -> bool:
    """Whether a packed ``weight [out, in]`` runs in csrc/panel_linear.cpp (the module's docstring says why): float32
    on a CPU with AVX2 but no AVX-512, and float32 or bfloat16 with ``in`` even on one with AVX512-BF16 but no AMX."""
    if weight.device.type != "cpu" or weight.dtype not in cpu_layers.PANEL_DTYPES or has_amx():
        return False
    if weight.dtype == torch.float32 and not has_avx512():
        return cpu_layers.has_panel_linear(torch.float32)  # (the AVX2 build's kernel)
    return ((weight.dtype != torch.bfloat16 or weight.shape[1] % 2 == 0)
            and cpu_layers.has_panel_linear(torch.bfloat16))  # (AVX512-BF16 implies AVX-512)


class PackedLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W [out, in]`` held in oneDNN's blocked layout, or panel_linear's (uses_panel_kernel)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else bias.detach()
        self.panel_kernel = uses_panel_kernel(weight)
        if self.panel_kernel:
            self.packed_weight = cpu_layers.pack_panel_weight(weight.detach())
            # (F.linear adds a bfloat16 layer's bias in float32 before its one rounding; so does the kernel)
            self.bias32 = None if bias is None else self.bias.to(weight.dtype).float().contiguous()
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ROWS_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in]`` (any strides) -> ``[..., out]``."""
        rows = x.numel() // self.in_features
        if self.panel_kernel:  # (any row count: the kernel compiles nothing per shape, so no padding)
            flat = x.reshape(rows, self.in_features)
            flat = flat if flat.stride(1) == 1 else flat.contiguous()
            out = cpu_layers.panel_linear(flat, self.packed_weight, self.out_features, self.bias32)
            return out.view(*x.shape[:-1], self.out_features)
        padded = padded_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        x_padded = x.new_empty(padded, self.in_features)  # (F.pad would write every row twice)
        x_padded[:rows].copy_(x.reshape(rows, self.in_features))
        x_padded[rows:].zero_()
        out = torch.ops.mkldnn._linear_pointwise(x_padded, self.packed_weight, self.bias, "none", [], "")
        return out[:rows].view(*x.shape[:-1], self.out_features)

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
