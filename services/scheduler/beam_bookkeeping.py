"""Beam search's side of a step's result: each beam reports its candidates to its BeamGroup
(beam_search.py, which decides), and once the group decides, this carries the decision out on the
sequences: a continued beam takes its token, a beam continued more than once forks (sharing every
block), a beam nobody continues ends, and a finished search ends them all with the best hypotheses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from services.scheduler.beam_search import BeamStep, Hypothesis
from services.scheduler.sequence import Sequence, SequenceStatus, SequenceUpdate
from shared.step_protocol import SequenceOutput

if TYPE_CHECKING:
    from services.scheduler.scheduler import Scheduler


class BeamBookkeeping:
    def __init__(self, scheduler: Scheduler, new_seq_id: Callable[[], int] | None):
        self.scheduler = scheduler  # ends and forks sequences (its queues and blocks)
        self.new_seq_id = new_seq_id  # allocates ids for beams that fork
        self._spawned: list[Sequence] = []  # beams forked since take_spawned: the engine registers them

    def take_spawned(self) -> list[Sequence]:
        spawned, self._spawned = self._spawned, []
        return spawned

    def report(self, seq: Sequence, out: SequenceOutput) -> list[SequenceUpdate]:
        """A beam's step result; the updates (the final ones, once the search is over)."""
        if out.token_id is None or out.logprobs is None:
            return []  # mid-prefill
        candidates = list(zip(out.logprobs.top_token_ids, out.logprobs.top_logprobs))
        step = seq.beam_group.report(seq.seq_id, candidates)
        return [] if step is None else self._apply(seq, step)

    def _apply(self, reporter: Sequence, step: BeamStep) -> list[SequenceUpdate]:
        group, finish = reporter.beam_group, self.scheduler.finish
        live = {s.seq_id: s for s in reporter.siblings if s.seq_id in group.beams}
        if step.done:
            for seq in live.values():
                finish(seq, SequenceStatus.FINISHED_STOPPED)
            return [_final_update(reporter, i, hyp) for i, hyp in enumerate(group.best(reporter.params.n))]
        # Forks first, while every parent still holds only its old tokens; then the tokens go on.
        targets, used = [], set()
        for c in step.continuations:
            parent = live[c.parent_seq_id]
            target = parent if parent.seq_id not in used else self._fork_beam(parent)
            used.add(parent.seq_id)
            targets.append(target)
        for c, target in zip(step.continuations, targets):
            target.output_token_ids.append(c.token_id)
        for seq in live.values():
            if seq.seq_id not in used:  # a beam nobody continues: its blocks go back now
                finish(seq, SequenceStatus.FINISHED_ABORTED)
        group.advance(step.continuations, [t.seq_id for t in targets])
        return []

    def _fork_beam(self, parent: Sequence) -> Sequence:
        child = Sequence(self.new_seq_id(), parent.request, len(parent.siblings), parent.max_output_tokens,
                         parent.arrival)
        child.output_token_ids = list(parent.output_token_ids)
        child.worker_params, child.beam_group, child.siblings = parent.worker_params, parent.beam_group, parent.siblings
        parent.siblings.append(child)
        self._spawned.append(child)
        if parent.status is SequenceStatus.RUNNING and parent.known_to_worker:
            self.scheduler.fork(parent, child)
        else:  # the parent is waiting or swapped: the child recomputes on its own
            self.scheduler.wait_first(child)
        return child


def _final_update(reporter: Sequence, index: int, hyp: Hypothesis) -> SequenceUpdate:
    update = SequenceUpdate(reporter, index)
    update.new_token_ids = list(hyp.token_ids)
    update.new_logprobs = list(hyp.positions)
    update.finish_reason = "stop" if hyp.stopped else "length"
    update.stop_reason = hyp.token_ids[-1] if hyp.stopped and hyp.token_ids[-1] in reporter.params.stop_token_ids \
        else None
    return update
