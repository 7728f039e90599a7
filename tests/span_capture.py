"""Tracing into memory, for in-process tests of the spans the services make (OpenTelemetry's SDK
InMemorySpanExporter behind the same Tracing a service starts)."""

from __future__ import annotations

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.tracing import Tracing, start_tracing

# A client's trace context, as W3C's example writes it: trace 4bf9...4736, its span 00f0...02b7, sampled.
CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class SpanCapture:
    def __init__(self, service: str):
        self.exporter = InMemorySpanExporter()
        self.tracing: Tracing = start_tracing(service, None, self.exporter)

    def spans(self) -> list[ReadableSpan]:
        """Every span ended so far (the batch processor flushed first)."""
        self.tracing.flush()
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[ReadableSpan]:
        return [span for span in self.spans() if span.name == name]

    def one(self, name: str) -> ReadableSpan:
        (span,) = self.named(name)
        return span

    def close(self) -> None:
        self.tracing.shutdown()


def parent_id(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


def ids(context) -> tuple[int, int] | None:
    """A span context's trace and span ids (one read from a carrier is remote: the same span all the same)."""
    return (context.trace_id, context.span_id) if context is not None else None
