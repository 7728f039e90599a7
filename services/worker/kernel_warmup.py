"""Compiles the Triton kernels' batch-dependent variants at start, not inside a request's step.

Triton compiles a binary the first time a launch brings a new set of constexprs. The attention
kernel's change with the batch: the query-tile height (a power of two, up to a prefill tile) and
split-K on or off; the reduce kernel's with the split count, rounded up to a power of two. Serving
would meet them one at a time, each a stall of about a second in some request's step. So the worker
runs the model once over dummy batches that bring every one of them, within its context length and
token budget, while the pool is still empty: what they write lands in blocks no sequence owns.
"""

from __future__ import annotations

import torch

from services.worker.attention.triton_attention import PREFILL_ROWS, SPLIT_MAX, SPLIT_MIN_KEYS
from services.worker.attention.triton_cache_ops import copy_blocks
from services.worker.input_batch import ScheduledSequence, build_model_inputs


def warm_up_batches(block_size: int, num_blocks: int, max_model_len: int,
                    token_budget: int) -> list[list[ScheduledSequence]]:
    """One-sequence batches: prefills of 1, 2, 4, ... tokens (every tile height), then decodes over
    2, 4, ... x SPLIT_MIN_KEYS keys (every split count's power of two the heuristic can reach)."""
    batches = []
    length = 1
    while length <= min(PREFILL_ROWS, token_budget, max_model_len):
        batches.append([_dummy_sequence(0, length, block_size, num_blocks)])
        length *= 2
    splits = 2
    while splits <= SPLIT_MAX and splits * SPLIT_MIN_KEYS <= max_model_len:
        batches.append([_dummy_sequence(splits * SPLIT_MIN_KEYS - 1, 1, block_size, num_blocks)])
        splits *= 2
    return batches


def _dummy_sequence(cached: int, new: int, block_size: int, num_blocks: int) -> ScheduledSequence:
    total = cached + new
    table = [i % num_blocks for i in range(-(-total // block_size))]  # blocks may repeat: contents are garbage
    return ScheduledSequence([0] * total, table, cached, new)


def warm_up_kernels(model, attention, kv_pool: torch.Tensor, block_size: int, max_model_len: int,
                    token_budget: int, device: torch.device) -> int:
    """Runs ``model`` over the warm-up batches and one block copy; returns the number of forward passes."""
    num_blocks = kv_pool.shape[2]
    batches = warm_up_batches(block_size, num_blocks, max_model_len, token_budget)
    with torch.inference_mode():
        for batch in batches:
            inputs = build_model_inputs(batch, block_size, device)
            model(inputs.input_ids, inputs.positions, attention, inputs.meta)
        if num_blocks >= 2:
            copy_blocks(kv_pool, [(0, 1)])
    return len(batches)
