"""One decoder layer of the Llama family: attention, the MLP (dense, or the experts of moe.py), their norms.

Inputs are flattened: the scheduled tokens of every sequence in the batch, one after another, with their
positions; attention (and the KV cache) is the backend's job, so this module is only the dense math. q/k/v
and gate/up are fused into one matmul each (weight_targets.py fills them from the checkpoint's tensors).
With tensor parallelism a layer holds this rank's heads and MLP columns; o_proj's and down_proj's outputs
are summed over the ranks (tensor_parallel.py).
"""

from __future__ import annotations

import torch
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.models.layers import GATED_ACTIVATIONS, RotaryEmbedding, SplitRMSNorm, rms_norm_class
from services.worker.models.moe import SparseMoeBlock
from services.worker.models.packed_linear import PackedLinear
from services.worker.tensor_parallel import TensorParallel
from services.worker.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding | None, tp: TensorParallel):
        """``rotary`` None: a layer without positional rotation (SmolLM3's NoPE layers)."""
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias and tp.rank == 0)
        if config.qk_norm and config.qk_norm_per_head:
            norm = rms_norm_class(config.norm_style)
            self.q_norm = norm(self.head_dim, config.rms_norm_eps)
            self.k_norm = norm(self.head_dim, config.rms_norm_eps)
        elif config.qk_norm:  # over this rank's share of the whole projection (OLMo 2)
            self.q_norm = SplitRMSNorm(self.q_size, config.rms_norm_eps, tp)
            self.k_norm = SplitRMSNorm(self.kv_size, config.rms_norm_eps, tp)
        self.qk_norm, self.qk_norm_per_head = config.qk_norm, config.qk_norm_per_head
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention, meta: AttentionMetadata,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``, or only the rows ``output_rows`` (int64 indices into the T) from
        the output projection on: every row's K and V still go into the cache."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_norm and not self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm and self.qk_norm_per_head:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary[0] is not None:
            q, k = self.rotary[0](positions, q, k)
        # v stays a view of the projection, strided as k is: the backends take each token's heads at any row
        # stride, and the CPU prefill kernel reads a first chunk's k and v in place only when their strides agree.
        out = attention.forward(self.layer, q, k, v, meta).reshape(-1, self.q_size)
        if output_rows is not None:
            out = out.index_select(0, output_rows)
        return self.tp.all_reduce(self.o_proj(out))


# How much gate/up product a CPU MLP makes at once. Whole, a 4096-token prefill chunk's is 46 MB for the bench model
# in float32: past glibc's 32 MiB mmap ceiling, so each layer page-faults a fresh mapping, and past the caches before
# the activation reads it back. In parts of at most 16 MiB (a power of two of rows: 1024 there) the MLP ran 9 %
# faster (benchmarks/RESULTS.md). Never fewer rows than CPU_MLP_MIN_ROWS, where oneDNN's products stay near peak.
CPU_MLP_BYTES = 16 << 20
CPU_MLP_MIN_ROWS = 128


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TensorParallel, reduce: bool = True,
                 activation: str = "silu"):
        """``reduce``: sum the output over the ranks (False: the caller adds this rank's part to its own first);
        ``activation``: the gate's (SwiGLU's silu, or Gemma's tanh-approximated GELU)."""
        super().__init__()
        self.tp, self.reduce = tp, reduce
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias and tp.rank == 0)
        self.act_and_mul = GATED_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, hidden]`` -> ``[T, hidden]``."""
        rows = self._rows_per_part(x) if self._rows_independent() else x.shape[0]
        out = torch.cat([self._product(part) for part in x.split(rows)]) if x.shape[0] > rows else self._product(x)
        return self.tp.all_reduce(out) if self.reduce else out

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))

    def _rows_per_part(self, x: torch.Tensor) -> int:
        """The most rows whose gate/up product fits CPU_MLP_BYTES, a power of two (CPU_MLP_MIN_ROWS at least)."""
        fit = CPU_MLP_BYTES // (self.gate_up_proj.out_features * x.element_size())
        return max(CPU_MLP_MIN_ROWS, 1 << (max(fit, 1).bit_length() - 1))

    def _rows_independent(self) -> bool:
        """Whether the projections are plain packed CPU products, which may take a step's rows in parts (a LoRA
        wrapper reads a mask over the whole step's tokens, or its output rows')."""
        return isinstance(self.gate_up_proj, PackedLinear) and isinstance(self.down_proj, PackedLinear)


def build_mlp(config: ModelConfig, layer: int, tp: TensorParallel) -> nn.Module:
    """The layer's dense MLP, or its experts where the model has them there."""
    moe = config.moe
    if moe is None or not moe.is_sparse(layer):
        return MLP(config.hidden_size, config.intermediate_size, config.mlp_bias, tp, activation=config.hidden_act)
    shared = moe.shared_expert_intermediate_size
    shared_expert = MLP(config.hidden_size, shared, False, tp, reduce=False) if shared else None
    return SparseMoeBlock(config.hidden_size, moe, tp, shared_expert)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding | None, tp: TensorParallel):
        super().__init__()
        norm, size, eps = rms_norm_class(config.norm_style), config.hidden_size, config.rms_norm_eps
        self.placement = config.norm_placement
        if self.placement != "post":
            self.input_layernorm = norm(size, eps)
        self.self_attn = Attention(config, layer, rotary, tp)
        # With sandwich or post norms this one normalises attention's output, not the MLP's input.
        self.post_attention_layernorm = norm(size, eps)
        if self.placement == "sandwich":
            self.pre_feedforward_layernorm = norm(size, eps)
        if self.placement != "pre":
            self.post_feedforward_layernorm = norm(size, eps)
        self.residual_multiplier = config.residual_multiplier
        self.mlp = build_mlp(config, layer, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, attention,
                meta: AttentionMetadata, output_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``, whose sum is the layer's output (HF: ``x + mlp(norm(x))``); only the rows
        ``output_rows`` of it where given (the model's last layer: output_rows.py says why).

        The sum is left to the next norm, which adds it in the same pass (vLLM's fused_add_rms_norm);
        the first layer gets ``residual=None``. On the CPU ``residual`` is updated in place.
        """
        if self.placement == "post":  # HF: x + post_ff(mlp(x)), x = residual + post_attn(attention(residual))
            stream = x if residual is None else x + residual
            attended = self.self_attn(stream, positions, attention, meta, output_rows)
            stream = self._rows(stream, output_rows) + self.post_attention_layernorm(attended)
            return self.post_feedforward_layernorm(self.mlp(stream)), stream
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(h, positions, attention, meta, output_rows)
        residual = self._rows(residual, output_rows)
        if self.residual_multiplier != 1.0:  # Granite scales both outputs before the residual add
            h = h * self.residual_multiplier
        if self.placement == "sandwich":  # HF: x + post_ff(mlp(pre_ff(x))), x = residual + post_attn(attention)
            h, residual = self.pre_feedforward_layernorm.forward_with_residual(self.post_attention_layernorm(h),
                                                                               residual)
            return self.post_feedforward_layernorm(self.mlp(h)), residual
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        h = self.mlp(h)
        return (h * self.residual_multiplier if self.residual_multiplier != 1.0 else h), residual

    @staticmethod
    def _rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        return x if rows is None else x.index_select(0, rows)
