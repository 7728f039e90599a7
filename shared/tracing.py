"""Tracing with OpenTelemetry, as vLLM's --otlp-traces-endpoint: each service sends its spans to an OTLP/gRPC
collector, and one request's spans, in every service, share its W3C trace context.

Off by default: a service without the flag holds None where a Tracing would be, imports no OpenTelemetry SDK
module, and makes no span. Each service has a TracerProvider of its own rather than the process-wide one, so
that no library instrumented against the global provider starts tracing beside ours.

The context travels as the W3C TraceContext propagator writes it, a carrier of `traceparent` (and
`tracestate`): from a client's HTTP headers or gRPC metadata, in the engine request to the scheduler, and in
each new sequence to the workers (a Session or Steps stream carries many requests, so their own gRPC metadata
cannot).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared.options import option

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

TRACE_HEADERS = ("traceparent", "tracestate")  # what the W3C TraceContext propagator reads and writes
# One export's limit, retries included (the exporter's default is 10 s): it bounds what a stopping service
# spends on a collector that is down (measured: 7 s at the default, 3 s at this).
EXPORT_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class TracingOptions:
    """Every service's (gateway, scheduler, worker): each sends its own spans."""
    otlp_traces_endpoint: str | None = option(
        None, "OpenTelemetry collector to send traces to over OTLP/gRPC, as vLLM's flag: http://host:4317 "
              "(plaintext) or https://host:4317 (TLS); OTEL_EXPORTER_OTLP_* variables (headers, certificates) "
              "apply (default: no tracing)")


class Tracing:
    """A service's tracer, over a TracerProvider of its own that batches spans to its exporter."""

    def __init__(self, provider: TracerProvider):
        self.provider = provider
        self.tracer: Tracer = provider.get_tracer("pagedserve")

    def flush(self) -> None:
        """Send the spans ended so far (the batch processor otherwise waits for its schedule)."""
        self.provider.force_flush(int(EXPORT_TIMEOUT_S * 1000))

    def shutdown(self) -> None:
        """At the service's stop: send what is left, then stop the exporter."""
        self.provider.shutdown()


def start_tracing(service: str, endpoint: str | None, exporter: SpanExporter | None = None) -> Tracing | None:
    """The service's Tracing, exporting to ``endpoint`` (or to ``exporter``: tests); None without either."""
    if endpoint is None and exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        timeout = None if _timeout_variable_set() else EXPORT_TIMEOUT_S
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
    provider = TracerProvider(resource=Resource.create({"service.name": f"pagedserve-{service}"}))
    # Batched off the caller's thread: a span costs the engine loop or a step an append to a queue.
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider)


def _timeout_variable_set() -> bool:
    """OpenTelemetry's own variables for the export timeout win over ours."""
    return any(os.environ.get(name) for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"))


def context_from(carrier: Mapping[str, str] | None) -> Context:
    """The trace context a carrier holds (HTTP headers, gRPC metadata, a request's trace_context); an empty
    one (a new trace) when it holds none, or a malformed one."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(carrier or {})


def carrier_of(span: Span) -> dict[str, str]:
    """The span's context as a carrier (traceparent, tracestate): what the next service continues from."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def span_context_from(carrier: Mapping[str, str] | None) -> SpanContext | None:
    """The sampled span context a carrier names; None when it names none, or one not sampled (nothing of
    its trace is recorded: a link to it would point nowhere)."""
    from opentelemetry import trace

    context = trace.get_current_span(context_from(carrier)).get_span_context()
    return context if context.is_valid and context.trace_flags.sampled else None


def trace_headers(pairs) -> dict[str, str]:
    """The trace context's entries among (name, value) pairs (lowercase names: HTTP/2 and gRPC metadata,
    ASGI headers decoded)."""
    return {name: value for name, value in pairs if name in TRACE_HEADERS}


def traced_call(tracer: Tracer, name: str, fn, *args):
    """fn(*args) inside a span of that name, a child of the current one (a thread from asyncio.to_thread
    inherits the caller's)."""
    with tracer.start_as_current_span(name):
        return fn(*args)
