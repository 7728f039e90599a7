"""Projections with LoRA adapters beside them: ``y = W x + sum over parts of B_p (A_p x)``, per token's adapter.

Every wrapped projection holds room for ``num_slots`` adapters of rank up to ``max_rank``, one per
fused part (q, k and v of qkv_proj; gate and up of gate_up_proj; one part for o_proj and down_proj):

- ``lora_a [S * P * R, in]``: slot s, part p's A in rows ``(s * P + p) * R`` onwards (unused rows zero);
- ``lora_b [S * P * R, out]``: B transposed, in the same rows; part p's rows reach only its own output
  columns (block diagonal), its scaling (alpha / r) folded in.

A step's tokens run through their own slot's adapter, or none: the shrink ``x @ A^T`` covers the slots
the step uses (the span from the lowest to the highest: a slice, contiguous in both matrices), a
``[T, slots]`` mask keeps each token's own, and the expand is one matmul. That costs the other slots'
rows in the span (small: S * P * R beside the layer's thousands of columns), needs no sort and no host
sync, and a step in which no token has an adapter skips both matmuls. The mask lives in one
``LoRABatch`` that every wrapped layer of the model reads, set by the worker before each forward pass.

With tensor parallelism a column-parallel projection (q/k/v, gate/up) takes this rank's rows of B and
all of A; a row-parallel one (o_proj, down_proj) its columns of A and all of B: its partial products are
summed by the all-reduce that sums the layer's own (B (A_1 x_1 + A_2 x_2) = B A_1 x_1 + B A_2 x_2).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class LoRABatch:
    """Which adapter slot each token of the current step runs through; one per model."""

    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.num_slots, self.dtype, self.device = num_slots, dtype, device
        # [T, hi - lo] bool: token t uses slot lo + j; None: no token uses any.
        self.mask: torch.Tensor | None = None
        self.lo, self.hi = 0, 0  # the slots the step uses lie in [lo, hi)
        self.sequence_slots: list[int | None] = []  # the step's, per sequence, as set_token_slots was told
        # The mask's rows for the step's output rows, which alone run the last layer past its attention
        # (services/worker/output_rows.py); None: every row runs every layer.
        self.output_mask: torch.Tensor | None = None

    def set_token_slots(self, slots: list[int | None], counts: list[int]) -> None:
        """Sequence i's ``counts[i]`` consecutive tokens use slot ``slots[i]`` (None: the base model alone)."""
        used = [slot for slot in slots if slot is not None]
        if not used:
            self.clear()
            return
        self.sequence_slots = list(slots)
        self.lo, self.hi = min(used), max(used) + 1
        width = self.hi - self.lo
        per_token = torch.repeat_interleave(
            torch.tensor([width if slot is None else slot - self.lo for slot in slots]), torch.tensor(counts))
        # One column more for "no adapter", then dropped: those rows are all zero.
        mask = F.one_hot(per_token, width + 1)[:, :width]
        self.mask = mask.bool().to(self.device)
        self.output_mask = None

    def keep_output_rows(self, rows: torch.Tensor) -> None:
        """The step's last layer runs only ``rows`` (ascending indices into its tokens, fewer than all) past its
        attention; the mask's rows for them."""
        self.output_mask = None if self.mask is None else self.mask.index_select(0, rows)

    def mask_for(self, num_rows: int) -> torch.Tensor:
        """The mask for a projection of ``num_rows`` rows: every token's, or the output rows' (keep_output_rows)."""
        if num_rows == self.mask.shape[0]:
            return self.mask
        if self.output_mask is None or num_rows != self.output_mask.shape[0]:
            raise RuntimeError(f"a projection of {num_rows} rows in a step of {self.mask.shape[0]} tokens")
        return self.output_mask

    def clear(self) -> None:
        self.mask, self.lo, self.hi, self.sequence_slots, self.output_mask = None, 0, 0, [], None

    def decode_mask(self, size: int) -> torch.Tensor:
        """``[size, num_slots]`` bool on the host: row i, the step's sequence i's slot (one token each, a decode);
        rows past the step's sequences (a graph's padding) use none."""
        mask = torch.zeros(size, self.num_slots, dtype=torch.bool)
        for row, slot in enumerate(self.sequence_slots):
            if slot is not None:
                mask[row, slot] = True
        return mask

    @contextmanager
    def every_slot(self, mask: torch.Tensor) -> Iterator[None]:
        """The layers read ``mask [T, num_slots]`` over all slots while inside: how a decode graph is captured,
        so that one graph serves any slots (its replays read the mask's buffer, refilled before each)."""
        saved = self.mask, self.lo, self.hi, self.output_mask
        self.mask, self.lo, self.hi, self.output_mask = mask, 0, self.num_slots, None
        try:
            yield
        finally:
            self.mask, self.lo, self.hi, self.output_mask = saved


class LoRALinear(nn.Module):
    """``base`` (an nn.Linear or a packed one) plus the adapters of the step's tokens."""

    def __init__(self, base: nn.Module, in_features: int, part_sizes: list[int], batch: LoRABatch, max_rank: int):
        super().__init__()
        self.base = base
        self.part_sizes = list(part_sizes)
        self.part_starts = [sum(part_sizes[:p]) for p in range(len(part_sizes))]
        self.max_rank = max_rank
        self.batch = [batch]  # in a list: the shared object is not a submodule
        slots, parts = batch.num_slots, len(part_sizes)
        width = slots * parts * max_rank
        self.register_buffer("lora_a", torch.zeros(width, in_features, dtype=batch.dtype, device=batch.device))
        self.register_buffer("lora_b", torch.zeros(width, sum(part_sizes), dtype=batch.dtype, device=batch.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, in]``, or ``[1, T, in]`` as transformers' modelling code passes a step's tokens."""
        out = self.base(x)
        batch = self.batch[0]
        if batch.mask is None:
            return out
        flat_x, flat_out = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        per_slot = len(self.part_sizes) * self.max_rank
        rows = slice(batch.lo * per_slot, batch.hi * per_slot)
        shrunk = F.linear(flat_x, self.lora_a[rows])
        # Selected, not multiplied by 0/1: an inf in another slot's product (float16 overflow) times 0 is NaN.
        mask = batch.mask_for(flat_x.shape[0])
        shrunk = torch.where(mask[:, :, None], shrunk.view(flat_x.shape[0], batch.hi - batch.lo, per_slot), 0)
        shrunk = shrunk.view(flat_x.shape[0], -1)
        flat_out.addmm_(shrunk, self.lora_b[rows])
        return out

    def _rows(self, slot: int, part: int, rank: int | None = None) -> slice:
        """The rows of both matrices that hold the slot's part (its first ``rank`` of them)."""
        start = (slot * len(self.part_sizes) + part) * self.max_rank
        return slice(start, start + (self.max_rank if rank is None else rank))

    def clear_slot(self, slot: int) -> None:
        for part in range(len(self.part_sizes)):
            rows = self._rows(slot, part)
            self.lora_a[rows] = 0
            self.lora_b[rows] = 0

    def set_part(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """This rank's ``a [r, in]`` and ``b [part's outputs, r]`` (already scaled) into the slot's part."""
        rows = self._rows(slot, part, a.shape[0])
        outputs = slice(self.part_starts[part], self.part_starts[part] + self.part_sizes[part])
        self.lora_a[rows] = a
        self.lora_b[rows, outputs] = b.t()


@dataclass(frozen=True)
class LoRATarget:
    """Where the adapter of one checkpoint module goes: a part of a wrapped projection, and this rank's share."""

    layer: LoRALinear
    part: int
    row_parallel: bool  # o_proj, down_proj: A's columns are split over the ranks; else B's rows are
    whole: int  # B's rows (column-parallel) or A's columns (row-parallel) in the whole model
    replicas: int = 1  # ranks holding the same rows (KV heads shared by ranks)
