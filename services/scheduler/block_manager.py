"""Block tables: which physical blocks hold each sequence's tokens.

A sequence's table grows one block at a time as its tokens are scheduled;
after each allocation it has exactly ceil(tokens / block_size) entries, where
``tokens`` counts every token that has (or is about to get) a slot.

With prefix caching, a sequence's full blocks are indexed by their chained hash
as soon as their KV is computed, and a new sequence starts from the longest run
of cached blocks matching its first tokens.

With a sliding window on every attention layer (``kv_window``), a block wholly
before the window of the sequence's next token is never read again: it is freed
(to the prefix cache, if indexed) and its table entry becomes None. Released
entries are always a run at the table's start; the worker keeps whatever id it
had there (or gets FREED_BLOCK_ID) and never reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.block_hash import BlockHash, hash_full_blocks
from services.scheduler.block_pool import BlockPool, KVCacheBlock

TokenSlice = Callable[[int, int], list[int]]  # (start, end) -> the sequence's token ids in that range
FREED_BLOCK_ID = 0  # what a released entry is sent as: any id would do, no kernel reads it
# A kernel may start reading up to this many keys before a query's window: the Triton kernel rounds its
# first key down to a multiple of 16 (aligned loads). Blocks are freed only behind that.
READ_MARGIN = 16


@dataclass(frozen=True)
class Allocation:
    new_block_ids: tuple[int, ...]  # appended to the table
    copy: tuple[int, int] | None  # copy-on-write (old, new) of the block written first, when it was shared


# Most decode steps write into the last block's free slots: nothing to allocate, nothing to copy.
NO_NEW_BLOCKS = Allocation((), None)


@dataclass(frozen=True)
class CacheHit:
    """The cached start of a new sequence: its first table entries and their hashes (the chain that
    later blocks continue). With a sliding window only the blocks the first new token's window reaches
    must be cached; the entries before them are released (None) from the start."""
    blocks: tuple[KVCacheBlock | None, ...] = ()
    hashes: tuple[BlockHash, ...] = ()

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


NO_HIT = CacheHit()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, enable_caching: bool = False,
                 num_host_blocks: int = 0, kv_window: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_window is not None and kv_window < 1:
            raise ValueError(f"kv_window must be >= 1 (or None), got {kv_window}")
        self.block_size = block_size
        self.kv_window = kv_window  # the most keys any layer sees back; None: the whole context
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.host_pool = BlockPool(num_host_blocks) if num_host_blocks else None  # swap space
        self._host_tables: dict[int, list[KVCacheBlock | None]] = {}  # swapped-out seq id -> its host blocks
        self._hashes: dict[int, list[BlockHash]] = {}  # seq id -> hashes of its full, computed blocks
        # Blocks kept back from new admissions so running sequences can grow without preempting at once.
        self.watermark_blocks = int(watermark * num_blocks)
        self._tables: dict[int, list[KVCacheBlock | None]] = {}  # None: released behind the window
        self._num_slotted: dict[int, int] = {}  # seq id -> tokens that have a slot
        self._num_released: dict[int, int] = {}  # seq id -> released entries at its table's start

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

    def block_table(self, seq_id: int, start: int = 0) -> list[int]:
        """The physical block ids of the sequence's table, from logical block ``start`` on."""
        return [FREED_BLOCK_ID if block is None else block.block_id for block in self._tables.get(seq_id, ())[start:]]

    def num_released_blocks(self, seq_id: int) -> int:
        """Entries at the start of the sequence's table whose blocks were freed behind the window."""
        return self._num_released.get(seq_id, 0)

    def most_blocks_held(self, num_tokens: int, step_tokens: int | None) -> int:
        """The most blocks a sequence growing to ``num_tokens`` tokens holds at once, computing at most
        ``step_tokens`` a step (None: a whole prompt, or a recomputed sequence, in one step).

        With a sliding window, a step from position p holds the blocks from the window's (and margin's)
        start at p to p + step: never more than step + window - 1 + READ_MARGIN slots, spread over
        their blocks plus one where they straddle a boundary; and one more for a copy-on-write (a
        fork's one-token step copies its shared last block: it matters only for a budget under a block).
        """
        whole = self.blocks_for(num_tokens)
        if self.kv_window is None or step_tokens is None:
            return whole
        return min(whole, self.blocks_for(step_tokens + self.kv_window - 1 + READ_MARGIN) + 2)

    def num_table_blocks(self, seq_id: int) -> int:
        return len(self._tables.get(seq_id, ()))

    def num_slotted_tokens(self, seq_id: int) -> int:
        return self._num_slotted.get(seq_id, 0)

    def num_new_blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        """Blocks to add so the sequence has slots for ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(self._tables.get(seq_id, ())))

    def free_slots_after(self, seq_id: int, num_tokens: int, reserve_blocks: int = 0) -> int:
        """Slots the sequence could add past its first ``num_tokens`` (which have slots) without taking
        any other sequence's blocks: the rest of its last block, and the free blocks but ``reserve_blocks``."""
        in_table = len(self._tables.get(seq_id, ())) * self.block_size - num_tokens
        return in_table + max(0, self.num_free_blocks - reserve_blocks) * self.block_size

    def can_allocate(self, seq_id: int, num_tokens: int, *, keep_watermark: bool = False,
                     hits: CacheHit = NO_HIT, write_from: int | None = None) -> bool:
        """Room for ``num_tokens`` slots, the first ones in cache hits (a cached-free hit costs a free block),
        plus a copy of the block written first when it is shared."""
        reserve = self.watermark_blocks if keep_watermark else 0
        revived = sum(1 for block in _live(hits.blocks) if block.ref_cnt == 0)
        needed = self.num_blocks_to_grow(seq_id, num_tokens, write_from) - hits.num_blocks + revived
        return needed <= self.num_free_blocks - reserve

    def num_blocks_to_grow(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> int:
        """Free blocks that append_slots would take: the new ones, and a copy of the block written
        first when it is shared."""
        copy = 1 if write_from is not None and self._shared_block_at(seq_id, write_from) is not None else 0
        return self.num_new_blocks_needed(seq_id, num_tokens) + copy

    def _shared_block_at(self, seq_id: int, position: int) -> KVCacheBlock | None:
        """The block holding token ``position``, if it exists and another sequence holds it too."""
        table = self._tables.get(seq_id, ())
        index = position // self.block_size
        block = table[index] if index < len(table) else None
        return block if block is not None and block.ref_cnt > 1 else None

    @property
    def num_cached_blocks(self) -> int:
        """Cached-free blocks: unreferenced, still indexed, evictable."""
        return self.pool.num_cached_free

    def wasted_slots(self) -> int:
        """Allocated slots that hold no token: the unfilled tail of each sequence's last block."""
        return sum(len(table) * self.block_size - self._num_slotted[seq_id]
                   for seq_id, table in self._tables.items())

    def allocated_slots(self) -> int:
        return sum(len(table) - self._num_released.get(seq_id, 0)
                   for seq_id, table in self._tables.items()) * self.block_size

    # --- changes ---------------------------------------------------------------------------------

    def append_slots(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> Allocation | None:
        """Grow the sequence to ``num_tokens`` slotted tokens; None if too few blocks are free.

        ``write_from`` is the first position written this step: if its block is shared (a fork's
        partly filled last block), the sequence gets its own copy first; a shared block is never
        written in place.
        """
        shared = self._shared_block_at(seq_id, write_from) if write_from is not None else None
        table = self._tables.get(seq_id)
        if shared is None and table is not None and num_tokens <= len(table) * self.block_size:
            if num_tokens > self._num_slotted[seq_id]:
                self._num_slotted[seq_id] = num_tokens
            return NO_NEW_BLOCKS  # the common decode step: the hot path does no more than this
        num_new = self.num_new_blocks_needed(seq_id, num_tokens)
        if num_new + (shared is not None) > self.num_free_blocks:
            return None
        copy = self._copy_on_write(seq_id, write_from, shared) if shared is not None else None
        new_blocks = self.pool.allocate(num_new)
        self._tables.setdefault(seq_id, []).extend(new_blocks)
        self._num_slotted[seq_id] = max(num_tokens, self._num_slotted.get(seq_id, 0))
        return Allocation(tuple(block.block_id for block in new_blocks), copy)

    def trim_slots(self, seq_id: int, num_tokens: int) -> int:
        """Shrink the sequence to ``num_tokens`` slotted tokens (slots given to drafts the worker
        rejected); returns how many blocks came off the table's end, freed last first."""
        table = self._tables[seq_id]
        keep = self.blocks_for(num_tokens)
        released = table[keep:]
        del table[keep:]
        self._num_slotted[seq_id] = min(self._num_slotted[seq_id], num_tokens)
        self.pool.free(released[::-1])
        return len(released)

    def _copy_on_write(self, seq_id: int, position: int, shared: KVCacheBlock) -> tuple[int, int]:
        (fresh,) = self.pool.allocate(1)
        self._tables[seq_id][position // self.block_size] = fresh
        self.pool.free([shared])
        return shared.block_id, fresh.block_id

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (one more reference each)."""
        table = self._tables[parent_id]
        for block in _live(table):
            block.ref_cnt += 1
        self._tables[child_id] = list(table)
        self._num_slotted[child_id] = self._num_slotted[parent_id]
        self._num_released[child_id] = self._num_released.get(parent_id, 0)
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, last block first (see the eviction order in block_pool)."""
        table = self._tables.pop(seq_id, [])
        self._num_slotted.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._num_released.pop(seq_id, None)
        self.pool.free(_live(table[::-1]))
        if seq_id in self._host_tables:
            self.host_pool.free(_live(self._host_tables.pop(seq_id)))

    def release_blocks_behind_window(self, seq_id: int, num_computed_tokens: int) -> int:
        """Free the blocks no layer will read again: wholly before the window (and READ_MARGIN) of the
        sequence's next token, at position ``num_computed_tokens``. Returns how many were freed."""
        if self.kv_window is None:  # on every step for every sequence: the common case returns first
            return 0
        table = self._tables.get(seq_id)
        if table is None:
            return 0
        behind = min(self._first_block_read(num_computed_tokens), len(table))
        start = self._num_released.get(seq_id, 0)
        if behind <= start:
            return 0
        released = table[start:behind]
        table[start:behind] = [None] * len(released)
        self._num_released[seq_id] = behind
        self.pool.free(released[::-1])  # as free(): the later blocks first, so they are evicted first
        return len(released)

    # --- swapping --------------------------------------------------------------------------------

    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks if self.host_pool else 0

    def can_swap_out(self, seq_id: int) -> bool:
        return self.host_pool is not None and len(_live(self._tables.get(seq_id, ()))) <= self.num_free_host_blocks

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence's KV to host blocks; the (device, host) pairs to copy. Its device blocks are
        released (a block another sequence shares stays with it); released entries stay released."""
        table = self._tables.pop(seq_id)
        live = _live(table)
        host = iter(self.host_pool.allocate(len(live)))
        self._host_tables[seq_id] = [None if block is None else next(host) for block in table]
        self._hashes.pop(seq_id, None)
        self.pool.free(live[::-1])
        return [(device.block_id, host_block.block_id)
                for device, host_block in zip(table, self._host_tables[seq_id]) if device is not None]

    def can_swap_in(self, seq_id: int, num_tokens: int) -> bool:
        """Room on the device for the swapped blocks and the ones ``num_tokens`` slotted tokens add."""
        host = self._host_tables[seq_id]
        return len(_live(host)) + max(0, self.blocks_for(num_tokens) - len(host)) <= self.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring the sequence's KV back into fresh device blocks; the (host, device) pairs to copy."""
        host = self._host_tables.pop(seq_id)
        live = _live(host)
        device = iter(self.pool.allocate(len(live)))
        self._tables[seq_id] = [None if block is None else next(device) for block in host]
        self.host_pool.free(live)
        return [(host_block.block_id, block.block_id)
                for host_block, block in zip(host, self._tables[seq_id]) if host_block is not None]

    def is_swapped(self, seq_id: int) -> bool:
        return seq_id in self._host_tables
    # --- prefix caching --------------------------------------------------------------------------

    def cached_prefix(self, token_ids: list[int], extra: bytes = b"") -> CacheHit:
        """The longest cached start of ``token_ids``: every block of it cached, or with a sliding window
        every block the window of the first token after it reaches (earlier ones may have been evicted;
        the chain of hashes is a function of the tokens, so later blocks are found without them).

        Stops one token short of the end: at least one token must be computed, since its
        logits are what the sequence samples from.
        """
        if not self.enable_caching:
            return NO_HIT
        hashes = hash_full_blocks(None, token_ids[:len(token_ids) - 1], self.block_size, extra)
        blocks = [self.pool.cached_block(block_hash) for block_hash in hashes]
        best, run_start = 0, 0  # the longest start found; where the run of cached blocks now ending began
        for index, block in enumerate(blocks):
            if block is None:
                if self.kv_window is None:
                    break  # without a window every block of the start is read
                run_start = index + 1
            elif run_start <= self._first_block_read((index + 1) * self.block_size):
                best = index + 1
        needed_from = self._first_block_read(best * self.block_size)
        return CacheHit((None,) * needed_from + tuple(blocks[needed_from:best]), tuple(hashes[:best]))

    def _first_block_read(self, position: int) -> int:
        """The first block a kernel may read for a query at ``position``: its window's, less READ_MARGIN."""
        if self.kv_window is None:
            return 0
        return max(0, position - self.kv_window + 1 - READ_MARGIN) // self.block_size

    def allocate_with_hits(self, seq_id: int, hits: CacheHit, num_tokens: int) -> list[int]:
        """Start a sequence's table with its cache hits, then fresh blocks up to ``num_tokens`` slots."""
        live = _live(hits.blocks)
        self.pool.touch(live)
        self._tables[seq_id] = list(hits.blocks)
        self._num_released[seq_id] = hits.num_blocks - len(live)
        self._num_slotted[seq_id] = hits.num_blocks * self.block_size
        self._hashes[seq_id] = list(hits.hashes)
        self.append_slots(seq_id, num_tokens)
        return self.block_table(seq_id)

    def cache_full_blocks(self, seq_id: int, num_computed_tokens: int, tokens: TokenSlice, extra: bytes = b"") -> None:
        """Index the blocks that became full (and computed) since the last call."""
        if not self.enable_caching:
            return
        hashes = self._hashes.setdefault(seq_id, [])
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        # Hash just the new blocks, chained onto the last known hash.
        new = hash_full_blocks(hashes[-1] if hashes else None,
                               tokens(len(hashes) * self.block_size, num_full * self.block_size), self.block_size, extra)
        table = self._tables[seq_id]
        for index, block_hash in enumerate(new, start=len(hashes)):
            if table[index] is not None:  # a block released before it was indexed is gone
                self.pool.cache_block(table[index], block_hash)
        hashes.extend(new)

    # --- invariants, for tests -------------------------------------------------------------------

    def check_invariants(self) -> None:
        if self.host_pool is not None:
            host_refs = sum(len(_live(t)) for t in self._host_tables.values())
            assert host_refs == self.host_pool.num_used_blocks, "host blocks leaked or double-used"
            assert all(b.ref_cnt in (0, 1) for b in self.host_pool.blocks), "a host block is shared"
        cached_free = [b for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None]
        assert len(cached_free) == self.pool.num_cached_free, "cached-free count"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block}: index and block disagree"
        refs: dict[int, int] = {}
        for seq_id, table in self._tables.items():
            assert len(table) == self.blocks_for(self._num_slotted[seq_id]), f"seq {seq_id}: table size"
            released = self._num_released.get(seq_id, 0)
            assert all(b is None for b in table[:released]) and None not in table[released:], \
                f"seq {seq_id}: released entries are not the table's first {released}"
            for block in _live(table):
                refs[block.block_id] = refs.get(block.block_id, 0) + 1
        free_ids = set(self.pool.free_queue.block_ids())
        assert len(free_ids) == self.pool.num_free_blocks, "free queue count"
        for block in self.pool.blocks:
            assert block.ref_cnt >= 0, f"{block}: negative reference count"
            assert block.ref_cnt == refs.get(block.block_id, 0), f"{block}: reference count != table uses"
            assert (block.ref_cnt == 0) == (block.block_id in free_ids), f"{block}: free iff unreferenced"


def _live(table) -> list[KVCacheBlock]:
    """A table's blocks that were not released behind the window."""
    return [block for block in table if block is not None]
