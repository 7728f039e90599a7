"""Beam search over the paged engine: beams are sequences; they fork by sharing blocks and die by
freeing them. This module only decides; the scheduler carries the decisions out.

The selection rule is transformers' (v5), so outputs match `generate(num_beams=B)`: each step
takes the K = max(2, 1 + number of stop tokens) * B best continuations over all live beams
(beam score + the token's log-probability); the best B that do not stop become the next beams;
those among the first B that stop (a stop token, or the length limit) become finished
hypotheses scored sum / generated_length ** length_penalty, of which the best B are kept. The
search ends when B hypotheses are finished and early_stopping is True, when no running beam can
still beat the worst of them (early_stopping False: judged at the current length; "never":
at the longest length when length_penalty > 0), or when every continuation hits the limit.

With `logprobs=k`, a beam carries each of its tokens' log-probability, its rank among its parent's
candidates (the top of the raw distribution, best first) and the k best of them, as a sampled
sequence's logprobs would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.step_protocol import PositionLogprobs

NEG_INF = -1.0e9
_LENGTH_FACTOR_RANGE = (1e-300, 1e300)  # length ** penalty kept finite and non-zero: extreme penalties rank


@dataclass
class Beam:
    seq_id: int  # the sequence carrying this beam
    score: float  # sum of its tokens' log-probabilities
    token_ids: list[int]  # generated so far
    positions: list[PositionLogprobs] = field(default_factory=list)  # one per token, when logprobs were asked for


@dataclass(order=True)
class Hypothesis:
    score: float  # normalised by length
    token_ids: list[int] = field(compare=False)
    logprob_sum: float = field(compare=False)
    stopped: bool = field(compare=False)  # ended on a stop token (else by length)
    positions: list[PositionLogprobs] = field(compare=False, default_factory=list)


@dataclass(frozen=True)
class Continuation:
    parent_seq_id: int  # the beam it extends
    token_id: int
    score: float
    position: PositionLogprobs | None = None  # the token's logprobs, when asked for


@dataclass
class BeamStep:
    """What to do with the sequences after one step of the search."""

    continuations: list[Continuation]  # the next beams, best first
    done: bool  # the search is over: drop every beam


class BeamGroup:
    def __init__(self, beam_width: int, stop_token_ids: set[int], max_new_tokens: int, length_penalty: float,
                 early_stopping: bool | str, num_logprobs: int | None = None):
        self.width = beam_width
        self.stop_token_ids = stop_token_ids
        self.max_new_tokens = max_new_tokens
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.num_candidates = max(2, 1 + len(stop_token_ids)) * beam_width
        self.num_logprobs = num_logprobs  # k of logprobs=k; None: no logprobs kept
        self.beams: dict[int, Beam] = {}
        self.finished: list[Hypothesis] = []  # at most `width`, best first
        self.improvable = True  # transformers' early-stop heuristic, still unsatisfied
        self._pending: dict[int, list[tuple[int, float]]] = {}  # seq id -> its (token, logprob) candidates

    def start(self, seq_id: int) -> None:
        self.beams = {seq_id: Beam(seq_id, 0.0, [])}

    @property
    def generated(self) -> int:
        return len(next(iter(self.beams.values())).token_ids)

    def has_reported(self, seq_id: int) -> bool:
        """This beam's candidates for the current step are in; it waits for its siblings'."""
        return seq_id in self._pending

    def report(self, seq_id: int, candidates: list[tuple[int, float]]) -> BeamStep | None:
        """A beam's best next tokens; once every live beam has reported, the step's decision."""
        if seq_id not in self.beams or seq_id in self._pending:
            return None  # a dead beam, or a repeat after a recompute
        self._pending[seq_id] = candidates
        if len(self._pending) < len(self.beams):
            return None
        return self._select()

    def _select(self) -> BeamStep:
        ranked = sorted(((beam.score + lp, beam.seq_id, token, rank) for beam in self.beams.values()
                         for rank, (token, lp) in enumerate(self._pending[beam.seq_id], start=1)),
                        key=lambda c: -c[0])[:self.num_candidates]
        length = self.generated + 1
        at_limit = length >= self.max_new_tokens
        continuations = [Continuation(seq_id, token, score, self._position(seq_id, rank))
                         for score, seq_id, token, rank in ranked
                         if token not in self.stop_token_ids and not at_limit][:self.width]
        self._collect_finished(ranked[:self.width], length, at_limit)
        self._pending = {}
        self.improvable = self._still_improvable(continuations, length)
        full = len(self.finished) == self.width
        done = not self.improvable or (full and self.early_stopping is True) or not continuations
        return BeamStep(continuations, done)

    def _collect_finished(self, best: list[tuple[float, int, int]], length: int, at_limit: bool) -> None:
        if not self.improvable or (len(self.finished) == self.width and self.early_stopping is True):
            return
        for score, seq_id, token, rank in best:
            if token in self.stop_token_ids or at_limit:
                beam = self.beams[seq_id]
                position = self._position(seq_id, rank)
                self.finished.append(Hypothesis(self._normalised(score, length), beam.token_ids + [token], score,
                                                token in self.stop_token_ids,
                                                beam.positions + [position] if position else []))
        self.finished = sorted(self.finished, reverse=True)[:self.width]

    def _normalised(self, score: float, length: int) -> float:
        """score / length ** length_penalty, as transformers; a penalty so large that the power
        overflows (or vanishes) is clamped rather than raising in the engine loop."""
        try:
            factor = length ** self.length_penalty
        except OverflowError:
            factor = _LENGTH_FACTOR_RANGE[1]
        low, high = _LENGTH_FACTOR_RANGE
        return score / min(max(factor, low), high)

    def _position(self, seq_id: int, rank: int) -> PositionLogprobs | None:
        """The logprobs of the rank-th candidate of a beam's pending step (None when none were asked for)."""
        if self.num_logprobs is None:
            return None
        candidates = self._pending[seq_id]
        token, logprob = candidates[rank - 1]
        top = candidates[:self.num_logprobs]
        return PositionLogprobs(token_id=token, logprob=logprob, rank=rank, top_token_ids=[t for t, _ in top],
                                top_logprobs=[lp for _, lp in top])

    def _still_improvable(self, continuations: list[Continuation], length: int) -> bool:
        if not self.improvable or len(self.finished) < self.width or not continuations:
            return self.improvable
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = length
        best_possible = self._normalised(continuations[0].score, best_length)
        return best_possible > self.finished[-1].score

    def advance(self, continuations: list[Continuation], seq_ids: list[int]) -> None:
        """The chosen continuations now live in these sequences (the parent's own or a fork)."""
        self.beams = {seq_id: Beam(seq_id, c.score, self.beams[c.parent_seq_id].token_ids + [c.token_id],
                                   self.beams[c.parent_seq_id].positions + [c.position] if c.position else [])
                      for c, seq_id in zip(continuations, seq_ids)}

    def best(self, n: int) -> list[Hypothesis]:
        return self.finished[:n]
