"""Images' features in place of their placeholder tokens: the rows of a step's input embeddings that image
placeholders take are filled from the encoder cache (encoding the images it lacks, together). A chunked prefill
may end in the middle of an image: each step takes the rows of the positions it computes.
"""

from __future__ import annotations

import torch

from services.worker.encoder_cache import EncoderCache
from shared.multimodal import ImageInput

ImageSpan = tuple[int, ImageInput, int, int]  # (row of the step's inputs, image, its first feature row, rows)


def image_spans(batch) -> list[ImageSpan]:
    """Where the step's scheduled positions hold image placeholders; ``batch``: (sequence, tokens) in input order."""
    spans, row = [], 0
    for seq, num_tokens in batch:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_tokens
        for image in seq.images:
            first, last = max(start, image.offset), min(end, image.end)
            if first < last:
                spans.append((row + first - start, image, first - image.offset, last - first))
        row += num_tokens
    return spans


def image_key_limits(positions: torch.Tensor, spans: list[ImageSpan], device: torch.device) -> torch.Tensor:
    """For images that attend both ways (Gemma 3's): the last key each of the step's tokens sees (``[T]`` int32),
    its own position, or its image's last for a placeholder. ``positions``: the step's ``[T]``. ValueError when the
    step does not reach an image's end (the scheduler never cuts such an image)."""
    limits = positions.to(device=device, dtype=torch.int32, copy=True)
    for row, image, first, count in spans:
        if first + count != image.length:
            raise ValueError(f"the step computes {count} of an image's placeholders from its {first}th, not through "
                             f"its last: its placeholders attend both ways, so a step must compute it whole")
        limits[row:row + count] = image.end - 1
    return limits


class ImageEncoder:
    """The vision encoder behind its cache."""

    def __init__(self, vision: torch.nn.Module, max_rows: int):
        self.vision = vision  # models/llava_vision.py: encode(images) -> each image's features
        self.cache = EncoderCache(max_rows)

    def fill(self, embeds: torch.Tensor, spans: list[ImageSpan]) -> None:
        """Write each span's features into ``embeds`` ``[T, hidden]`` at its rows."""
        features = self.cache.features([image for _, image, _, _ in spans], self._encode)
        for (row, _, first, count), rows in zip(spans, features):
            embeds[row:row + count] = rows[first:first + count].to(embeds.dtype)

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's features, as the model's encoder makes them (models/llava_vision.py)."""
        return self.vision.encode(images)
