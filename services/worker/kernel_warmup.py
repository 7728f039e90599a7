"""Compiles the Triton kernels' batch-dependent variants at start, not inside a request's step.

Triton compiles a binary the first time a launch brings a new set of constexprs. The attention
kernel's change with the batch: the query-tile height (the next power of two of the longest query,
up to a prefill tile) and split-K on or off; the reduce kernel's with the split count, rounded up to
a power of two. Serving would meet them one at a time, each a stall of about a second in some
request's step. So a CUDA worker runs the model once over dummy batches that bring every one of
them, within its context length and token budget, while the pool is still empty: what they write
lands in blocks no sequence owns, and every later read is of slots a sequence wrote first. A model
with fused experts also launches each of their tile heights once (one layer's weights serve for all).
"""

from __future__ import annotations

import torch

from services.worker.attention.triton_attention import PREFILL_ROWS, SPLIT_MAX, SPLIT_MIN_KEYS
from services.worker.attention.triton_cache_ops import copy_blocks
from services.worker.input_batch import ScheduledSequence, build_model_inputs


def warm_up_batches(block_size: int, num_blocks: int, max_model_len: int,
                    token_budget: int) -> list[list[ScheduledSequence]]:
    """One-sequence batches: prefills of every tile height, then decodes of every split count's power of two.

    Prefills of 1, 2, 4, ... tokens and of the longest a step allows. Decodes over 2, 4, ... x
    SPLIT_MIN_KEYS keys and over the longest context: one sequence alone is the fewest programs, so
    the heuristic splits it the most, and the last decode reaches the largest count serving can.
    """
    longest_query = min(PREFILL_ROWS, token_budget, max_model_len)
    lengths = _powers_of_two_up_to(longest_query) + [longest_query]
    batches = [[dummy_sequence(0, n, block_size, num_blocks)] for n in sorted(set(lengths))]
    contexts = [s * SPLIT_MIN_KEYS for s in _powers_of_two_up_to(SPLIT_MAX) if s > 1] + [max_model_len]
    contexts = sorted({c for c in contexts if 2 * SPLIT_MIN_KEYS <= c <= max_model_len})
    batches += [[dummy_sequence(c - 1, 1, block_size, num_blocks)] for c in contexts]
    return batches


def _powers_of_two_up_to(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def dummy_sequence(cached: int, new: int, block_size: int, num_blocks: int) -> ScheduledSequence:
    """A sequence of token 0s on blocks 0, 1, ... (wrapping at ``num_blocks``)."""
    total = cached + new
    table = [i % num_blocks for i in range(-(-total // block_size))]  # blocks may repeat: contents are garbage
    return ScheduledSequence([0] * total, table, cached, new)


def warm_up_kernels(model, attention, kv_pool: torch.Tensor, block_size: int, max_model_len: int,
                    token_budget: int, device: torch.device) -> int:
    """The block copy, and with the Triton backend ``model`` over the warm-up batches and its fused experts'
    tile heights; returns the forward passes plus the expert launches."""
    num_blocks = kv_pool.shape[2]
    batches = warm_up_batches(block_size, num_blocks, max_model_len, token_budget) if attention.name == "triton" else []
    with torch.inference_mode():
        for batch in batches:
            inputs = build_model_inputs(batch, block_size, device)
            model(inputs.input_ids, inputs.positions, attention, inputs.meta)
        launches = _warm_up_experts(model)
        if num_blocks >= 2:  # the worker copies with Triton on CUDA whatever its attention backend
            copy_blocks(kv_pool, [(0, 1)])
    return len(batches) + launches


def _warm_up_experts(model) -> int:
    from services.worker.models.fused_moe import compile_variants
    from services.worker.models.moe import SparseMoeBlock

    fused = [m for m in model.modules() if isinstance(m, SparseMoeBlock) and m.fused]
    return compile_variants(fused[0].w13, fused[0].w2, fused[0].moe.top_k) if fused else 0
