"""Instruments the scheduler's release of blocks behind the sliding window (BlockManager), in tests."""

from __future__ import annotations

from pagedserve import LLM


def on_release(llm: LLM, action) -> list[int]:
    """Calls ``action(block_ids)`` with the blocks of each release; returns a running count (one entry)."""
    blocks, count = llm.engine.scheduler.blocks, [0]
    release = blocks.release_blocks_behind_window

    def instrumented(seq_id: int, num_computed_tokens: int) -> int:
        start = blocks.num_released_blocks(seq_id)
        table = blocks.block_table(seq_id)
        released = release(seq_id, num_computed_tokens)
        if released:
            action(table[start:start + released])
            count[0] += released
        return released

    blocks.release_blocks_behind_window = instrumented
    return count


def count_releases(llm: LLM) -> list[int]:
    """A running count (one entry) of the blocks the scheduler frees behind the window."""
    return on_release(llm, lambda block_ids: None)


def poison_released_blocks(llm: LLM, value: float) -> list[int]:
    """Fill every block the scheduler releases with ``value`` in the (in-process) worker's pool: a kernel
    that read one within a window would go wrong. Returns the running count of released blocks."""
    pool = llm.engine.executor.worker.kv_pool

    def poison(block_ids: list[int]) -> None:
        pool[:, :, block_ids] = value

    return on_release(llm, poison)


def preempted_or_released(llm: LLM, released: list[int], block_size: int, small_blocks: int = 8) -> bool:
    """What a test meant to force preemption can ask: with a window on every layer, blocks that left it
    are freed as sequences go, and at small block sizes the smallest pool admission allows (a request
    must fit whole) no longer preempts; then the window must have freed blocks instead."""
    if llm.engine.info.kv_window is not None and block_size <= small_blocks:
        return released[0] > 0
    return llm.stats()["num_preemptions"] > 0
