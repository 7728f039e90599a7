"""Speculative decoding through the real worker: outputs equal transformers' (greedy) and plain
decoding's (seeded sampling with every sampling feature, stops, limits), token for token."""

from __future__ import annotations

import random

import pytest

from pagedserve import LLM, SamplingParams
from tests.oracle import assert_greedy_equal, hf_greedy
from tests.reference_proposer import ReferenceProposer

K = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": K}


def prompts(seed: int, lengths=(1, 5, 17, 40), vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def generate(llm: LLM, token_prompts, params) -> list:
    return llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)


def with_reference_drafts(llm: LLM, references: list[list[int]], wrong: float = 0.25, seed: int = 0
                          ) -> ReferenceProposer:
    worker = llm.engine.executor.worker
    proposer = ReferenceProposer(references, K, worker.vocab_size, wrong, seed)
    worker.proposer = proposer
    return proposer


def assert_drafts_were_verified(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0, "no draft was accepted: the test proves little"
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"], "none was rejected"
    assert stats["kv_blocks_used"] == 0


def test_greedy_with_drafts_equals_transformers_under_chunking_and_preemption(llama_dir):
    token_prompts = prompts(seed=1)
    max_tokens = 24
    refs = [hf_greedy(llama_dir, p, max_tokens) for p in token_prompts]
    # A few blocks more than the longest request: the others are preempted while drafts come and go.
    llm = LLM(str(llama_dir), block_size=4, max_num_batched_tokens=20, num_gpu_blocks_override=24,
              speculative_config=NGRAM)
    with_reference_drafts(llm, [p + ref for p, (ref, _) in zip(token_prompts, refs)])
    outputs = generate(llm, token_prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert llm.stats()["num_preemptions"] > 0, "the KV budget was meant to force preemption"
    assert_drafts_were_verified(llm)
    for prompt, out, (ref, ref_logprobs) in zip(token_prompts, outputs, refs):
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"prompt of {len(prompt)}")
        assert out.outputs[0].finish_reason == "length"


SAMPLING = [
    SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=5, max_tokens=20, ignore_eos=True, logprobs=3),
    SamplingParams(temperature=1.2, min_p=0.05, seed=6, presence_penalty=0.4, frequency_penalty=0.3,
                   repetition_penalty=1.2, max_tokens=20, min_tokens=8, logit_bias={7: 3.0, 9: -2.0}, logprobs=1),
    SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
]


@pytest.mark.parametrize("params", SAMPLING, ids=["top-p-k-logprobs", "penalties-bias-min-tokens", "n3"])
def test_seeded_sampling_with_drafts_equals_plain_decoding(llama_dir, params):
    """Each position of a verification is sampled from the state it would have had (penalty counts,
    min_tokens, the seeded counter), so accepting drafts changes no seeded sample."""
    token_prompts = prompts(seed=2)
    plain = generate(LLM(str(llama_dir), block_size=8), token_prompts, params)
    llm = LLM(str(llama_dir), block_size=8, speculative_config=NGRAM)
    with_reference_drafts(llm, [out.prompt_token_ids + c.token_ids for out in plain for c in out.outputs])
    speculative = generate(llm, token_prompts, params)
    assert_drafts_were_verified(llm)
    for a, b in zip(plain, speculative):
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
            if params.logprobs is not None:
                assert len(y.logprobs) == len(y.token_ids)
                for p, q in zip(x.logprobs, y.logprobs):
                    assert p.keys() == q.keys()
                    for token in p:
                        assert p[token].logprob == pytest.approx(q[token].logprob, abs=1e-4)
                        assert p[token].rank == q[token].rank


def test_stops_inside_a_run_of_accepted_drafts_end_the_output_where_plain_decoding_does(llama_dir):
    token_prompts = prompts(seed=3, lengths=(6, 12))
    free = generate(LLM(str(llama_dir), block_size=8), token_prompts,
                    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    llm = LLM(str(llama_dir), block_size=8, speculative_config=NGRAM)
    tokenizer = llm.get_tokenizer()
    for out in free:
        ids = out.outputs[0].token_ids
        # A stop token id, then a stop string made of later tokens' text: both land mid-way through
        # a run of drafts that are all right (wrong=0), so several tokens arrive after the stop.
        for params in (SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[9]]),
                       SamplingParams(temperature=0, max_tokens=30, stop=[tokenizer.decode(ids[13:15])]),
                       SamplingParams(temperature=0, max_tokens=11, ignore_eos=True)):
            plain = generate(LLM(str(llama_dir), block_size=8), [out.prompt_token_ids], params)[0].outputs[0]
            with_reference_drafts(llm, [out.prompt_token_ids + ids], wrong=0.0)
            spec = generate(llm, [out.prompt_token_ids], params)[0].outputs[0]
            assert (spec.token_ids, spec.text, spec.finish_reason, spec.stop_reason) == \
                (plain.token_ids, plain.text, plain.finish_reason, plain.stop_reason)
    assert llm.stats()["spec_decode_num_accepted_tokens"] > 0 and llm.stats()["kv_blocks_used"] == 0


def test_drafts_never_take_a_sequence_past_the_context(llama_dir):
    prompt = prompts(seed=4, lengths=(50,))[0]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    plain = generate(LLM(str(llama_dir), block_size=8, max_model_len=64), [prompt], params)[0].outputs[0]
    llm = LLM(str(llama_dir), block_size=8, max_model_len=64, speculative_config=NGRAM)
    with_reference_drafts(llm, [prompt + plain.token_ids + [1] * 8], wrong=0.0)  # drafts past the end too
    spec = generate(llm, [prompt], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and len(prompt) + len(spec.token_ids) == 64
    assert spec.finish_reason == "length"


def test_ngram_drafts_through_the_engine_change_no_greedy_output(llama_dir):
    """The real proposer: on a random model its drafts are rejected, but they are proposed and
    verified (blocks grow for them and come back) without changing a token."""
    rng = random.Random(5)
    loops = [[rng.randrange(1, 500) for _ in range(period)] * (30 // period) for period in (2, 3, 5)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = generate(LLM(str(llama_dir), block_size=4), loops, params)
    # Down to single tokens, so that the model's new tokens find earlier occurrences too.
    llm = LLM(str(llama_dir), block_size=4, speculative_config={**NGRAM, "prompt_lookup_min": 1})
    spec = generate(llm, loops, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0


def test_a_speculating_worker_serves_through_the_services(llama_dir, tmp_path):
    """Worker, scheduler and gateway as processes, the target its own draft model: accepted drafts
    travel in results over gRPC, several tokens reach the gateway at once, and the outputs, their
    logprobs and usage are plain decoding's."""
    import json

    import openai

    from benchmarks.serving import parse_engine_stats
    from tests.services_harness import Stack, http_get

    token_prompts = prompts(seed=6, lengths=(3, 20))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    expected = generate(LLM(str(llama_dir), block_size=16), token_prompts, params)
    worker_args = ("--block-size", "16", "--num-gpu-blocks-override", "128",
                   "--speculative-config", json.dumps(draft_model(llama_dir)))
    with Stack(llama_dir, tmp_path, worker_args=worker_args) as stack:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        for prompt, plain in zip(token_prompts, expected):
            reply = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                              logprobs=1, extra_body={"ignore_eos": True})
            choice, want = reply.choices[0], plain.outputs[0]
            assert choice.text == want.text and reply.usage.completion_tokens == 12
            assert choice.logprobs.token_logprobs == pytest.approx(
                [position[token].logprob for position, token in zip(want.logprobs, want.token_ids)], abs=1e-4)
            streamed = list(client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12,
                                                      temperature=0, stream=True, extra_body={"ignore_eos": True}))
            assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == want.text
            assert len(streamed) < 12, "accepted drafts come several tokens to a chunk"
        stats = parse_engine_stats(http_get(f"{stack.base_url}/metrics")[1])
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["kv_blocks_used"] == 0


# --- a draft model ------------------------------------------------------------------------------------


def draft_model(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}


PRESSURE = {  # a few blocks more than the longest request, and a small step budget: preemption happens
    "roomy": {},
    "swap": dict(num_gpu_blocks_override=30, preemption_mode="swap", max_num_batched_tokens=20),
    "recompute": dict(num_gpu_blocks_override=30, preemption_mode="recompute", max_num_batched_tokens=20),
}


@pytest.mark.parametrize("pressure", list(PRESSURE))
def test_a_draft_model_equal_to_the_target_proposes_what_the_target_samples(llama_dir, pressure):
    """With the target as its own draft, every greedy draft is right, so the rate of acceptance shows
    whether the draft's cache followed the target's through swaps, recomputes and prefix-cache hits
    (a draft cache left behind in a swap accepts about a third); and outputs equal transformers'."""
    rng = random.Random(7)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    token_prompts = prompts(seed=7) + [shared + [i] for i in (1, 2, 3)]
    llm = LLM(str(llama_dir), block_size=4, speculative_config=draft_model(llama_dir), **PRESSURE[pressure])
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    # The last two come once the first's prefix is in the cache: theirs is read from it, both caches.
    outputs = generate(llm, token_prompts[:-2], params) + generate(llm, token_prompts[-2:], params)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"] > 0, stats
    assert stats["prefix_cache_hits"] > 0 and stats["kv_blocks_used"] == 0
    if pressure != "roomy":
        assert stats[f"num_preemptions_{pressure}"] > 0, "the KV budget was meant to force preemption"
    for prompt, out in zip(token_prompts, outputs):
        ref, ref_logprobs = hf_greedy(llama_dir, prompt, 24)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"{pressure}, prompt of {len(prompt)}")


def test_a_draft_model_that_guesses_wrong_changes_no_output(llama_dir, tiny_model_factory):
    other = tiny_model_factory("llama", num_hidden_layers=1, seed=3)
    token_prompts = prompts(seed=8)
    for params in (SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                   SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=16, logprobs=2, ignore_eos=True)):
        plain = generate(LLM(str(llama_dir), block_size=4), token_prompts, params)
        llm = LLM(str(llama_dir), block_size=4, speculative_config=draft_model(other))
        spec = generate(llm, token_prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]
        assert llm.stats()["spec_decode_num_draft_tokens"] > 0 and llm.stats()["kv_blocks_used"] == 0


def test_draft_models_that_cannot_serve_the_target_are_refused(llama_dir, tiny_model_factory, tmp_path):
    with pytest.raises(ValueError, match="vocabulary of"):
        LLM(str(llama_dir), speculative_config=draft_model(tiny_model_factory("llama", vocab_size=1024)))
    short = tiny_model_factory("llama", max_position_embeddings=64)
    with pytest.raises(ValueError, match="fewer than the context length 512"):
        LLM(str(llama_dir), speculative_config=draft_model(short))
    LLM(str(llama_dir), max_model_len=64, speculative_config=draft_model(short))  # within its reach
    windowed = tiny_model_factory("mistral", sliding_window=16)  # a window is no limit: it attends within it
    LLM(str(llama_dir), speculative_config=draft_model(windowed))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(llama_dir), speculative_config=draft_model(tmp_path / "nothing"))


def test_the_draft_s_cache_comes_out_of_the_kv_budget(llama_dir):
    """Each block's share includes the draft's K/V, and the draft's scratch blocks are taken from the
    budget first: both pools together stay within it (found by review: the scratch was not counted)."""
    budget = 1 << 20
    alone = LLM(str(llama_dir), block_size=16, kv_cache_memory_bytes=budget, max_num_seqs=8).engine.executor.worker
    paired = LLM(str(llama_dir), block_size=16, kv_cache_memory_bytes=budget, max_num_seqs=8,
                 speculative_config=draft_model(llama_dir)).engine.executor.worker
    per_block = alone.kv_pool[:, :, 0].numel() * alone.kv_pool.element_size()
    scratch = 8 * -(-K // 16)  # a run of blocks per proposing sequence
    assert alone.num_blocks == budget // per_block
    assert paired.num_blocks == (budget - scratch * per_block) // (2 * per_block)
    draft_pool = paired.proposer.kv_pool
    assert draft_pool.shape[2] == paired.num_blocks + scratch
    assert paired.kv_pool.numel() * 4 + draft_pool.numel() * 4 <= budget


@pytest.mark.parametrize("method", ["reference", "draft_model"])
def test_no_drafts_for_steps_of_more_sequences_than_disable_by_batch_size(llama_dir, method):
    """vLLM's disable_by_batch_size: a step of more sequences proposes nothing (a draft model's cache
    still follows: drafts proposed once the batch is small again are all right)."""
    token_prompts = prompts(seed=9, lengths=(3, 4, 5, 6))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (4, 6, 8, 30)]
    plain = LLM(str(llama_dir), block_size=4).generate([{"prompt_token_ids": p} for p in token_prompts], params,
                                                       use_tqdm=False)
    config = {**NGRAM, "disable_by_batch_size": 1} if method == "reference" else \
        {**draft_model(llama_dir), "disable_by_batch_size": 1}
    llm = LLM(str(llama_dir), block_size=4, speculative_config=config)
    if method == "reference":
        with_reference_drafts(llm, [o.prompt_token_ids + o.outputs[0].token_ids for o in plain], wrong=0.0)
    worker, running = llm.engine.executor.worker, []
    execute = worker.execute
    worker.execute = lambda plan: (running.append((len(plan.new) + len(plan.running),
                                                   any(d.draft_token_ids for d in plan.running))), execute(plan))[1]
    spec = llm.generate([{"prompt_token_ids": p} for p in token_prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    # Drafts come only in steps after a step of one sequence (the last one's tail), and are all right.
    assert all(size == 1 for size, drafted in running if drafted) and any(drafted for _, drafted in running)
    stats = llm.stats()
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
