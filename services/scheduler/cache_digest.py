"""What the prefix caches hold, told to the gateways so that they route a prompt to the scheduler holding the
longest cached start of it (services/gateway/prefix_routing.py).

The caches report each block hash they index and unindex; the digest keeps them as 64-bit routing keys
(shared/block_hash.py) until the engine loop takes them and sends them on every open Session stream. A key
counts once per cache holding it (the device's and the host tier's), so a prefix moving from one to the
other is a removal and an addition that cancel out, and a gateway's count is zero exactly when neither
holds it. A new session first gets a snapshot of every key held, then only the changes.
"""

from __future__ import annotations

from shared.block_hash import BlockHash, routing_key


class CacheDigest:
    def __init__(self):
        self.added: list[int] = []  # keys indexed since the last take, in order
        self.removed: list[int] = []  # keys unindexed since the last take

    def indexed(self, block_hash: BlockHash) -> None:
        self.added.append(routing_key(block_hash))

    def unindexed(self, block_hash: BlockHash) -> None:
        self.removed.append(routing_key(block_hash))

    def take(self) -> tuple[list[int], list[int]]:
        """(added, removed) since the last call."""
        changes = self.added, self.removed
        self.added, self.removed = [], []
        return changes
