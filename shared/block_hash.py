"""Chained hashes of full blocks: the key of the prefix cache.

A block's hash covers its parent block's hash, its own token ids and extra keys
(a cache salt and a LoRA adapter, shared/lora.prefix_cache_extra; the images its tokens stand for,
shared/multimodal.image_keys), so equal hashes mean equal
prefixes, not just equal blocks. BLAKE2b makes a collision (which would hand one
request another's KV) practically impossible, unlike Python's 64-bit hash().
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

BlockHash = bytes


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra: bytes = b"") -> BlockHash:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent or b"root")
    digest.update(array("q", token_ids).tobytes())
    digest.update(extra)
    return digest.digest()


def hash_full_blocks(parent: BlockHash | None, token_ids: list[int], block_size: int, extra: bytes = b"",
                     position_keys: Callable[[int, int], bytes] | None = None, first_position: int = 0
                     ) -> list[BlockHash]:
    """Hashes of the full blocks of ``token_ids``, chained on from ``parent`` (None at a sequence's start).

    Only a sequence's first block carries ``extra``: through the chain it reaches every later block. A block
    also carries ``position_keys(start, end)`` of the sequence positions it holds (``token_ids`` start at
    ``first_position``): what those tokens stand for besides their ids (an image's, for its placeholders).
    """
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hashes[-1] if hashes else parent
        keys = extra if previous is None else b""
        if position_keys is not None:
            keys += position_keys(first_position + start, first_position + start + block_size)
        hashes.append(hash_block_tokens(previous, token_ids[start:start + block_size], keys))
    return hashes


def routing_key(block_hash: BlockHash) -> int:
    """A block hash shortened to 64 bits: what a scheduler tells gateways its prefix caches hold, and what a
    gateway looks a prompt's blocks up by to route it. A collision only misroutes a request (the scheduler's
    own cache looks blocks up by the whole hash)."""
    return int.from_bytes(block_hash[:8], "little")
