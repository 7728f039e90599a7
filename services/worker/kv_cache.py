"""The worker's KV pools: how many blocks fit the memory budget, and the tensors themselves."""

from __future__ import annotations

import torch

from services.worker.cpu_tuning import advise_huge_pages
from services.worker.model_config import ModelConfig
from shared.config import EngineConfig

CPU_DEFAULT_KV_BYTES = 4 << 30  # like vLLM's CPU backend: 4 GiB unless told otherwise


def bytes_per_block(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of block_size tokens, every layer."""
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * model.num_hidden_layers * block_size * model.num_key_value_heads * model.head_dim * element


# One sampler call's transient bytes per [row, vocab] entry: its costliest path (penalties, top-k/p,
# min-p, logprobs, seeded noise) peaked at 52-55 (benchmarks/sampler_memory.py); plus 4 for the float32
# copy of 16-bit logits, and a margin.
SAMPLER_BYTES_PER_LOGIT = 64


def activation_bytes_estimate(model: ModelConfig, config: EngineConfig, max_tokens: int) -> int:
    """A generous bound on one step's transient memory: the forward pass's hidden states, MLP and
    attention (twice over), and the sampler over max_num_seqs rows (the most one call takes)."""
    per_token = 4 * (4 * model.hidden_size + 3 * _mlp_width_per_token(model)
                     + 2 * (model.num_attention_heads + 2 * model.num_key_value_heads) * model.head_dim)
    sampling = SAMPLER_BYTES_PER_LOGIT * config.max_num_seqs * model.vocab_size
    return 2 * max_tokens * per_token + sampling


def _mlp_width_per_token(model: ModelConfig) -> int:
    """A token's widest MLP activations: a dense layer's, or its chosen experts' together (each also holds a
    copy of the token's input) plus the shared expert and the router's scores."""
    moe = model.moe
    if moe is None:
        return model.intermediate_size
    routed = moe.top_k * (moe.intermediate_size + model.hidden_size) + moe.shared_expert_intermediate_size
    return max(model.intermediate_size, routed + moe.num_experts)


def kv_budget_bytes(model: ModelConfig, config: EngineConfig, device: torch.device, max_tokens: int) -> int:
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type != "cuda":
        return CPU_DEFAULT_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    in_use = total - free  # weights (already loaded) and anything else on the device
    budget = int(config.gpu_memory_utilization * total) - in_use - activation_bytes_estimate(model, config, max_tokens)
    if budget <= 0:
        raise ValueError(f"no device memory left for the KV cache: {in_use / 2**30:.1f} GiB in use of "
                         f"{total / 2**30:.1f} GiB with gpu_memory_utilization={config.gpu_memory_utilization}")
    return budget


def num_kv_blocks(model: ModelConfig, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                  max_tokens: int, max_model_len: int, extra_bytes_per_block: int = 0, fixed_bytes: int = 0) -> int:
    """extra_bytes_per_block: what else every block holds (a draft model's K and V of its tokens);
    fixed_bytes: KV memory that is not blocks (a draft model's scratch), taken from the budget first."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    per_block = bytes_per_block(model, config.block_size, dtype) + extra_bytes_per_block
    blocks = (kv_budget_bytes(model, config, device, max_tokens) - fixed_bytes) // per_block
    if blocks < 1:
        raise ValueError("the KV cache budget is smaller than one block")
    if device.type != "cuda" and config.kv_cache_memory_bytes is None:
        # The CPU default is a budget, not a target: a small model would get millions of blocks
        # it can never fill. Cap it at every sequence at full length, twice over (room for the
        # prefix cache).
        blocks = min(blocks, 2 * config.max_num_seqs * -(-max_model_len // config.block_size))
    return int(blocks)


def allocate_kv_pools(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One tensor [layers, 2, blocks, block_size, kv_heads, head_dim]; per layer a (K, V) view.

    One allocation keeps every layer's copy of a block at a fixed stride, so block moves
    (swap, copy-on-write) can later touch all layers in one indexing operation.
    """
    pools = torch.empty(model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads,
                        model.head_dim, dtype=dtype, device=device)
    if pools.device.type == "cpu":
        advise_huge_pages(pools)  # before the first touch (the zeroing below)
    pools.zero_()
    return [(pools[layer, 0], pools[layer, 1]) for layer in range(model.num_hidden_layers)]


def num_host_blocks(model: ModelConfig, config: EngineConfig, dtype: torch.dtype, num_device_blocks: int,
                    extra_bytes_per_block: int = 0) -> tuple[int, int]:
    """Host memory's blocks: (swap space, the offload tier). Swap space is swap_space GiB, but no more than
    four times the device pool (more could never be filled: only sequences that were running get swapped
    out); the tier is kv_offloading_size GiB, with prefix caching (only indexed blocks are offloaded)."""
    per_block = bytes_per_block(model, config.block_size, dtype) + extra_bytes_per_block
    swap = min(int(config.swap_space * (1 << 30)) // per_block, 4 * num_device_blocks)
    tier = int(config.kv_offloading_size * (1 << 30)) // per_block if config.enable_prefix_caching else 0
    return swap, tier


def allocate_host_pool(model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The host pool, same per-block shape as the device pool. Left uninitialised: a host block is
    always written by a swap-out before a swap-in reads it. Pageable: a swap's blocks are scattered
    over the pool, so the transfer goes through a page-locked staging buffer (swap_staging.py)
    rather than out of the pool itself, and gigabytes of it need not be locked."""
    return torch.empty(model.num_hidden_layers, 2, num_blocks, block_size, model.num_key_value_heads,
                       model.head_dim, dtype=dtype)
