"""Images in, text out, on LLaVA-1.5 and LLaVA-NeXT (models/llava_vision.py): greedy tokens equal transformers' generate on the
same checkpoint and pixels, with one and two images, images amid text, chunked prefill cutting through an image's
placeholders, and preemption; the prefix cache hits the same image with the same text and misses another image;
the encoder cache encodes a repeated image once; and bad image input gets a clear error."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from tests.images import assert_preempted_images_equal, chat_text, hf_greedy_with_images, picture
from tests.oracle import assert_greedy_equal

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

PROMPTS = [  # (text, images)
    ("USER: <image>\nWhat is in the picture? ASSISTANT:", [picture(1)]),
    ("Compare <image> with <image> and say which is brighter.", [picture(2), picture(3)]),
    ("A long preamble about nothing in particular, then <image> and more words after it, at length.",
     [picture(4, (90, 30))]),
    ("<image><image> side by side", [picture(5), picture(6)]),
]


@pytest.fixture(scope="module")
def llm(llava_dir):
    engine = LLM(str(llava_dir), block_size=4, num_gpu_blocks_override=64)
    yield engine
    engine.close()


def generate(llm: LLM, text: str, images: list, params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params,
                        use_tqdm=False)[0].outputs[0].token_ids


def test_images_and_text_equal_transformers(llm, llava_dir):
    for text, images in PROMPTS:
        assert_greedy_equal(generate(llm, text, images), *hf_greedy_with_images(llava_dir, text, images), what=text)


def test_another_image_changes_the_answer(llava_dir):
    text = PROMPTS[0][0]
    first, _ = hf_greedy_with_images(llava_dir, text, [picture(1)])
    second, _ = hf_greedy_with_images(llava_dir, text, [picture(7)])
    assert first != second


@pytest.mark.parametrize("budget", [3, 5, 7])
def test_chunked_prefill_cutting_through_an_image(llava_dir, budget):
    """A step budget of a few tokens: chunks end inside the placeholders, and each step takes its rows of the
    features from the encoder cache."""
    engine = LLM(str(llava_dir), block_size=4, num_gpu_blocks_override=64, max_num_batched_tokens=budget,
                 enable_chunked_prefill=True, enable_prefix_caching=False)
    try:
        for text, images in PROMPTS[:3]:
            assert_greedy_equal(generate(engine, text, images), *hf_greedy_with_images(llava_dir, text, images),
                                what=f"{text} (budget {budget})")
        encoder = engine.engine.executor.worker.image_encoder
        assert encoder.cache.num_hits > 0  # later chunks of an image found its features
    finally:
        engine.close()


def test_preempted_sequences_with_images_come_back_right(llava_dir):
    """Few blocks for several requests at once: some are preempted (recomputed) and encode nothing anew."""
    assert_preempted_images_equal(llava_dir, PROMPTS, num_blocks=24)


def test_the_prefix_cache_hits_the_same_image_and_misses_another(llava_dir):
    engine = LLM(str(llava_dir), block_size=4, num_gpu_blocks_override=64)
    try:
        text = "A long preamble about nothing in particular, then <image> and more words after it, at length."
        generate(engine, text, [picture(8)])
        before = engine.stats()["prefix_cache_hits"]
        generate(engine, text, [picture(8)])  # the same image and text: all but the last block
        same = engine.stats()["prefix_cache_hits"] - before
        before = engine.stats()["prefix_cache_hits"]
        other = generate(engine, text, [picture(9)])  # another image: only the text before it
        another = engine.stats()["prefix_cache_hits"] - before
        offset = text.index("<image>")
        assert same > another > 0
        assert another <= len(engine.tokenizer(text[:offset]).input_ids) + 4  # up to its block, not past the image
        assert_greedy_equal(other, *hf_greedy_with_images(llava_dir, text, [picture(9)]), what="after a hit")
        assert engine.engine.executor.worker.image_encoder.cache.num_encoded == 2  # the repeated image once
    finally:
        engine.close()


def test_bad_image_input_is_refused_clearly(llm, llama_dir):
    text = PROMPTS[0][0]
    with pytest.raises(ValueError, match="marks 1 image"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [picture(1), picture(2)]}}, GREEDY)
    with pytest.raises(ValueError, match="PIL image"):
        llm.generate({"prompt": text, "multi_modal_data": {"image": [b"not an image"]}}, GREEDY)
    with pytest.raises(ValueError, match="multi_modal_data takes 'image'"):
        llm.generate({"prompt": text, "multi_modal_data": {"audio": [1]}}, GREEDY)
    with pytest.raises(ValueError, match="needs its 'prompt' text"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [picture(1)]}}, GREEDY)
    text_model = LLM(str(llama_dir))
    try:
        with pytest.raises(ValueError, match="takes no images"):
            text_model.generate({"prompt": text, "multi_modal_data": {"image": [picture(1)]}}, GREEDY)
    finally:
        text_model.close()
    assert generate(llm, text, [picture(1)])  # and it goes on serving


def test_image_inputs_that_do_not_fit_their_prompt_are_refused_at_admission(llm):
    """A request made by hand, or by a gateway of another release, must not reach the worker."""
    import dataclasses

    from services.gateway.image_prompts import ImagePrompts
    from shared.invalid_parameter import InvalidParameter
    from shared.request import EngineRequest

    text, images = PROMPTS[0]
    token_ids, (image,) = ImagePrompts(llm.engine.info.model, llm.engine.info.image_token_id).process(text, images)
    bad = {"outside the prompt": dataclasses.replace(image, offset=len(token_ids) - 1),
           "over text tokens": dataclasses.replace(image, offset=image.offset - 1),
           "pixels cut short": dataclasses.replace(image, pixel_values=image.pixel_values[:-4]),
           "another image's hash": dataclasses.replace(image, hash=bytes(16))}
    for what, tampered in bad.items():
        with pytest.raises(InvalidParameter, match=r"images\[0\]"):
            llm.engine.add_request(EngineRequest(f"bad {what}", token_ids, GREEDY, images=(tampered,)))
    assert llm.stats()["num_requests_waiting"] == 0


def test_chat_takes_image_parts(llm, llava_dir):
    """vLLM's image_pil parts and OpenAI's image_url ones (a data: URL), each where it stands in the message."""
    import base64
    import io

    question = "What do you see?"
    png = io.BytesIO()
    picture(18).save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    for part, image in (({"type": "image_pil", "image_pil": picture(17)}, picture(17)),
                        ({"type": "image_url", "image_url": {"url": url}}, picture(18))):
        messages = [{"role": "user", "content": [part, {"type": "text", "text": question}]}]
        tokens = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert_greedy_equal(tokens, *hf_greedy_with_images(llava_dir, chat_text(str(llava_dir), question, 1), [image]),
                            what=part["type"])


def test_without_an_encoder_cache_each_step_encodes_what_it_reads(llava_dir):
    """--encoder-cache-size 0: a prefill cut through an image encodes it again at each chunk; tokens alike."""
    engine = LLM(str(llava_dir), block_size=4, num_gpu_blocks_override=64, max_num_batched_tokens=3,
                 enable_chunked_prefill=True, encoder_cache_size=0)
    try:
        text, images = PROMPTS[0]
        assert_greedy_equal(generate(engine, text, images), *hf_greedy_with_images(llava_dir, text, images),
                            what="no encoder cache")
        cache = engine.engine.executor.worker.image_encoder.cache
        assert cache.num_encoded >= 2 and cache.num_hits == 0  # its 4 placeholders span at least 2 steps of 3
    finally:
        engine.close()


@pytest.mark.parametrize("budget", [None, 5])
def test_llava_next_tiles_equal_transformers(llava_next_dir, budget):
    """Images of several shapes (each its best-fitting tile layout), side by side and amid text, whole or with
    chunked prefill cutting through their placeholders."""
    options = {} if budget is None else {"max_num_batched_tokens": budget, "enable_chunked_prefill": True}
    engine = LLM(str(llava_next_dir), block_size=4, num_gpu_blocks_override=256, **options)
    try:
        for text, images in [("Compare <image> with <image> please.", [picture(20, (40, 50)), picture(21, (90, 40))]),
                             ("A wide one: <image>", [picture(22, (30, 100))]),
                             ("<image> and a small square", [picture(23, (20, 20))])]:
            assert_greedy_equal(generate(engine, text, images), *hf_greedy_with_images(llava_next_dir, text, images),
                                what=f"{text} (budget {budget})")
    finally:
        engine.close()



def test_tensor_parallel_ranks_each_encode_the_images(llava_dir):
    """Two ranks (worker processes), each with the whole vision encoder beside its share of the language model."""
    engine = LLM(str(llava_dir), tensor_parallel_size=2, block_size=4, num_gpu_blocks_override=64)
    try:
        for text, images in PROMPTS[:2]:
            assert_greedy_equal(generate(engine, text, images), *hf_greedy_with_images(llava_dir, text, images),
                                what=f"{text} (2 ranks)")
    finally:
        engine.close()
