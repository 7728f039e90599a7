"""A request submitted again after the scheduler or worker it ran on was lost.

The gateway knows what each sequence of a request has generated so far: it passed those tokens
on to the client. When the request's scheduler goes away, the gateway submits it again, with
those tokens, to a scheduler that serves; the engine takes them as output already produced (they
count for max_tokens, min_tokens, the penalties and the seeded sampler's counter, and only their
KV is computed again), so the client's stream goes on where it stopped, without a token twice.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.proto import pagedserve_internal_pb2 as wire


@dataclass(frozen=True)
class Resumption:
    """For each sequence still running when the request was lost: the tokens it had generated."""

    outputs: dict[int, list[int]]  # sequence index (among the request's n) -> its output token ids so far

    def __post_init__(self) -> None:
        if not self.outputs:
            raise ValueError("a resumed request needs at least one sequence to carry on")
        for index, tokens in self.outputs.items():
            if not isinstance(index, int) or index < 0:
                raise ValueError(f"a resumed sequence's index must be a non-negative integer, got {index!r}")
            if not all(isinstance(t, int) for t in tokens):
                raise ValueError(f"resumed sequence {index}'s output must be token ids")

    def to_proto(self) -> list[wire.ResumedSequence]:
        return [wire.ResumedSequence(seq_index=index, output_token_ids=tokens)
                for index, tokens in sorted(self.outputs.items())]

    @classmethod
    def from_proto(cls, messages) -> Resumption | None:
        """None for a request from the start (no entries)."""
        if not messages:
            return None
        outputs = {m.seq_index: list(m.output_token_ids) for m in messages}
        if len(outputs) != len(messages):
            raise ValueError("a resumed request names one of its sequences twice")
        return cls(outputs)
