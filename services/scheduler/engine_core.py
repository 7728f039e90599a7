"""The engine core: requests in, the scheduler and an executor turning steps, updates out.

It owns the sequences and validates every request at admission, so a request
that could never run is refused with a clear error instead of waiting forever.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from services.scheduler.beam_search import BeamGroup
from services.scheduler.cache_digest import CacheDigest
from services.scheduler.executor import Executor
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.sequence import Sequence, SequenceUpdate
from services.scheduler.stage import Stage
from shared.grpc_errors import AlreadyExists
from shared.request import EngineRequest, RequestLimits, max_output_tokens, validate
from shared.sampling_params import SamplingParams
from shared.step_protocol import WorkerInfo
from shared.tracing import Tracing

if TYPE_CHECKING:  # (imported only when tracing: it imports OpenTelemetry)
    from services.scheduler.request_spans import RequestSpans


# What an embedding request's sequence carries as sampling parameters: nothing is sampled for it.
_POOLING_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


class EngineCore:
    def __init__(self, executor: Executor, limits: SchedulerLimits, watermark: float = 0.01,
                 max_logprobs: int = 20, enable_prefix_caching: bool = True, tracing: Tracing | None = None):
        self.executor = executor
        self.info: WorkerInfo = executor.worker_info()
        self.max_logprobs = max_logprobs
        self._seq_ids = itertools.count()
        # (the counter's own method, not a closure over self: a cycle through the engine would keep the worker,
        # and with it the KV cache, in memory after the last reference goes, until a full collection)
        self.stage = Stage.for_worker(executor, limits, watermark, enable_prefix_caching,
                                      new_seq_id=self._seq_ids.__next__)
        self.scheduler, self.stats = self.stage.scheduler, self.stage.stats
        self._in_flight = self.stage.in_flight  # steps submitted whose results are not applied yet, oldest first
        self._seqs: dict[int, Sequence] = {}
        self._requests: dict[str, list[Sequence]] = {}
        self._arrivals = itertools.count()
        # What validate holds each request to at admission.
        self.request_limits = RequestLimits(
            max_model_len=self.info.max_model_len, vocab_size=self.info.vocab_size, max_logprobs=max_logprobs,
            max_num_seqs=limits.max_num_seqs, eos_token_ids=self.info.eos_token_ids, max_loras=self.info.max_loras,
            pooler=self.info.pooler, priority_scheduling=limits.scheduling_policy == "priority",
            image_token_id=self.info.image_token_id,
            max_image_tokens=limits.max_num_batched_tokens if self.info.whole_images else None)
        # Each request's spans (--otlp-traces-endpoint); None: untraced, at no cost per request or step.
        self.spans: RequestSpans | None = None
        if tracing is not None:
            from services.scheduler.request_spans import RequestSpans

            self.spans = RequestSpans(tracing.tracer, self.info.model)
            self.scheduler.request_stats.on_finished = self.spans.finished

    # --- admission ----------------------------------------------------------------------------------

    def add_request(self, request: EngineRequest) -> int:
        """Admit a request (ValueError if it could never run; AlreadyExists for an id in flight); returns how
        many sequences it runs, each of which ends with a finish reason. A resumption runs only the sequences
        it names, each carrying on after its earlier output (recomputed like a sequence preempted by
        recompute). An embedding request (``pooling``, a pooling engine's only kind) has one sequence, which
        ends with an update that carries the embedding."""
        if request.request_id in self._requests:
            raise AlreadyExists(f"request id {request.request_id!r} is already in use")
        if self.spans is None:
            return self._admit(request)
        request = self.spans.admitted(request)  # (its sequences carry the span's context to the workers)
        try:
            return self._admit(request)
        except Exception as exc:
            self.spans.refused(request.request_id, exc)
            raise

    def _admit(self, request: EngineRequest) -> int:
        validate(request, self.request_limits)
        if request.pooling is not None:
            self._add_pooling_request(request)
            return 1
        params, prompt_len = request.params, len(request.prompt_token_ids)
        self._check_blocks_suffice(prompt_len, params)
        max_output = max_output_tokens(prompt_len, params, self.info.max_model_len)
        arrival = next(self._arrivals)
        if params.use_beam_search:
            self._add_beam_request(request, max_output, arrival)
            return params.n
        resumption = request.resumption
        indexes = range(params.n) if resumption is None else sorted(resumption.outputs)
        seqs = [Sequence(next(self._seq_ids), request, i, max_output, arrival) for i in indexes]
        for seq in seqs:
            seq.siblings = seqs
            self._seqs[seq.seq_id] = seq
        self._requests[request.request_id] = seqs
        if resumption is not None:  # each has its own tokens: no sibling forks from another
            for seq in seqs:
                seq.output_token_ids = list(resumption.outputs[seq.index])
                self._enqueue(seq)
            return len(seqs)
        # The first sequence computes the prompt; the others fork from it and share its blocks.
        seqs[0].pending_siblings = seqs[1:]
        self._enqueue(seqs[0])
        return len(seqs)

    def _check_blocks_suffice(self, prompt_len: int, params: SamplingParams) -> None:
        """One sequence at a time must fit: siblings that do not fit beside it are preempted and run after it
        (the oldest sequence always advances), so n does not multiply the need. With a sliding window on every
        layer and chunked prefill, a sequence holds only its window's blocks."""
        info, limits = self.info, self.scheduler.limits
        longest = prompt_len + (params.max_tokens or info.max_model_len - prompt_len)
        needed = self.scheduler.blocks.most_blocks_held(
            longest, limits.max_num_batched_tokens if limits.enable_chunked_prefill else None)
        if needed > info.num_kv_blocks:
            raise ValueError(f"the request can grow to {longest} tokens, needing {needed} KV blocks at once, but "
                             f"the cache has only {info.num_kv_blocks}: it could never run")

    def _add_beam_request(self, request: EngineRequest, max_output: int, arrival: int) -> None:
        """One sequence to start with; the beams fork from it as the search goes."""
        params = request.params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.info.eos_token_ids))
        group = BeamGroup(params.num_beams, stops, max_output, params.length_penalty, params.early_stopping,
                          params.logprobs)
        seq = Sequence(next(self._seq_ids), request, 0, max_output, arrival)
        # The worker returns the top candidates of the raw distribution; the group chooses.
        seq.worker_params = SamplingParams(temperature=0, logprobs=max(group.num_candidates, params.logprobs or 0),
                                           max_tokens=None, ignore_eos=True)
        seq.beam_group = group
        group.start(seq.seq_id)
        self._requests[request.request_id] = seq.siblings
        self._seqs[seq.seq_id] = seq
        self._enqueue(seq)

    def _add_pooling_request(self, request: EngineRequest) -> None:
        """One sequence that computes its prompt and ends with its embedding (no output token: the prompt
        may fill the whole context)."""
        prompt_len = len(request.prompt_token_ids)
        needed = self.scheduler.blocks.blocks_for(prompt_len)
        if needed > self.info.num_kv_blocks:
            raise ValueError(f"the prompt needs {needed} KV blocks, but the cache has only {self.info.num_kv_blocks}: "
                             "it could never run")
        # One output, the embedding: max_output_tokens 1 makes the step that ends the prompt its last.
        seq = Sequence(next(self._seq_ids), request, 0, 1, next(self._arrivals), params=_POOLING_PARAMS,
                       whole_prompt=self.info.pooler.needs_every_token)
        self._requests[request.request_id] = seq.siblings
        self._seqs[seq.seq_id] = seq
        self._enqueue(seq)

    def _enqueue(self, seq: Sequence) -> None:
        """An admitted sequence waits for its first step."""
        self.scheduler.add(seq)

    def _scheduler_of(self, seq: Sequence) -> Scheduler:
        """The scheduler holding the sequence (there is one here; disaggregated_core.py has several)."""
        return self.scheduler

    def _left(self, seq: Sequence) -> None:
        """The sequence ended outside a step (aborted, or stopped by a string): nothing more to do here."""

    def abort_request(self, request_id: str) -> None:
        seqs = self._requests.pop(request_id, None)
        if seqs:
            for seq in seqs:
                self._scheduler_of(seq).abort([seq])
                self._left(seq)
                self._seqs.pop(seq.seq_id, None)

    def finish_by_stop_string(self, request_id: str, seq_index: int, stop: str) -> bool:
        """End one sequence of a request (its text hit a stop string); False if it had ended already
        (or the request is gone). Its siblings run on."""
        seq = next((s for s in self._requests.get(request_id, ()) if s.index == seq_index), None)
        if seq is None:  # (by its index: a resumed request holds only the sequences it resumed)
            return False
        ended = self._scheduler_of(seq).finish_by_stop_string(seq, stop)
        self._left(seq)
        self._forget_if_done(request_id)
        return ended

    # --- stepping -----------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[SequenceUpdate]:
        """Plan one step, run it, and apply its result."""
        return self.finish_step() if self.start_step() else []

    @property
    def num_in_flight(self) -> int:
        """Steps sent to the worker whose results are not applied yet."""
        return len(self._in_flight)

    def has_idle_work(self) -> bool:
        """Whether a step could start now without planning ahead: work waits and no step is in flight."""
        return not self._in_flight and self.has_unfinished()

    @property
    def executors(self) -> list[Executor]:
        """Every worker group this engine drives (the scheduler service checks their health)."""
        return [self.executor]

    def can_plan_ahead(self) -> bool:
        """Whether start_step may be called now, with one step in flight (the scheduler service
        plans step N+1 while the worker computes step N, so the worker never waits for a plan).

        Never with speculative decoding: a step's drafts continue the tokens it samples, so a plan
        made before that result could not carry them (and every later result's drafts would be stale)."""
        return len(self._in_flight) == 1 and not self.info.num_speculative_tokens and self.scheduler.can_plan_ahead()

    def start_step(self) -> bool:
        """Plan the next step and send it to the worker without waiting; False when there is nothing to run.

        Between start_step and finish_step the caller may do anything that does not touch the
        engine (the scheduler service streams the previous step's tokens out meanwhile). With a
        step in flight, only when can_plan_ahead() says so.
        """
        return self.stage.start_step() is not None

    def finish_step(self) -> list[SequenceUpdate]:
        """Wait for the oldest step's result and apply it: new tokens, finished sequences, forked beams."""
        updates = self.stage.apply(self.executor.wait(), self._seqs)
        self._forget_finished(updates)
        return updates

    def _forget_finished(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            if update.finish_reason is not None:
                self._forget_if_done(update.request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id, [])
        if all(seq.status.is_finished for seq in seqs):
            self._requests.pop(request_id, None)
            for seq in seqs:
                self._seqs.pop(seq.seq_id, None)

    def publish_cache(self) -> CacheDigest | None:
        """Record, from now on, what the prefix caches index and unindex (the gateways route by it); None
        without prefix caching."""
        blocks = self.scheduler.blocks
        return blocks.publish_cache() if blocks.enable_caching else None

    def cached_keys(self) -> list[int]:
        """Every routing key the prefix caches hold (cache_digest.py), once per cache holding it."""
        return self.scheduler.blocks.cached_keys()

    def get_stats(self) -> dict:
        return self.stats.as_dict(self.scheduler)

    def shutdown(self) -> None:
        self.stage.shutdown()

    def abandon(self) -> None:
        """A step failed or a worker went away: close every stream without a last word to the workers."""
        for executor in self.executors:
            executor.shutdown()
