"""A mixture-of-experts layer (Mixtral, Qwen2-MoE, Qwen3-MoE): a router and SwiGLU experts.

The experts' weights are stacked, ``w13 [E, 2I, H]`` (each expert's gate and up projections, fused)
and ``w2 [E, H, I]``, the layout fused-MoE kernels take. The tokens are grouped by expert with one
sort, so each expert runs one matmul pair over all of its tokens, and the host learns the group
sizes in a single sync (transformers asks once per expert). The outputs are summed in expert order,
in the activations' dtype, as transformers does (bfloat16 outputs equal its to the bit on a CPU). With
the Triton kernels (on GPUs) fused_moe.py runs all experts in one launch per projection, with no sync
at all, and sums in float32 (equal to rounding).

With tensor parallelism every rank holds every expert, and its share of each one's intermediate
columns (like the dense MLP); the partial sums are added across ranks once, after the shared expert's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.models.layers import silu_and_mul
from services.worker.models.packed_linear import PackedLinear
from services.worker.tensor_parallel import TensorParallel
from services.worker.moe_config import MoEConfig


def select_experts(router_logits: torch.Tensor, moe: MoEConfig, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k], expert ids [T, k])``: each token's top-k experts by softmax probability (float32),
    rescaled to sum to one if the model says so, and cast to ``dtype`` unless it keeps them in float32."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(moe.top_k, dim=-1)
    if moe.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if moe.float32_weights else weights.to(dtype)), ids


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoEConfig, tp: TensorParallel, shared_expert: nn.Module | None):
        """``moe``: this rank's share (its intermediate columns of every expert); ``shared_expert``: Qwen2-MoE's
        always-on MLP (this rank's share, its output not yet summed over ranks), or None."""
        super().__init__()
        self.moe, self.tp = moe, tp
        self.gate = nn.Linear(hidden_size, moe.num_experts, bias=False)  # the router, whole on every rank
        inter = moe.intermediate_size
        self.w13 = nn.Parameter(torch.empty(moe.num_experts, 2 * inter, hidden_size))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, hidden_size, inter))
        self.shared_expert = shared_expert
        if shared_expert is not None:
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
        self.packed: list[tuple[PackedLinear, PackedLinear]] | None = None  # set by pack_experts
        self.fused = False  # the Triton kernel (fused_moe.py) instead of one matmul pair per expert

    def pack_experts(self) -> None:
        """On the CPU in float32: each expert's two projections in oneDNN's layout (see packed_linear). bfloat16
        experts stay stacked (the Triton kernel takes them under the interpreter; packing them is not measured)."""
        if self.w13.dtype != torch.float32:
            return
        # A copy each: oneDNN reorders a view of the stacked weight on every call instead of once.
        self.packed = [(PackedLinear(self.w13[e].clone(), None), PackedLinear(self.w2[e].clone(), None))
                       for e in range(self.moe.num_experts)]
        # The packed copies replace the stacked weights (an empty tensor keeps the parameter's dtype).
        self.w13 = nn.Parameter(self.w13.new_empty(0), requires_grad=False)
        self.w2 = nn.Parameter(self.w2.new_empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> the layer's output ``[T, hidden]``, summed over the ranks."""
        weights, ids = select_experts(self.gate(x), self.moe, x.dtype)
        if self.fused:
            from services.worker.models.fused_moe import fused_experts

            out = fused_experts(x, self.w13, self.w2, weights, ids)
        else:
            out = self.run_experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def run_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`` for every token t, in ``x``'s dtype."""
        top_k = ids.shape[1]
        flat = ids.flatten()
        order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.moe.num_experts).tolist()
        tokens, pair_weights = order // top_k, weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if not count:
                continue
            rows = tokens[start:start + count]
            h = self._down(expert, silu_and_mul(self._gate_up(expert, x[rows])))
            out.index_add_(0, rows, (h * pair_weights[start:start + count, None]).to(out.dtype))
            start += count
        return out

    def _gate_up(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        return self.packed[expert][0](x) if self.packed is not None else F.linear(x, self.w13[expert])

    def _down(self, expert: int, h: torch.Tensor) -> torch.Tensor:
        return self.packed[expert][1](h) if self.packed is not None else F.linear(h, self.w2[expert])
