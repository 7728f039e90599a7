"""The scheduler -> worker step protocol: one plan in, one result out, per step.

Plain data only (ints, floats, strings, lists, SamplingParams), so the same
objects run through the in-process executor and, converted field by field,
over gRPC. The worker keeps a copy of every sequence it has been sent, so
sequences are sent in full once (``new``) and afterwards only as deltas
(``running``); ``finished_seq_ids`` tells it which copies to drop.

Order of execution on the worker: drop ``finished_seq_ids``, register
``new``, apply ``running`` deltas, then run one forward pass over every
scheduled token and sample for each sequence whose computed tokens reach its
end this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling_params import SamplingParams


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker has not seen (or must forget and rebuild: recompute)."""

    request_id: str  # the client's request, for logs
    seq_id: int  # unique among live sequences; the key of every later delta
    index: int  # position among the request's n sequences; gives each sibling its own seeded stream
    prompt_token_ids: list[int]  # the prompt, in full
    output_token_ids: list[int]  # tokens generated before a recompute preemption; else empty
    sampling_params: SamplingParams  # how to sample; the worker needs penalties, seed, logprobs
    block_table: list[int]  # physical block ids, logical order; covers every token computed after this step
    num_computed_tokens: int  # tokens whose KV is already in the cache (a prefix-cache hit); 0 otherwise
    num_scheduled_tokens: int  # tokens to compute this step, starting at num_computed_tokens


@dataclass(slots=True)
class RunningSequence:
    """The change to a sequence the worker already holds."""

    seq_id: int  # as sent in NewSequence
    new_token_ids: list[int]  # tokens appended since the worker last heard (the last sampled token)
    new_block_ids: list[int]  # physical blocks appended to the block table
    num_computed_tokens: int  # tokens with KV in cache before this step (the worker checks its copy)
    num_scheduled_tokens: int  # tokens to compute this step


@dataclass(slots=True)
class StepPlan:
    step_id: int  # increases by one per step; echoed in the result
    new: list[NewSequence] = field(default_factory=list)  # first scheduled (or resumed after recompute)
    running: list[RunningSequence] = field(default_factory=list)  # deltas for known sequences
    finished_seq_ids: list[int] = field(default_factory=list)  # finished, aborted or preempted: drop state

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new) + sum(s.num_scheduled_tokens for s in self.running)

    @property
    def is_empty(self) -> bool:
        return not self.new and not self.running


@dataclass(slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, from the model's raw distribution."""

    token_id: int  # the token at this position (sampled, or the prompt's own)
    logprob: float  # its log-probability
    rank: int  # 1 for the most likely token
    top_token_ids: list[int]  # the k most likely tokens, best first (k as the request asked)
    top_logprobs: list[float]  # their log-probabilities, same order


@dataclass(slots=True)
class SequenceOutput:
    """What one sequence produced in one step."""

    seq_id: int
    token_id: int | None  # the sampled token; None mid-way through a chunked prefill
    logprobs: PositionLogprobs | None = None  # for token_id, when the request asked for logprobs
    # For requests with prompt_logprobs: prompt positions computed this step, in order,
    # starting at prompt index ``prompt_logprobs_start`` (index 0 has none: nothing precedes it).
    prompt_logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs_start: int = 0


@dataclass(slots=True)
class StepResult:
    step_id: int  # the plan's
    outputs: list[SequenceOutput] = field(default_factory=list)
    forward_time_s: float = 0.0  # model forward pass, including the KV writes
    sample_time_s: float = 0.0  # logits processing and sampling


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Facts a worker finds at start-up and reports once; the scheduler sizes its pool from them."""

    model: str  # the model path or name it loaded
    num_kv_blocks: int  # blocks in its KV pools
    block_size: int  # tokens per block
    max_model_len: int  # longest sequence (prompt + output) it serves
    vocab_size: int  # logits width; token ids must be below it
    eos_token_ids: tuple[int, ...]  # from generation_config.json / the tokenizer
    device: str  # e.g. "cpu", "cuda:0"
    dtype: str  # e.g. "float32"
