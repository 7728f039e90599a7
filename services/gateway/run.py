"""One prompt's engine request as it streams from the scheduler: its outputs as SeqDeltas (each sequence's
text through its Sequence), its prompt logprobs and cached tokens, its latencies and finish reasons in the
gateway's metrics, and, with a resumer, its resumption at another scheduler when its own is lost.

A sequence that hits a stop string is ended at the scheduler, freeing its KV blocks while its siblings run
on; once every sequence has stopped the request is cancelled on the Session stream, which aborts the rest.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import replace

from services.gateway.deltas import SeqDelta, TokenLogprob
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
from services.gateway.resumption import Resumer
from services.gateway.run_span import RunSpan
from services.gateway.scheduler_session import SessionLost, SubmitStream
from services.gateway.sequence import Sequence
from shared.grpc_errors import ServiceUnavailable
from shared.request import EngineRequest
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams


class Run:
    """One prompt's engine request: iterate it for SeqDeltas; leaving early aborts it. With a
    resumer, a run whose scheduler is lost goes on at another (or the same one, back)."""

    def __init__(self, model: Model, stream: SubmitStream, request: EngineRequest, metrics: GatewayMetrics,
                 position: int = 0, resumer: Resumer | None = None, span: RunSpan | None = None):
        self.model, self.request = model, request
        self.span = span  # its llm_request span (run_span.py); None: not traced
        # An embedding request's (``pooling``): its one output (start() waits for it) carries the embedding.
        self.embedding: list[float] | None = None
        self.position = position  # which of the request's prompts this is
        self._stream, self._metrics = stream, metrics
        self._resumer = resumer
        self.resumes = 0  # times this run was submitted again after losing its scheduler
        self.finish_reasons: list[str] = []  # its sequences' as they end ("stop", "length", "abort")
        self._recorded = False  # its end is in the metrics (by __aiter__'s end, once it was read)
        self._read = False
        self._aborted = False  # the client's Abort: a resumption stops
        self._skip_prompt_logprobs = 0  # a run started over sends the prompt logprobs already passed on again
        self._first = None
        self._sequences = [Sequence(index, position, model.tokenizer, request) for index in range(request.params.n)]
        self._logprob = model.logprob if request.params.logprobs is not None else None  # (read once per output)
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens the prefix cache held (known from the first output on)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self._first_output_s: float | None = None  # arrival to first output (start())

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    def _since_arrival(self) -> float:
        """Seconds since the request arrived (vLLM's latencies count from there; a resumption keeps it)."""
        return time.time() - self.request.arrival_time

    @property
    def finished(self) -> bool:
        return len(self.finish_reasons) == len(self._sequences)  # (asked once per output: a sum, not a walk)

    def cancel(self) -> None:
        self._stream.cancel()

    def abort(self) -> None:
        """Abort at the scheduler; iterating goes on to the sequences' ends, as "abort" (the Abort RPC)."""
        self._aborted = True
        self._stream.abort()

    async def start(self) -> None:
        """Wait for the first output, so admission errors surface before any response is sent."""
        try:
            self._first = await self._next()
        except BaseException as exc:
            self.cancel()
            if self.span is not None:
                self.span.fail(exc)
            raise
        self._first_output_s = self._since_arrival()
        if self.request.pooling is not None:  # its whole latency: no first token to time
            await self._take_embedding(self._first)
            return
        self._metrics.ttft.observe(self._first_output_s)
        if self.span is not None:
            self.span.first_output(self._first_output_s)

    async def _take_embedding(self, message) -> None:
        """An embedding request is done with its first output."""
        self._sequences[0].done, self._recorded = True, True
        self.finish_reasons.append("stop" if message is not None and message.embedding else "abort")
        self._metrics.finish(len(self.prompt), 0, self._since_arrival(), None, 1, self.finish_reasons)
        if message is not None and message.num_cached_tokens:
            self.cached_tokens = min(message.num_cached_tokens, len(self.prompt))
        self._end_span(self.finish_reasons)
        if message is None or not message.embedding:  # aborted at the scheduler (it is stopping)
            raise ServiceUnavailable(f"embedding request {self.request_id} ended without its embedding")
        self.embedding = list(message.embedding)
        # Its end came in the same session message: take it, so the stream ends without an abort.
        if await anext(self._stream, None) is not None:
            raise RuntimeError(f"embedding request {self.request_id} had an output after its embedding")

    async def __aiter__(self) -> AsyncIterator[SeqDelta]:
        self._read = True
        try:
            message = self._first
            while message is not None:
                delta = self._apply(message)
                if delta is not None and delta.token_ids:
                    self._observe_inter_token_latency(self._sequences[delta.index])
                # A prefill chunk's output brings only prompt logprobs (kept in the run): no delta.
                if delta is not None and (delta.token_ids or delta.text or delta.finish_reason):
                    yield delta
                if self.finished:
                    return
                message = await self._next()
            # The stream ended with sequences still running: the request was aborted (Abort RPC).
            for sequence in self._sequences:
                if not sequence.done:
                    self.finish_reasons.append("abort")
                    yield sequence.aborted()
        finally:
            self.cancel()  # no-op after a normal end; otherwise aborts the rest at the scheduler
            self._record_end()

    def _record_end(self) -> None:
        # Beam search reports its beams once, at the end: there is no time per token to see.
        first = None if self.params.use_beam_search else self._first_output_s
        # A sequence that did not end (the client went away) was aborted.
        reasons = self.finish_reasons + ["abort"] * (len(self._sequences) - len(self.finish_reasons))
        self._recorded = True
        self._metrics.finish(len(self.prompt), self.completion_tokens, self._since_arrival(), first,
                             self.params.n, reasons)
        self._end_span(reasons)

    def _end_span(self, finish_reasons: list[str]) -> None:
        if self.span is not None:
            self.span.end(self.completion_tokens, self.cached_tokens, finish_reasons, self._since_arrival(),
                          self.resumes)

    def _observe_inter_token_latency(self, sequence: Sequence) -> None:
        """The time since the sequence's previous tokens came (vLLM's inter-token latency; beam search reports
        its beams once, at the end: nothing to time)."""
        now, last = time.perf_counter(), sequence.last_tokens_at
        sequence.last_tokens_at = now
        if last is not None and not self.params.use_beam_search:
            self._metrics.inter_token.observe(now - last)

    def record_abandoned(self) -> None:
        """A run given up before it was read (its request failed, or its client left, first): its
        sequences ended as aborted."""
        if not (self._recorded or self._read):
            self._recorded = True
            self._metrics.request_success.labels(finished_reason="abort").inc(len(self._sequences))
            self._end_span(["abort"] * len(self._sequences))

    async def _next(self):
        """The request's next output (None once it ended), from the scheduler it runs on now."""
        try:
            return await anext(self._stream, None)
        except SessionLost as exc:
            if self._resumer is None or not self._resumer.may_resume(exc, self.resumes):
                raise
            lost = exc
        self._skip_prompt_logprobs = len(self.prompt_logprobs) - 1 if self.prompt_logprobs else 0
        resumes_left = self._resumer.policy.max_resumes - self.resumes
        try:
            first, used = await self._resumer.resubmit(self._resubmission(), lost, resumes_left, self._take_stream,
                                                       lambda: self._aborted)
        except SessionLost:
            self.resumes = self._resumer.policy.max_resumes
            raise
        self.resumes += used
        return first

    def _take_stream(self, stream: SubmitStream) -> None:
        self._stream = stream

    def _resubmission(self) -> EngineRequest:
        """The request again: once any token came, its unfinished sequences carry on after theirs (the
        prompt's logprobs came before them); until then it starts over."""
        if not any(sequence.token_ids for sequence in self._sequences):
            return self.request
        resumption = Resumption({sequence.index: list(sequence.token_ids) for sequence in self._sequences
                                 if not sequence.done})
        return replace(self.request, resumption=resumption, params=replace(self.params, prompt_logprobs=None))

    def _apply(self, message) -> SeqDelta | None:
        # Every streamed token comes through here: each protobuf field is read once.
        if self.request.params.prompt_logprobs is not None and message.prompt_logprobs:
            self._take_prompt_logprobs(message.prompt_logprobs)
        if message.num_cached_tokens:  # (a resumed request's count covers its earlier outputs too)
            self.cached_tokens = max(self.cached_tokens, min(message.num_cached_tokens, len(self.prompt)))
        sequence = self._sequences[message.seq_index]
        if sequence.done:  # stopped by a stop string; the engine may still be running it for a moment
            return None
        delta = sequence.take(message, self._logprob)
        self.completion_tokens += len(delta.token_ids)
        if delta.finish_reason is not None:
            self.finish_reasons.append(delta.finish_reason)
            if not message.finish_reason and not self.finished:  # a stop string: its siblings run on, so
                self._stream.stop_sequence(sequence.index, delta.stop_reason)  # free this one's blocks now
        return delta

    def _take_prompt_logprobs(self, positions) -> None:
        """The prompt's logprobs as they come (with chunked prefill, a chunk's at a time), less those a run
        started over sends again."""
        if self._skip_prompt_logprobs:
            skip = min(self._skip_prompt_logprobs, len(positions))
            self._skip_prompt_logprobs -= skip
            positions = positions[skip:]
        self.prompt_logprobs = (self.prompt_logprobs or [None]) + [self.model.logprob(p) for p in positions]
