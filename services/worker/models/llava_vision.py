"""LLaVA's image encoders: a CLIP vision tower and LLaVA's two-layer projector, as transformers builds them
(the modules are transformers' own; the language model is ours, llama.py). An image's features are the tower's
hidden states at ``vision_feature_layer``, without the CLS row under the "default" strategy, projected to the
language model's width: one row per placeholder token the processor put in the prompt.

LLaVA-NeXT encodes each image as tiles (an overview, then the tiles of the resolution its size fits best) and
packs their features as transformers' LlavaNextModel.pack_image_features does: the tiles laid out as the
image, the padding cut off, a learned newline row after each row of patches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from services.worker.models.vision_parts import load_whole, pixels_of, read_part
from shared.multimodal import ImageInput

# Where the checkpoint keeps each part (transformers v4 wrote the first, v5 the second), and where in a tower
# saved by v4 the CLIPVisionModel's own parameters begin.
_TOWER_PREFIXES = ("vision_tower.", "model.vision_tower.")
_PROJECTOR_PREFIXES = ("multi_modal_projector.", "model.multi_modal_projector.")
_NEWLINE_NAMES = ("image_newline", "model.image_newline")
_TOWER_INNER = "vision_model."


class LlavaVision(nn.Module):
    attends_both_ways = False  # its placeholders attend causally, as text does
    def __init__(self, raw_config: dict[str, Any]):
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        config = self.config_class().from_dict(raw_config)
        if not isinstance(config.vision_feature_layer, int):
            raise ValueError("a LLaVA checkpoint whose vision_feature_layer is a list is not supported yet")
        if config.vision_feature_select_strategy not in ("default", "full"):
            raise ValueError(f"unknown vision_feature_select_strategy {config.vision_feature_select_strategy!r}")
        super().__init__()
        self.feature_layer = config.vision_feature_layer
        self.drop_cls = config.vision_feature_select_strategy == "default"
        self.config = config
        self.vision_tower = AutoModel.from_config(config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(config)

    @staticmethod
    def config_class():
        from transformers import LlavaConfig

        return LlavaConfig

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[crops, 3, H, W]`` -> ``[crops, rows, hidden]``: each crop's projected features."""
        dtype = next(self.vision_tower.parameters()).dtype
        out = self.vision_tower(pixel_values.to(dtype), output_hidden_states=True, return_dict=True)
        features = out.hidden_states[self.feature_layer]
        if self.drop_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's features ``[rows, hidden]``: one batch through the tower per pixel shape."""
        by_shape: dict[tuple, list[int]] = {}
        for index, image in enumerate(images):
            by_shape.setdefault((image.shape, image.dtype), []).append(index)
        out: list[torch.Tensor | None] = [None] * len(images)
        device = next(self.parameters()).device
        for indexes in by_shape.values():
            pixels = torch.stack([pixels_of(images[i]) for i in indexes]).to(device)
            for i, features in zip(indexes, self(pixels)):
                out[i] = features
        return out

    def load_checkpoint(self, files: list[Path]) -> None:
        """The tower's and projector's tensors from the checkpoint's safetensors files; ValueError if some are
        missing."""
        tower = read_part(files, _TOWER_PREFIXES)
        load_whole(self.vision_tower, {name.removeprefix(_TOWER_INNER): value for name, value in tower.items()})
        load_whole(self.multi_modal_projector, read_part(files, _PROJECTOR_PREFIXES))

    def take_modules(self, model: nn.Module) -> None:
        """transformers' inner model's tower and projector (and LLaVA-NeXT's newline row), shared."""
        self.vision_tower, self.multi_modal_projector = model.vision_tower, model.multi_modal_projector
        if hasattr(self, "image_newline"):
            self.image_newline = model.image_newline

    def check(self, image: ImageInput) -> None:
        """ValueError unless the image is one crop of the tower's size, with a placeholder per row of features."""
        side = self.config.vision_config.image_size
        rows = (side // self.config.vision_config.patch_size) ** 2 + (0 if self.drop_cls else 1)
        if image.shape != (3, side, side) or image.length != rows:
            raise ValueError(f"an image needs pixels (3, {side}, {side}) and {rows} placeholders; got pixels "
                             f"{image.shape} and {image.length} placeholders")


class LlavaNextVision(LlavaVision):
    def __init__(self, raw_config: dict[str, Any]):
        super().__init__(raw_config)
        self.image_newline = nn.Parameter(torch.zeros(self.config.text_config.hidden_size))

    def load_checkpoint(self, files: list[Path]) -> None:
        super().load_checkpoint(files)
        newline = read_part(files, _NEWLINE_NAMES).get("")
        if newline is None:
            raise ValueError("the checkpoint lacks LLaVA-NeXT's image_newline")
        self.image_newline.data.copy_(newline)

    def check(self, image: ImageInput) -> None:
        """ValueError unless the image is its size's tiles of the tower's size."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        side = self.config.vision_config.image_size
        if len(image.layout) != 2 or min(image.layout) < 1:
            raise ValueError(f"an image's layout must be its (height, width), got {image.layout}")
        tiles = image_size_to_num_patches(image.layout, self.config.image_grid_pinpoints, side)
        if image.shape != (tiles, 3, side, side):
            raise ValueError(f"an image of size {image.layout} needs pixels ({tiles}, 3, {side}, {side}); got "
                             f"{image.shape}")

    @staticmethod
    def config_class():
        from transformers import LlavaNextConfig

        return LlavaNextConfig

    def encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's tiles through the tower together, then packed as the model lays them out."""
        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

        device = self.image_newline.device
        out = []
        for image in images:
            tiles = self(pixels_of(image).to(device))
            packed, _ = LlavaNextModel.pack_image_features(
                self, [tiles], torch.tensor([image.layout]), self.config.vision_feature_select_strategy,
                image_newline=self.image_newline)
            out.append(packed[0])
        return out
