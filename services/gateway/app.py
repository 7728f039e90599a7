"""The OpenAI-compatible HTTP API (FastAPI): the middleware around every request, errors as OpenAI error objects
(http_errors.py), and the routes, one router per API family (routes/)."""

from __future__ import annotations

import functools

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from services.gateway.api_key_auth import ApiKeyAuth
from services.gateway.auth import Authenticator
from services.gateway.body_limit import BodySizeLimit
from services.gateway.generator import Generator
from services.gateway.http_errors import error_response, install_error_handlers
from services.gateway.http_limits import HttpLimits
from services.gateway.openapi import documented, errors_as_json
from services.gateway.request_context import RequestContext
from services.gateway.routes import completions, invocations, lora, models, pooling, responses, status, tokenizer
from services.gateway.server_load import LoadTracking, ServerLoad
from shared.tracing import Tracing


def create_app(gen: Generator, allowed_origins: tuple[str, ...] = ("*",), auth: Authenticator | None = None,
               runtime_lora_updating: bool = False, limits: HttpLimits = HttpLimits(),
               server_load_tracking: bool = False, tokenizer_info_endpoint: bool = False,
               tracing: Tracing | None = None) -> FastAPI:
    """allowed_origins: the browser origins CORS lets call the API (as vLLM: any, by default; none: no CORS).
    auth: the API keys a request must carry (None or none configured: the gateway is open);
    runtime_lora_updating: serve vLLM's load/unload LoRA adapter endpoints (lora_api.py);
    limits: the HTTP server's (the app keeps the body size; http_protocol.py the rest);
    server_load_tracking, tokenizer_info_endpoint: serve vLLM's /load and /tokenizer_info;
    tracing: trace each POST (--otlp-traces-endpoint; http_tracing.py)."""
    app = FastAPI(title="pagedserve gateway", description="OpenAI-compatible API of pagedserve")
    load = ServerLoad() if server_load_tracking else None
    if load is not None:  # innermost: counts the requests that got through
        app.add_middleware(LoadTracking, load=load)
    keyed = auth is not None and auth.enabled
    if keyed:  # inside CORS, so that a 401 carries CORS headers too
        app.add_middleware(ApiKeyAuth, auth=auth, metrics=gen.metrics)
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes, refuse=error_response)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    if tracing is not None:  # inside RequestContext: the span names the request id it chose
        from services.gateway.http_tracing import TraceRequests

        app.add_middleware(TraceRequests, tracing=tracing)
    app.add_middleware(RequestContext, metrics=gen.metrics)
    install_error_handlers(app)
    doc = functools.partial(documented, keyed=keyed)  # what /openapi.json says a route answers (openapi.py)
    for router in (completions.router(gen, doc), pooling.router(gen, doc), responses.router(gen, doc),
                   invocations.router(gen, doc), models.router(gen, doc)):
        app.include_router(router)
    if runtime_lora_updating:
        app.include_router(lora.router(gen, doc))
    app.include_router(tokenizer.router(gen, doc, tokenizer_info_endpoint))
    app.include_router(status.router(gen, auth, load))
    errors_as_json(app)
    return app
