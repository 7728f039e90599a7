"""Draft tokens from a smaller model run beside the target (vLLM's "draft_model" method).

The draft keeps a KV cache of its own over the same block ids: block b of its pool holds the draft's
K/V of the tokens whose target K/V are in block b. So the scheduler's block tables, prefix-cache
hits, copy-on-write copies and swaps serve both caches (the worker moves the draft's blocks with the
target's), and the draft's cache is right wherever the target's is: for every computed token.

After each step, once the target has verified and sampled, the draft computes what the step kept
(the sequence's own tokens and its accepted drafts) plus the token just sampled; from that token's
logits it takes its greedy choice, feeds it back for the next, and so on, k tokens in all. Greedy
drafts are what exact-match verification accepts most often (a draft is kept when the target
samples it), and they keep seeded outputs reproducible.

The sampled token and the proposals have no blocks yet (the scheduler allocates a sequence's blocks
for the tokens it schedules): they go to scratch blocks past the end of the draft's pool, a run of
ceil(k / block_size) per proposing sequence for max_num_seqs sequences (their memory comes out of the
KV budget before it is divided into blocks; in the rare step with more sequences sampling, forked
siblings, the rest propose nothing), and are computed again once the target has scheduled them. A
write into the free slots of a sequence's last real block is harmless: those slots hold no computed
token, and the catch-up pass rewrites them before anything reads them as context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.block_moves import whole_pool
from services.worker.host_block_tables import HostBlockTables
from services.worker.input_batch import ScheduledSequence, build_model_inputs
from services.worker.kv_cache import allocate_host_pool, allocate_kv_pools
from services.worker.model_loader import load_model
from services.worker.models.llama import LlamaForCausalLM
from services.worker.model_config import ModelConfig
from services.worker.sampler import greedy_tokens


@dataclass
class DraftModel:
    model: LlamaForCausalLM
    config: ModelConfig


def load_draft_model(path: str, target: ModelConfig, max_model_len: int, dtype: torch.dtype,
                     device: torch.device) -> DraftModel:
    """The draft's weights, after checking it can propose for this target."""
    config = ModelConfig.from_model_dir(path)
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model at {path} has a vocabulary of {config.vocab_size} tokens, the target "
                         f"{target.vocab_size}: a draft must share the target's tokenizer")
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model at {path} handles {config.max_position_embeddings} positions, fewer than "
                         f"the context length {max_model_len}: lower max_model_len")
    model, config = load_model(Path(path), dtype, device, max_model_len=max_model_len)
    return DraftModel(model, config)


class DraftModelProposer:
    needs_history = False  # it reads tokens from the sequences themselves

    def __init__(self, draft: DraftModel, num_tokens: int, attention_backend: type, num_blocks: int,
                 num_host_blocks: int, block_size: int, max_num_seqs: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device):
        self.draft = draft
        self.num_tokens = num_tokens
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        # A proposing sequence writes at most num_tokens positions past its computed ones.
        self.scratch_per_seq = -(-num_tokens // block_size)
        self.max_proposing = max_num_seqs  # a batch holds more only briefly (forked siblings): the rest wait a step
        self.first_scratch = num_blocks
        pools = allocate_kv_pools(draft.config, num_blocks + self.num_scratch_blocks(num_tokens, block_size, max_num_seqs),
                                  block_size, dtype, device)
        self.kv_pool = whole_pool(pools)  # [layers, 2, blocks + scratch, block_size, kv_heads, head_dim]
        self.host_pool = allocate_host_pool(draft.config, num_host_blocks, block_size, dtype)
        self.attention = attention_backend(pools, draft.model.attention_spec())

    @staticmethod
    def num_scratch_blocks(num_tokens: int, block_size: int, max_num_seqs: int) -> int:
        return max_num_seqs * -(-num_tokens // block_size)

    def propose_batch(self, seqs: list, computed_before: list[int], new_tokens: list[list[int]],
                      tables: HostBlockTables, wanted: bool = True) -> list[list[int]]:
        """Drafts for each sequence that sampled (new_tokens: its accepted drafts, then the sampled token),
        unless not ``wanted``; every sequence's kept tokens go into the draft's cache either way."""
        proposing = [i for i, new in enumerate(new_tokens)  # (a grammar's matcher verifies no drafts)
                     if wanted and new and self._room(seqs[i]) > 0 and not seqs[i].constrained]
        proposing = proposing[:self.max_proposing]
        block_tables = self._tables_with_scratch(seqs, proposing, tables)
        drafts = self._catch_up(seqs, computed_before, new_tokens, proposing, block_tables)
        for step in range(1, self.num_tokens):
            going_on = [j for j, i in enumerate(proposing) if len(drafts[j]) == step and self._room(seqs[i]) > step]
            if not going_on:
                break
            batch = [ScheduledSequence(seqs[proposing[j]].token_ids, [], seqs[proposing[j]].num_computed_tokens + step,
                                       1, [drafts[j][-1]]) for j in going_on]
            rows = torch.tensor([proposing[j] for j in going_on], dtype=torch.int64)
            for j, token in zip(going_on, self._greedy(batch, block_tables.index_select(0, rows), None)):
                drafts[j].append(token)
        out: list[list[int]] = [[] for _ in seqs]
        for j, i in enumerate(proposing):
            out[i] = drafts[j]
        return out

    def _room(self, seq) -> int:
        """Drafts the scheduler could grant after the token just sampled (at position num_computed_tokens):
        with them accepted and one more sampled, the sequence stays within the context."""
        return min(self.num_tokens, self.max_model_len - 2 - seq.num_computed_tokens)

    def _catch_up(self, seqs, computed_before, new_tokens, proposing, block_tables) -> list[list[int]]:
        """The tokens each sequence kept this step, and the sampled token of each proposing one; the
        draft's greedy next token after each sampled one."""
        proposes = set(proposing)
        batch = []
        for i, seq in enumerate(seqs):
            accepted = new_tokens[i][:-1]  # not yet in the sequence's own tokens (the next plan brings them)
            own = seq.num_computed_tokens - computed_before[i] - len(accepted)
            tail = new_tokens[i] if i in proposes else accepted  # the sampled token only where it has a slot
            batch.append(ScheduledSequence(seq.token_ids, [], computed_before[i], own + len(tail), tail))
        return [[token] for token in self._greedy(batch, block_tables, proposing)]

    def _greedy(self, batch: list[ScheduledSequence], block_tables: torch.Tensor, rows: list[int] | None) -> list[int]:
        """One draft forward pass; the argmax after the last token of each sequence in ``rows`` (all: None)."""
        inputs = build_model_inputs(batch, self.block_size, self.device, block_tables)
        ends = inputs.meta.query_start_loc[1:].long() - 1
        if rows is not None:
            ends = ends[torch.tensor(rows, dtype=torch.int64, device=ends.device)]
        # The last layer only for those rows (services/worker/output_rows.py), one at least: no kernel meets an
        # empty input, and the pass still fills the cache. (Every row: no selection to make.)
        output_rows = ends if len(ends) else ends.new_tensor([len(inputs.input_ids) - 1])
        hidden = self.draft.model(inputs.input_ids, inputs.positions, self.attention, inputs.meta,
                                  output_rows=None if len(output_rows) == len(inputs.input_ids) else output_rows)
        if not len(ends):
            return []
        return greedy_tokens(self.draft.model.compute_logits(hidden)).tolist()

    def _tables_with_scratch(self, seqs, proposing: list[int], tables: HostBlockTables) -> torch.Tensor:
        """The batch's block tables, each proposing sequence's followed by its scratch blocks."""
        base = tables.gather([seq.table_row for seq in seqs])
        lengths = [len(seqs[i].block_table) for i in proposing]
        width = max([base.shape[1], *(n + self.scratch_per_seq for n in lengths)])
        padded = torch.zeros(len(seqs), width, dtype=torch.int32)
        padded[:, :base.shape[1]] = base
        for j, (i, length) in enumerate(zip(proposing, lengths)):
            first = self.first_scratch + j * self.scratch_per_seq
            padded[i, length:length + self.scratch_per_seq] = torch.arange(first, first + self.scratch_per_seq)
        return padded
