"""Tensor parallelism: this worker's rank among the workers that hold one model between them.

Megatron's split, as vLLM does it: each rank holds 1/size of the attention heads (query and KV) and
of the MLP's intermediate columns (with fewer KV heads than ranks, each KV head is held by the ranks
whose query heads use it; in a mixture-of-experts layer, every expert with 1/size of its columns), so q/k/v and gate/up are split by their outputs and need no
communication, while o_proj and down_proj are split by their inputs and their partial sums are
added across ranks (one all-reduce each, per layer). Norms, the embedding and the logits head are
whole on every rank, so every rank ends a step with the same hidden states and samples the same
tokens; the scheduler takes rank 0's result and checks that the others agree. Communication is
torch.distributed: NCCL on GPUs, gloo on CPUs.
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass

import torch

from services.worker.model_config import ModelConfig
from services.worker.moe_config import MoEConfig

# How long a rank waits in a collective for the others: longer than any step, shorter than forever
# (a rank that died leaves the others waiting here; then they fail, and the group is restarted).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=5)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} is outside a group of {self.size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of ``x`` (in place); ``x`` itself on a single rank."""
        if self.size > 1:
            torch.distributed.all_reduce(x)
        return x

    def all_agree(self, yes: bool, device: torch.device) -> bool:
        """Whether every rank said yes (one all-reduce); ``yes`` itself on a single rank."""
        if self.size == 1:
            return yes
        votes = torch.tensor([int(yes)], dtype=torch.int32, device=device)
        return int(self.all_reduce(votes).item()) == self.size

    def shard(self, config: ModelConfig) -> ModelConfig:
        """This rank's share of the model: its heads and intermediate columns."""
        if self.size == 1:
            return config
        dense_mlps = config.moe is None or len(config.moe.sparse_layers) < config.num_hidden_layers
        for name in ("num_attention_heads", "intermediate_size") if dense_mlps else ("num_attention_heads",):
            if getattr(config, name) % self.size:
                raise ValueError(f"tensor_parallel_size {self.size} does not divide the model's {name} "
                                 f"({getattr(config, name)})")
        kv_heads = config.num_key_value_heads
        if kv_heads % self.size and self.size % kv_heads:
            raise ValueError(f"tensor_parallel_size {self.size} and the model's {kv_heads} KV heads: one must "
                             "divide the other")
        return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // self.size,
                                   num_key_value_heads=max(1, kv_heads // self.size),
                                   intermediate_size=config.intermediate_size // self.size if dense_mlps else
                                   config.intermediate_size,
                                   moe=config.moe and self._shard_experts(config.moe))

    def _shard_experts(self, moe: MoEConfig) -> MoEConfig:
        """Every expert on every rank, each with its share of the expert's intermediate columns."""
        for name in ("intermediate_size", "shared_expert_intermediate_size"):
            if getattr(moe, name) % self.size:
                raise ValueError(f"tensor_parallel_size {self.size} does not divide the experts' {name} "
                                 f"({getattr(moe, name)})")
        return dataclasses.replace(moe, intermediate_size=moe.intermediate_size // self.size,
                                   shared_expert_intermediate_size=moe.shared_expert_intermediate_size // self.size)

    def kv_replicas(self, config: ModelConfig) -> int:
        """How many ranks hold each KV head of the (whole) model: 1 unless it has fewer than the ranks."""
        return max(1, self.size // config.num_key_value_heads)

    def rows(self, total: int, replicas: int = 1) -> slice:
        """This rank's part of ``total`` rows (or columns) split into size / replicas parts, each part held
        by ``replicas`` consecutive ranks."""
        parts = self.size // replicas
        part = total // parts
        index = self.rank // replicas
        return slice(index * part, (index + 1) * part)


def join_group(rank: int, size: int, init_method: str | None, device: torch.device) -> TensorParallel:
    """Joins the group of ``size`` workers (blocks until all have joined); a single worker joins nothing."""
    tp = TensorParallel(rank, size)
    if size == 1:
        return tp
    if not init_method:
        raise ValueError("tensor parallelism needs the group's meeting point: a distributed_init_method such as "
                         "tcp://127.0.0.1:29500, the same for every rank")
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                                         timeout=COLLECTIVE_TIMEOUT)
    return tp


def leave_group(tp: TensorParallel) -> None:
    if tp.size > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
