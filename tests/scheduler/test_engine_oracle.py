"""Greedy outputs of the whole engine equal transformers', under chunked prefill and preemption."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.kv_release import count_releases, preempted_or_released
from tests.oracle import assert_greedy_equal, hf_greedy
from tests.pipeline import Pipeline
from shared.request import EngineRequest

PROMPT_LENS = [1, 3, 17, 64, 150]
MAX_TOKENS = 20


def random_prompts(seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in PROMPT_LENS]


def blocks_to_force_preemption(block_size: int) -> int:
    # The longest request fits alone; all together need about twice as many blocks.
    need = [-(-(n + MAX_TOKENS) // block_size) for n in PROMPT_LENS]
    return max(max(need), sum(need) // 2)


@pytest.mark.parametrize("model_fixture", ["llama_dir", "mistral_dir", "qwen2_dir", "qwen3_dir", "tied_dir",
                                           "mixtral_dir", "qwen2_moe_dir", "qwen3_moe_dir", "mistral_window_dir",
                                           "qwen2_window_dir", "gemma_dir", "gemma2_dir", "gemma3_dir", "gemma3_multimodal_dir",
                                           "phi3_dir", "yarn_dir", "granite_dir", "olmo2_dir", "smollm3_dir"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_greedy_equals_transformers(model_fixture, block_size, request):
    model_dir = request.getfixturevalue(model_fixture)
    prompts = random_prompts(seed=block_size)
    llm = LLM(str(model_dir), block_size=block_size, max_num_batched_tokens=48, enable_chunked_prefill=True,
              num_gpu_blocks_override=blocks_to_force_preemption(block_size))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    released = count_releases(llm)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.stats()
    assert preempted_or_released(llm, released, block_size), "the KV budget was meant to force preemption"
    assert stats["kv_blocks_used"] == 0
    for prompt, out in zip(prompts, outputs):
        ref, ref_logprobs = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{model_fixture} prompt of {len(prompt)}")
        assert out.outputs[0].finish_reason == "length"


def test_longrope_picks_its_factors_by_the_context_served(phi3_longrope_dir):
    """LongRoPE's short factors while the context served stays within the pretraining length (64 here):
    then every sequence equals transformers'; past it the long ones, as transformers uses for sequences
    longer than that length (shorter ones it would rotate with the short factors; vLLM serves as we do)."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # Within 64: prompts up to 40 tokens, 20 more generated. Past it: a prompt of 150 (one of 64 would not do:
    # transformers rotates a forward pass over positions 0..63 with the short factors).
    cases = [(64, [p[:40] for p in random_prompts(seed=5)[1:]]), (None, random_prompts(seed=6)[4:])]
    for max_model_len, prompts in cases:
        llm = LLM(str(phi3_longrope_dir), block_size=8, max_num_batched_tokens=48, max_model_len=max_model_len)
        assert llm.engine.executor.worker.model.rotary.long_context == (max_model_len is None)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            ref, ref_logprobs = hf_greedy(phi3_longrope_dir, prompt, MAX_TOKENS)
            assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"context {max_model_len}, {len(prompt)}")


@pytest.mark.parametrize("max_num_seqs", [256, 3])  # 3: a step's prompt logprobs come 3 rows at a time
def test_logprobs_agree_with_transformers(llama_dir, max_num_seqs):
    prompts = random_prompts(seed=3)[1:4]
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=32, max_num_seqs=max_num_seqs)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        ref, ref_logprobs = hf_greedy(llama_dir, prompt, 6)
        assert_greedy_equal(completion.token_ids, ref, ref_logprobs)
        assert len(completion.logprobs) == 6
        for token, position, expected in zip(completion.token_ids, completion.logprobs, ref_logprobs):
            top = torch.topk(expected, 5)
            assert set(top.indices.tolist()) <= set(position)  # the top 5 (+ the sampled token)
            for token_id, logprob in position.items():
                assert logprob.logprob == pytest.approx(expected[token_id].item(), abs=1e-4)
            assert position[token].rank == 1
        assert completion.cumulative_logprob == pytest.approx(
            sum(p[t].logprob for p, t in zip(completion.logprobs, completion.token_ids)))
        # Prompt logprobs: position i holds log p(prompt[i] | prompt[:i]).
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        full = torch.log_softmax(_hf_logits(llama_dir, prompt), dim=-1)
        for i in range(1, len(prompt)):
            assert out.prompt_logprobs[i][prompt[i]].logprob == pytest.approx(full[i - 1, prompt[i]].item(), abs=1e-4)


def _hf_logits(model_dir, token_ids):
    from tests.oracle import hf_model

    with torch.no_grad():
        return hf_model(str(model_dir))(torch.tensor([token_ids])).logits[0].float()


def test_prompt_logprobs_survive_chunking_and_preemption(llama_dir):
    prompts = random_prompts(seed=5)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=0)
    roomy = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=4096).generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tight_llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=16,
                    num_gpu_blocks_override=blocks_to_force_preemption(8))
    tight = tight_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert tight_llm.stats()["num_preemptions"] > 0
    for a, b in zip(roomy, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            for k in x:
                assert x[k].logprob == pytest.approx(y[k].logprob, abs=1e-4)


def test_async_scheduling_keeps_greedy_equal_to_transformers_and_seeded_samples_unchanged(llama_dir):
    """Steps planned while the previous one runs (the worker appends its own samples) give the
    tokens transformers gives, and the same seeded, penalised samples as steps planned after."""
    prompts = random_prompts(seed=3)
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=48, enable_chunked_prefill=True)
    engine = llm.engine

    def run(params: SamplingParams, pipelined: bool) -> dict[str, list[int]]:
        for i, prompt in enumerate(prompts):
            engine.add_request(EngineRequest(f"{pipelined}-{i}", prompt, params))
        driver = Pipeline(engine) if pipelined else engine
        outputs: dict[str, list[int]] = {}
        while driver.has_unfinished():
            for update in driver.step():
                outputs.setdefault(update.request_id.split("-")[1], []).extend(update.new_token_ids)
        if pipelined:
            assert driver.ahead >= MAX_TOKENS - 2, "most steps were meant to be planned ahead"
        assert engine.get_stats()["kv_blocks_used"] == 0
        return outputs

    greedy = run(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), pipelined=True)
    for i, prompt in enumerate(prompts):
        ref, ref_logprobs = hf_greedy(llama_dir, prompt, MAX_TOKENS)
        assert_greedy_equal(greedy[str(i)], ref, ref_logprobs, f"async scheduling, prompt of {len(prompt)}")
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=11, repetition_penalty=1.3, frequency_penalty=0.4,
                            max_tokens=MAX_TOKENS, ignore_eos=True)
    assert run(seeded, pipelined=False) == run(seeded, pipelined=True)
