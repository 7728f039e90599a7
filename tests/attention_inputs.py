"""Attention metadata for hand-made batches, shared by the model and attention tests."""

from __future__ import annotations

import torch

from services.worker.attention.metadata import AttentionMetadata


def build_metadata(seqs: list[tuple[list[int], int, int]], block_size: int) -> AttentionMetadata:
    """Metadata for sequences given as (block table, tokens already cached, new tokens)."""
    slots, starts, seq_lens, query_lens = [], [0], [], []
    for table, cached, new in seqs:
        total = cached + new
        assert len(table) == -(-total // block_size)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, total)]
        starts.append(starts[-1] + new)
        seq_lens.append(total)
        query_lens.append(new)
    width = max(len(table) for table, _, _ in seqs)
    tables = [table + [0] * (width - len(table)) for table, _, _ in seqs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens))
