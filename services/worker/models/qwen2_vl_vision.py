"""Qwen2-VL's and Qwen2.5-VL's image encoder, as transformers builds it (its own module; the language model is
ours, llama.py, rotating by M-RoPE positions: mrope.py). The processor cuts an image, resized to a multiple of
28 pixels a side, into 14-pixel patches (each twice over in time, a still image being two equal frames); the
tower attends among an image's patches (Qwen2.5-VL within windows in most layers) and merges each 2 by 2 patches
into one row of features: one per placeholder token, the image's grid of them read row by row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.models.vision_parts import load_whole, pixels_of, read_part
from shared.multimodal import ImageInput

# Where the checkpoint keeps the tower: the Hub's checkpoints (transformers v4) under "visual.", v5 under
# "model.visual.".
_TOWER_PREFIXES = ("visual.", "model.visual.")


class Qwen2VLVision(nn.Module):
    attends_both_ways = False  # its placeholders attend causally, as text does
    def __init__(self, raw_config: dict[str, Any]):
        super().__init__()
        config_class, tower_class = _classes(raw_config["model_type"])
        vision_config = config_class.from_dict(raw_config).vision_config
        self.spatial_merge_size = vision_config.spatial_merge_size
        # A patch's pixel values: channels x frames x patch x patch (1176 for the released models).
        self.patch_values = (vision_config.in_channels * vision_config.temporal_patch_size
                             * vision_config.patch_size ** 2)
        self.visual = tower_class(vision_config)

    @torch.inference_mode()
    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's features ``[rows * columns, hidden]``: the images through the tower together (it attends
        within each image alone)."""
        weight = self.visual.patch_embed.proj.weight
        device, dtype = weight.device, weight.dtype
        pixels = torch.cat([pixels_of(image) for image in images]).to(device, dtype)
        grids = torch.tensor([image.layout for image in images], dtype=torch.int64, device=device)
        merged = self.visual(pixels, grid_thw=grids).pooler_output
        return list(merged.split([image.length for image in images]))

    def check(self, image: ImageInput) -> None:
        """ValueError unless the image's pixels, grid and placeholder run agree (a request made by hand)."""
        if len(image.layout) != 3 or image.layout[0] != 1 or any(side % self.spatial_merge_size
                                                                 for side in image.layout[1:]):
            raise ValueError(f"an image's grid must be (1, height, width) in patches, height and width multiples "
                             f"of {self.spatial_merge_size}; got {image.layout}")
        patches = image.layout[1] * image.layout[2]
        if image.shape != (patches, self.patch_values) or image.length * self.spatial_merge_size ** 2 != patches:
            raise ValueError(f"an image of grid {image.layout} needs {patches} rows of patches of "
                             f"{self.patch_values} values and {patches // self.spatial_merge_size ** 2} placeholders; "
                             f"got pixels {image.shape} and {image.length} placeholders")

    def take_modules(self, model: nn.Module) -> None:
        """transformers' inner model's tower, shared."""
        self.visual = model.visual

    def load_checkpoint(self, files: list[Path]) -> None:
        load_whole(self.visual, read_part(files, _TOWER_PREFIXES))


def _classes(model_type: str):
    if model_type == "qwen2_5_vl":
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        return Qwen2_5_VLConfig, Qwen2_5_VisionTransformerPretrainedModel
    from transformers import Qwen2VLConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    return Qwen2VLConfig, Qwen2VisionTransformerPretrainedModel
