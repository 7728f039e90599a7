"""Tiny random vision-language checkpoints for the tests (model_factory.py makes their language model): a small
vision tower of the family beside it, the placeholder tokens added to the tokenizer, and the processor files the
family's checkpoints ship, so that they load through the same code as a real checkpoint.

- ``llava`` / ``llava_next``: a 2-layer CLIP tower of 28-pixel images, 4 patches of 14 (LLaVA-NeXT: up to 2 by 2
  tiles of them);
- ``gemma3``: a 1-layer SigLIP tower of 56-pixel images, 16 patches of 14 pooled 2 by 2 into 4 placeholders, over
  the Gemma 3 text model asked for (its 4B and up's layout);
- ``qwen2_vl`` / ``qwen2_5_vl``: a 2-layer tower of 14-pixel patches merged 2 by 2, images resized to between 2 by
  2 and 4 by 4 merged tokens (Qwen2.5-VL: windows of 2 by 2 tokens in its first layer, full attention in its
  second), and M-RoPE over the Qwen 2 language model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VISION_MODEL_TYPES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "gemma3")
# The tokens each family's tokenizer adds, its image placeholder first.
_TOKENS = {"llava": ["<image>"], "llava_next": ["<image>"],
           "qwen2_vl": ["<|image_pad|>", "<|vision_start|>", "<|vision_end|>", "<|video_pad|>"]}
_TOKENS["qwen2_5_vl"] = _TOKENS["qwen2_vl"]
_TOKENS["gemma3"] = ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]
GEMMA3_TOKEN_NAMES = ("image_token", "boi_token", "eoi_token")  # what its tokenizer_config.json calls them


def add_image_tokens(model_type: str, tokenizer) -> dict[str, int]:
    """Adds the family's tokens; the config fields that name them."""
    tokens = _TOKENS[model_type]
    tokenizer.add_special_tokens({"additional_special_tokens": tokens})
    ids = [tokenizer.convert_tokens_to_ids(token) for token in tokens]
    if model_type.startswith("llava"):
        return {"image_token_index": ids[0]}
    if model_type == "gemma3":
        return {"image_token_index": ids[0], "boi_token_index": ids[1], "eoi_token_index": ids[2]}
    return {"image_token_id": ids[0], "vision_start_token_id": ids[1], "vision_end_token_id": ids[2],
            "video_token_id": ids[3]}


def vision_config(model_type: str, text_config_class, **kwargs: Any):
    """The wrapper's config: a small tower beside the language model that ``kwargs`` describe."""
    if model_type.startswith("llava"):
        return _llava_config(model_type, text_config_class, **kwargs)
    if model_type == "gemma3":
        from transformers import Gemma3Config, SiglipVisionConfig

        tokens = {key: kwargs.pop(key) for key in ("image_token_index", "boi_token_index", "eoi_token_index")}
        tie = kwargs.pop("tie_word_embeddings", True)
        vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=56, patch_size=14)
        return Gemma3Config(text_config=text_config_class(**kwargs), vision_config=vision, mm_tokens_per_image=4,
                            tie_word_embeddings=tie, **tokens)
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig

    tokens = {key: kwargs.pop(key) for key in ("image_token_id", "vision_start_token_id", "vision_end_token_id",
                                               "video_token_id")}
    kwargs.pop("rope_scaling", None)
    half = kwargs["head_dim"] // 2  # M-RoPE: the rotary pairs shared among time, height and width
    section = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = dict(kwargs, model_type=f"{model_type}_text",
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section})
    tower = dict(depth=2, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if model_type == "qwen2_vl":
        return Qwen2VLConfig(text_config=text, vision_config=dict(tower, embed_dim=32, mlp_ratio=2,
                                                                  hidden_size=kwargs["hidden_size"]),
                             tie_word_embeddings=kwargs.get("tie_word_embeddings", False), **tokens)
    return Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        tower, hidden_size=32, intermediate_size=64, out_hidden_size=kwargs["hidden_size"], window_size=56,
        fullatt_block_indexes=[1]), tie_word_embeddings=kwargs.get("tie_word_embeddings", False), **tokens)


def _llava_config(model_type: str, text_config_class, **kwargs: Any):
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaNextConfig

    image_token = kwargs.pop("image_token_index")
    vision = CLIPVisionConfig(**{**dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=28, patch_size=14, projection_dim=32),
                                 **kwargs.pop("vision_config", {})})
    common = dict(text_config=text_config_class(**kwargs), vision_config=vision, image_token_index=image_token,
                  vision_feature_layer=-2, vision_feature_select_strategy="default",
                  tie_word_embeddings=kwargs.get("tie_word_embeddings", False))
    if model_type == "llava":
        return LlavaConfig(**common)
    side = vision.image_size  # LLaVA-NeXT: tiles of the tower's size, up to 2 by 2
    return LlavaNextConfig(**common, image_grid_pinpoints=[[side, 2 * side], [2 * side, side], [2 * side, 2 * side]])


def vision_model(config):
    """The whole model, in transformers' classes, for its random weights."""
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_config(config)


def save_processor(path: Path, tokenizer, config) -> None:
    """The preprocessing files the family's checkpoints ship."""
    if config.model_type == "gemma3":
        _save_gemma3_processor(path, config)
        return
    if config.model_type.startswith("qwen2"):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        # Images between 2 by 2 and 4 by 4 tokens of 28 pixels (the Hub's allow 4 to 16,384 tokens).
        Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                 temporal_patch_size=2).save_pretrained(path)
        return
    _save_llava_processor(path, tokenizer, config)


def _save_gemma3_processor(path: Path, config) -> None:
    """The tokenizer's named image tokens (as the Hub's tokenizer_config.json has them), SigLIP's preprocessing at the
    tower's size, and each ``<start_of_image>`` expanded to the image's placeholders between its start and end."""
    from transformers import AutoTokenizer, Gemma3Processor
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    file = path / "tokenizer_config.json"
    tokenizer_config = json.loads(file.read_text())
    tokenizer_config.update(zip(GEMMA3_TOKEN_NAMES, _TOKENS["gemma3"]))
    file.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    side = config.vision_config.image_size
    images = Gemma3ImageProcessorPil(size={"height": side, "width": side})
    Gemma3Processor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(path),
                    image_seq_length=config.mm_tokens_per_image).save_pretrained(path)


def _save_llava_processor(path: Path, tokenizer, config) -> None:
    """CLIP's preprocessing at the tower's size, and the placeholder expanded to one token per patch (the CLS row
    dropped)."""
    from transformers import LlavaNextProcessor, LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    size = config.vision_config.image_size
    sizes = dict(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    if config.model_type == "llava_next":  # tiles: the image's best fit among the checkpoint's resolutions
        processor, images = LlavaNextProcessor, LlavaNextImageProcessorPil(
            **sizes, image_grid_pinpoints=config.image_grid_pinpoints)
    else:
        processor, images = LlavaProcessor, LlavaImageProcessorPil(**sizes)
    processor(image_processor=images, tokenizer=tokenizer, patch_size=config.vision_config.patch_size,
              vision_feature_select_strategy=config.vision_feature_select_strategy,
              num_additional_image_tokens=1).save_pretrained(path)
