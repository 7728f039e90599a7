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
def hf_llava(model_dir: str):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval(), AutoProcessor.from_pretrained(model_dir)


def hf_greedy_with_images(model_dir, text: str, images: list, max_new_tokens: int = 10):
    """transformers' tokens and log-softmax per step, for the prompt as its own processor makes it."""
    model, processor = hf_llava(str(model_dir))
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0,
                             return_dict_in_generate=True, output_logits=True)
    prompt_len = inputs["input_ids"].shape[1]
    return out.sequences[0, prompt_len:].tolist(), [torch.log_softmax(s[0].float(), dim=-1) for s in out.logits]


@functools.lru_cache(maxsize=None)
def chat_text(model_dir: str, question: str, count: int) -> str:
    """The prompt text the chat template makes of a user message with ``count`` images, then the question."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    content = "\n".join(["<image>"] * count + [question])
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
