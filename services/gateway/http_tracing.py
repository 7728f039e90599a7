"""Each HTTP request that does work (a POST) as a server span, continuing the client's trace from its
`traceparent` header (or starting one). Installed only with --otlp-traces-endpoint.

The span is the current one while the request is served, streaming included, so the gateway's spans of
its work (tokenize, llm_request) are its children. GETs are probes and listings (/health, /metrics,
/v1/models): traced, they would bury the requests in a trace store."""

from __future__ import annotations

from opentelemetry.trace import SpanKind, Status, StatusCode

from services.gateway.request_context import ENDPOINTS, REQUEST_ID
from shared import span_attributes as attrs
from shared.tracing import Tracing, context_from, trace_headers


class TraceRequests:
    """Pure ASGI, inside RequestContext (whose request id it reads) and outside everything else."""

    def __init__(self, app, tracing: Tracing):
        self.app, self.tracer = app, tracing.tracer

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = trace_headers((name.decode("latin-1"), value.decode("latin-1"))
                                for name, value in scope.get("headers") or ())
        # A name from the known endpoints only: a client must not make a span name per URL it invents.
        name = f"POST {path}" if path in ENDPOINTS else "POST"
        with self.tracer.start_as_current_span(name, context=context_from(headers), kind=SpanKind.SERVER,
                                               attributes={"http.request.method": "POST", "url.path": path,
                                                           attrs.REQUEST_ID: scope.get(REQUEST_ID, "")}) as span:
            async def send_traced(message):
                if message["type"] == "http.response.start":
                    status = message["status"]
                    span.set_attribute("http.response.status_code", status)
                    if status >= 500:  # a client's error is not the server's (OpenTelemetry's HTTP rule)
                        span.set_status(Status(StatusCode.ERROR))
                await send(message)

            await self.app(scope, receive, send_traced)
