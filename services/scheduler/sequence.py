"""A sequence as the scheduler sees it: tokens, progress, and what the worker already knows."""

from __future__ import annotations

import enum

from shared.lora import prefix_cache_extra
from shared.multimodal import image_keys
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from shared.step_protocol import PositionLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"  # preempted; its KV waits in host memory
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


class Sequence:
    """One of a request's sequences. Slotted: the scheduler reads its fields many times per step, and
    past 30 attributes CPython stops sharing instance dicts' keys, which slowed every step by a few percent."""

    __slots__ = ("seq_id", "request", "index", "prompt_token_ids", "output_token_ids", "params", "max_output_tokens",
                 "arrival", "status", "num_computed_tokens", "num_inflight_tokens", "num_placeholders",
                 "stop_reason", "known_to_worker", "num_tokens_sent", "num_blocks_sent", "num_prompt_logprobs",
                 "num_cached_tokens", "whole_prompt", "cache_extra", "table_replaced", "siblings",
                 "pending_siblings", "worker_params", "beam_group", "draft_token_ids", "inflight_drafts", "kv_source",
                 "image_keys")

    def __init__(self, seq_id: int, request: EngineRequest, index: int, max_output_tokens: int, arrival: int,
                 params: SamplingParams | None = None, whole_prompt: bool = False):
        """``params``: what it runs with, if not the request's (an embedding request samples nothing)."""
        self.seq_id = seq_id
        self.request = request  # its id, prompt, adapter, pooling: read from here, never copied
        self.index = index  # position among the request's n sequences
        self.prompt_token_ids = request.prompt_token_ids  # the request's own list (read on every step)
        self.output_token_ids: list[int] = []
        self.params = request.params if params is None else params
        self.max_output_tokens = max_output_tokens  # max_tokens, capped by the context length
        self.arrival = arrival  # admission order; preemption picks the largest
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0  # tokens whose KV is in the cache, as of the last result applied
        # Planning ahead: tokens scheduled in steps whose results have not come back yet, and the
        # tokens those steps will sample (placeholders: the worker knows them, the scheduler not yet).
        self.num_inflight_tokens = 0
        self.num_placeholders = 0
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # What the worker holds: set when sent as new, cleared when it is told to drop the sequence.
        self.known_to_worker = False
        self.num_tokens_sent = 0
        self.num_blocks_sent = 0
        self.num_prompt_logprobs = 0  # prompt positions whose logprobs were passed on (recompute repeats them)
        self.num_cached_tokens: int | None = None  # tokens found in the prefix cache at its first admission
        # Every prompt position must be computed (prompt logprobs, mean or cls pooling): no prefix-cache hit.
        self.whole_prompt = whole_prompt or self.params.prompt_logprobs is not None
        # What its prefix-cache hashes cover besides tokens (its salt and adapter).
        self.cache_extra = prefix_cache_extra(request.cache_salt, request.lora)
        self.image_keys = image_keys(request.images)  # ...and what its image placeholders stand for (None: no images)
        self.table_replaced = False  # copy-on-write or swap-in changed the table: send it whole
        self.siblings: list[Sequence] = [self]  # every sequence of the request, this one included
        # n > 1, on the first sequence: siblings that start by forking from it once its prompt is done.
        self.pending_siblings: list[Sequence] = []
        self.worker_params = self.params  # what the worker samples with (beams: the top candidates instead)
        self.beam_group = None  # the BeamGroup deciding this sequence's tokens, for beam search
        # Speculative decoding: the worker's drafts for this sequence's next step (from the latest
        # result), and the ones the step in flight verifies.
        self.draft_token_ids: list[int] = []
        self.inflight_drafts: list[int] = []
        # Prefill/decode disaggregation: where its computed KV waits, on the decode stage until the step that
        # pulls it has come back (a KVSource, kv_handoff.py); None otherwise.
        self.kv_source = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_planned_tokens(self) -> int:
        """Tokens whose KV is computed, or will be once the steps in flight finish."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to schedule, counting the ones the steps in flight will sample."""
        return self.num_tokens + self.num_placeholders - self.num_planned_tokens

    def awaits_last_token(self, max_model_len: int) -> bool:
        """A step in flight samples this sequence's last token (max_tokens or the context length):
        there is nothing more to schedule."""
        return self.num_placeholders > 0 and (
            len(self.output_token_ids) + self.num_placeholders >= self.max_output_tokens
            or self.num_tokens + self.num_placeholders >= max_model_len)

    def token_ids(self, start: int = 0) -> list[int]:
        return self.token_slice(start, self.num_tokens)

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids in [start, end) without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def finish(self, status: SequenceStatus, stop_reason: int | str | None = None) -> None:
        self.status = status
        self.stop_reason = stop_reason

    def reset_for_recompute(self) -> None:
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_inflight_tokens = self.num_placeholders = 0  # only preempted with no step in flight
        self.known_to_worker = False
        self.table_replaced = False
        self.num_tokens_sent = self.num_blocks_sent = 0
        self.draft_token_ids, self.inflight_drafts = [], []  # proposed for the sequence's state on the worker

    def reset_for_handoff(self) -> None:
        """Its prompt is computed and its first token sampled on a prefill stage: it waits for the decode stage,
        which has not heard of it, keeping its computed tokens (their KV moves there)."""
        computed = self.num_computed_tokens
        self.reset_for_recompute()
        self.num_computed_tokens = computed

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, {self.status.value}, "
                f"tokens={self.num_tokens}, computed={self.num_computed_tokens})")


class SequenceUpdate:
    """What the front end learns about one sequence after a step."""

    __slots__ = ("request_id", "seq_index", "new_token_ids", "new_logprobs", "prompt_logprobs",
                 "finish_reason", "stop_reason", "error", "num_cached_tokens", "embedding")

    def __init__(self, seq: Sequence, index: int | None = None):
        self.request_id = seq.request.request_id
        self.seq_index = seq.index if index is None else index
        self.new_token_ids: list[int] = []
        self.new_logprobs: list[PositionLogprobs] = []
        self.prompt_logprobs: list[PositionLogprobs] = []  # newly available, in prompt order from index 1
        self.finish_reason: str | None = None  # "stop", "length" or "abort" once finished
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the request failed (it ended: "abort", every sequence)
        # Until the sequence's first output token: the tokens its admission found in the prefix cache (usage).
        self.num_cached_tokens = 0 if seq.output_token_ids else seq.num_cached_tokens or 0
        self.embedding: list[float] | None = None  # an embedding request's result (its update that finishes it)

    @property
    def is_plain(self) -> bool:
        """New tokens and nothing else (the common update; it travels as column entries)."""
        return not (self.new_logprobs or self.prompt_logprobs or self.finish_reason or self.stop_reason is not None
                    or self.error or self.num_cached_tokens or self.embedding is not None)
