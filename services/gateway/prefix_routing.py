"""Routing by cached prefix: what each scheduler's prefix caches hold, as its Session stream tells this gateway
(services/scheduler/cache_digest.py), and how much of a prompt each holds.

Why the Session stream and not Redis: every gateway already holds one ordered stream to every scheduler it
routes to, so the changes arrive in order, with the step that made them, at no extra hop and with nothing
more to run; a new stream starts from a snapshot, so a gateway that restarts, or a scheduler that does,
is in step again at once. Sets in Redis would add a write per indexed block to the scheduler's step and a
read per request to the gateway's, and a dependency schedulers do not have.
"""

from __future__ import annotations

from shared.block_hash import hash_full_blocks, routing_key
from shared.multimodal import image_keys
from shared.lora import prefix_cache_extra
from shared.proto import pagedserve_internal_pb2 as wire
from shared.request import EngineRequest


class PrefixIndex:
    """One scheduler's routing keys, each with the number of its caches holding it (device, host tier)."""

    def __init__(self):
        self._counts: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._counts)

    def apply(self, events: wire.SessionEvents) -> None:
        """A Session message's cache changes; a snapshot replaces everything known. Additions go first: a
        message's changes may be several steps', and each key's count only ever falls to its true value."""
        if events.cache_snapshot:
            self._counts = {}
        counts = self._counts
        for key in events.cache_added:
            counts[key] = counts.get(key, 0) + 1
        for key in events.cache_removed:
            left = counts.get(key, 0) - 1
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)

    def clear(self) -> None:
        """The stream ended: nothing is known until the next one's snapshot."""
        self._counts = {}

    def cached_blocks(self, keys: list[int]) -> int:
        """How many of a prompt's first blocks (their keys, in order) the scheduler holds, in a row."""
        counts = self._counts
        for index, key in enumerate(keys):
            if key not in counts:
                return index
        return len(keys)


def prompt_keys(request: EngineRequest, block_size: int) -> list[int]:
    """The routing keys of the request's full prompt blocks, chained as the scheduler's prefix cache chains
    them (never the last token: the scheduler computes it whatever it holds)."""
    prompt = request.prompt_token_ids
    extra = prefix_cache_extra(request.cache_salt, request.lora)
    return [routing_key(h) for h in hash_full_blocks(None, prompt[:len(prompt) - 1], block_size, extra,
                                                     image_keys(request.images))]
