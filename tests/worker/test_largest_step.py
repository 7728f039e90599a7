"""The largest step a CUDA worker runs at start to measure its memory: its batch, and that it runs."""

from __future__ import annotations

import pytest

from pagedserve import LLM
from services.worker.largest_step import largest_step_batch, run_largest_step


@pytest.mark.parametrize("max_model_len, budget, max_num_seqs, lengths", [
    (2048, 4096, 256, [2048, 2048]),
    (1000, 4096, 256, [1000, 1000, 1000, 1000, 96]),
    (1000, 4096, 3, [1000, 1000, 1000]),  # no more sequences than a step may hold
    (8192, 4096, 256, [4096]),
])
def test_the_largest_step_spends_the_budget_on_the_longest_prompts(max_model_len, budget, max_num_seqs, lengths):
    batch = largest_step_batch(16, 10, max_model_len, budget, max_num_seqs)
    assert [s.num_scheduled_tokens for s in batch] == lengths
    assert all(s.num_computed_tokens == 0 and len(s.block_table) == -(-len(s.token_ids) // 16) for s in batch)
    assert all(0 <= b < 10 for s in batch for b in s.block_table)


def test_the_largest_step_runs_through_the_model_and_the_costliest_sampling(llama_dir):
    worker = LLM(str(llama_dir), block_size=4, max_num_seqs=8).engine.executor.worker
    peak = run_largest_step(worker.model, worker.attention, worker.sampler, block_size=4,
                            num_blocks=worker.num_blocks, max_model_len=worker.max_model_len, token_budget=96,
                            max_num_seqs=8, max_logprobs=5, device=worker.device)
    assert peak is None  # measured on CUDA only
