"""vLLM's server load (--enable-server-load-tracking, GET /load): how many requests are in flight at the
endpoints that run the engine, from their arrival to their answer's last byte (a stream's too). Load-aware
routers poll it to pick the least loaded server."""

from __future__ import annotations

TRACKED = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify",
                     "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/invocations"})


class ServerLoad:
    def __init__(self):
        self.in_flight = 0


class LoadTracking:
    """Pure ASGI: counts the requests to TRACKED paths into a ServerLoad while they last."""

    def __init__(self, app, load: ServerLoad):
        self.app, self.load = app, load

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") not in TRACKED or scope.get("method") != "POST":
            return await self.app(scope, receive, send)
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1
