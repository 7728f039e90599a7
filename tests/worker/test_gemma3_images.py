"""Images in, text out, on Gemma 3 (models/gemma3_vision.py): an image's placeholders attend to each other both ways,
as transformers' token types make them. Greedy tokens and prompt log-probabilities equal transformers' (which the
same prompt attended causally does not), with one and two images amid text, chunked prefill at budgets that would cut
an image (the scheduler never does), preemption and a prefix-cache hit that ends inside an image; an image longer
than a step is refused.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.images import (assert_preempted_images_equal, chat_text, hf_greedy_with_images, hf_prompt_logprobs,
                          picture)
from tests.oracle import assert_greedy_equal

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
IMAGE = "<start_of_image>"

PROMPTS = [  # (text, images): each image 4 placeholders between its start and end tokens
    (f"What is in {IMAGE} this picture?", [picture(1)]),
    (f"Compare {IMAGE} with {IMAGE} and say which is brighter.", [picture(2, (60, 30)), picture(3, (100, 100))]),
    (f"A long preamble about nothing in particular, then {IMAGE} and more words after it.", [picture(4)]),
]


def generate(llm: LLM, text: str, images: list, params: SamplingParams = GREEDY):
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params, use_tqdm=False)[0]


def prompt_logprobs(output) -> torch.Tensor:
    """Each prompt token's log-probability after the first (prompt_logprobs=0: the token's own)."""
    ids = output.prompt_token_ids
    return torch.tensor([entry[token].logprob for token, entry in zip(ids[1:], output.prompt_logprobs[1:])])


def assert_equal_transformers(llm: LLM, model_dir, text: str, images: list, what: str, prompt: bool = True) -> None:
    """Greedy tokens and their log-probabilities (up to a near-tie), and with ``prompt`` the prompt's (which turn
    prefix caching off for the request), equal transformers'."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0 if prompt else None)
    output = generate(llm, text, images, params)
    sample = output.outputs[0]
    expected, expected_logprobs = hf_greedy_with_images(model_dir, text, images)
    assert_greedy_equal(sample.token_ids, expected, expected_logprobs, what=what)
    agreed = next((i for i, (a, b) in enumerate(zip(sample.token_ids, expected)) if a != b), len(expected))
    ours = torch.tensor([entry[token].logprob for token, entry in zip(sample.token_ids[:agreed], sample.logprobs)])
    theirs = torch.stack([logprobs[token] for token, logprobs in zip(expected[:agreed], expected_logprobs)])
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=0, msg=lambda m: f"{what}, sampled: {m}")
    if prompt:
        torch.testing.assert_close(prompt_logprobs(output), hf_prompt_logprobs(model_dir, text, images), atol=2e-4,
                                   rtol=0, msg=lambda m: f"{what}, prompt: {m}")


@pytest.fixture(scope="module")
def llm(gemma3_multimodal_dir):
    engine = LLM(str(gemma3_multimodal_dir), block_size=4, num_gpu_blocks_override=128)
    yield engine
    engine.close()


def test_images_attend_both_ways_as_in_transformers(llm, gemma3_multimodal_dir):
    for text, images in PROMPTS:
        assert_equal_transformers(llm, gemma3_multimodal_dir, text, images, text)
    # The oracle tells the two apart: attended causally, the image's placeholders and the text after them differ.
    text, images = PROMPTS[0]
    gap = (hf_prompt_logprobs(gemma3_multimodal_dir, text, images)
           - hf_prompt_logprobs(gemma3_multimodal_dir, text, images, both_ways=False)).abs().max()
    assert gap > 1e-2


def test_the_triton_kernel_attends_images_both_ways(gemma3_multimodal_dir):
    """The engine on the Triton backend (its KEY_LIMIT kernels, interpreted here), a chunk budget that puts an
    image and text in one step."""
    engine = LLM(str(gemma3_multimodal_dir), block_size=4, num_gpu_blocks_override=128, attention_backend="triton",
                 max_num_batched_tokens=7, enable_chunked_prefill=True)
    try:
        text, images = PROMPTS[0]
        assert_equal_transformers(engine, gemma3_multimodal_dir, text, images, "triton")
    finally:
        engine.close()


@pytest.mark.parametrize("budget", [4, 5, 7])
def test_chunked_prefill_never_cuts_an_image(gemma3_multimodal_dir, budget):
    """Budgets that would end chunks inside the 4 placeholders: each image goes whole, in a step of its own or
    beside text, and the answers equal transformers'."""
    engine = LLM(str(gemma3_multimodal_dir), block_size=4, num_gpu_blocks_override=128,
                 max_num_batched_tokens=budget, enable_chunked_prefill=True, enable_prefix_caching=False)
    try:
        for text, images in PROMPTS[:2]:
            assert_equal_transformers(engine, gemma3_multimodal_dir, text, images, f"{text} (budget {budget})")
    finally:
        engine.close()


def test_preempted_sequences_with_images_come_back_right(gemma3_multimodal_dir):
    assert_preempted_images_equal(gemma3_multimodal_dir, PROMPTS, num_blocks=40)


def test_a_prefix_hit_ending_inside_an_image_goes_on_from_there(gemma3_multimodal_dir):
    """The cached placeholders were computed with the whole image; the rest of the image sees them and itself."""
    from services.gateway.image_prompts import image_prompts

    engine = LLM(str(gemma3_multimodal_dir), block_size=4, num_gpu_blocks_override=128)
    try:
        images, prompts = [picture(5)], image_prompts(gemma3_multimodal_dir, engine.engine.info.image_token_id)
        for more in range(8):  # a word more each time, until the image straddles the last block's start
            text = f"Describe{' it' * more}: {IMAGE}"
            token_ids, (placed,) = prompts.process(text, images)
            last_block = (len(token_ids) - 1) // 4 * 4  # where a hit of the whole prompt stops: its last token computes
            if placed.offset < last_block < placed.end:
                break
        else:
            raise AssertionError("no prompt puts its last block's start inside the image")
        hits = []
        for _ in range(2):
            before = engine.stats()["prefix_cache_hits"]
            assert_equal_transformers(engine, gemma3_multimodal_dir, text, images, "a hit", prompt=False)
            hits.append(engine.stats()["prefix_cache_hits"] - before)
        assert hits == [0, last_block]
    finally:
        engine.close()


def test_an_image_longer_than_a_step_is_refused(gemma3_multimodal_dir):
    engine = LLM(str(gemma3_multimodal_dir), block_size=4, num_gpu_blocks_override=128, max_num_batched_tokens=3,
                 enable_chunked_prefill=True)
    try:
        text, images = PROMPTS[0]
        with pytest.raises(ValueError, match="computes each image in one step, of at most 3 tokens"):
            generate(engine, text, images)
        assert generate(engine, "Only text here.", []).outputs[0].token_ids  # and it goes on serving
    finally:
        engine.close()


def test_chat_places_each_image_at_its_start_token(llm, gemma3_multimodal_dir):
    question = "What do you see?"
    messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(17)},
                                             {"type": "text", "text": question}]}]
    tokens = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    text = chat_text(str(gemma3_multimodal_dir), question, 1, IMAGE)
    assert_greedy_equal(tokens, *hf_greedy_with_images(gemma3_multimodal_dir, text, [picture(17)]), what="chat")
