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
    """Worker, scheduler and gateway as processes: drafts travel in plans and results over gRPC, the
    scheduler does not plan ahead of them, and the outputs are plain decoding's."""
    import json

    import openai

    from benchmarks.serving import parse_engine_stats
    from tests.services_harness import Stack, http_get

    rng = random.Random(6)
    loops = [[rng.randrange(1, 500) for _ in range(period)] * (24 // period) for period in (2, 3)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in generate(LLM(str(llama_dir), block_size=16), loops, params)]
    ngram = json.dumps({**NGRAM, "prompt_lookup_min": 1})
    worker_args = ("--block-size", "16", "--num-gpu-blocks-override", "128", "--speculative-config", ngram)
    with Stack(llama_dir, tmp_path, worker_args=worker_args) as stack:
        client = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)
        for prompt, text in zip(loops, expected):
            reply = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                              logprobs=1, extra_body={"ignore_eos": True})
            assert reply.choices[0].text == text and reply.usage.completion_tokens == 12
            assert len(reply.choices[0].logprobs.tokens) == 12
            streamed = client.completions.create(model=stack.model_name, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
            assert "".join(chunk.choices[0].text for chunk in streamed) == text
        stats = parse_engine_stats(http_get(f"{stack.base_url}/metrics")[1])
        assert stats["spec_decode_num_draft_tokens"] > 0 and stats["kv_blocks_used"] == 0
