"""Host memory's KV blocks: swap space for preempted sequences, and the offload tier of the prefix cache.

One pool serves both. Swapped sequences hold their blocks (count 1) and always come first: a swap-out
evicts the tier's least recently used blocks, since a preempted sequence is live work and a tier block
only saves a recompute. The tier fills whatever the swapped sequences leave, so swap space that is idle
caches prefixes too; swapped sequences never hold more than ``num_swap_blocks``, so the tier always keeps
the rest (its own size, ``--kv-offloading-size``); and a plan's stores, which hold their blocks until it is
sealed, never take the swap space a preemption later in the same plan may need.

The tier is a second prefix-cache index (the pool's, by the same chained block hashes). A block the
device cache evicts is stored here (a device -> host copy) unless its hash is here already; a later
prefix hit here is loaded into a fresh device block (a host -> device copy) instead of recomputed.
Both copies run in the step being planned, before its forward pass: the store with the swap-outs, the
load with the swap-ins. A host block written or read by the step being planned is held (counted) until
the plan is sealed, so no later allocation in the same plan can hand it to another copy. One block may be
both stored and loaded in a plan (one admission evicts a prefix, a later one finds it in the tier): the
worker runs every swap-out before any swap-in, so the load reads what the store wrote.
"""

from __future__ import annotations

from services.scheduler.block_pool import BlockPool, KVCacheBlock
from shared.block_hash import BlockHash

Move = tuple[int, int]  # (source block id, destination block id)


class HostBlocks:
    def __init__(self, num_swap_blocks: int, num_tier_blocks: int):
        self.num_swap_blocks = num_swap_blocks  # the most that swapped sequences hold at once
        self.tier_enabled = num_tier_blocks > 0
        self.pool = BlockPool(num_swap_blocks + num_tier_blocks, enable_caching=self.tier_enabled)
        self.num_swapped = 0  # blocks swapped-out sequences hold
        self._held: list[KVCacheBlock] = []  # read or written by the plan being made
        self.stores: list[Move] = []  # (device, host) tier stores of the plan being made
        self.loads: list[Move] = []  # (host, device) tier loads of the plan being made
        self.num_stored_blocks = 0  # device blocks copied into the tier, ever
        self.num_loaded_blocks = 0  # tier blocks copied back to the device, ever

    # --- swap space -----------------------------------------------------------------------------------

    def can_swap_out(self, num_blocks: int) -> bool:
        return self.num_swapped + num_blocks <= self.num_swap_blocks and num_blocks <= self.pool.num_free_blocks

    def swap_out(self, num_blocks: int) -> list[KVCacheBlock]:
        """Blocks for a preempted sequence's KV (evicting the tier's oldest where need be)."""
        self.num_swapped += num_blocks
        return self.pool.allocate(num_blocks)

    def swapped_in(self, blocks: list[KVCacheBlock]) -> None:
        """A sequence's blocks are read back this plan: free once it is sealed."""
        self.num_swapped -= len(blocks)
        self._held.extend(blocks)

    def free_swapped(self, blocks: list[KVCacheBlock]) -> None:
        """A swapped sequence ended: its blocks are free now (nothing reads them)."""
        self.num_swapped -= len(blocks)
        self.pool.free(blocks)

    # --- the offload tier -------------------------------------------------------------------------------

    def store(self, device_block_id: int, block_hash: BlockHash) -> None:
        """The device evicts this block's prefix: keep a copy, unless the tier has it (then it is the most
        recently used) or only swap space is left. (Wired to the device pool's evictions only with a tier.)"""
        kept = self.pool.cached_block(block_hash)
        if kept is not None:
            self._hold(kept)
            return
        if self.pool.num_free_blocks <= self.num_swap_blocks - self.num_swapped:
            return  # what is left is swap space a preemption later in this plan may need: the prefix is lost
        (block,) = self.pool.allocate(1)
        self.pool.cache_block(block, block_hash)
        self._held.append(block)
        self.stores.append((device_block_id, block.block_id))
        self.num_stored_blocks += 1

    def cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.pool.cached_block(block_hash) if self.tier_enabled else None

    def load(self, block: KVCacheBlock, device_block_id: int) -> None:
        """Copy a tier hit (held since the lookup) into a device block this plan."""
        self.loads.append((block.block_id, device_block_id))
        self.num_loaded_blocks += 1

    def hold(self, blocks: list[KVCacheBlock]) -> None:
        """Keep tier hits from being handed out before the plan is sealed (they are loaded in it)."""
        for block in blocks:
            self._hold(block)

    def _hold(self, block: KVCacheBlock) -> None:
        self.pool.touch([block])
        self._held.append(block)

    def forget(self, block_hash: BlockHash) -> None:
        """Drop the tier's copy of this prefix (a load of it failed: it may not be what the hash says)."""
        block = self.pool.cached_block(block_hash)
        if block is not None:
            self.pool.forget(block)

    def seal(self) -> tuple[list[Move], list[Move]]:
        """The plan is complete: its (stores, loads), and the blocks it held go back, most recently used last."""
        moves = self.stores, self.loads
        self.stores, self.loads = [], []
        held, self._held = self._held, []
        self.pool.free(held)
        return moves

    @property
    def num_tier_blocks(self) -> int:
        """Blocks the tier holds a prefix in now."""
        return self.pool.num_cached_free
