"""What generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 for the most likely token
    decoded_token: str | None = None


# Per position: token id -> Logprob, holding the chosen token and the top-k.
PositionLogprobDict = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n outputs
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None  # sum of the sampled tokens' logprobs, when logprobs were asked for
    logprobs: list[PositionLogprobDict] | None
    finish_reason: str | None = None  # "stop", "length" or "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobDict | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (their prefill skipped)


@dataclass
class PoolingOutput:
    data: torch.Tensor  # the pooled vector (an embedding, or class scores), float32 on the CPU


@dataclass
class PoolingRequestOutput:
    """One prompt's pooled output (LLM.encode), shaped like vLLM's; embed() and classify() give its kinds."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: PoolingOutput
    finished: bool = True
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (their prefill skipped)


@dataclass
class EmbeddingOutput:
    embedding: list[float]  # pooled, cut to the request's dimensions, normalized unless it said otherwise

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput):
    """One prompt's embedding, shaped like vLLM's."""

    outputs: EmbeddingOutput


@dataclass
class ClassificationOutput:
    probs: list[float]  # one score per class in the model's label order (its activation's, or raw logits)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput(PoolingRequestOutput):
    """One prompt's class scores, shaped like vLLM's."""

    outputs: ClassificationOutput


@dataclass
class ScoringOutput:
    score: float  # the cosine similarity of the pair's embeddings, or a cross-encoder's relevance


@dataclass
class ScoringRequestOutput:
    """One pair's score, shaped like vLLM's."""

    request_id: str
    outputs: ScoringOutput
    finished: bool = True
