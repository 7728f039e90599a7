"""Beam search in the engine equals transformers' beam search on the same weights."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.oracle import hf_greedy


@functools.lru_cache(maxsize=2)
def hf_beam_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


def hf_beams(model_dir, prompt: list[int], *, beams: int, n: int, max_tokens: int, length_penalty: float,
             early_stopping, stop_ids: list[int]) -> list[list[int]]:
    model = hf_beam_model(str(model_dir))
    eos = list(model.generation_config.eos_token_id) + stop_ids
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, num_beams=beams, num_return_sequences=n,
                             max_new_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping,
                             eos_token_id=eos, pad_token_id=eos[0])
    results = []
    for row in out[:, len(prompt):].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        results.append(row[:cut])
    return results


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), block_size=8)


CASES = [(3, 2, 1.0, False), (4, 4, 0.0, True), (2, 1, 2.0, "never"), (4, 2, -1.0, False)]


@pytest.mark.parametrize("beams, n, length_penalty, early_stopping", CASES)
def test_beam_search_equals_transformers(llama_dir, llm, beams, n, length_penalty, early_stopping):
    rng = random.Random(beams * 10 + n)
    prompt = [rng.randrange(1, 500) for _ in range(rng.randint(4, 30))]
    # A stop token the beams will meet early, so finished hypotheses, scores and early stopping all matter.
    stop = hf_greedy(llama_dir, prompt, 3)[0][2]
    expected = hf_beams(llama_dir, prompt, beams=beams, n=n, max_tokens=10, length_penalty=length_penalty,
                        early_stopping=early_stopping, stop_ids=[stop])
    params = SamplingParams(use_beam_search=True, beam_width=beams, n=n, max_tokens=10,
                            length_penalty=length_penalty, early_stopping=early_stopping, stop_token_ids=[stop])
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == expected
    assert llm.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("top", [0, 2, 9])  # 9: more than the group's own candidates (2 * beams)
def test_beams_carry_their_tokens_logprobs(llama_dir, llm, top):
    rng = random.Random(top)
    prompt = [rng.randrange(1, 500) for _ in range(rng.randint(4, 20))]
    plain = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6, ignore_eos=True)
    with_logprobs = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6, ignore_eos=True, logprobs=top)
    expected = llm.generate({"prompt_token_ids": prompt}, plain, use_tqdm=False)[0].outputs
    outputs = llm.generate({"prompt_token_ids": prompt}, with_logprobs, use_tqdm=False)[0].outputs
    assert [c.token_ids for c in outputs] == [c.token_ids for c in expected]  # asking for them changes nothing
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in expected)
    model = hf_beam_model(str(llama_dir))
    for completion in outputs:
        tokens = completion.token_ids
        with torch.no_grad():  # the oracle: transformers' distribution at every position of this beam
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
        reference = torch.log_softmax(logits.float(), dim=-1)
        assert len(completion.logprobs) == len(tokens)
        for position, token, row in zip(completion.logprobs, tokens, reference):
            assert position[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            best = torch.topk(row, top).indices.tolist() if top else []
            assert [t for t in position if position[t].rank <= top] == best
            assert position[token].rank == 1 + int((row > row[token]).sum())
        assert completion.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(completion.logprobs,
                                                                                                tokens)))


@pytest.mark.parametrize("mode", [None, "recompute", "swap"])
def test_beams_survive_preemption(llama_dir, mode):
    rng = random.Random(5)
    prompts = [{"prompt_token_ids": [rng.randrange(1, 500) for _ in range(rng.randint(20, 40))]} for _ in range(3)]
    params = SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=12, ignore_eos=True)
    free = LLM(str(llama_dir), block_size=8).generate(prompts, params, use_tqdm=False)
    tight_llm = LLM(str(llama_dir), block_size=8, num_gpu_blocks_override=16, swap_space=0.01, preemption_mode=mode)
    tight = tight_llm.generate(prompts, params, use_tqdm=False)
    assert tight_llm.stats()["num_preemptions"] > 0
    assert [[c.token_ids for c in o.outputs] for o in free] == [[c.token_ids for c in o.outputs] for o in tight]


def test_beam_parameters_are_validated():
    with pytest.raises(ValueError, match="n"):
        SamplingParams(use_beam_search=True, beam_width=2, n=3)
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(use_beam_search=True, early_stopping="sometimes")
    # Bad beam fields are refused without use_beam_search too (the gRPC API accepted them).
    with pytest.raises(ValueError, match="early_stopping"):
        SamplingParams(early_stopping="bogus")
    with pytest.raises(ValueError, match="beam_width"):
        SamplingParams(beam_width=0)


@pytest.mark.parametrize("length_penalty", [1000.0, -1e30, 3e38, -3e38])
def test_an_extreme_length_penalty_ranks_beams_instead_of_failing(llm, length_penalty):
    """length ** penalty overflowed (or vanished) and took the engine loop down with it."""
    params = SamplingParams(use_beam_search=True, beam_width=2, n=2, max_tokens=4, length_penalty=length_penalty)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    assert len(out.outputs) == 2 and all(c.token_ids for c in out.outputs)
    assert llm.stats()["kv_blocks_used"] == 0
    assert llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs
