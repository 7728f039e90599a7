"""Which of a step's token rows its outputs read, so that the model's last layer computes only those.

Every row of a step goes through every layer's attention, whose K and V the cache keeps; but past the last
layer's attention a row matters only if an output reads its hidden state: a sampled token's (with drafts, the
last ``len(drafts) + 1`` rows of its sequence) or a prompt logprob's. A prompt is sampled at its last row only,
so the last layer's output projection, MLP and the final norm run on one row of a prompt's final chunk and on
none of an earlier chunk's. On the bench workload (8 layers; two thirds of the tokens are prompt tokens) that is
5.5 % of the projections' multiply-adds (benchmarks/RESULTS.md). Each row's states are computed as before, up to
the rounding of products of another row count: nothing in those layers mixes rows.
"""

from __future__ import annotations

import torch

from services.worker.worker_sequence import WorkerSequence

# (batch index, sequence, first step row, count): the rows of a sequence's prompt logprobs
PromptRows = tuple[int, WorkerSequence, int, int]


def rows_read(query_start: list[int], prompt_rows: list[PromptRows], sampling: list[tuple[int, WorkerSequence]]
              ) -> list[int]:
    """The step rows, ascending, that the outputs read: ``prompt_rows``' and, for each sampling ``(batch index,
    sequence)``, its last ``len(sequence.draft_token_ids) + 1`` rows (sequence i's rows run from
    ``query_start[i]`` up to ``query_start[i + 1]``)."""
    rows = set()
    for _, _, first, count in prompt_rows:
        rows.update(range(first, first + count))
    for i, seq in sampling:
        end = query_start[i + 1]
        rows.update(range(end - len(seq.draft_token_ids) - 1, end))
    return sorted(rows)


class StepHidden:
    """The final hidden states of the rows of a step that the model computed, addressed by step row."""

    def __init__(self, states: torch.Tensor, rows: list[int] | None):
        """``states [len(rows), hidden]``: step rows ``rows`` in that order (None: every row, ``states [T, hidden]``)."""
        self.states = states
        self._index = None if rows is None else {row: i for i, row in enumerate(rows)}

    def take(self, rows: list[int]) -> torch.Tensor:
        """``[len(rows), hidden]``: the states of step rows ``rows`` (each one the model computed)."""
        if self._index is None:
            return self.states[rows]
        return self.states[[self._index[row] for row in rows]]
