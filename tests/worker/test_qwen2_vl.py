"""Images in, text out, on Qwen2-VL and Qwen2.5-VL (models/qwen2_vl_vision.py, mrope.py): M-RoPE positions equal
transformers' get_rope_index over any slice of a prompt; greedy tokens equal transformers' generate on the same
checkpoint and images (its own processor's pixels and placeholders), with one and two images of several sizes,
images amid text and side by side, chunked prefill cutting through an image, preemption and prefix-cache hits; the
checkpoints' older config layout loads alike; and images that do not fit the model are refused, request by request.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from pagedserve import LLM, SamplingParams
from services.gateway.image_prompts import image_prompts
from services.worker.mrope import MRopePositions
from tests.engine_runs import run_to_end
from tests.images import assert_preempted_images_equal, chat_text, hf_greedy_with_images, hf_image_model, picture
from tests.oracle import assert_greedy_equal

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"

PROMPTS = [  # (text, images): sizes whose grids differ (2 by 2 up to 4 by 4 tokens, wide and tall)
    (f"What is in {IMAGE} this picture?", [picture(1)]),
    (f"Compare {IMAGE} with {IMAGE} and say which is brighter.", [picture(2, (60, 30)), picture(3, (100, 100))]),
    (f"A long preamble about nothing in particular, then {IMAGE} and more words after it, at length.",
     [picture(4, (70, 100))]),
    (f"{IMAGE}{IMAGE} side by side", [picture(5, (90, 50)), picture(6)]),
]


def generate(llm: LLM, text: str, images: list, params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate({"prompt": text, "multi_modal_data": {"image": images}}, params,
                        use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("family", ["qwen2_vl_dir", "qwen2_5_vl_dir"])
def test_images_and_text_equal_transformers(family, request):
    model_dir = request.getfixturevalue(family)
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks_override=128)
    try:
        for text, images in PROMPTS:
            assert_greedy_equal(generate(llm, text, images), *hf_greedy_with_images(model_dir, text, images),
                                what=f"{family}: {text}")
    finally:
        llm.close()


def test_mrope_positions_equal_transformers_over_any_slice(qwen2_vl_dir):
    """Every chunk [start, end) of each prompt, and the shift of the text after it, as transformers places them."""
    hf_model, processor = hf_image_model(str(qwen2_vl_dir))
    prompts = image_prompts(qwen2_vl_dir, hf_model.config.image_token_id)
    mrope = MRopePositions(spatial_merge_size=2)
    generator = torch.Generator().manual_seed(0)
    for text, images in PROMPTS:
        inputs = processor(text=[text], images=images, return_tensors="pt")
        expected, deltas = hf_model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"],
                                                         image_grid_thw=inputs["image_grid_thw"])
        token_ids, ours = prompts.process(text, images)
        assert token_ids == inputs["input_ids"][0].tolist()  # the placeholders expanded as the processor does
        pixels = torch.cat([torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(image.shape)
                            for image in ours])
        assert torch.equal(pixels, inputs["pixel_values"])
        assert [image.layout for image in ours] == [tuple(grid) for grid in inputs["image_grid_thw"].tolist()]
        length = len(token_ids)
        torch.testing.assert_close(mrope.positions(ours, 0, length), expected[:, 0], rtol=0, atol=0)
        for _ in range(8):
            start, end = sorted(torch.randint(0, length + 1, (2,), generator=generator).tolist())
            torch.testing.assert_close(mrope.positions(ours, start, end), expected[:, 0, start:end], rtol=0, atol=0)
        assert mrope.shift(ours, length) == deltas.item()  # the generated text's


def test_images_side_by_side_get_their_own_grids_placeholders(qwen2_vl_dir):
    """Two placeholders with nothing between them make one run of tokens: it is cut by each image's grid, as
    transformers' processor expands them, not into equal halves."""
    _, processor = hf_image_model(str(qwen2_vl_dir))
    images = [picture(7, (100, 100)), picture(8, (60, 30))]  # 16 and 6 placeholders
    text = "<|vision_start|><|image_pad|><|image_pad|><|vision_end|> glued"
    token_ids, placed = image_prompts(qwen2_vl_dir, processor.image_token_id).process(text, images)
    assert token_ids == processor(text=[text], images=images, return_tensors="pt")["input_ids"][0].tolist()
    assert [image.length for image in placed] == [16, 6] and placed[1].offset == placed[0].end


@pytest.mark.parametrize("budget", [3, 7])
def test_chunked_prefill_cutting_through_an_image(qwen2_vl_dir, budget):
    """Chunks end inside the placeholders and in the text after an image: each takes its own positions."""
    engine = LLM(str(qwen2_vl_dir), block_size=4, num_gpu_blocks_override=128, max_num_batched_tokens=budget,
                 enable_chunked_prefill=True, enable_prefix_caching=False)
    try:
        for text, images in PROMPTS[1:3]:
            assert_greedy_equal(generate(engine, text, images), *hf_greedy_with_images(qwen2_vl_dir, text, images),
                                what=f"{text} (budget {budget})")
    finally:
        engine.close()


def test_preempted_sequences_with_images_come_back_right(qwen2_vl_dir):
    assert_preempted_images_equal(qwen2_vl_dir, PROMPTS, num_blocks=40)


def test_prefix_hits_inside_and_after_an_image_go_on_at_the_right_positions(qwen2_vl_dir):
    """The same image and text hit the cache up to a block inside the image (a prompt ending with it) or after it;
    the rest is computed from there, at positions shifted by the image. Another image misses from its first block."""
    engine = LLM(str(qwen2_vl_dir), block_size=4, num_gpu_blocks_override=128)
    prompts = image_prompts(qwen2_vl_dir, engine.engine.info.image_token_id)
    try:
        image = picture(4, (100, 100))  # 4 by 4 tokens: the text after it shifted by 4 - 16
        for text in (f"Describe this: {IMAGE}", f"Before {IMAGE} and a long text after it, at some length."):
            token_ids, (placed,) = prompts.process(text, [image])
            generate(engine, text, [image])
            before = engine.stats()["prefix_cache_hits"]
            again = generate(engine, text, [image])
            hits = engine.stats()["prefix_cache_hits"] - before
            assert placed.offset < hits < (placed.end if text.endswith(IMAGE) else len(token_ids))
            assert hits > placed.end or text.endswith(IMAGE)
            assert_greedy_equal(again, *hf_greedy_with_images(qwen2_vl_dir, text, [image]), what=f"{text}: a hit")
            before = engine.stats()["prefix_cache_hits"]
            other = picture(9, (100, 100))
            tokens = generate(engine, text, [other])
            assert engine.stats()["prefix_cache_hits"] - before <= placed.offset
            assert_greedy_equal(tokens, *hf_greedy_with_images(qwen2_vl_dir, text, [other]), what=f"{text}: a miss")
    finally:
        engine.close()


def test_the_older_config_layout_loads_alike(qwen2_vl_dir, tmp_path):
    """The Hub's Qwen2-VL configs (transformers v4): the language model's fields at the top level and the rope kind
    "mrope"; the same model as v5's nested text_config."""
    from services.worker.model_config import ModelConfig

    raw = json.loads((qwen2_vl_dir / "config.json").read_text())
    text = raw.pop("text_config")
    rope = text.pop("rope_parameters")
    older = {**raw, **{k: v for k, v in text.items() if k != "model_type"}, "rope_theta": rope["rope_theta"],
             "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert ModelConfig.from_dict(older) == ModelConfig.from_dict(json.loads((qwen2_vl_dir / "config.json").read_text()))
    assert ModelConfig.from_dict(older).mrope_section == (2, 3, 3)
    for bad, why in (({"mrope_section": [2, 3]}, "three counts"), ({"mrope_section": [4, 4, 4]}, "adding up to 8")):
        with pytest.raises(ValueError, match=why):
            ModelConfig.from_dict({**older, "rope_scaling": {"type": "mrope", **bad}})
    with pytest.raises(ValueError, match="needs mrope_section"):
        ModelConfig.from_dict({**older, "rope_scaling": None})


def test_images_the_model_cannot_take_fail_their_request_alone(qwen2_vl_dir):
    """Pixels, grid and placeholders that disagree (a request made by hand) end that request with an error; the
    others are served, and no blocks stay held."""
    from shared.multimodal import pixels_hash
    from shared.request import EngineRequest

    llm = LLM(str(qwen2_vl_dir), block_size=4, num_gpu_blocks_override=128)
    try:
        engine = llm.engine
        text, images = PROMPTS[0]
        token_ids, (image,) = image_prompts(qwen2_vl_dir, engine.info.image_token_id).process(text, images)
        _, height, width = image.layout
        layouts = {"odd grid": (1, 1, height * width), "two frames": (2, height // 2, width),
                   "more patches than pixels": (1, height * 2, width)}
        for name, layout in layouts.items():
            bad = dataclasses.replace(image, layout=layout,
                                      hash=pixels_hash(image.pixel_values, image.shape, image.dtype, layout))
            engine.add_request(EngineRequest(name, token_ids, GREEDY, images=(bad,)))
        half = (image.shape[0], image.shape[1] // 2)  # patches of half the values: whole bytes, the wrong patch
        narrow = dataclasses.replace(image, shape=half, pixel_values=image.pixel_values[:len(image.pixel_values) // 2],
                                     hash=pixels_hash(image.pixel_values[:len(image.pixel_values) // 2], half,
                                                      image.dtype, image.layout))
        engine.add_request(EngineRequest("narrow patches", token_ids, GREEDY, images=(narrow,)))
        layouts["narrow patches"] = image.layout
        engine.add_request(EngineRequest("good", token_ids, GREEDY, images=(image,)))
        tokens, errors = run_to_end(engine)
        assert set(errors) == set(layouts)
        assert "multiples of 2" in errors["odd grid"] and "(1, height, width)" in errors["two frames"]
        assert "rows of patches" in errors["more patches than pixels"]
        assert "of 1176 values" in errors["narrow patches"]
        assert_greedy_equal(tokens["good"], *hf_greedy_with_images(qwen2_vl_dir, text, images), what="beside them")
        assert engine.get_stats()["kv_blocks_used"] == 0
    finally:
        llm.close()


def test_chat_places_each_image_as_the_template_does(qwen2_vl_dir):
    """An image part becomes the vision-start, placeholder and vision-end text of Qwen2-VL's chat template."""
    llm = LLM(str(qwen2_vl_dir), block_size=4, num_gpu_blocks_override=128)
    try:
        question = "What do you see?"
        messages = [{"role": "user", "content": [{"type": "image_pil", "image_pil": picture(17, (70, 100))},
                                                 {"type": "text", "text": question}]}]
        tokens = llm.chat(messages, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        text = chat_text(str(qwen2_vl_dir), question, 1, IMAGE)
        assert_greedy_equal(tokens, *hf_greedy_with_images(qwen2_vl_dir, text, [picture(17, (70, 100))]), what="chat")
    finally:
        llm.close()
