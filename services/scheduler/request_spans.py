"""The scheduler's spans of each request (--otlp-traces-endpoint): "engine_request" from its admission to
its end, a child of the gateway's span whose context the request carries (or a trace of its own), and
within it "queue", "prefill" and "decode", with vLLM's latency attributes.

Nothing happens per step: the span starts at admission, and its phases are made when the request ends,
from the times the scheduler keeps for vLLM's histograms anyway (request_stats.py: queued, first
scheduled, first and last token). The request goes on carrying this span's context, which each new
sequence takes to the workers: their step spans link to it."""

from __future__ import annotations

import time
from dataclasses import replace

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer

from services.scheduler.request_stats import SequenceTimes
from services.scheduler.sequence import Sequence
from shared import span_attributes as attrs
from shared.request import EngineRequest
from shared.tracing import carrier_of, context_from


class RequestSpans:
    """Touched by the engine loop's thread only, as the engine is."""

    def __init__(self, tracer: Tracer, model: str):
        self.tracer, self.model = tracer, model
        self._spans: dict[str, Span] = {}  # by request id, from admission to the end

    def admitted(self, request: EngineRequest) -> EngineRequest:
        """Start the request's span; the request as the engine should keep it: carrying the span's context."""
        attributes = {**attrs.request_attributes(request), attrs.RESPONSE_MODEL: self.model}
        span = self.tracer.start_span("engine_request", context=context_from(request.trace_context),
                                      kind=SpanKind.SERVER, attributes=attributes)
        self._spans[request.request_id] = span
        return replace(request, trace_context=carrier_of(span))

    def refused(self, request_id: str, error: Exception) -> None:
        """Admission refused it (it could never run)."""
        span = self._spans.pop(request_id)
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
        span.end()

    def finished(self, seqs: list[Sequence], times: list[SequenceTimes]) -> None:
        """Its every sequence has ended (RequestStats.on_finished): its phases, its attributes, its end."""
        span = self._spans.pop(seqs[0].request_id, None)
        if span is None:
            return
        phases = _Phases(times)
        parent = trace.set_span_in_context(span)
        for name, start, end in phases.spans():
            self.tracer.start_span(name, context=parent, start_time=start).end(end_time=end)
        made = sum(len(s.output_token_ids) - t.num_resumed_tokens for s, t in zip(seqs, times))  # here, not resumed
        span.set_attributes({
            **phases.latencies(),
            attrs.USAGE_COMPLETION_TOKENS: made,
            attrs.USAGE_NUM_SEQUENCES: len(seqs),
            attrs.CACHED_PROMPT_TOKENS: seqs[0].num_cached_tokens or 0,
            attrs.NUM_PREEMPTIONS: sum(t.num_preemptions for t in times),
            attrs.RESPONSE_FINISH_REASONS: [s.status.value for s in seqs]})
        span.end()


class _Phases:
    """A request's times over its sequences (the first queued, scheduled and first token; the last token), on
    time.monotonic()'s clock, and as the epoch nanoseconds spans take."""

    def __init__(self, times: list[SequenceTimes]):
        self.queued = min((t.queued for t in times if t.queued is not None), default=None)
        self.scheduled = min((t.scheduled for t in times if t.scheduled is not None), default=None)
        self.first_token = min((t.first_token for t in times if t.first_token is not None), default=None)
        self.last_token = max((t.last_token for t in times if t.last_token is not None), default=None)
        self.now = time.monotonic()
        self._epoch_ns = time.time_ns() - int(self.now * 1e9)  # monotonic seconds + this = epoch nanoseconds

    def ns(self, monotonic: float) -> int:
        return self._epoch_ns + int(monotonic * 1e9)

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each phase it reached; one cut short by an abort ends now."""
        marks = [self.queued, self.scheduled, self.first_token]
        ends = [self.scheduled, self.first_token, self.last_token]
        return [(name, self.ns(start), self.ns(self.now if end is None else end))
                for name, start, end in zip(("queue", "prefill", "decode"), marks, ends)
                if start is not None and (name != "decode" or end is not None)]

    def latencies(self) -> dict[str, float]:
        """vLLM's: queue (queued to scheduled), prefill (to the first token), decode (first to last token),
        inference (scheduled to the last token); those it reached."""
        found = {}
        if self.queued is not None and self.scheduled is not None:
            found[attrs.LATENCY_TIME_IN_QUEUE] = self.scheduled - self.queued
        if self.scheduled is not None and self.first_token is not None:
            found[attrs.LATENCY_TIME_IN_MODEL_PREFILL] = self.first_token - self.scheduled
            found[attrs.LATENCY_TIME_IN_MODEL_DECODE] = self.last_token - self.first_token
            found[attrs.LATENCY_TIME_IN_MODEL_INFERENCE] = self.last_token - self.scheduled
        return found
