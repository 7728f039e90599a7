"""The image encoder of each vision-language family we serve natively (multimodal_config.TAKES_IMAGES)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def load_vision_encoder(raw_config: dict[str, Any], files: list[Path], dtype: torch.dtype,
                        device: torch.device) -> nn.Module:
    """The checkpoint's encoder, its weights loaded, in inference mode. Each encoder has ``encode(images)`` (each
    image's features, a row per placeholder token) and ``check(image)`` (ValueError where an image's pixels, layout
    and placeholders disagree); ``attends_both_ways`` where an image's placeholders see each other both ways."""
    model_type = raw_config["model_type"]
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from services.worker.models.qwen2_vl_vision import Qwen2VLVision

        encoder = Qwen2VLVision(raw_config)
    elif model_type == "gemma3":
        from services.worker.models.gemma3_vision import Gemma3Vision

        encoder = Gemma3Vision(raw_config)
    else:
        from services.worker.models.llava_vision import LlavaNextVision, LlavaVision

        encoder = (LlavaNextVision if model_type == "llava_next" else LlavaVision)(raw_config)
    encoder.load_checkpoint(files)
    return encoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
