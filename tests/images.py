"""Images for the vision-language tests, and transformers' greedy answers to prompts with them (the oracle)."""

from __future__ import annotations

import functools

import numpy as np
import torch
from PIL import Image


def picture(seed: int, size: tuple[int, int] = (40, 52)) -> Image.Image:
    """Random pixels (the processor resizes and crops them to the tower's 28 by 28)."""
    return Image.fromarray((np.random.default_rng(seed).random((*size, 3)) * 255).astype("uint8"))


@functools.lru_cache(maxsize=1)
def hf_image_model(model_dir: str):
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), hf_processor(model_dir)


def hf_processor(model_dir: str):
    """The checkpoint's processor, as transformers makes it. Qwen2-VL's class refuses to be made without torchvision
    (its video processor's class is missing): here it is made with that class check skipped, which its images do not
    need."""
    from unittest import mock

    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer, Qwen2VLProcessor

    images = AutoImageProcessor.from_pretrained(model_dir)
    if not type(images).__name__.startswith("Qwen2VLImageProcessor"):
        return AutoProcessor.from_pretrained(model_dir)
    with mock.patch("transformers.processing_utils.ProcessorMixin.check_argument_for_proper_class"):
        return Qwen2VLProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                video_processor=None)


def hf_greedy_with_images(model_dir, text: str, images: list, max_new_tokens: int = 10):
    """transformers' tokens and log-softmax per step, for the prompt as its own processor makes it."""
    model, processor = hf_image_model(str(model_dir))
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                             return_dict_in_generate=True, output_logits=True)
    prompt_len = inputs["input_ids"].shape[1]
    return out.sequences[0, prompt_len:].tolist(), [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]


def assert_preempted_images_equal(model_dir, prompts: list, num_blocks: int) -> None:
    """Each prompt twice over, at once, in too few blocks (4 tokens each): some sequences are preempted and
    recomputed, and every answer still equals transformers'."""
    from pagedserve import LLM, SamplingParams
    from tests.oracle import assert_greedy_equal

    engine = LLM(str(model_dir), block_size=4, num_gpu_blocks_override=num_blocks, preemption_mode="recompute")
    try:
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        requests = [{"prompt": text, "multi_modal_data": {"image": images}} for text, images in prompts * 2]
        outputs = engine.generate(requests, params, use_tqdm=False)
        assert engine.stats()["num_preemptions"] > 0
        for (text, images), output in zip(prompts * 2, outputs):
            assert_greedy_equal(output.outputs[0].token_ids, *hf_greedy_with_images(model_dir, text, images, 24),
                                what=text)
    finally:
        engine.close()


def hf_prompt_logprobs(model_dir, text: str, images: list, both_ways: bool = True) -> torch.Tensor:
    """transformers' log-probability of each prompt token after the first, in one forward pass; ``both_ways``:
    with the processor's token types, so that Gemma 3's image placeholders attend to each other both ways (False:
    causally, as text)."""
    model, processor = hf_image_model(str(model_dir))
    inputs = dict(processor(text=[text], images=images, return_tensors="pt"))
    if not both_ways:
        inputs.pop("token_type_ids")
    with torch.no_grad():
        logprobs = torch.log_softmax(model(**inputs).logits[0].float(), dim=-1)
    ids = inputs["input_ids"][0]
    return logprobs[:-1].gather(1, ids[1:, None])[:, 0]


@functools.lru_cache(maxsize=None)
def chat_text(model_dir: str, question: str, count: int, placeholder: str = "<image>") -> str:
    """The prompt text the chat template makes of a user message with ``count`` images (each the family's
    ``placeholder`` text), then the question."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = "\n".join([placeholder] * count + [question])
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
