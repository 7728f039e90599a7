"""A step's result applied to the sequences (vLLM's Scheduler.update_from_output): computed tokens
count, full blocks join the prefix cache, blocks behind the window go back, sampled and accepted
tokens are appended and checked for a stop (stop_checks.py), n > 1 siblings fork from their parent's
first sample, drafts are accepted (draft_acceptance.py), beams report (beam_bookkeeping.py), and
embeddings end their requests (pooling_results.py). Ending and forking sequences is the
scheduler's: this calls it for both.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.beam_bookkeeping import BeamBookkeeping
from services.scheduler.draft_acceptance import DraftAcceptance
from services.scheduler.pooling_results import embedding_update
from services.scheduler.sequence import Sequence, SequenceStatus, SequenceUpdate
from services.scheduler.stop_checks import Stop, stop_for
from shared.step_protocol import PositionLogprobs, Sample, SequenceOutput, StepResult

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: tuple[int, ...], max_model_len: int,
                 drafts: DraftAcceptance, new_seq_id: Callable[[], int] | None):
        self.scheduler = scheduler  # its queues, blocks and request stats; it ends and forks sequences
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.drafts = drafts
        self.beams = BeamBookkeeping(scheduler, new_seq_id)

    def update_from_output(self, scheduled: dict[int, int], result: StepResult,
                           seqs: dict[int, Sequence]) -> list[SequenceUpdate]:
        """Advance the scheduled sequences by the step's result; the updates for the front end."""
        # When its tokens came, for the request's times (found inline: this runs for every token).
        request_stats = self.scheduler.request_stats
        now, times_of, times_get = time.monotonic(), request_stats.times_of, request_stats.times.get
        self._count_computed(scheduled, result, seqs)
        updates = []
        for out in result.outputs:
            seq = seqs.get(out.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # finished or aborted while the step ran
            if out.embedding is not None:
                updates.append(self._finish_pooling(seq, out.embedding))
                continue
            if out.token_id is not None:
                _resolve_placeholder(seq)
                times = times_get(out.seq_id) or times_of(out.seq_id)
                if times.first_token is None:
                    times.first_token = now
                times.last_token = now
            if out.error:
                updates.append(self._fail_request(seq, out.error))
                continue
            if seq.beam_group is not None:
                updates.extend(self.beams.report(seq, out))
                continue
            # Siblings fork before the parent's token is appended; their updates go after the
            # parent's, which carries the prompt logprobs (the front ends send them first).
            forked = self._fork_siblings(seq, out.siblings) if out.siblings else []
            update = SequenceUpdate(seq)
            if out.prompt_logprobs:
                _take_prompt_logprobs(seq, out, update)
            if out.token_id is not None:
                self._append_output(seq, out, update)
            updates.append(update)
            updates.extend(forked)
        return updates

    def _count_computed(self, scheduled: dict[int, int], result: StepResult, seqs: dict[int, Sequence]) -> None:
        """The step's tokens are computed: index the blocks they filled, release those behind the window."""
        blocks = self.scheduler.blocks
        cache_full_blocks, release_behind_window = blocks.cache_full_blocks, blocks.release_blocks_behind_window
        # A sequence the worker failed (its adapter would not load) computed nothing: cache none of its blocks.
        failed = {out.seq_id for out in result.outputs if out.error} if self.scheduler.max_loras else ()
        # A pooling engine's mean or cls prompts never take hits: indexing their blocks would only evict others.
        for seq_id, num_tokens in scheduled.items():
            seq = seqs.get(seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.num_inflight_tokens -= num_tokens
                seq.num_computed_tokens += num_tokens
                # Every computed token is known: the placeholders of earlier steps are resolved.
                if seq_id not in failed and not (seq.whole_prompt and seq.request.pooling is not None):
                    cache_full_blocks(seq_id, seq.num_computed_tokens, seq.token_slice, seq.cache_extra,
                                      seq.image_keys)
                # Indexed first: a released block stays in the prefix cache. A step already in flight
                # starts at num_computed_tokens too, so it reads nothing released here.
                release_behind_window(seq_id, seq.num_computed_tokens)

    def _finish_pooling(self, seq: Sequence, embedding: list[float]) -> SequenceUpdate:
        """An embedding request's one output: its prompt is computed, and it is done."""
        update = embedding_update(seq, embedding)
        _resolve_placeholder(seq)
        self.scheduler.finish(seq, SequenceStatus.FINISHED_STOPPED)
        return update

    def _fail_request(self, seq: Sequence, error: str) -> SequenceUpdate:
        """The worker cannot go on with this sequence: its request ends, every sequence of it."""
        for sibling in [*seq.siblings, *seq.pending_siblings]:
            if not sibling.status.is_finished:
                self.scheduler.finish(sibling, SequenceStatus.FINISHED_ABORTED)
        update = SequenceUpdate(seq)
        update.finish_reason, update.error = "abort", error
        return update

    def _append_output(self, seq: Sequence, out: SequenceOutput, update: SequenceUpdate) -> None:
        """The accepted drafts (each one a computed token more), then the sampled token; a stop among
        them ends the sequence there. A sequence verifying drafts gives back the blocks of the rejected ones."""
        verified = bool(seq.inflight_drafts)
        if (verified or out.accepted_token_ids) and self._append_accepted(seq, out, update):
            return
        if self._append_token(seq, out.token_id, out.logprobs, update):
            return
        if verified:
            self._release_rejected_slots(seq)
        # Drafts continue the sequence as the worker knew it; with another step of it in flight they would not.
        seq.draft_token_ids = out.draft_token_ids if not seq.num_placeholders else []

    def _append_accepted(self, seq: Sequence, out: SequenceOutput, update: SequenceUpdate) -> bool:
        """Append the drafts the worker accepted; whether one of them ended the sequence."""
        accepted = self.drafts.take_accepted(seq, out)
        logprobs = out.accepted_logprobs or [None] * len(accepted)
        blocks = self.scheduler.blocks
        for token_id, position in zip(accepted, logprobs):
            _push_token(seq, token_id, position, update)
            seq.num_computed_tokens += 1  # the draft's KV, written in this step, is the token's
            # Indexed now: a stop at this token frees the blocks, which the prefix cache keeps if indexed.
            blocks.cache_full_blocks(seq.seq_id, seq.num_computed_tokens, seq.token_slice, seq.cache_extra,
                                     seq.image_keys)
            stop = stop_for(seq, token_id, self.eos_token_ids, self.max_model_len)
            if stop is not None:
                self._end(seq, stop, update)
                return True
        return False

    def _release_rejected_slots(self, seq: Sequence) -> None:
        """Blocks past the sequence's computed tokens held only rejected drafts: free them now. The
        worker cuts its copy of the table alike (the step protocol's rule), so nothing is sent."""
        blocks = self.scheduler.blocks
        if blocks.trim_slots(seq.seq_id, seq.num_computed_tokens):
            seq.num_blocks_sent = min(seq.num_blocks_sent, blocks.num_table_blocks(seq.seq_id))

    def _append_token(self, seq: Sequence, token_id: int, logprobs: PositionLogprobs | None,
                      update: SequenceUpdate) -> bool:
        """Append one sampled token; whether it ended the sequence."""
        _push_token(seq, token_id, logprobs, update)
        stop = stop_for(seq, token_id, self.eos_token_ids, self.max_model_len)
        if stop is None:
            return False
        self._end(seq, stop, update)
        return True

    def _end(self, seq: Sequence, stop: Stop, update: SequenceUpdate) -> None:
        self.scheduler.finish(seq, stop.status, stop.reason)
        update.finish_reason, update.stop_reason = seq.status.value, seq.stop_reason

    def _fork_siblings(self, parent: Sequence, samples: list[Sample]) -> list[SequenceUpdate]:
        """n > 1: the siblings start now, sharing every block of the parent's prompt."""
        updates = []
        for child, sample in zip(parent.pending_siblings, samples):
            if child.status.is_finished:
                continue
            self.scheduler.fork(parent, child)
            update = SequenceUpdate(child)
            self._append_token(child, sample.token_id, sample.logprobs, update)
            updates.append(update)
        parent.pending_siblings = []
        return updates


def _resolve_placeholder(seq: Sequence) -> None:
    if seq.num_placeholders == 0:
        raise ValueError(f"the worker sampled a token for sequence {seq.seq_id}, which was not due to sample")
    seq.num_placeholders -= 1


def _push_token(seq: Sequence, token_id: int, logprobs: PositionLogprobs | None, update: SequenceUpdate) -> None:
    seq.output_token_ids.append(token_id)
    update.new_token_ids.append(token_id)
    if logprobs is not None:
        update.new_logprobs.append(logprobs)


def _take_prompt_logprobs(seq: Sequence, out: SequenceOutput, update: SequenceUpdate) -> None:
    # Positions start at prompt index 1; a recomputed sequence sends them again: skip repeats.
    first_new = seq.num_prompt_logprobs + 1 - out.prompt_logprobs_start
    fresh = out.prompt_logprobs[max(0, first_new):]
    update.prompt_logprobs.extend(fresh)
    seq.num_prompt_logprobs += len(fresh)
