"""Swap, recompute and copy-on-write through the real model: memory pressure changes no output."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams


def prompts(seed: int, count: int = 6) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randint(5, 60))]} for _ in range(count)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_greedy_under_pressure_equals_unconstrained(llama_dir, mode):
    batch = prompts(1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    free = LLM(str(llama_dir), block_size=8).generate(batch, params, use_tqdm=False)
    tight = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=12, max_num_batched_tokens=64,
                preemption_mode=mode, swap_space=0.01)
    out = tight.generate(batch, params, use_tqdm=False)
    stats = tight.stats()
    assert stats[f"num_preemptions_{mode}"] > 0
    assert stats["num_preemptions"] == stats[f"num_preemptions_{mode}"]
    if mode == "swap":
        assert stats["num_swaps_in"] == stats["num_swaps_out"] > 0
    assert [o.outputs[0].token_ids for o in free] == [o.outputs[0].token_ids for o in out]
    assert stats["kv_blocks_used"] == 0 and stats["kv_host_blocks_used"] == 0


def test_automatic_mode_under_pressure_with_parallel_samples(llama_dir):
    batch = prompts(2, count=4)
    params = [SamplingParams(temperature=0.8, seed=i, n=1 + i % 2, max_tokens=24, ignore_eos=True) for i in range(4)]
    free = LLM(str(llama_dir), block_size=8).generate(batch, params, use_tqdm=False)
    tight = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=14, max_num_batched_tokens=64,
                swap_space=0.01)
    out = tight.generate(batch, params, use_tqdm=False)
    assert tight.stats()["num_preemptions_swap"] > 0  # n > 1 victims are swapped
    for a, b in zip(free, out):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_the_automatic_rule():
    from services.scheduler.preemption import choose_preemption
    from services.scheduler.sequence import Sequence
    from shared.request import EngineRequest

    seq = Sequence(0, EngineRequest("r", [1] * 10, SamplingParams()), 0, 10, 0)
    seq.num_computed_tokens = 10
    assert choose_preemption(None, seq, num_live_siblings=0, token_budget=64, can_swap=True) == "recompute"
    assert choose_preemption(None, seq, num_live_siblings=1, token_budget=64, can_swap=True) == "swap"
    seq.num_computed_tokens = 100  # more than a step's budget to recompute
    assert choose_preemption(None, seq, num_live_siblings=0, token_budget=64, can_swap=True) == "swap"
    assert choose_preemption(None, seq, num_live_siblings=1, token_budget=64, can_swap=False) == "recompute"
    assert choose_preemption("recompute", seq, num_live_siblings=1, token_budget=64, can_swap=True) == "recompute"
    assert choose_preemption("swap", seq, num_live_siblings=0, token_budget=64, can_swap=True) == "swap"
    with pytest.raises(ValueError, match="preemption_mode"):
        choose_preemption("sometimes", seq, 0, 64, True)


def test_parallel_sampling_shares_the_prompt_blocks(llama_dir):
    prompt = {"prompt_token_ids": list(range(3, 103))}  # 100 tokens: 12 full blocks and a partial one
    llm = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=1, ignore_eos=True)
    llm.generate(prompt, params, use_tqdm=False)
    # Peak: one copy of the prompt's 13 blocks for all four sequences (no copy needed for one token).
    assert llm.stats()["kv_blocks_used_peak"] == 13
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Each sibling's sample stream is its own: the same request again gives the same four outputs.
    again = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in again.outputs]
