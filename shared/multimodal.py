"""Images in a prompt, as every layer passes them: the front end runs the model's processor, which makes each
image's pixels and expands its placeholder into as many placeholder tokens as the vision encoder makes rows of
features; the worker encodes the pixels and puts the features in place of those tokens.

An image is known by the hash of its pixels: the worker's encoder cache keeps features by it, and the prefix
cache's key of every block an image's placeholders reach includes it, so the same image with the same text
hits the cache and another image misses (the placeholder tokens alone are the same for every image).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from math import prod

from shared.invalid_parameter import require
from shared.proto import pagedserve_internal_pb2 as wire

ITEM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}  # the pixel dtypes a processor makes


@dataclass(frozen=True, slots=True)
class ImageInput:
    hash: bytes  # of the pixels, their shape and dtype (pixels_hash)
    offset: int  # the prompt position of its first placeholder token
    length: int  # its placeholder tokens (the rows of features it becomes)
    pixel_values: bytes  # C-contiguous, little-endian
    shape: tuple[int, ...]  # of the pixels, e.g. (3, 336, 336), or LLaVA-NeXT's (tiles, 3, 336, 336)
    dtype: str = "float32"
    layout: tuple[int, ...] = ()  # what else its features depend on: LLaVA-NeXT the image's (height, width)

    @property
    def end(self) -> int:
        """The position after its last placeholder token."""
        return self.offset + self.length

    def to_proto(self) -> wire.ImageInput:
        return wire.ImageInput(hash=self.hash, offset=self.offset, length=self.length, pixel_values=self.pixel_values,
                               shape=self.shape, dtype=self.dtype, layout=self.layout)

    @classmethod
    def from_proto(cls, m: wire.ImageInput) -> ImageInput:
        return cls(hash=m.hash, offset=m.offset, length=m.length, pixel_values=m.pixel_values, shape=tuple(m.shape),
                   dtype=m.dtype, layout=tuple(m.layout))


def pixels_hash(pixel_values: bytes, shape: Sequence[int], dtype: str, layout: Sequence[int] = ()) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(repr((tuple(shape), dtype, tuple(layout))).encode())
    digest.update(pixel_values)
    return digest.digest()


def check_images(images: Sequence[ImageInput], prompt_token_ids: list[int], image_token_id: int | None,
                 max_length: int | None = None) -> None:
    """InvalidParameter unless every image's placeholders are image tokens of the prompt, in order, apart, and its
    pixels are whole (a request from a gateway of another release, or made by hand, must not reach the worker);
    ``max_length``: the most placeholders an image may have (one step computes it whole)."""
    if not images:
        return
    require(image_token_id is not None, "images", "were given, but the model takes no images: it is a text model")
    end = 0
    for index, image in enumerate(images):
        field = f"images[{index}]"
        require(image.length > 0 and image.offset >= end and image.end <= len(prompt_token_ids), field,
                "must have its placeholder tokens in the prompt, after the image before it")
        require(all(token == image_token_id for token in prompt_token_ids[image.offset:image.end]), field,
                f"must have the image token ({image_token_id}) at each of its placeholder positions")
        require(image.dtype in ITEM_BYTES and len(image.pixel_values) == prod(image.shape) * ITEM_BYTES[image.dtype],
                field, "has pixel values that do not match their shape and dtype")
        require(max_length is None or image.length <= max_length, field,
                f"has {image.length} placeholder tokens, but this model computes each image in one step, of at most "
                f"{max_length} tokens: raise --max-num-batched-tokens")
        require(image.hash == pixels_hash(image.pixel_values, image.shape, image.dtype, image.layout), field,
                "has a hash that is not that of its pixels")
        end = image.end


def image_keys(images: Sequence[ImageInput]) -> Callable[[int, int], bytes] | None:
    """For the prefix cache: what the positions [start, end) stand for besides their token ids, the hash and
    place of each image whose placeholders they reach (shared/block_hash.py); None without images."""
    if not images:
        return None

    def keys(start: int, end: int) -> bytes:
        return b"".join(image.hash + image.offset.to_bytes(4, "little") for image in images
                        if image.offset < end and image.end > start)

    return keys
