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

from services.scheduler.block_pool import BlockPool, KVCacheBlock
from services.scheduler.cache_digest import CacheDigest
from services.scheduler.host_blocks import HostBlocks, Move
from services.scheduler.sequence_blocks import SequenceBlocks
from shared.block_hash import BlockHash, hash_full_blocks, routing_key

TokenSlice = Callable[[int, int], list[int]]  # (start, end) -> the sequence's token ids in that range
PositionKeys = Callable[[int, int], bytes]  # (start, end) -> what those positions stand for besides their ids
FREED_BLOCK_ID = 0  # what a released entry is sent as: any id would do, no kernel reads it
# A kernel may start reading up to this many keys before a query's window: the Triton kernel rounds its
# first key down to a multiple of 16 (aligned loads). Blocks are freed only behind that.
READ_MARGIN = 16
_NO_TABLE: list[KVCacheBlock | None] = []  # what a sequence without a device table reads as (never written)


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
    must be cached; the entries before them are released (None) from the start. An entry found in the
    host tier, not on the device, is that host block: its index is in ``on_host``."""
    blocks: tuple[KVCacheBlock | None, ...] = ()
    hashes: tuple[BlockHash, ...] = ()
    on_host: tuple[int, ...] = ()  # indexes of the entries that are host blocks, loaded into fresh device ones

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def device_blocks(self) -> list[KVCacheBlock]:
        return [block for index, block in enumerate(self.blocks) if block is not None and index not in self.on_host]

    def host_blocks(self) -> list[KVCacheBlock]:
        return [self.blocks[index] for index in self.on_host]


NO_HIT = CacheHit()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.0, enable_caching: bool = False,
                 num_host_blocks: int = 0, kv_window: int | None = None, num_offload_blocks: int = 0):
        """``num_host_blocks``: host memory's blocks in all; ``num_offload_blocks`` of them are the prefix
        cache's offload tier (host_blocks.py), the rest swap space. The tier needs prefix caching."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if kv_window is not None and kv_window < 1:
            raise ValueError(f"kv_window must be >= 1 (or None), got {kv_window}")
        self.block_size = block_size
        self.kv_window = kv_window  # the most keys any layer sees back; None: the whole context
        self.enable_caching = enable_caching
        num_offload_blocks = num_offload_blocks if enable_caching else 0
        self.host = HostBlocks(num_host_blocks - num_offload_blocks, num_offload_blocks) if num_host_blocks else None
        on_evict = self.host.store if self.host is not None and self.host.tier_enabled else None
        self.pool = BlockPool(num_blocks, enable_caching, on_evict=on_evict)
        # Blocks kept back from new admissions so running sequences can grow without preempting at once.
        self.watermark_blocks = int(watermark * num_blocks)
        self._seqs: dict[int, SequenceBlocks] = {}  # seq id -> its blocks, on the device or swapped out

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
        return [FREED_BLOCK_ID if block is None else block.block_id for block in self._table(seq_id)[start:]]

    def _table(self, seq_id: int) -> list[KVCacheBlock | None]:
        """The sequence's device table; empty when it has none (unknown, or swapped out)."""
        entry = self._seqs.get(seq_id)
        return _NO_TABLE if entry is None else entry.table

    def num_released_blocks(self, seq_id: int) -> int:
        """Entries at the start of the sequence's table whose blocks were freed behind the window."""
        entry = self._seqs.get(seq_id)
        return 0 if entry is None else entry.num_released

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
        return len(self._table(seq_id))

    def num_slotted_tokens(self, seq_id: int) -> int:
        entry = self._seqs.get(seq_id)
        return 0 if entry is None else entry.num_slotted

    def _num_missing(self, table: list[KVCacheBlock | None], num_tokens: int) -> int:
        """Blocks to add to the table so it has slots for ``num_tokens`` tokens in all."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def free_slots_after(self, seq_id: int, num_tokens: int, reserve_blocks: int = 0) -> int:
        """Slots the sequence could add past its first ``num_tokens`` (which have slots) without taking
        any other sequence's blocks: the rest of its last block, and the free blocks but ``reserve_blocks``."""
        in_table = len(self._table(seq_id)) * self.block_size - num_tokens
        return in_table + max(0, self.num_free_blocks - reserve_blocks) * self.block_size

    def can_allocate(self, seq_id: int, num_tokens: int, *, keep_watermark: bool = False,
                     hits: CacheHit = NO_HIT, write_from: int | None = None) -> bool:
        """Room for ``num_tokens`` slots, the first ones in cache hits (a cached-free hit costs a free block),
        plus a copy of the block written first when it is shared."""
        reserve = self.watermark_blocks if keep_watermark else 0
        revived = sum(1 for block in hits.device_blocks() if block.ref_cnt == 0)
        loaded = len(hits.on_host)  # each needs a fresh device block
        needed = self.num_blocks_to_grow(seq_id, num_tokens, write_from) - hits.num_blocks + revived + loaded
        return needed <= self.num_free_blocks - reserve

    def num_blocks_to_grow(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> int:
        """Free blocks that append_slots would take: the new ones, and a copy of the block written
        first when it is shared."""
        table = self._table(seq_id)
        copy = 1 if write_from is not None and self._shared_block_at(table, write_from) is not None else 0
        return self._num_missing(table, num_tokens) + copy

    def _shared_block_at(self, table: list[KVCacheBlock | None], position: int) -> KVCacheBlock | None:
        """The table's block holding token ``position``, if it exists and another sequence holds it too."""
        index = position // self.block_size
        block = table[index] if index < len(table) else None
        return block if block is not None and block.ref_cnt > 1 else None

    @property
    def num_cached_blocks(self) -> int:
        """Cached-free blocks: unreferenced, still indexed, evictable."""
        return self.pool.num_cached_free

    def wasted_slots(self) -> int:
        """Allocated slots that hold no token: the unfilled tail of each sequence's last block."""
        return sum(len(entry.table) * self.block_size - entry.num_slotted
                   for entry in self._seqs.values() if entry.host_table is None)

    def allocated_slots(self) -> int:
        return sum(len(entry.table) - entry.num_released
                   for entry in self._seqs.values() if entry.host_table is None) * self.block_size

    # --- changes ---------------------------------------------------------------------------------

    def append_slots(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> Allocation | None:
        """Grow the sequence to ``num_tokens`` slotted tokens; None if too few blocks are free.

        ``write_from`` is the first position written this step: if its block is shared (a fork's
        partly filled last block), the sequence gets its own copy first; a shared block is never
        written in place.
        """
        entry = self._seqs.get(seq_id)
        table = _NO_TABLE if entry is None else entry.table
        shared = self._shared_block_at(table, write_from) if write_from is not None else None
        if shared is None and entry is not None and num_tokens <= len(table) * self.block_size:
            if num_tokens > entry.num_slotted:
                entry.num_slotted = num_tokens
            return NO_NEW_BLOCKS  # the common decode step: the hot path does no more than this
        num_new = self._num_missing(table, num_tokens)
        if num_new + (shared is not None) > self.num_free_blocks:
            return None
        if entry is None:
            entry = self._seqs[seq_id] = SequenceBlocks()
        copy = self._copy_on_write(entry.table, write_from, shared) if shared is not None else None
        new_blocks = self.pool.allocate(num_new)
        entry.table.extend(new_blocks)
        entry.num_slotted = max(num_tokens, entry.num_slotted)
        return Allocation(tuple(block.block_id for block in new_blocks), copy)

    def trim_slots(self, seq_id: int, num_tokens: int) -> int:
        """Shrink the sequence to ``num_tokens`` slotted tokens (slots given to drafts the worker
        rejected); returns how many blocks came off the table's end, freed last first."""
        entry = self._seqs[seq_id]
        keep = self.blocks_for(num_tokens)
        released = entry.table[keep:]
        del entry.table[keep:]
        entry.num_slotted = min(entry.num_slotted, num_tokens)
        self.pool.free(released[::-1])
        return len(released)

    def _copy_on_write(self, table: list[KVCacheBlock | None], position: int,
                       shared: KVCacheBlock) -> tuple[int, int]:
        (fresh,) = self.pool.allocate(1)
        table[position // self.block_size] = fresh
        self.pool.free([shared])
        return shared.block_id, fresh.block_id

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (one more reference each)."""
        parent = self._seqs[parent_id]
        for block in _live(parent.table):
            block.ref_cnt += 1
        self._seqs[child_id] = parent.forked()

    def free(self, seq_id: int) -> None:
        """Release the sequence's blocks, last block first (see the eviction order in block_pool)."""
        entry = self._seqs.pop(seq_id, None)
        if entry is None:
            return
        self.pool.free(_live(entry.table[::-1]))
        if entry.host_table is not None:
            self.host.free_swapped(_live(entry.host_table))

    def release_blocks_behind_window(self, seq_id: int, num_computed_tokens: int) -> int:
        """Free the blocks no layer will read again: wholly before the window (and READ_MARGIN) of the
        sequence's next token, at position ``num_computed_tokens``. Returns how many were freed."""
        if self.kv_window is None:  # on every step for every sequence: the common case returns first
            return 0
        entry = self._seqs.get(seq_id)
        if entry is None:
            return 0
        table = entry.table  # (empty while swapped out: nothing to release)
        behind = min(self._first_block_read(num_computed_tokens), len(table))
        start = entry.num_released
        if behind <= start:
            return 0
        released = table[start:behind]
        table[start:behind] = [None] * len(released)
        entry.num_released = behind
        self.pool.free(released[::-1])  # as free(): the later blocks first, so they are evicted first
        return len(released)

    # --- swapping --------------------------------------------------------------------------------

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks nothing holds: free, or keeping an offloaded prefix."""
        return self.host.pool.num_free_blocks if self.host else 0

    def can_swap_out(self, seq_id: int) -> bool:
        return self.host is not None and self.host.can_swap_out(len(_live(self._table(seq_id))))

    def swap_out(self, seq_id: int) -> list[tuple[int, int]]:
        """Move the sequence's KV to host blocks; the (device, host) pairs to copy. Its device blocks are
        released (a block another sequence shares stays with it); released entries stay released."""
        entry = self._seqs[seq_id]
        table, entry.table, entry.hashes = entry.table, [], []
        live = _live(table)
        host = iter(self.host.swap_out(len(live)))
        entry.host_table = [None if block is None else next(host) for block in table]
        self.pool.free(live[::-1])
        return [(device.block_id, host_block.block_id)
                for device, host_block in zip(table, entry.host_table) if device is not None]

    def can_swap_in(self, seq_id: int, num_tokens: int) -> bool:
        """Room on the device for the swapped blocks and the ones ``num_tokens`` slotted tokens add."""
        host = self._seqs[seq_id].host_table
        return len(_live(host)) + max(0, self.blocks_for(num_tokens) - len(host)) <= self.num_free_blocks

    def swap_in(self, seq_id: int) -> list[tuple[int, int]]:
        """Bring the sequence's KV back into fresh device blocks; the (host, device) pairs to copy."""
        entry = self._seqs[seq_id]
        host, entry.host_table = entry.host_table, None
        live = _live(host)
        device = iter(self.pool.allocate(len(live)))
        entry.table = [None if block is None else next(device) for block in host]
        self.host.swapped_in(live)
        return [(host_block.block_id, block.block_id)
                for host_block, block in zip(host, entry.table) if host_block is not None]

    def is_swapped(self, seq_id: int) -> bool:
        entry = self._seqs.get(seq_id)
        return entry is not None and entry.host_table is not None
    # --- prefix caching --------------------------------------------------------------------------

    def cached_prefix(self, token_ids: list[int], extra: bytes = b"", position_keys: PositionKeys | None = None
                      ) -> CacheHit:
        """The longest cached start of ``token_ids``: every block of it cached, or with a sliding window
        every block the window of the first token after it reaches (earlier ones may have been evicted;
        the chain of hashes is a function of the tokens, so later blocks are found without them).

        Stops one token short of the end: at least one token must be computed, since its
        logits are what the sequence samples from.
        """
        if not self.enable_caching:
            return NO_HIT
        hashes = hash_full_blocks(None, token_ids[:len(token_ids) - 1], self.block_size, extra, position_keys)
        blocks, on_host = [], []
        for index, block_hash in enumerate(hashes):
            block = self.pool.cached_block(block_hash)
            if block is None and self.host is not None:
                block = self.host.cached_block(block_hash)
                if block is not None:
                    on_host.append(index)
            blocks.append(block)
        best, run_start = 0, 0  # the longest start found; where the run of cached blocks now ending began
        for index, block in enumerate(blocks):
            if block is None:
                if self.kv_window is None:
                    break  # without a window every block of the start is read
                run_start = index + 1
            elif run_start <= self._first_block_read((index + 1) * self.block_size):
                best = index + 1
        needed_from = self._first_block_read(best * self.block_size)
        return CacheHit((None,) * needed_from + tuple(blocks[needed_from:best]), tuple(hashes[:best]),
                        tuple(index for index in on_host if needed_from <= index < best))

    def _first_block_read(self, position: int) -> int:
        """The first block a kernel may read for a query at ``position``: its window's, less READ_MARGIN."""
        if self.kv_window is None:
            return 0
        return max(0, position - self.kv_window + 1 - READ_MARGIN) // self.block_size

    def allocate_with_hits(self, seq_id: int, hits: CacheHit, num_tokens: int) -> list[int]:
        """Start a sequence's table with its cache hits, then fresh blocks up to ``num_tokens`` slots. Hits in
        the host tier are loaded into fresh device blocks (this plan's swap-ins), indexed there at once."""
        self.pool.touch(hits.device_blocks())
        table = list(hits.blocks)
        if hits.on_host:
            self.host.hold(hits.host_blocks())  # before the device allocation below may store into the tier
            for index, device in zip(hits.on_host, self.pool.allocate(len(hits.on_host))):
                self.host.load(table[index], device.block_id)
                self.pool.cache_block(device, hits.hashes[index])
                table[index] = device
        self._seqs[seq_id] = SequenceBlocks(table, num_slotted=hits.num_blocks * self.block_size,
                                            num_released=hits.num_blocks - len(_live(table)), hashes=list(hits.hashes))
        self.append_slots(seq_id, num_tokens)
        return self.block_table(seq_id)

    def allocate_transferred(self, seq_id: int, hits: CacheHit, source_blocks: tuple[int | None, ...],
                             num_source_tokens: int, num_tokens: int) -> list[tuple[int, int]]:
        """Start a handed-off sequence's table (prefill/decode disaggregation): its cached start here, then fresh
        blocks up to ``num_tokens`` slots; returns the (source block, block here) pairs to pull for the rest of
        its ``num_source_tokens`` computed tokens. The entries the source released behind the window are
        released here too. ``hits`` must come from transfer_hits."""
        self.allocate_with_hits(seq_id, hits, num_tokens)
        table = self._seqs[seq_id].table
        return [(source_blocks[index], table[index].block_id)
                for index in range(hits.num_blocks, self.blocks_for(num_source_tokens))]

    def transfer_hits(self, hits: CacheHit, source_blocks: tuple[int | None, ...]) -> CacheHit:
        """A handed-off sequence's cached start here, so that every block after it is one the source holds: the
        source's released entries (a run at its start) lie behind the window of the sequence's next token, so
        no kernel reads them, and when they reach past the hits, the start is those released entries alone."""
        released = next((index for index, block in enumerate(source_blocks) if block is not None), len(source_blocks))
        return hits if released <= hits.num_blocks else CacheHit((None,) * released)

    def publish_cache(self, digest: CacheDigest | None = None) -> CacheDigest:
        """From now on, record what the prefix caches index and unindex (for the gateways' routing) in ``digest``
        (one that other block managers record in too) or a new one; returns the record. Its changes follow a
        snapshot: cached_keys() taken before the next change."""
        digest = CacheDigest() if digest is None else digest
        self.pool.digest = digest
        if self.host is not None:
            self.host.pool.digest = digest
        return digest

    def cached_keys(self) -> list[int]:
        """Every routing key the caches hold, once per cache holding it."""
        pools = [self.pool] + ([self.host.pool] if self.host is not None else [])
        return [routing_key(block_hash) for pool in pools for block_hash in pool.cached]

    def seal_plan(self) -> tuple[list[Move], list[Move]]:
        """The step's plan is complete: the host tier's (stores, loads) to add to its swap-outs and swap-ins,
        and the host blocks the plan reads or writes may be handed out again."""
        return self.host.seal() if self.host is not None else ([], [])

    def forget_cached(self, block_ids: set[int]) -> None:
        """These device blocks' contents are not what their hashes say (a swap-in failed): neither cache may
        offer their prefixes again."""
        for block_id in block_ids:
            block_hash = self.pool.blocks[block_id].block_hash
            if block_hash is not None:
                self.pool.forget(self.pool.blocks[block_id])
                if self.host is not None:
                    self.host.forget(block_hash)

    def cache_full_blocks(self, seq_id: int, num_computed_tokens: int, tokens: TokenSlice, extra: bytes = b"",
                          position_keys: PositionKeys | None = None) -> None:
        """Index the blocks that became full (and computed) since the last call."""
        if not self.enable_caching:
            return
        entry = self._seqs[seq_id]
        hashes = entry.hashes
        num_full = num_computed_tokens // self.block_size
        if num_full <= len(hashes):
            return
        # Hash just the new blocks, chained onto the last known hash.
        first = len(hashes) * self.block_size
        new = hash_full_blocks(hashes[-1] if hashes else None, tokens(first, num_full * self.block_size),
                               self.block_size, extra, position_keys, first)
        table = entry.table
        for index, block_hash in enumerate(new, start=len(hashes)):
            if table[index] is not None:  # a block released before it was indexed is gone
                self.pool.cache_block(table[index], block_hash)
        hashes.extend(new)

    # --- invariants, for tests -------------------------------------------------------------------

    def check_invariants(self) -> None:
        if self.host is not None:
            host_refs = sum(len(_live(e.host_table)) for e in self._seqs.values() if e.host_table is not None)
            assert host_refs == self.host.pool.num_used_blocks == self.host.num_swapped, \
                "host blocks leaked or double-used (or a plan was not sealed)"
            assert all(b.ref_cnt in (0, 1) for b in self.host.pool.blocks), "a host block is shared"
            assert all(b.block_hash is None for b in self.host.pool.blocks if b.ref_cnt), "a swapped block is indexed"
        cached_free = [b for b in self.pool.blocks if b.ref_cnt == 0 and b.block_hash is not None]
        assert len(cached_free) == self.pool.num_cached_free, "cached-free count"
        for block_hash, block in self.pool.cached.items():
            assert block.block_hash == block_hash, f"{block}: index and block disagree"
        refs: dict[int, int] = {}
        for seq_id, entry in self._seqs.items():
            table, released = entry.table, entry.num_released
            if entry.host_table is not None:
                assert not table and not entry.hashes, f"seq {seq_id}: swapped out, yet holds device blocks"
                assert len(entry.host_table) == self.blocks_for(entry.num_slotted), f"seq {seq_id}: host table size"
                continue
            assert len(table) == self.blocks_for(entry.num_slotted), f"seq {seq_id}: table size"
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
