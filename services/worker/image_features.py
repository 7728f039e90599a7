"""Images' features in place of their placeholder tokens: the rows of a step's input embeddings that image
placeholders take are filled from the encoder cache (encoding the images it lacks, together). A chunked prefill
may end in the middle of an image: each step takes the rows of the positions it computes.
"""

from __future__ import annotations

import torch

from services.worker.encoder_cache import EncoderCache
from shared.multimodal import ImageInput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

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


class ImageEncoder:
    """The vision encoder behind its cache."""

    def __init__(self, vision: torch.nn.Module, max_rows: int, device: torch.device):
        self.vision = vision
        self.cache = EncoderCache(max_rows)
        self.device = device

    def fill(self, embeds: torch.Tensor, spans: list[ImageSpan]) -> None:
        """Write each span's features into ``embeds`` ``[T, hidden]`` at its rows."""
        features = self.cache.features([image for _, image, _, _ in spans], self._encode)
        for (row, _, first, count), rows in zip(spans, features):
            embeds[row:row + count] = rows[first:first + count].to(embeds.dtype)

    def _encode(self, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's features, encoded in one batch per pixel shape."""
        by_shape: dict[tuple, list[int]] = {}
        for index, image in enumerate(images):
            by_shape.setdefault((image.shape, image.dtype), []).append(index)
        out: list[torch.Tensor | None] = [None] * len(images)
        for (shape, dtype), indexes in by_shape.items():
            pixels = torch.stack([torch.frombuffer(bytearray(images[i].pixel_values), dtype=_DTYPES[dtype]).view(shape)
                                  for i in indexes]).to(self.device)
            for i, features in zip(indexes, self.vision(pixels)):
                out[i] = features
        return out
