"""Each HTTP request's id and count: the client's X-Request-Id (or a new one) bound into every log line and
echoed in the response, and the response counted by endpoint and status in the gateway's metrics."""

from __future__ import annotations

import uuid

from shared.logging import bind_request_id, clear_request_id

REQUEST_ID = "pagedserve.request_id"  # where the middleware leaves the request id in the ASGI scope
# The endpoints counted under their own path (any other is "other": a client cannot grow the metrics).
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify",
             "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/models", "/tokenize",
             "/detokenize", "/version", "/health", "/metrics", "/invocations", "/ping", "/load", "/tokenizer_info"}


class RequestContext:
    """Pure ASGI (BaseHTTPMiddleware would get in the way of stream cancellation): takes the
    client's X-Request-Id or makes one, binds it into every log line, echoes it, counts the response."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope[REQUEST_ID] = request_id
        bind_request_id(request_id)
        status = 500

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            path = scope.get("path", "")
            self.metrics.requests.labels(endpoint=path if path in ENDPOINTS else "other", status=str(status)).inc()
            clear_request_id()
