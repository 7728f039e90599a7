"""The worker's copy of one sequence, kept between steps so that plans carry only deltas."""

from __future__ import annotations

from services.worker.grammar import Grammars
from services.worker.host_block_tables import HostBlockTables
from services.worker.ngram_proposer import TokenHistory
from services.worker.sampler import SamplingState
from services.worker.pooler import PoolingState
from shared.lora import LoRARequest
from shared.multimodal import ImageInput
from shared.pooling import PoolingParams
from shared.step_protocol import NewSequence, RunningSequence


class WorkerSequence:
    def __init__(self, seq_id: int, index: int, prompt_token_ids: list[int], output_token_ids: list[int],
                 block_table: list[int], num_computed_tokens: int, params, vocab_size: int,
                 block_tables: HostBlockTables, num_siblings: int = 0, table_row: int | None = None,
                 keep_history: bool = False, grammars: Grammars | None = None, lora: LoRARequest | None = None,
                 pooling: PoolingParams | None = None, images: tuple[ImageInput, ...] = ()):
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
        self.grammars = grammars
        self.lora = lora  # the adapter its tokens run through; None: the base model
        self.images = images  # its prompt's images, whose features replace their placeholders (image_features.py)
        # An embedding request's: its prompt's states are pooled (pool_state holds its chunks so far), nothing sampled.
        self.pooling = pooling
        self.pool_state = PoolingState() if pooling is not None else None
        # Its adapter could not be loaded: its request has failed; later deltas (plans made before the
        # scheduler heard) are ignored until it is dropped.
        self.failed = False
        self.sampling = SamplingState(params, prompt_token_ids, output_token_ids, vocab_size, stream_index=index,
                                      grammar=self._grammar(output_token_ids))
        # n > 1: the siblings' first tokens come from this sequence's last prompt logits.
        self.sibling_sampling = [SamplingState(params, prompt_token_ids, [], vocab_size, stream_index=index + i,
                                               grammar=self._grammar([]))
                                 for i in range(1, num_siblings + 1)]
        # The token sampled in this sequence's latest step, until the next plan either appends it
        # (append_last_sample: that plan was made before the scheduler saw it) or sends it.
        self.last_sample: int | None = None
        # Speculative decoding: the drafts this step verifies after the sequence's own tokens (set
        # by each delta), how many of them the step rejected, and the tokens as an array for the
        # n-gram proposer's search (only when the worker speculates).
        self.draft_token_ids: list[int] = []
        self.num_rejected_drafts = 0
        self.history = TokenHistory(self.token_ids) if keep_history else None
        self.table_row = block_tables.add(self.block_table) if table_row is None else table_row

    def _grammar(self, output_token_ids: list[int]):
        """Structured outputs: the sequence's grammar after these tokens (None without)."""
        constraint = self.params.structured_outputs
        if constraint is None:
            return None
        if self.grammars is None:
            raise ValueError(f"sequence {self.seq_id} asks for structured outputs, which this worker cannot give")
        return self.grammars.for_sequence(constraint, output_token_ids)

    @property
    def constrained(self) -> bool:
        return self.sampling.grammar is not None

    @classmethod
    def from_new(cls, new: NewSequence, vocab_size: int, block_tables: HostBlockTables,
                 keep_history: bool = False, grammars: Grammars | None = None) -> "WorkerSequence":
        return cls(new.seq_id, new.index, new.prompt_token_ids, new.output_token_ids, new.block_table,
                   new.num_computed_tokens, new.sampling_params, vocab_size, block_tables, new.num_siblings,
                   keep_history=keep_history, grammars=grammars, lora=new.lora, pooling=new.pooling,
                   images=new.images)

    def fork(self, child_seq_id: int, child_index: int) -> "WorkerSequence":
        """A child sharing everything so far; its own random stream from now on."""
        child = WorkerSequence(child_seq_id, child_index, self.token_ids[:self.prompt_len],
                               self.token_ids[self.prompt_len:], self.block_table, self.num_computed_tokens,
                               self.params, self.vocab_size, self.block_tables,
                               table_row=self.block_tables.copy(self.table_row), grammars=self.grammars,
                               lora=self.lora, images=self.images)
        child.history = self.history.copy() if self.history is not None else None
        return child

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
        self._take_drafts(delta, len(self.token_ids) + len(tokens), step_id)
        self.token_ids.extend(tokens)
        for token in tokens:
            self.sampling.append(token)
        if self.history is not None:
            self.history.extend(tokens)
        if delta.new_block_table is not None:  # the row first: it refuses bad ids before changing anything
            self.block_tables.replace(self.table_row, delta.new_block_table)
            self.block_table = list(delta.new_block_table)
        elif delta.new_block_ids:
            self.block_tables.append(self.table_row, delta.new_block_ids)
            self.block_table.extend(delta.new_block_ids)
        if self.num_computed_tokens != delta.num_computed_tokens:
            raise ValueError(f"step {step_id}: sequence {self.seq_id} has {self.num_computed_tokens} computed "
                             f"tokens here, the scheduler says {delta.num_computed_tokens}")

    def finish_verification(self, num_tokens: int, block_size: int) -> None:
        """After a step that computed ``num_tokens`` (drafts included): only accepted drafts count as
        computed, and, as the scheduler does, the table keeps just the blocks the computed tokens fill."""
        self.num_computed_tokens += num_tokens - self.num_rejected_drafts
        if self.draft_token_ids:
            keep = -(-self.num_computed_tokens // block_size)
            if keep < len(self.block_table):
                self.block_tables.truncate(self.table_row, keep)
                del self.block_table[keep:]
            self.draft_token_ids, self.num_rejected_drafts = [], 0

    def _take_drafts(self, delta: RunningSequence, num_tokens: int, step_id: int) -> None:
        """Drafts follow every one of the sequence's ``num_tokens`` tokens: the step computes them all,
        then samples. Checked before the delta changes anything."""
        drafts, self.num_rejected_drafts = delta.draft_token_ids, 0
        if drafts and (delta.num_computed_tokens + delta.num_scheduled_tokens != num_tokens + len(drafts)
                       or not 0 <= min(drafts) <= max(drafts) < self.vocab_size):
            raise ValueError(f"step {step_id}: sequence {self.seq_id}'s {len(drafts)} draft tokens do not follow "
                             f"its {num_tokens} tokens within {delta.num_scheduled_tokens} scheduled ones, "
                             f"or leave the vocabulary")
        self.draft_token_ids = drafts
