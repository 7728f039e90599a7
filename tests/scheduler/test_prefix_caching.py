"""Prefix caching through the real model: hits skip compute and change no output."""

from __future__ import annotations

import random

from pagedserve import LLM, SamplingParams


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
