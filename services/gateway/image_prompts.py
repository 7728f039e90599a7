"""Prompts with images, through the model's own processor from transformers: it resizes and normalizes each image
into pixels, and expands each image placeholder in the text into the run of placeholder tokens the model's
vision encoder fills (shared/multimodal.py). Where torchvision is missing, transformers picks its PIL-backed
image processors; where present, its fast ones.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shared.invalid_parameter import InvalidParameter
from shared.multimodal import ImageInput, pixels_hash


class ImagePrompts:
    def __init__(self, model_dir: str | Path, image_token_id: int):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.image_token_id = image_token_id
        self.placeholder = getattr(self.processor, "image_token", "<image>")  # what a prompt marks each image with

    def process(self, text: str, images: list, add_special_tokens: bool = True) -> tuple[list[int],
                                                                                        tuple[ImageInput, ...]]:
        """The prompt's token ids (placeholders expanded) and its images, in order; InvalidParameter when the
        text does not mark each image once, or an image cannot be read. ``add_special_tokens``: False for a chat
        template's text, which holds its own."""
        from PIL import Image

        for index, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise InvalidParameter(f"image[{index}] must be a PIL image, got {type(image).__name__}",
                                       f"image[{index}]")
        marks = text.count(self.placeholder)
        if marks != len(images):
            raise InvalidParameter(f"the prompt marks {marks} image(s) with {self.placeholder!r}, but {len(images)} "
                                   "were given: put the placeholder where each image goes", "prompt")
        try:
            out = self.processor(text=[text], images=[image.convert("RGB") for image in images], return_tensors="np",
                                 add_special_tokens=add_special_tokens)
        except (ValueError, OSError) as exc:
            raise InvalidParameter(f"the images cannot go through the model's processor: {exc}", "image") from exc
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) < len(images) and pixels.shape[0] == len(images) and "image_sizes" not in out:
            runs = split_runs(runs, len(images))  # LLaVA-1.5's images side by side: equal pixels, equal runs
        if len(runs) != len(images) or pixels.shape[0] != len(images):
            raise InvalidParameter(f"the model's processor made {len(runs)} placeholder run(s) and {pixels.shape[0]} "
                                   f"image(s) of {len(images)}: put text between images that stand side by side",
                                   "prompt")
        sizes = [tuple(int(v) for v in size) for size in out["image_sizes"]] if "image_sizes" in out else None
        inputs = []
        for index, ((offset, length), image) in enumerate(zip(runs, pixels)):
            layout = sizes[index] if sizes is not None else ()
            if sizes is not None:  # LLaVA-NeXT: the image's own tiles, not the batch's padding
                image = np.ascontiguousarray(image[:self._num_tiles(layout)])
            data = image.tobytes()
            inputs.append(ImageInput(hash=pixels_hash(data, image.shape, "float32", layout), offset=offset,
                                     length=length, pixel_values=data, shape=tuple(image.shape), layout=layout))
        return token_ids, tuple(inputs)

    def _num_tiles(self, size: tuple[int, int]) -> int:
        """LLaVA-NeXT: the tiles of an image of this size, its overview first (as its processor makes them)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        images = self.processor.image_processor
        crop = images.crop_size
        side = crop if isinstance(crop, int) else crop["height"]  # (a dict, or transformers' SizeDict)
        return image_size_to_num_patches(size, images.image_grid_pinpoints, side)


def split_runs(runs: list[tuple[int, int]], count: int) -> list[tuple[int, int]]:
    """Runs of several images placed side by side, cut into ``count`` runs of one length (every image's pixels
    have one shape here, so its features one number of rows); the runs as they are when they cannot be."""
    total = sum(length for _, length in runs)
    if total % count:
        return runs
    each = total // count
    if any(length % each for _, length in runs):
        return runs
    return [(offset + i * each, each) for offset, length in runs for i in range(length // each)]


def placeholder_runs(token_ids: list[int], image_token_id: int) -> list[tuple[int, int]]:
    """(offset, length) of each run of the image token."""
    runs: list[tuple[int, int]] = []
    for position, token in enumerate(token_ids):
        if token != image_token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == position:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((position, 1))
    return runs
