"""Tensor parallelism: ranks as real processes (gloo on the CPU) that share a model's heads and MLP
columns give transformers' greedy tokens and the single worker's seeded samples."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from services.scheduler.tensor_parallel_executor import group_info
from services.worker.tensor_parallel import TensorParallel
from services.worker.model_config import ModelConfig
from shared.step_protocol import WorkerInfo
from tests.kv_release import count_releases, preempted_or_released
from tests.oracle import assert_greedy_equal, hf_greedy


def prompts(seed: int, lengths=(1, 6, 19, 45)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in lengths]


def generate(llm: LLM, token_prompts, params, lora_request=None):
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False,
                        lora_request=lora_request)


@pytest.fixture(scope="module")
def biased_dir(tiny_model_factory):
    # Biases on o_proj and down_proj: split by their inputs, so rank 0 alone adds them.
    return tiny_model_factory("llama", attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("model_fixture, size", [("mistral_dir", 2), ("biased_dir", 2), ("qwen3_dir", 2),
                                                 ("qwen2_moe_dir", 2), ("gemma2_dir", 2),
                                                 ("phi3_dir", 2), ("granite_dir", 2), ("olmo2_dir", 2)])
def test_greedy_on_ranks_equals_transformers(model_fixture, size, request):
    """Multi-query attention (one KV head, held by both ranks), row-parallel biases, per-head q/k
    norms; under chunked prefill and preemption. (Four ranks: the LoRA test below.)"""
    model_dir = request.getfixturevalue(model_fixture)
    token_prompts = prompts(seed=size)
    llm = LLM(str(model_dir), block_size=4, tensor_parallel_size=size, max_num_batched_tokens=24,
              num_gpu_blocks_override=30)
    released = count_releases(llm)
    try:
        outputs = generate(llm, token_prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert preempted_or_released(llm, released, block_size=4) and llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()
    for prompt, out in zip(token_prompts, outputs):
        ref, ref_logprobs = hf_greedy(model_dir, prompt, 16)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{model_fixture} on {size} ranks")


def test_four_ranks_over_two_kv_heads_with_and_without_a_lora_adapter_equal_transformers(llama_dir, tmp_path):
    """Each rank holds its share of every adapter (B's rows of q/k/v and gate/up, k/v's shared by two
    ranks; A's columns of o_proj and down_proj), the base model beside it in the same steps."""
    from pagedserve import LoRARequest
    from tests.lora_adapters import make_adapter, merged_model

    adapter = make_adapter(llama_dir, tmp_path / "adapter", rank=8, seed=3)
    merged = merged_model(llama_dir, adapter, tmp_path / "merged")
    token_prompts = prompts(seed=4)
    llm = LLM(str(llama_dir), block_size=4, tensor_parallel_size=4, max_num_batched_tokens=24,
              num_gpu_blocks_override=30, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("adapter", str(adapter))
    try:
        outputs = generate(llm, token_prompts * 2, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           lora_request=[None] * len(token_prompts) + [lora] * len(token_prompts))
        assert llm.stats()["num_preemptions"] > 0 and llm.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()
    for i, (prompt, out) in enumerate(zip(token_prompts * 2, outputs)):
        model_dir, what = (llama_dir, "base") if i < len(token_prompts) else (merged, "adapter")
        ref, ref_logprobs = hf_greedy(model_dir, prompt, 16)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{what} on 4 ranks")


def test_seeded_samples_logprobs_and_swaps_on_ranks_equal_one_worker(llama_dir):
    token_prompts = prompts(seed=5)
    params = SamplingParams(n=2, temperature=0.9, top_p=0.9, seed=3, max_tokens=14, logprobs=2,
                            presence_penalty=0.5, ignore_eos=True)
    options = dict(block_size=4, num_gpu_blocks_override=40, preemption_mode="swap", max_num_batched_tokens=24)
    single = generate(LLM(str(llama_dir), **options), token_prompts, params)
    llm = LLM(str(llama_dir), tensor_parallel_size=2, **options)
    try:
        ranked = generate(llm, token_prompts, params)
        assert llm.stats()["num_swaps_out"] > 0
    finally:
        llm.close()
    for a, b in zip(single, ranked):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids
            for p, q in zip(x.logprobs, y.logprobs):
                assert p.keys() == q.keys()
                assert all(p[t].logprob == pytest.approx(q[t].logprob, abs=1e-4) for t in p)


def test_a_draft_model_beside_the_ranks(llama_dir):
    """Speculative decoding composes: every rank runs the whole draft model beside its share of the target."""
    token_prompts = prompts(seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    single = generate(LLM(str(llama_dir), block_size=4), token_prompts, params)
    llm = LLM(str(llama_dir), block_size=4, tensor_parallel_size=2,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3})
    try:
        ranked = generate(llm, token_prompts, params)
        stats = llm.stats()
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in ranked] == [o.outputs[0].token_ids for o in single]
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"] > 0


def test_models_the_ranks_cannot_share_are_refused_before_any_starts(llama_dir):
    with pytest.raises(ValueError, match="does not divide the model's num_attention_heads"):
        LLM(str(llama_dir), tensor_parallel_size=3)
    config = ModelConfig.from_model_dir(llama_dir)  # 4 heads, 2 KV heads
    assert TensorParallel(1, 2).shard(config).num_key_value_heads == 1
    assert TensorParallel(3, 4).shard(config).num_key_value_heads == 1  # each KV head on two ranks
    assert TensorParallel(3, 4).kv_replicas(config) == 2 and TensorParallel(3, 4).rows(8, 2) == slice(4, 8)
    with pytest.raises(ValueError, match="outside a group"):
        TensorParallel(2, 2)


def test_the_scheduler_takes_a_group_s_ranks_in_order_and_sizes_it_by_the_smallest():
    def info(rank, size=2, blocks=100, model="m"):
        return WorkerInfo(model=model, num_kv_blocks=blocks, block_size=16, max_model_len=64, vocab_size=10,
                          eos_token_ids=(0,), device="cpu", dtype="float32", tensor_parallel_rank=rank,
                          tensor_parallel_size=size)

    group = group_info([info(0, blocks=100), info(1, blocks=90)], ["a", "b"])
    assert group.num_kv_blocks == 90 and group.tensor_parallel_rank == 0
    with pytest.raises(ValueError, match="given as rank 0"):
        group_info([info(1), info(0)], ["a", "b"])
    with pytest.raises(ValueError, match="rank 0 of 3, but was given as rank 0 of 2"):
        group_info([info(0, 3), info(1, 3)], ["a", "b"])
    with pytest.raises(ValueError, match="disagree on model"):
        group_info([info(0), info(1, model="other")], ["a", "b"])
    with pytest.raises(ValueError, match="rank 0 of 2, but was given as rank 0 of 1"):  # rank 0 alone would hang
        group_info([info(0)], ["a"])


def test_ranks_are_the_llm_s_own_and_leave_together(llama_dir, monkeypatch):
    """The ranks take no PAGEDSERVE_* settings from the environment (the in-process worker does not
    either), run in a session of their own (a Ctrl-C at the terminal is not theirs), and leave when
    their scheduler does; close() releases everything even after a rank died (found by review)."""
    import os
    import time

    from services.scheduler.local_workers import LocalWorkerGroup
    from services.scheduler.tensor_parallel_executor import TensorParallelExecutor
    from shared.config import EngineConfig

    monkeypatch.setenv("PAGEDSERVE_MAX_MODEL_LEN", "20")
    llm = LLM(str(llama_dir), block_size=4, tensor_parallel_size=2)
    try:
        assert llm.engine.info.max_model_len == 512
        procs, folder = list(llm._workers.procs), llm._workers.folder
        assert all(os.getsid(p.pid) != os.getsid(0) for p in procs)
        procs[1].kill()
        procs[1].wait()
    finally:
        llm.close()
    assert all(p.poll() is not None for p in procs) and not folder.exists()

    group = LocalWorkerGroup(EngineConfig(model=str(llama_dir), block_size=4, tensor_parallel_size=2))
    try:
        TensorParallelExecutor(group.addresses).shutdown()  # the scheduler goes away
        deadline = time.monotonic() + 30
        while any(p.poll() is None for p in group.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p.poll() for p in group.procs] == [75, 75]  # EXIT_GROUP_BROKEN: they meet anew when restarted
    finally:
        group.stop()
