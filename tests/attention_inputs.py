"""Attention metadata for hand-made batches, shared by the model and attention tests."""

from __future__ import annotations

import dataclasses

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


def with_image_spans(meta: AttentionMetadata, generator: torch.Generator) -> AttentionMetadata:
    """The metadata with key limits for images that attend both ways (Gemma 3's): in each sequence with several new
    tokens, up to two spans ending among them (one may start among the cached tokens, as after a prefix-cache hit
    inside an image), whose new tokens each see to their span's end."""
    limits = []
    for query_len, context_len in zip(meta.query_lens_cpu, meta.seq_lens_cpu):
        first = context_len - query_len
        own = list(range(first, context_len))
        if query_len >= 2:
            for _ in range(2):
                end = first + 1 + int(torch.randint(1, query_len, (1,), generator=generator))
                start = max(0, end - int(torch.randint(2, query_len + 3, (1,), generator=generator)))
                for position in range(max(start, first), end):
                    if own[position - first] == position:  # (spans that overlap: the first drawn keeps its tokens)
                        own[position - first] = end - 1
        limits += own
    return dataclasses.replace(meta, key_limits=torch.tensor(limits, dtype=torch.int32))
