"""Gemma 3's image encoder, as transformers builds it (its modules; the language model is ours, llama.py): a SigLIP
tower over the image, resized to the tower's square (896 pixels for the released models), then the projector,
which averages the patches' states in squares down to ``mm_tokens_per_image`` rows (256), RMS-normalises them and
projects them to the language model's width.

Its placeholders attend to each other both ways (transformers' token_type_ids mask): every placeholder of an image
sees the whole image, so a step computes an image whole (the scheduler never cuts one; the worker gives the
attention backends each placeholder's last visible key: image_features.image_key_limits).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.worker.models.llava_vision import LlavaVision
from shared.multimodal import ImageInput


class Gemma3Vision(LlavaVision):
    attends_both_ways = True

    def __init__(self, raw_config: dict[str, Any]):
        from transformers import AutoModel, Gemma3Config
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        nn.Module.__init__(self)
        self.config = Gemma3Config.from_dict(raw_config)
        self.vision_tower = AutoModel.from_config(self.config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(self.config)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, 3, H, W]`` -> ``[images, mm_tokens_per_image, hidden]``."""
        dtype = self.multi_modal_projector.mm_input_projection_weight.dtype
        states = self.vision_tower(pixel_values=pixel_values.to(dtype)).last_hidden_state
        return self.multi_modal_projector(states)

    def check(self, image: ImageInput) -> None:
        """ValueError unless the image is one square of the tower's size, with a placeholder per row of features."""
        side, rows = self.config.vision_config.image_size, self.config.mm_tokens_per_image
        if image.shape != (3, side, side) or image.length != rows:
            raise ValueError(f"an image needs pixels (3, {side}, {side}) and {rows} placeholders; got pixels "
                             f"{image.shape} and {image.length} placeholders")
