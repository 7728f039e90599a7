"""Speculative decoding's results: which of a sequence's drafts the worker accepted, checked against
the drafts it was sent, and counted as vLLM's spec_decode metrics count them.

Granting drafts is planning (Scheduler, rule 3); this is the other half, when the step's result comes.
"""

from __future__ import annotations

from services.scheduler.sequence import Sequence
from shared.step_protocol import SequenceOutput


class DraftAcceptance:
    def __init__(self):
        self.num_drafts = 0  # sequence-steps that verified drafts
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # of those, the ones the worker accepted
        self.num_accepted_per_pos: list[int] = []  # accepted drafts by their place in the draft (vLLM's)

    def take_accepted(self, seq: Sequence, out: SequenceOutput) -> list[int]:
        """The drafts the step verified leave the sequence; returns those the worker accepted, which must
        be a prefix of them (ValueError otherwise: a worker out of step with its plans)."""
        drafts, seq.inflight_drafts = seq.inflight_drafts, []
        accepted = out.accepted_token_ids
        if accepted != drafts[:len(accepted)]:
            raise ValueError(f"the worker accepted tokens {accepted} for sequence {seq.seq_id}, not a prefix of the "
                             f"drafts {drafts} it was sent")
        if drafts:
            self._count(len(drafts), len(accepted))
        return accepted

    def _count(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_per_pos
        if len(per_pos) < num_drafts:
            per_pos.extend([0] * (num_drafts - len(per_pos)))
        for position in range(num_accepted):  # accepted drafts are a prefix: positions 0 .. num_accepted - 1
            per_pos[position] += 1
