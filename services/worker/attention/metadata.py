"""What the attention layers need to know about one forward pass over a mixed batch.

The batch is flattened: the scheduled tokens of every sequence, one sequence
after another. Each sequence's context is its cached tokens (already in the
KV pool, read through its block table) followed by its new tokens; the new
tokens attend causally among themselves, except where ``key_limits`` lets a
token see further: the placeholders of an image that attends both ways (Gemma
3's) each see the whole image, which a step computes whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: block * block_size + offset where each new token's K/V goes
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: sequence i's new tokens are [loc[i], loc[i+1])
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32: physical block ids, padded with 0
    query_lens_cpu: list[int]  # per sequence, number of new tokens (host copy for Python loops)
    seq_lens_cpu: list[int]  # per sequence, context length after this step (host copy)
    max_query_len: int  # the longest query in the batch
    max_seq_len: int  # the longest context in the batch
    # [num_tokens] int32: the last key position each new token sees, where some see past their own; None: causal.
    key_limits: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
