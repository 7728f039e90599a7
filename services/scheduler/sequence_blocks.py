"""One sequence's blocks as the block manager keeps them: one object, so its parts cannot drift apart.

On the device, its table has exactly ceil(num_slotted / block_size) entries, the first num_released
of them None (freed behind the sliding window). Swapped out, its table is empty and host_table holds
its blocks in host memory (None where the device entry was released); num_slotted and num_released
stay as they were, for when it comes back.
"""

from __future__ import annotations

from services.scheduler.block_pool import KVCacheBlock
from shared.block_hash import BlockHash


class SequenceBlocks:
    # Slotted: the block manager reads these for every sequence on every step.
    __slots__ = ("table", "num_slotted", "num_released", "hashes", "host_table")

    def __init__(self, table: list[KVCacheBlock | None] | None = None, num_slotted: int = 0, num_released: int = 0,
                 hashes: list[BlockHash] | None = None):
        self.table: list[KVCacheBlock | None] = [] if table is None else table  # None: released behind the window
        self.num_slotted = num_slotted  # tokens that have a slot
        self.num_released = num_released  # released entries at the table's start
        self.hashes: list[BlockHash] = [] if hashes is None else hashes  # of its full, computed, indexed blocks
        self.host_table: list[KVCacheBlock | None] | None = None  # its host blocks while swapped out

    @property
    def is_swapped(self) -> bool:
        return self.host_table is not None

    def forked(self) -> SequenceBlocks:
        """A child's copy: the same blocks (the caller counts the new references), slots and hashes."""
        return SequenceBlocks(list(self.table), self.num_slotted, self.num_released, list(self.hashes))

    def __repr__(self) -> str:
        where = "swapped" if self.is_swapped else f"{len(self.table)} blocks"
        return f"SequenceBlocks({where}, slotted={self.num_slotted}, released={self.num_released})"
