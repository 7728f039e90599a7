"""Physical KV blocks: reference counts, the free queue and the prefix-cache index.

A block is in exactly one state: free (count 0, not indexed), in use (count >= 1),
or cached-free (count 0, on the free queue, but still indexed by its hash so a
later request with the same prefix can take it back). Eviction is lazy: a
cached-free block loses its hash only when the free queue hands it out again.

Eviction order of the free queue: blocks are taken from the head and
returned to the tail, so the block freed longest ago is reused first (LRU).
A sequence frees its blocks last-to-first, so when prefix caching keeps
freed blocks indexed, the deeper blocks of a prefix sit nearer the head and
are evicted before the blocks they depend on.
"""

from __future__ import annotations

from collections.abc import Callable

from services.scheduler.cache_digest import CacheDigest


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set once the block is full and indexed
        # Links of the doubly linked free queue; None when not on it.
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeBlockQueue:
    """A doubly linked list of blocks with O(1) pop from the head, append, and removal anywhere.

    Removal from the middle is what a prefix-cache hit on a cached-free block needs;
    a deque cannot do it in O(1).
    """

    def __init__(self, blocks: list[KVCacheBlock]):
        self._head = KVCacheBlock(-1)  # sentinels: never handed out
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not on the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def block_ids(self) -> list[int]:
        """Head to tail, for tests and debugging."""
        ids, block = [], self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every physical block; hands them out and takes them back by reference count."""

    def __init__(self, num_blocks: int, enable_caching: bool = False,
                 on_evict: Callable[[int, bytes], None] | None = None):
        """``on_evict(block_id, block_hash)``: told of each cached block as it loses its prefix, while the
        block still holds it (the host tier keeps a copy)."""
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_caching = enable_caching
        self.cached: dict[bytes, KVCacheBlock] = {}  # block hash -> the block holding that prefix
        self.num_cached_free = 0  # cached-free blocks: count 0, still indexed
        self.on_evict = on_evict
        self.digest: CacheDigest | None = None  # set while gateways are told what the cache holds (cache_digest.py)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def allocate(self, count: int) -> list[KVCacheBlock]:
        """Fresh blocks from the head of the free queue; a cached-free one is evicted on the way."""
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(count)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the tail of the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block} freed more often than allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free += 1

    # --- prefix cache ----------------------------------------------------------------------------

    def cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference to cache hits; a cached-free block leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
                self.num_cached_free -= 1
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Index a block that just became full. If another block already holds this prefix
        (two requests computed it at once), the index keeps that one and this block stays plain."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block
        if self.digest is not None:
            self.digest.indexed(block_hash)

    def forget(self, block: KVCacheBlock) -> None:
        """Unindex a block (its contents are not its prefix's): it stays with whoever holds it, as a plain block."""
        if block.block_hash is not None:
            self._unindex(block)
            if block.ref_cnt == 0:
                self.num_cached_free -= 1

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.on_evict is not None:
                self.on_evict(block.block_id, block.block_hash)
            self._unindex(block)
            self.num_cached_free -= 1

    def _unindex(self, block: KVCacheBlock) -> None:
        del self.cached[block.block_hash]
        if self.digest is not None:
            self.digest.unindexed(block.block_hash)
        block.block_hash = None
