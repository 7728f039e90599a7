"""The Llama family (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Inputs are flattened: the scheduled tokens of every sequence in the batch, one
after another, with their positions; attention (and the KV cache) is the
backend's job, so this module is only the dense math. q/k/v and gate/up are
fused into one matmul each; ``load_weights`` takes Hugging Face names and
writes each checkpoint tensor into its slice of the fused weight.

With tensor parallelism the model is built from this rank's share of the config
(its heads and intermediate columns, see tensor_parallel.py): ``load_weights``
takes this rank's rows of q/k/v and gate/up and its columns of o_proj and
down_proj, whose outputs are summed over the ranks (their biases added by rank 0).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.attention.metadata import AttentionMetadata
from services.worker.models.layers import RMSNorm, RotaryEmbedding, silu_and_mul
from services.worker.models.packed_linear import PackedLinear, pack_linear_layers
from services.worker.tensor_parallel import TensorParallel
from shared.model_config import ModelConfig


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.layer = layer
        self.tp = tp
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias and tp.rank == 0)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = [rotary]  # in a list so the shared module is not registered once per layer

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention, meta: AttentionMetadata
                ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary[0](positions, q, k)
        out = attention.forward(self.layer, q, k, v.contiguous(), meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias and tp.rank == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(silu_and_mul(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, rotary: RotaryEmbedding, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer, rotary, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, attention,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mlp output, residual)``, whose sum is the layer's output (HF: ``x + mlp(norm(x))``).

        The sum is left to the next norm, which adds it in the same pass (vLLM's fused_add_rms_norm);
        the first layer gets ``residual=None``. On the CPU ``residual`` is updated in place.
        """
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.forward_with_residual(x, residual)
        h = self.self_attn(h, positions, attention, meta)
        h, residual = self.post_attention_layernorm.forward_with_residual(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel(), kv_replicas: int = 1):
        """``config``: this rank's share of the model (the whole model on a single rank); ``kv_replicas``:
        how many ranks hold each KV head (more than one when the model has fewer KV heads than ranks)."""
        super().__init__()
        self.config = config
        self.tp = tp
        self.kv_replicas = kv_replicas
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, self.rotary, tp)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Tied: the embedding matrix doubles as the output projection (see lm_head_weight).
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_logits: PackedLinear | None = None  # set by pack_linear_weights

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def pack_linear_weights(self) -> None:
        """After loading, on CPU in float32: every projection, the logits head included, in oneDNN's layout.

        The tied head packs a copy and leaves the embedding as it is (lookups still need it).
        """
        pack_linear_layers(self)
        tied = self.config.tie_word_embeddings
        self.packed_logits = PackedLinear(self.embed_tokens.weight, None) if tied else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, one row per scheduled token."""
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(x, residual, positions, attention, meta)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm.forward_with_residual(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` for the rows of ``hidden`` that need sampling."""
        if self.packed_logits is not None:
            return self.packed_logits(hidden).float()
        return F.linear(hidden, self.lm_head_weight).float()

    # ---- loading -----------------------------------------------------------------------------

    def _weight_targets(self) -> dict[str, _Target]:
        """HF parameter name -> where this rank's part of it goes."""
        targets: dict[str, _Target] = {}
        tp = self.tp

        def whole(name: str, tensor: torch.Tensor) -> None:
            targets[name] = _Target(tensor, 0, tensor.shape[0])

        def parts(prefix: str, suffix: str, fused: torch.Tensor, names: list[str], sizes: list[int],
                  replicas: list[int]) -> None:
            start = 0
            for name, size, shared in zip(names, sizes, replicas):  # this rank's rows of each (its heads, columns)
                whole_rows = size * tp.size // shared
                targets[f"{prefix}.{name}.{suffix}"] = _Target(fused, start, size, 0, tp.rows(whole_rows, shared),
                                                               whole_rows)
                start += size

        def columns(name: str, tensor: torch.Tensor) -> None:  # this rank's inputs of a row-parallel layer
            whole_columns = tensor.shape[1] * tp.size
            targets[name] = _Target(tensor, 0, tensor.shape[0], 1, tp.rows(whole_columns), whole_columns)

        whole("model.embed_tokens.weight", self.embed_tokens.weight)
        whole("model.norm.weight", self.norm.weight)
        if not self.config.tie_word_embeddings:
            whole("lm_head.weight", self.lm_head.weight)
        for i, layer in enumerate(self.layers):
            p, attn, mlp = f"model.layers.{i}", layer.self_attn, layer.mlp
            whole(f"{p}.input_layernorm.weight", layer.input_layernorm.weight)
            whole(f"{p}.post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
            qkv_sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            for suffix, fused in (("weight", attn.qkv_proj.weight), ("bias", attn.qkv_proj.bias)):
                if fused is not None:
                    parts(f"{p}.self_attn", suffix, fused, ["q_proj", "k_proj", "v_proj"], qkv_sizes,
                          [1, self.kv_replicas, self.kv_replicas])
            inter = self.config.intermediate_size
            for suffix, fused in (("weight", mlp.gate_up_proj.weight), ("bias", mlp.gate_up_proj.bias)):
                if fused is not None:
                    parts(f"{p}.mlp", suffix, fused, ["gate_proj", "up_proj"], [inter, inter], [1, 1])
            for name, module in ((f"{p}.self_attn.o_proj", attn.o_proj), (f"{p}.mlp.down_proj", mlp.down_proj)):
                columns(f"{name}.weight", module.weight)
                if module.bias is not None:
                    whole(f"{name}.bias", module.bias)
                elif self.config.o_bias if name.endswith("o_proj") else self.config.mlp_bias:
                    targets[f"{name}.bias"] = None  # added once, by rank 0
            if attn.qk_norm:
                whole(f"{p}.self_attn.q_norm.weight", attn.q_norm.weight)
                whole(f"{p}.self_attn.k_norm.weight", attn.k_norm.weight)
        return targets

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (HF names) into the model, converting dtype and device."""
        targets = self._weight_targets()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some old checkpoints saved this buffer; we derive it from the config
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # tied: the output projection is the embedding, as in transformers
            if name not in targets:
                raise ValueError(f"unexpected weight {name!r} for a {self.config.model_type} model")
            loaded.add(name)
            target = targets[name]
            if target is None:
                continue  # another rank's
            expected = target.source_shape()
            if tuple(tensor.shape) != expected:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            if target.part is not None:
                tensor = tensor[target.part] if target.dim == 0 else tensor[:, target.part]
            target.param[target.start:target.start + target.rows].copy_(tensor)
        missing = sorted(set(targets) - loaded)
        if missing:
            raise ValueError(f"missing weights ({len(missing)}): {', '.join(missing)}")


class _Target:
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
