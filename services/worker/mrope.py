"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): an image's placeholder tokens lie on a grid, each at (time, row, column)
from the image's first position, and the text after an image goes on from its first position plus the grid's longer
side, not from its token index. So a token's rotary position is its index plus a shift, each image before it adding
``max(rows, columns) - rows * columns`` (never positive: positions stay within the rotary table).

A step computes text-only tokens with one position each (``[T]``, the shift added per sequence: input_batch.py, and
the decode graphs likewise), and, when it computes some image's placeholders, three per token (``[3, T]``) for the
whole step: models/layers.py rotates each pair of dimensions by the component its section names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.multimodal import ImageInput


class MRopePositions:
    def __init__(self, spatial_merge_size: int):
        self.merge = spatial_merge_size  # the vision encoder merges this many patches by this many into a token

    def grid(self, image: ImageInput) -> tuple[int, int]:
        """(rows, columns) of an image's placeholder tokens; its layout is the processor's (time, height, width)
        grid of patches."""
        _, height, width = image.layout
        return height // self.merge, width // self.merge

    def shift(self, images: Sequence[ImageInput], position: int) -> int:
        """What a text token at ``position`` (not inside an image) adds to its index."""
        total = 0
        for image in images:
            if image.end > position:
                break
            rows, columns = self.grid(image)
            total += max(rows, columns) - rows * columns
        return total

    def positions(self, images: Sequence[ImageInput], start: int, end: int) -> torch.Tensor:
        """``[3, end - start]`` int64: the (time, row, column) positions of a sequence's tokens start..end-1."""
        index = torch.arange(start, end)
        out = index.repeat(3, 1)
        shift = 0
        for image in images:
            rows, columns = self.grid(image)
            inside = (index >= image.offset) & (index < image.end)
            if inside.any():
                cell = index[inside] - image.offset
                first = image.offset + shift  # where the image's grid starts
                out[0, inside] = first
                out[1, inside] = first + cell // columns
                out[2, inside] = first + cell % columns
            step = max(rows, columns) - rows * columns
            out[:, index >= image.end] += step
            shift += step
        return out

    def step_positions(self, batch) -> torch.Tensor:
        """``[3, T]`` for a step whose ``batch`` ((sequence, tokens) in input order) computes image placeholders."""
        return torch.cat([self.positions(seq.images, seq.num_computed_tokens, seq.num_computed_tokens + n)
                          for seq, n in batch], dim=1)
