"""bad_words (vLLM's): greedy with banned token sequences equals transformers' generate with bad_words_ids,
and words become token sequences as vLLM makes them."""

from __future__ import annotations

import random

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.oracle import assert_greedy_equal, hf_model


def hf_greedy_banning(model_dir, prompt: list[int], max_new_tokens: int, bad_words_ids: list[list[int]]):
    model = hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=0, bad_words_ids=bad_words_ids, return_dict_in_generate=True,
                             output_scores=True, output_logits=True)
    return out.sequences[0, len(prompt):].tolist(), [torch.log_softmax(s[0].float(), -1) for s in out.logits]


def test_greedy_without_bad_words_equals_transformers_banning_them(llama_dir):
    llm = LLM(str(llama_dir))
    rng = random.Random(11)
    for _ in range(3):
        prompt = [rng.randrange(1, 500) for _ in range(rng.randrange(3, 30))]
        plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20,
                                                                          ignore_eos=True), use_tqdm=False)
        out = plain[0].outputs[0].token_ids
        # Pairs banned only where their first token came just before: out[3] after a token never generated
        # stays; out[6] after out[5] goes. (And a single token, banned everywhere, in a second request.)
        never = next(t for t in range(1, 500) if t not in out and t != prompt[-1])
        banned = [[never, out[3]], [out[5], out[6]]]
        assert prompt[-1] != out[5]  # transformers also matches across the prompt's end; vLLM (and we) do not
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=banned)
        ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert ours[:6] == out[:6] and ours[6] != out[6]
        ref, ref_logprobs = hf_greedy_banning(llama_dir, prompt, 20, banned)
        assert_greedy_equal(ours, ref, ref_logprobs, f"bad words {banned}")
        banned = [[out[2]]]
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, bad_words_token_ids=banned)
        ours = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
        assert out[2] not in ours
        ref, ref_logprobs = hf_greedy_banning(llama_dir, prompt, 20, banned)
        assert_greedy_equal(ours, ref, ref_logprobs, f"bad words {banned}")
    assert llm.stats()["kv_blocks_used"] == 0


def test_bad_words_become_token_sequences_as_vllm_makes_them(llama_dir):
    llm = LLM(str(llama_dir))
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(bad_words=["hello", " world"]).with_bad_words_tokenized(
        lambda w: tokenizer(w, add_special_tokens=False).input_ids)
    encode = lambda w: tokenizer(w, add_special_tokens=False).input_ids  # noqa: E731
    expected = []
    for word in ("hello", "world"):
        expected.append(encode(word))
        spaced = encode(" " + word)
        if spaced[0] != expected[-1][0] and len(spaced) == len(expected[-1]):
            expected.append(spaced)
    assert params.bad_words_token_ids == expected
    # Through generate: no sampled text contains a banned word's tokens in a row.
    out = llm.generate("hello hello", SamplingParams(max_tokens=30, seed=1, bad_words=["hello"]), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    for word in params.bad_words_token_ids[:2]:
        assert not any(tokens[i:i + len(word)] == word for i in range(len(tokens)))


@pytest.mark.parametrize("bad, reason", [(["", "x"], "non-blank"), ("word", "list of non-blank")])
def test_bad_words_are_checked(bad, reason):
    with pytest.raises(ValueError, match=reason):
        SamplingParams(bad_words=bad)
    with pytest.raises(ValueError, match="bad_words_token_ids"):
        SamplingParams(bad_words_token_ids=[[]])
