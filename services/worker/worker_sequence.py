"""The worker's copy of one sequence, kept between steps so that plans carry only deltas."""

from __future__ import annotations

from services.worker.host_block_tables import HostBlockTables
from services.worker.sampler import SamplingState
from shared.step_protocol import NewSequence, RunningSequence


class WorkerSequence:
    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], output_token_ids: list[int],
                 block_table: list[int], num_computed_tokens: int, params, vocab_size: int,
                 block_tables: HostBlockTables, num_siblings: int = 0, table_row: int | None = None):
        self.seq_id = seq_id
        self.index = index
        self.prompt_len = len(prompt_token_ids)
        self.token_ids = list(prompt_token_ids) + list(output_token_ids)
        # The block table twice: the list for per-token lookups, and a row of the worker's host tensor for
        # building batches (taken last below, so nothing that raises can leave it taken). Both change only here.
        self.block_table = list(block_table)
        self.block_tables = block_tables
        self.num_computed_tokens = num_computed_tokens
        self.params = params
        self.vocab_size = vocab_size
        self.sampling = SamplingState(params, prompt_token_ids, output_token_ids, vocab_size, stream_index=index)
        # n > 1: the siblings' first tokens come from this sequence's last prompt logits.
        self.sibling_sampling = [SamplingState(params, prompt_token_ids, [], vocab_size, stream_index=index + i)
                                 for i in range(1, num_siblings + 1)]
        # The token sampled in this sequence's latest step, until the next plan either appends it
        # (append_last_sample: that plan was made before the scheduler saw it) or sends it.
        self.last_sample: int | None = None
        self.table_row = block_tables.add(self.block_table) if table_row is None else table_row

    @classmethod
    def from_new(cls, new: NewSequence, vocab_size: int, block_tables: HostBlockTables) -> "WorkerSequence":
        return cls(new.seq_id, new.index, new.prompt_token_ids, new.output_token_ids, new.block_table,
                   new.num_computed_tokens, new.sampling_params, vocab_size, block_tables, new.num_siblings)

    def fork(self, child_seq_id: int, child_index: int) -> "WorkerSequence":
        """A child sharing everything so far; its own random stream from now on."""
        return WorkerSequence(child_seq_id, child_index, self.token_ids[:self.prompt_len],
                              self.token_ids[self.prompt_len:], self.block_table, self.num_computed_tokens,
                              self.params, self.vocab_size, self.block_tables,
                              table_row=self.block_tables.copy(self.table_row))

    def release(self) -> None:
        """Gives back the table's row: the worker dropped this sequence."""
        self.block_tables.release(self.table_row)

    def apply(self, delta: RunningSequence, step_id: int) -> None:
        own, self.last_sample = self.last_sample, None
        tokens = delta.new_token_ids
        if delta.append_last_sample:
            if own is None:
                raise ValueError(f"step {step_id}: sequence {self.seq_id} is told to append its last sample, "
                                 f"but it sampled nothing in its previous step")
            tokens = [*tokens, own]
        self.token_ids.extend(tokens)
        for token in tokens:
            self.sampling.append(token)
        if delta.new_block_table is not None:  # the row first: it refuses bad ids before changing anything
            self.block_tables.replace(self.table_row, delta.new_block_table)
            self.block_table = list(delta.new_block_table)
        elif delta.new_block_ids:
            self.block_tables.append(self.table_row, delta.new_block_ids)
            self.block_table.extend(delta.new_block_ids)
        if self.num_computed_tokens != delta.num_computed_tokens:
            raise ValueError(f"step {step_id}: sequence {self.seq_id} has {self.num_computed_tokens} computed "
                             f"tokens here, the scheduler says {delta.num_computed_tokens}")
