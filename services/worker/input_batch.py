"""Turns the scheduled sequences of one step into the model's flat input tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.worker.attention.metadata import AttentionMetadata


@dataclass
class ScheduledSequence:
    token_ids: list[int]  # the worker's copy of prompt + output
    block_table: list[int]
    num_computed_tokens: int  # tokens already in the cache
    num_scheduled_tokens: int  # tokens to compute now, the drafts included
    draft_token_ids: list[int] = field(default_factory=list)  # computed after the sequence's own tokens
    rope_offset: int = 0  # added to each token's index for its rotary position (M-RoPE's shift after images: mrope.py)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] rotary positions (M-RoPE steps with image tokens: [3, T], set by the worker)
    meta: AttentionMetadata


def build_model_inputs(batch: list[ScheduledSequence], block_size: int, device: torch.device,
                       block_tables: torch.Tensor | None = None) -> ModelInputs:
    """``block_tables`` ([len(batch), longest table] int32 on the host, padded with 0) saves rebuilding them
    from the lists: the worker keeps them (host_block_tables.py)."""
    query_lens = [s.num_scheduled_tokens for s in batch]
    seq_lens = [s.num_computed_tokens + s.num_scheduled_tokens for s in batch]
    input_ids: list[int] = []
    for s in batch:
        own = s.num_scheduled_tokens - len(s.draft_token_ids)
        input_ids.extend(s.token_ids[s.num_computed_tokens:s.num_computed_tokens + own])
        input_ids.extend(s.draft_token_ids)
    tables = block_tables if block_tables is not None else padded_block_tables(batch)
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    query_start_loc = torch.zeros(len(batch) + 1, dtype=torch.int64)
    torch.cumsum(query_lens_t, 0, out=query_start_loc[1:])
    # Token t of the flat batch belongs to sequence seq_of[t] and sits at its position positions[t].
    if min(query_lens) == max(query_lens) == 1:  # one token each (decodes): repeat_interleave took ~0.7 ms
        seq_of = torch.arange(len(batch))
    else:
        seq_of = torch.repeat_interleave(torch.arange(len(batch)), query_lens_t)
    starts = torch.tensor([s.num_computed_tokens for s in batch], dtype=torch.int64)
    positions = starts[seq_of] + torch.arange(len(input_ids)) - query_start_loc[seq_of]
    slot_mapping = tables[seq_of, positions // block_size].long() * block_size + positions % block_size
    if any(s.rope_offset for s in batch):
        positions = positions + torch.tensor([s.rope_offset for s in batch], dtype=torch.int64)[seq_of]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_start_loc=query_start_loc.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device),
        block_tables=tables.to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    return ModelInputs(torch.tensor(input_ids, dtype=torch.int64).to(device), positions.to(device), meta)


def padded_block_tables(batch: list[ScheduledSequence]) -> torch.Tensor:
    """``[len(batch), longest table]`` int32, padded with 0, from the lists."""
    width = max(len(s.block_table) for s in batch)
    return torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in batch], dtype=torch.int32)
