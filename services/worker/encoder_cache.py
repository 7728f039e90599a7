"""The encoder cache: the vision encoder's features of recent images, by the hash of their pixels
(shared/multimodal.py), so that an image is encoded once however many steps its placeholders span (a chunked
prefill) and however many requests send it. Bounded by rows of features (as vLLM's by tokens); the least
recently used image goes first, and one that is needed again after that is encoded again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import torch

from shared.multimodal import ImageInput


def encoder_cache_rows(config, max_model_len: int) -> int:
    """Its size: --encoder-cache-size, or as vLLM sizes its encoder cache, a step's token budget of features and
    at least a context's."""
    if config.encoder_cache_size is not None:
        return config.encoder_cache_size
    return max(config.token_budget(max_model_len), max_model_len)


class EncoderCache:
    def __init__(self, max_rows: int):
        self.max_rows = max_rows  # rows of features kept (the newest image whatever its size; 0: none)
        self._features: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # hash -> [rows, hidden], least recent first
        self._rows = 0
        self.num_encoded = 0  # images encoded (cache misses)
        self.num_hits = 0  # images found here

    def features(self, images: list[ImageInput], encode: Callable[[list[ImageInput]], list[torch.Tensor]]
                 ) -> list[torch.Tensor]:
        """Each image's features ``[length, hidden]``, from here or encoded together (``encode`` takes the images
        missing and returns their features in order)."""
        missing = list({image.hash: image for image in images if image.hash not in self._features}.values())
        fresh: dict[bytes, torch.Tensor] = {}
        for image, rows in zip(missing, encode(missing) if missing else []):
            if rows.shape[0] != image.length:
                raise ValueError(f"the vision encoder made {rows.shape[0]} rows of features of an image whose "
                                 f"prompt holds {image.length} placeholder tokens: the processor and the model "
                                 "disagree")
            fresh[image.hash] = rows
        self.num_encoded += len(missing)
        self.num_hits += len(images) - len(missing)
        found = []
        for image in images:
            if image.hash in fresh:
                found.append(fresh[image.hash])
            else:
                self._features.move_to_end(image.hash)
                found.append(self._features[image.hash])
        for key, rows in fresh.items():  # kept after the lookups: one step's images never evict each other first
            self._put(key, rows)
        return found

    def _put(self, key: bytes, rows: torch.Tensor) -> None:
        if not self.max_rows:
            return  # a cache of no rows: every step encodes what it reads
        self._features[key] = rows
        self._rows += rows.shape[0]
        while self._rows > self.max_rows and len(self._features) > 1:
            _, evicted = self._features.popitem(last=False)
            self._rows -= evicted.shape[0]
