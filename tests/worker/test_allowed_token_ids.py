"""allowed_token_ids (vLLM's): only those tokens may be sampled; greedy picks the best of them, as
transformers' logits restricted to the same set do."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from services.worker.model_loader import load_eos_token_ids
from tests.oracle import assert_greedy_equal, hf_model


def hf_restricted_greedy(model_dir, prompt: list[int], allowed: list[int], max_tokens: int):
    model = hf_model(str(model_dir))
    eos = set(load_eos_token_ids(model_dir))
    outside = torch.ones(model.config.vocab_size, dtype=torch.bool)
    outside[allowed] = False
    tokens, logprobs = [], []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
        logits[outside] = float("-inf")
        tokens.append(int(logits.argmax()))
        logprobs.append(torch.log_softmax(logits, dim=-1))
        if tokens[-1] in eos:
            break
    return tokens, logprobs


def test_greedy_within_the_allowed_tokens_equals_transformers(llama_dir):
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    llm = LLM(str(llama_dir), block_size=8, max_num_batched_tokens=64)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))] for _ in range(3)]
    allowed = [sorted(rng.sample(range(3, 500), k)) for k in (1, 5, 40)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=a) for a in allowed],
                        use_tqdm=False)
    for prompt, ids, out in zip(prompts, allowed, outs):
        ref, ref_logprobs = hf_restricted_greedy(llama_dir, prompt, ids, 6)
        assert_greedy_equal(out.outputs[0].token_ids, ref, ref_logprobs, f"seed {seed}, allowed {ids}")
    # Sampled (with a bias inside the set), the tokens stay in it; the allowed set may include EOS.
    sampled = llm.generate([{"prompt_token_ids": prompts[0]}],
                           SamplingParams(temperature=1.5, max_tokens=30, n=3, seed=seed, allowed_token_ids=allowed[2],
                                          logit_bias={allowed[2][0]: 2.0}), use_tqdm=False)[0]
    assert all(set(o.token_ids) <= set(allowed[2]) for o in sampled.outputs)


def test_bad_allowed_token_ids_are_refused(llama_dir):
    for bad in ([], [-1], "12", [1.5]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[3], structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="use_beam_search"):
        SamplingParams(allowed_token_ids=[3], use_beam_search=True, temperature=0)
    llm = LLM(str(llama_dir), block_size=8)
    eos = load_eos_token_ids(llama_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[10 ** 6]), use_tqdm=False)
    with pytest.raises(ValueError, match="only stop tokens"):  # min_tokens bans every token it allows
        llm.generate("Hi", SamplingParams(allowed_token_ids=list(eos) + [7], stop_token_ids=[7], min_tokens=2),
                     use_tqdm=False)
    wire = SamplingParams(allowed_token_ids=[4, 9])
    assert SamplingParams.from_proto(wire.to_proto()).allowed_token_ids == [4, 9]
    assert SamplingParams.from_proto(SamplingParams().to_proto()).allowed_token_ids is None
    assert llm.generate("Hi", SamplingParams(max_tokens=2, allowed_token_ids=[7], ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids == [7, 7]
