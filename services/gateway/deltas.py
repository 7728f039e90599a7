"""What a run yields: a SeqDelta per engine output of a sequence, its tokens' logprobs as TokenLogprobs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TopToken:
    token_id: int
    token: str
    logprob: float


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    rank: int
    top: list[TopToken]
    text_offset: int = 0  # where this token's text starts in the sequence's output text


@dataclass(slots=True)
class SeqDelta:
    """New output of one sequence since its last delta."""
    index: int  # the sequence's index within its prompt's n
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort" in the sequence's last delta
    stop_reason: int | str | None = None
    position: int = 0  # which of the request's prompts (its Run's position)
