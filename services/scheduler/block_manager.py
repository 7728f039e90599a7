"""Block tables: which physical blocks hold each sequence's tokens.

A sequence's table grows one block at a time as its tokens are scheduled;
after each allocation it has exactly ceil(tokens / block_size) entries, where
``tokens`` counts every token that has (or is about to get) a slot.
"""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool, KVCacheBlock


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # Blocks kept back from new admissions so running sequences can grow without preempting at once.
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[int, list[KVCacheBlock]] = {}
        self._num_slotted: dict[int, int] = {}  # seq id -> tokens that have a slot

    # --- queries ---------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return [block.block_id for block in self._tables.get(seq_id, ())]

    def num_slotted_tokens(self, seq_id: int) -> int:
        return self._num_slotted.get(seq_id, 0)

    def num_new_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so the sequence has slots for ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def can_allocate(self, seq_id: int, num_tokens: int, *, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.num_new_blocks_needed(seq_id, num_tokens) <= self.num_free_blocks - reserve

    def wasted_slots(self) -> int:
        """Allocated slots that hold no token: the unfilled tail of each sequence's last block."""
        return sum(len(table) * self.block_size - self._num_slotted[seq_id]
                   for seq_id, table in self._tables.items())

    def allocated_slots(self) -> int:
        return sum(len(table) for table in self._tables.values()) * self.block_size

    # --- changes ---------------------------------------------------------------------------------

    def append_slots(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Grow the sequence to ``num_tokens`` slotted tokens; the new block ids, or None if too few are free."""
        if not self.can_allocate(seq_id, num_tokens):
            return None
        new_blocks = self.pool.allocate(self.num_new_blocks_needed(seq_id, num_tokens))
        self._tables.setdefault(seq_id, []).extend(new_blocks)
        self._num_slotted[seq_id] = max(num_tokens, self._num_slotted.get(seq_id, 0))
        return [block.block_id for block in new_blocks]

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, last block first (see the eviction order in block_pool)."""
        table = self._tables.pop(seq_id, [])
        self._num_slotted.pop(seq_id, None)
        self.pool.free(table[::-1])

    # --- invariants, for tests -------------------------------------------------------------------

    def check_invariants(self) -> None:
        refs: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._num_slotted[seq_id]), f"seq {seq_id}: table size"
            for block in table:
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        free_ids = set(self.pool.free_queue.block_ids())
        assert len(free_ids) == self.pool.num_free_blocks, "free queue count"
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0, f"{block}: negative reference count"
            assert block.ref_cnt == refs.get(block.block_id, 0), f"{block}: reference count != table uses"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{block}: free iff unreferenced"
