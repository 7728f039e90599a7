"""The gateway's span of one engine request, "llm_request" as vLLM names its span of a request: from its
submission to its end, with vLLM's attributes as the client sees them (time to first token, end to end,
usage). The request carries the span's context to the scheduler, whose spans of it are its children; a
request resumed at another scheduler carries the same context, so its second life joins the same trace."""

from __future__ import annotations

from dataclasses import replace

from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from shared import span_attributes as attrs
from shared.request import EngineRequest
from shared.tracing import carrier_of


class RunSpan:
    def __init__(self, tracer: Tracer, request: EngineRequest, model_name: str):
        """A child of the current span (the HTTP request's, or the gRPC call's)."""
        self._span = tracer.start_span("llm_request", kind=SpanKind.CLIENT, attributes={
            **attrs.request_attributes(request), attrs.RESPONSE_MODEL: model_name})
        self.request = replace(request, trace_context=carrier_of(self._span))  # what to submit
        self._ended = False

    def first_output(self, seconds: float) -> None:
        """Seconds from the request's arrival to its first output."""
        self._span.set_attribute(attrs.LATENCY_TIME_TO_FIRST_TOKEN, seconds)

    def end(self, completion_tokens: int, cached_tokens: int, finish_reasons: list[str], e2e_s: float,
            resumes: int) -> None:
        """The request ended (finished, aborted, or its client gone); only the first call counts."""
        if self._ended:
            return
        self._ended = True
        self._span.set_attributes({attrs.USAGE_COMPLETION_TOKENS: completion_tokens,
                                   attrs.CACHED_PROMPT_TOKENS: cached_tokens,
                                   attrs.RESPONSE_FINISH_REASONS: finish_reasons, attrs.LATENCY_E2E: e2e_s,
                                   attrs.NUM_RESUMES: resumes})
        self._span.end()

    def fail(self, error: BaseException) -> None:
        """It failed before any output (refused by the scheduler, none reachable, cancelled)."""
        if self._ended:
            return
        self._ended = True
        self._span.record_exception(error)
        self._span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        self._span.end()
