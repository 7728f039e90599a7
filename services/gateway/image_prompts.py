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


def image_prompts(model_dir: str | Path, image_token_id: int) -> ImagePrompts:
    """The prompt maker for the model's processor: Qwen2-VL's images become grids of patches (GridImagePrompts);
    the others go through their processor as it is."""
    from transformers import AutoImageProcessor

    images = AutoImageProcessor.from_pretrained(str(model_dir))
    if type(images).__name__.startswith("Qwen2VLImageProcessor"):
        return GridImagePrompts(model_dir, image_token_id, images)
    return ImagePrompts(model_dir, image_token_id)


class ImagePrompts:
    def __init__(self, model_dir: str | Path, image_token_id: int):
        from transformers import AutoProcessor

        self.processor = AutoProcessor.from_pretrained(str(model_dir))
        self.image_token_id = image_token_id
        self.placeholder = getattr(self.processor, "image_token", "<image>")  # what a prompt marks each image with
        self.chat_placeholder = self.placeholder  # the text a chat message's image part becomes

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
            out = self._run_processor(text, [image.convert("RGB") for image in images], add_special_tokens)
        except (ValueError, OSError) as exc:
            raise InvalidParameter(f"the images cannot go through the model's processor: {exc}", "image") from exc
        token_ids = [int(t) for t in out["input_ids"][0]]
        pixels = self._pixels(out)
        runs = placeholder_runs(token_ids, self.image_token_id)
        if len(runs) < len(images) and len(pixels) == len(images):
            runs = split_runs(runs, self._run_lengths(out, len(images), runs))  # images side by side
        if len(runs) != len(images) or len(pixels) != len(images):
            raise InvalidParameter(f"the model's processor made {len(runs)} placeholder run(s) and {len(pixels)} "
                                   f"image(s) of {len(images)}: put text between images that stand side by side",
                                   "prompt")
        inputs = []
        for (offset, length), (image, layout) in zip(runs, pixels):
            data = np.ascontiguousarray(image, dtype=np.float32).tobytes()
            inputs.append(ImageInput(hash=pixels_hash(data, image.shape, "float32", layout), offset=offset,
                                     length=length, pixel_values=data, shape=tuple(image.shape), layout=layout))
        return token_ids, tuple(inputs)

    def _run_lengths(self, out: dict, count: int, runs: list[tuple[int, int]]) -> list[int] | None:
        """How many placeholders each image has, where its features' rows are known from its pixels alone:
        LLaVA-1.5's images, all one shape, have one length each (None: not known, LLaVA-NeXT's tiles)."""
        total = sum(length for _, length in runs)
        return None if "image_sizes" in out or total % count else [total // count] * count

    def _run_processor(self, text: str, images: list, add_special_tokens: bool) -> dict:
        return self.processor(text=[text], images=images, return_tensors="np", add_special_tokens=add_special_tokens)

    def _pixels(self, out: dict) -> list[tuple[np.ndarray, tuple[int, ...]]]:
        """Each image's pixels and layout, from the processor's output."""
        if "image_sizes" not in out:
            return [(image, ()) for image in out["pixel_values"]]
        pixels = []
        for image, size in zip(out["pixel_values"], out["image_sizes"]):  # LLaVA-NeXT: tiles, and the image's size
            layout = tuple(int(v) for v in size)
            pixels.append((image[:self._num_tiles(layout)], layout))  # its own tiles, not the batch's padding
        return pixels

    def _num_tiles(self, size: tuple[int, int]) -> int:
        """LLaVA-NeXT: the tiles of an image of this size, its overview first (as its processor makes them)."""
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        images = self.processor.image_processor
        crop = images.crop_size
        side = crop if isinstance(crop, int) else crop["height"]  # (a dict, or transformers' SizeDict)
        return image_size_to_num_patches(size, images.image_grid_pinpoints, side)


class GridImagePrompts(ImagePrompts):
    """Qwen2-VL and Qwen2.5-VL: the image processor cuts each image (resized within its pixel bounds) into a grid of
    patches, and each placeholder becomes one token per 2 by 2 patches, as their processor expands it. (The
    processor class itself needs torchvision's video support to be made; the image processor does not.)"""

    def __init__(self, model_dir: str | Path, image_token_id: int, image_processor):
        from transformers import AutoTokenizer

        self.image_processor = image_processor
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.image_token_id = image_token_id
        self.placeholder = self.tokenizer.convert_ids_to_tokens(image_token_id)  # "<|image_pad|>"
        self.chat_placeholder = f"<|vision_start|>{self.placeholder}<|vision_end|>"  # as their chat template writes it

    def _run_processor(self, text: str, images: list, add_special_tokens: bool) -> dict:
        out = dict(self.image_processor(images=images, return_tensors="np"))
        merged = self.image_processor.merge_size ** 2
        pieces = text.split(self.placeholder)
        expanded = pieces[0] + "".join(self.placeholder * (int(np.prod(grid)) // merged) + piece
                                       for grid, piece in zip(out["image_grid_thw"], pieces[1:]))
        out["input_ids"] = [self.tokenizer(expanded, add_special_tokens=add_special_tokens).input_ids]
        return out

    def _run_lengths(self, out: dict, count: int, runs: list[tuple[int, int]]) -> list[int] | None:
        """Each image's placeholders: its grid's merged tokens."""
        merged = self.image_processor.merge_size ** 2
        return [int(np.prod(grid)) // merged for grid in out["image_grid_thw"]]

    def _pixels(self, out: dict) -> list[tuple[np.ndarray, tuple[int, ...]]]:
        grids = [tuple(int(v) for v in grid) for grid in out["image_grid_thw"]]
        bounds = np.cumsum([0] + [int(np.prod(grid)) for grid in grids])
        return [(out["pixel_values"][bounds[i]:bounds[i + 1]], grid) for i, grid in enumerate(grids)]


def split_runs(runs: list[tuple[int, int]], lengths: list[int] | None) -> list[tuple[int, int]]:
    """Runs of several images placed side by side, cut into one run per image of the given ``lengths``, in order;
    the runs as they are when they cannot be (``lengths`` None, or not adding up run by run)."""
    if lengths is None:
        return runs
    out, pending = [], list(lengths)
    for offset, length in runs:
        while length > 0 and pending and pending[0] <= length:
            out.append((offset, pending[0]))
            offset, length = offset + pending[0], length - pending.pop(0)
        if length:
            return runs
    return out if not pending else runs


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
