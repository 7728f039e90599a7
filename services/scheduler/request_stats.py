"""vLLM's per-request histograms, observed by the scheduler as each request ends, and where its
prompts' tokens came from (computed, or found in the prefix cache).

The times are vLLM V1's, from the engine's own clock: queued (added to the scheduler), first
scheduled (admitted; a preemption later does not count again), first token and last token (the
step results that carried them). So queue time is queued to scheduled, prefill scheduled to first
token, decode first token to last, inference scheduled to last token (preemptions included). A
request that never ran observes none of them; one that ran but made no token (aborted in its
prefill, an embedding) only its queue time, as vLLM.

Each engine request is observed once, when its last sequence ends: n > 1 sequences share the
request's times (the first of their first tokens, the last of their last ones), and its preemptions
add up. (vLLM runs each of n as a request of its own and observes them apart.)
"""

from __future__ import annotations

import time
from collections.abc import Callable

from services.scheduler.histogram import Histogram, buckets_1_2_5
from services.scheduler.sequence import Sequence

# vLLM's buckets
REQUEST_SECONDS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_SECONDS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (0, 1, 2, 3, 4, 5, 10, 20)  # vLLM's from 1; 0 apart, so a preempted request stands out


class SequenceTimes:
    """A live sequence's times (time.monotonic(); None until they happen) and preemptions.

    Kept here by seq id rather than on Sequence: they are the stats' business, not the scheduler's."""

    __slots__ = ("queued", "scheduled", "first_token", "last_token", "num_preemptions", "num_resumed_tokens")

    def __init__(self):
        self.queued: float | None = None  # added to the scheduler (a forked sibling or beam never is)
        self.scheduled: float | None = None  # first admitted to prefill its prompt
        self.first_token: float | None = None  # the first step result with a token of it
        self.last_token: float | None = None
        self.num_preemptions = 0
        self.num_resumed_tokens = 0  # output tokens it came with (a resumption), not generated here


class RequestStats:
    def __init__(self, max_model_len: int):
        tokens = buckets_1_2_5(max_model_len)
        self.histograms: dict[str, Histogram] = {
            "request_queue_time_seconds": Histogram(REQUEST_SECONDS),
            "request_prefill_time_seconds": Histogram(REQUEST_SECONDS),
            "request_decode_time_seconds": Histogram(REQUEST_SECONDS),
            "request_inference_time_seconds": Histogram(REQUEST_SECONDS),
            "request_time_per_output_token_seconds": Histogram(TOKEN_SECONDS),
            "request_num_preemptions": Histogram(PREEMPTION_BUCKETS),
            "request_params_n": Histogram(N_BUCKETS),
            "request_params_max_tokens": Histogram(tokens),
            "request_max_num_generation_tokens": Histogram(tokens),
            "request_prefill_kv_computed_tokens": Histogram(tokens),
        }
        # Prompt tokens at their first prefill (first_admitted): computed, or found in the prefix cache.
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0  # found in a prefix cache: the device's or the host tier's
        self.prompt_tokens_loaded = 0  # of those, loaded from the host tier
        self.times: dict[int, SequenceTimes] = {}  # by seq id, until its request ends (the scheduler reads it)
        # Told each request's sequences and their times as it ends (request_spans.py); None: nobody listens.
        self.on_finished: Callable[[list[Sequence], list[SequenceTimes]], None] | None = None

    def times_of(self, seq_id: int) -> SequenceTimes:
        times = self.times.get(seq_id)
        if times is None:  # (a forked sibling or beam starts here)
            times = self.times[seq_id] = SequenceTimes()
        return times

    def queued(self, seq: Sequence) -> None:
        times = self.times_of(seq.seq_id)
        times.queued, times.num_resumed_tokens = time.monotonic(), len(seq.output_token_ids)

    def is_first_prefill(self, seq: Sequence) -> bool:
        """Whether the sequence, being admitted, prefills its prompt for the first time (not a forked
        sibling recomputing after a preemption)."""
        return len(seq.output_token_ids) == self.times_of(seq.seq_id).num_resumed_tokens

    def first_admitted(self, seq: Sequence, num_cached: int, num_loaded: int = 0) -> None:
        """At its first prefill: when, and where its prompt's tokens come from (``num_loaded`` of the
        ``num_cached`` from the host tier)."""
        self.times_of(seq.seq_id).scheduled = time.monotonic()
        prompt_len = len(seq.prompt_token_ids)
        cached = min(num_cached, prompt_len)  # (a resumed sequence's hits may cover its outputs too)
        self.prompt_tokens_cached += cached
        self.prompt_tokens_loaded += min(num_loaded, cached)
        self.prompt_tokens_computed += prompt_len - cached

    def preempted(self, seq: Sequence) -> None:
        self.times_of(seq.seq_id).num_preemptions += 1

    def observe_finished(self, seqs: list[Sequence]) -> None:
        """The request whose sequences these are has ended (every one of them): observe it, and forget them."""
        times = [self.times.pop(s.seq_id, None) or SequenceTimes() for s in seqs]
        h = self.histograms
        first = seqs[0]
        h["request_params_n"].observe(first.params.n)
        if first.params.max_tokens is not None and first.request.pooling is None:
            h["request_params_max_tokens"].observe(first.params.max_tokens)
        h["request_max_num_generation_tokens"].observe(max(len(s.output_token_ids) for s in seqs))
        h["request_prefill_kv_computed_tokens"].observe(len(first.prompt_token_ids) - (first.num_cached_tokens or 0))
        h["request_num_preemptions"].observe(sum(t.num_preemptions for t in times))
        self._observe_times(seqs, times)
        if self.on_finished is not None:
            self.on_finished(seqs, times)

    def _observe_times(self, seqs: list[Sequence], times: list[SequenceTimes]) -> None:
        scheduled = min((t.scheduled for t in times if t.scheduled is not None), default=None)
        if scheduled is None:
            return  # it never ran
        h = self.histograms
        queued = min((t.queued for t in times if t.queued is not None), default=scheduled)
        h["request_queue_time_seconds"].observe(scheduled - queued)
        first_token = min((t.first_token for t in times if t.first_token is not None), default=None)
        if first_token is None:
            return  # no token came: aborted in its prefill, or an embedding
        last_token = max(t.last_token for t in times if t.last_token is not None)
        decode = last_token - first_token
        h["request_prefill_time_seconds"].observe(first_token - scheduled)
        h["request_decode_time_seconds"].observe(decode)
        h["request_inference_time_seconds"].observe(last_token - scheduled)
        # Per sequence, the first token is the prefill's (n > 1: their mean length); beams come at the end.
        made = sum(len(s.output_token_ids) - t.num_resumed_tokens for s, t in zip(seqs, times))
        per_sequence = made / len(seqs)
        if per_sequence > 1 and seqs[0].beam_group is None:
            h["request_time_per_output_token_seconds"].observe(decode / (per_sequence - 1))
