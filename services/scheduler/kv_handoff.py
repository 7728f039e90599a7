"""Prefill/decode disaggregation's bookkeeping: the KV a prefill stage holds for the decode stage.

A sequence whose prompt a prefill stage computed (and whose first token it sampled) is handed to a decode
stage with a KVSource: the prefill worker's address and the blocks there. Those blocks stay held on the
prefill stage until the decode step whose plan pulls them has come back, whether the pull worked or not
(if it failed, the decode stage recomputes the sequence), or until the sequence ends before any plan pulled
them. Then they go back to the prefill stage's pool, where the prefix cache keeps them.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager
from services.scheduler.sequence import Sequence


@dataclass(frozen=True, slots=True)
class KVSource:
    """Where a handed-off sequence's computed KV is."""
    address: str  # the prefill worker's (its ReadBlocks)
    block_ids: tuple[int | None, ...]  # the prefill stage's table (None: released behind the window)
    num_tokens: int  # tokens whose KV those blocks hold: all the sequence's but the one just sampled


class Handoffs:
    """The sequences whose KV a prefill stage holds, and the decode steps pulling it."""

    def __init__(self):
        self._held: dict[int, tuple[Sequence, BlockManager]] = {}  # seq id -> (sequence, its prefill blocks)
        self._pulled: dict[tuple[int, int], list[int]] = {}  # (decode stage, step id) -> seq ids its plan pulls

    def __len__(self) -> int:
        return len(self._held)

    def hand_off(self, seq: Sequence, blocks: BlockManager, address: str) -> None:
        """The prefill stage's blocks of ``seq`` stay held for the decode stage; the sequence carries where."""
        seq.kv_source = KVSource(address, tuple(_table(blocks, seq)), seq.num_computed_tokens)
        self._held[seq.seq_id] = (seq, blocks)

    def planned(self, stage: int, step_id: int, seq_ids: list[int]) -> None:
        """The decode stage's step ``step_id`` pulls these sequences' blocks."""
        pulled = [seq_id for seq_id in seq_ids if seq_id in self._held]
        if pulled:
            self._pulled[(stage, step_id)] = pulled

    def step_done(self, stage: int, step_id: int) -> None:
        """That step has come back: the blocks it pulled are released (a failed pull's sequence is recomputed)."""
        for seq_id in self._pulled.pop((stage, step_id), ()):
            self._release(seq_id)

    def dropped(self, seq: Sequence) -> None:
        """The sequence ended (aborted, or stopped) on the decode stage: its blocks go back unless a step in
        flight is pulling them (then when it comes back)."""
        if seq.seq_id in self._held and not any(seq.seq_id in ids for ids in self._pulled.values()):
            self._release(seq.seq_id)

    def _release(self, seq_id: int) -> None:
        seq, blocks = self._held.pop(seq_id)
        blocks.free(seq_id)
        seq.kv_source = None


def _table(blocks: BlockManager, seq: Sequence) -> list[int | None]:
    """The sequence's prefill table, with its released entries as None (an id 0 may be a real block)."""
    released = blocks.num_released_blocks(seq.seq_id)
    table = blocks.block_table(seq.seq_id)
    return [None] * released + table[released:]
