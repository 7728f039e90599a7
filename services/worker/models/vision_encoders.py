"""The image encoder of each vision-language family we serve natively (multimodal_config.TAKES_IMAGES)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def load_vision_encoder(raw_config: dict[str, Any], files: list[Path], dtype: torch.dtype,
                        device: torch.device) -> nn.Module:
    """The checkpoint's encoder, its weights loaded, in inference mode (encoder_class)."""
    encoder = encoder_class(raw_config["model_type"])(raw_config)
    encoder.load_checkpoint(files)
    return encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)


def vision_encoder_of(raw_config: dict[str, Any], hf_model: nn.Module) -> nn.Module:
    """The encoder over transformers' whole model's own vision modules (--model-impl transformers): built on the
    meta device, then given those modules, so no weight is held twice."""
    with torch.device("meta"):
        encoder = encoder_class(raw_config["model_type"])(raw_config)
    encoder.take_modules(hf_model.model)
    return encoder.eval()


def encoder_class(model_type: str) -> type:
    """The encoder of a vision-language family. Each encoder has ``encode(images)`` (each
    image's features, a row per placeholder token) and ``check(image)`` (ValueError where an image's pixels, layout
    and placeholders disagree); ``attends_both_ways`` where an image's placeholders see each other both ways; and
    ``load_checkpoint(files)`` or ``take_modules(model)`` (transformers' inner model's) for its weights."""
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from services.worker.models.qwen2_vl_vision import Qwen2VLVision

        return Qwen2VLVision
    if model_type == "gemma3":
        from services.worker.models.gemma3_vision import Gemma3Vision

        return Gemma3Vision
    from services.worker.models.llava_vision import LlavaNextVision, LlavaVision

    return LlavaNextVision if model_type == "llava_next" else LlavaVision
