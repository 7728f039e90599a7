"""Prefix caching through the real model: hits skip compute and change no output."""

from __future__ import annotations

import random

import torch

from pagedserve import LLM, SamplingParams
from tests.oracle import assert_greedy_equal, hf_greedy


def recording(llm: LLM) -> list:
    """Record every step plan the engine sends to its worker."""
    plans = []
    executor = llm.engine.executor
    submit = executor.submit

    def record(plan):
        plans.append(plan)
        return submit(plan)

    executor.submit = record
    return plans


def test_extension_of_a_cached_prompt_computes_only_the_new_part(llama_dir):
    rng = random.Random(11)
    base = [rng.randrange(1, 500) for _ in range(70)]
    extended = base + [rng.randrange(1, 500) for _ in range(9)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cold = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False)
    expected = cold.generate({"prompt_token_ids": extended}, params, use_tqdm=False)[0].outputs[0].token_ids

    warm = LLM(str(llama_dir), block_size=8)
    assert warm.generate({"prompt_token_ids": base}, params, use_tqdm=False)[0].num_cached_tokens == 0
    plans = recording(warm)
    output = warm.generate({"prompt_token_ids": extended}, params, use_tqdm=False)[0]
    got = output.outputs[0].token_ids
    assert output.num_cached_tokens == 64  # what the request reports (vLLM's RequestOutput field)
    (first,) = plans[0].new
    assert first.num_computed_tokens == 64  # 8 full blocks of the 70-token prompt were cached
    assert first.num_scheduled_tokens == len(extended) - 64
    assert got == expected
    stats = warm.stats()
    assert stats["prefix_cache_hits"] == 64 and stats["kv_blocks_cached"] > 0 and stats["kv_blocks_used"] == 0


def test_shared_system_prompt_batch_matches_uncached(llama_dir):
    rng = random.Random(12)
    system = [rng.randrange(1, 500) for _ in range(40)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]}
               for _ in range(6)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    cold = LLM(str(llama_dir), block_size=8, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    warm_llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=48, num_gpu_blocks_override=24)
    warm = warm_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in cold] == [o.outputs[0].token_ids for o in warm]
    assert warm_llm.stats()["prefix_cache_hits"] > 0


def test_prompt_logprobs_requests_bypass_the_cache(llama_dir):
    prompt = {"prompt_token_ids": list(range(5, 45))}
    llm = LLM(str(llama_dir), block_size=8)
    llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1), use_tqdm=False)[0]
    assert len(out.prompt_logprobs) == 40 and out.prompt_logprobs[0] is None
    assert all(p is not None for p in out.prompt_logprobs[1:])


def _chat_turns(llm: LLM, seed: int, conversations: int = 3, turns: int = 3) -> list[tuple[list[int], list[int]]]:
    """Conversations taking turns, one request at a time: each turn's prompt is the history so far, the
    last reply and new user tokens. Returns every (prompt, greedy reply)."""
    rng = random.Random(seed)
    history = [[rng.randrange(1, 500) for _ in range(rng.randint(30, 50))] for _ in range(conversations)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    seen = []
    for _ in range(turns):
        for c in range(conversations):
            reply = llm.generate({"prompt_token_ids": history[c]}, params, use_tqdm=False)[0].outputs[0].token_ids
            seen.append((history[c], list(reply)))
            history[c] = history[c] + list(reply) + [rng.randrange(1, 500) for _ in range(rng.randint(5, 12))]
    return seen


def test_the_host_tier_brings_evicted_history_back_and_changes_no_output(llama_dir):
    # 12 device blocks of 8 hold one conversation; the tier (1 MiB: hundreds of blocks) holds them all.
    llm = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=12, kv_offloading_size=1 / 1024)
    seen = _chat_turns(llm, seed=21)
    for prompt, reply in seen:
        assert_greedy_equal(reply, *hf_greedy(llama_dir, prompt, len(reply)), what=f"prompt of {len(prompt)}")
    stats = llm.stats()
    assert stats["host_cache_hits"] > 0 and stats["kv_offload_blocks_stored"] > 0
    assert stats["host_cache_hits"] == 8 * stats["kv_offload_blocks_loaded"]


def test_a_failed_load_from_the_host_tier_is_recomputed(llama_dir):
    expected = _chat_turns(LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=12), seed=22)
    llm = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=12, kv_offloading_size=1 / 1024)
    worker = llm.engine.executor.worker
    swap_in, failures = worker._swap_in, []

    def fail_once(host_pool, device_pool, pairs):
        if not failures:
            failures.append(list(pairs))
            device_pool.view(torch.uint8)[:, :, [dst for _, dst in pairs]] = 0xFF  # half-written: NaNs, if read
            raise RuntimeError("injected: host to device copy failed")
        return swap_in(host_pool, device_pool, pairs)

    worker._swap_in = fail_once
    assert _chat_turns(llm, seed=22) == expected
    assert failures and llm.stats()["num_failed_swap_ins"] == 1 and llm.stats()["host_cache_hits"] > 0
