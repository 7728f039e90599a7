"""A public gRPC call as a server span, continuing the client's trace from its `traceparent` metadata (or
starting one); nothing without --otlp-traces-endpoint. The gRPC twin of http_tracing.py."""

from __future__ import annotations

import contextlib

from shared.tracing import Tracing, context_from, trace_headers

SERVICE = "pagedserve.api.v1.Generation"


def call_span(tracing: Tracing | None, context, method: str):
    """A context manager: the call's span, current while it runs (its tokenize and llm_request spans are its
    children)."""
    if tracing is None:
        return contextlib.nullcontext()
    from opentelemetry.trace import SpanKind

    metadata = trace_headers(context.invocation_metadata() or ())
    # An aborted call (a status for the client) is its answer, not an exception of the server's.
    return tracing.tracer.start_as_current_span(
        f"{SERVICE}/{method}", context=context_from(metadata), kind=SpanKind.SERVER, record_exception=False,
        set_status_on_exception=False, attributes={"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": method})
