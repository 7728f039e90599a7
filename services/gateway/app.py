"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE, errors as OpenAI error objects, metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from pagedserve import __version__
from services.gateway.auth import OPEN_PATHS, Authenticator
from services.gateway.classify_api import ClassificationRequest, create_classification
from services.gateway.embeddings_api import EmbeddingRequest, create_embeddings
from services.gateway.generation import Generator, InvalidParameter
from services.gateway.lora_api import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, load_lora_adapter,
                                       unload_lora_adapter)
from services.gateway.openai_api import create_chat_completion, create_completion
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.rate_limits import RateLimited
from services.gateway.responses_api import create_response
from services.gateway.responses_protocol import ResponsesRequest
from services.gateway.score_api import RerankRequest, ScoreRequest, create_rerank, create_score
from services.gateway.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable, Unauthenticated
from shared.logging import bind_request_id, clear_request_id, setup_logging

log = setup_logging("gateway")

REQUEST_ID = "pagedserve.request_id"  # where the middleware leaves the request id in the ASGI scope
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify",
             "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/models", "/tokenize", "/detokenize", "/version", "/health",
             "/metrics"}
API_KEY = "pagedserve.api_key"  # where the auth middleware leaves the caller's ApiKey in the ASGI scope


# --- errors ------------------------------------------------------------------------------------------

def error_body(exc: BaseException) -> tuple[int, dict]:
    """The status and OpenAI error object for a domain error."""
    if isinstance(exc, RateLimited):
        status, kind, code = 429, exc.kind, "rate_limit_exceeded"  # OpenAI's type: what ran out
    elif isinstance(exc, ResourceExhausted):
        status, kind, code = 429, "TooManyRequestsError", "too_many_requests"
    elif isinstance(exc, Unauthenticated):
        status, kind, code = 401, "AuthenticationError", "invalid_api_key"
    elif isinstance(exc, NotFound):
        status, kind, code = 404, "NotFoundError", "model_not_found"
    elif isinstance(exc, (ValueError, TypeError)):
        status, kind, code = 400, "BadRequestError", "invalid_request"
    elif isinstance(exc, (ServiceUnavailable, TimeoutError)):
        status, kind, code = 503, "ServiceUnavailableError", "service_unavailable"
    else:
        status, kind, code = 500, "InternalServerError", "internal_error"
    message = str(exc) or type(exc).__name__
    return status, {"error": {"message": message, "type": kind, "param": getattr(exc, "param", None), "code": code}}


def error_response(exc: BaseException) -> JSONResponse:
    status, body = error_body(exc)
    if status >= 500:
        log.warning("request failed", status=status, error=body["error"]["message"])
    return JSONResponse(body, status_code=status, headers=error_headers(exc))


def error_headers(exc: BaseException) -> dict[str, str] | None:
    if isinstance(exc, Unauthenticated):
        return {"WWW-Authenticate": "Bearer"}
    if not isinstance(exc, ResourceExhausted):
        return None
    headers = {"Retry-After": str(exc.retry_after_s)}
    if isinstance(exc, RateLimited):  # as OpenAI's: which limit, and when it has room again
        headers[f"x-ratelimit-limit-{exc.kind}"] = str(exc.limit)
        headers[f"x-ratelimit-reset-{exc.kind}"] = f"{exc.retry_after_s}s"
    return headers


def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0]
    where = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        message = f"malformed JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return error_response(InvalidParameter(message))
    if not where:  # the body as a whole: not JSON at all, or not an object
        content_type = request.headers.get("content-type", "")
        hint = "" if "json" in content_type else f" (it was sent as {content_type or 'no content type'!r})"
        return error_response(InvalidParameter(f"the request body must be a JSON object with Content-Type: "
                                               f"application/json{hint}"))
    # With pydantic's error type, as pydantic words it (vLLM's clients match it, e.g. greater_than_equal).
    return error_response(InvalidParameter(f"{'.'.join(where)}: {first.get('msg')} [type={first.get('type')}]",
                                           where[0] if where else None))


def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    log.error("request failed", error=repr(exc), exc_info=exc)
    return error_response(exc)


def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    kind, code = {404: ("NotFoundError", "not_found"), 405: ("MethodNotAllowedError", "method_not_allowed")}.get(
        exc.status_code, ("BadRequestError", "invalid_request"))
    return JSONResponse({"error": {"message": str(exc.detail), "type": kind, "param": None, "code": code}},
                        status_code=exc.status_code, headers=exc.headers)


# --- request ids and counts ------------------------------------------------------------------------

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


class ApiKeyAuth:
    """Pure ASGI, innermost: every request but OPEN_PATHS' and CORS preflights needs a known API key
    (when the gateway has any); the caller's ApiKey goes into the scope for the rate limits."""

    def __init__(self, app, auth: Authenticator, metrics):
        self.app, self.auth, self.metrics = app, auth, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_PATHS or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        authorization = headers.get(b"authorization")
        try:
            scope[API_KEY] = await self.auth.authenticate(authorization.decode("latin-1") if authorization else None)
        except (Unauthenticated, ServiceUnavailable) as exc:
            if isinstance(exc, Unauthenticated):
                self.metrics.unauthenticated.inc()
            return await error_response(exc)(scope, receive, send)
        return await self.app(scope, receive, send)


# --- the app --------------------------------------------------------------------------------------------

async def _unless_disconnected(request: Request, work, poll_s: float = 0.25):
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away first:
    a non-streamed answer nobody will read should not keep holding KV blocks."""
    task = asyncio.ensure_future(work)
    try:
        while not (await asyncio.wait([task], timeout=poll_s))[0]:
            if await request.is_disconnected():
                log.info("client went away before the answer was ready; request aborted")
                return None
        return task.result()
    finally:
        if not task.done():
            task.cancel()  # the client left (or we are being cancelled): its cleanup aborts the engine requests


class EventStream(StreamingResponse):
    """A streamed reply as server-sent events, closed by `data: [DONE]` (chat, completions); an error after the headers
    went out becomes an error event. However the response ends (done, failed, client gone, or never
    started), the reply's engine requests are cancelled and its concurrency slot is freed.

    The chunks are framed and sent here rather than through a body iterator: this loop runs once
    per token per stream, so it keeps to one generator (the reply's) between the scheduler's
    output and the socket."""

    def __init__(self, reply):
        super().__init__((), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.reply = reply

    async def stream_response(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        events = self.reply.events()
        try:
            failed = False
            while not failed:
                try:
                    event = await events.__anext__()
                except StopAsyncIteration:
                    break
                except Exception as exc:  # the generation failed (a failed send is not: it propagates)
                    log.warning("stream failed", error=str(exc))
                    event, failed = self.reply.error_event(error_body(exc)[1]), True
                await send({"type": "http.response.body", "body": self.reply.frame(event), "more_body": True})
        finally:
            await events.aclose()  # a disconnect lands here too: the runs abort their requests at the scheduler
        await send({"type": "http.response.body", "body": self.reply.done_frame or b"", "more_body": False})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.reply.aclose()


def create_app(gen: Generator, allowed_origins: tuple[str, ...] = ("*",), auth: Authenticator | None = None,
               runtime_lora_updating: bool = False) -> FastAPI:
    """allowed_origins: the browser origins CORS lets call the API (as vLLM: any, by default; none: no CORS).
    auth: the API keys a request must carry (None or none configured: the gateway is open);
    runtime_lora_updating: serve vLLM's load/unload LoRA adapter endpoints (lora_api.py)."""
    app = FastAPI(title="pagedserve gateway", description="OpenAI-compatible API of pagedserve")
    if auth is not None and auth.enabled:  # inside CORS, so that a 401 carries CORS headers too
        app.add_middleware(ApiKeyAuth, auth=auth, metrics=gen.metrics)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["x-request-id"])
    app.add_middleware(RequestContext, metrics=gen.metrics)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for kind in (ValueError, TypeError, NotFound, ServiceUnavailable, ResourceExhausted, Unauthenticated, TimeoutError):
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))
    app.add_exception_handler(Exception, _internal_error)  # still an OpenAI error object, never a bare 500

    async def respond(request: Request, create, body):
        try:
            result = await _unless_disconnected(request, create(gen, body, request.scope[REQUEST_ID],
                                                                request.scope.get(API_KEY)))
        except (ValueError, TypeError, NotFound, ServiceUnavailable, ResourceExhausted, TimeoutError) as exc:
            return error_response(exc)
        if result is None:  # nobody to answer; 499 as nginx logs a client that closed the request
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return EventStream(result)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, create_completion, body)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(request, create_chat_completion, body)

    def model_card(model, adapter=None, name: str | None = None) -> dict:
        """The model's card (under ``name``, one of its names), or an adapter's (vLLM's fields: its directory
        as root, its base model as parent)."""
        card = {"id": name or model.name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
                "root": model.path, "max_model_len": model.max_model_len, "parent": None}
        if adapter is not None:
            card.update(id=adapter.lora.name, root=adapter.lora.path, parent=adapter.base_model_name or model.name)
        return card

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await respond(request, create_embeddings, body)

    for path in ("/classify", "/v1/classify"):  # vLLM's path, and SGLang's
        @app.post(path)
        async def classify(body: ClassificationRequest, request: Request):
            return await respond(request, create_classification, body)

    # vLLM's paths: scores at /score and /v1/score; reranking also at Jina's /v1 and Cohere's /v2.
    for path in ("/score", "/v1/score"):
        @app.post(path)
        async def score(body: ScoreRequest, request: Request):
            return await respond(request, create_score, body)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path)
        async def rerank(body: RerankRequest, request: Request):
            return await respond(request, create_rerank, body)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(request, create_response, body)

    @app.get("/v1/models")
    async def models():
        served = await gen.model()
        return {"object": "list", "data": [model_card(served, name=name) for name in served.names] +
                [model_card(served, adapter) for adapter in served.adapters.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        served = await gen.model()
        try:
            lora = served.resolve(model_id)
        except NotFound as exc:
            return error_response(exc)
        if lora is not None:
            return model_card(served, served.adapters[lora.name])
        return model_card(served, name=model_id if model_id in served.names else None)

    async def plain_text(action, body):
        """vLLM's LoRA endpoints answer success as plain text, errors as OpenAI error objects."""
        try:
            return PlainTextResponse(await action(gen, body))
        except (ValueError, NotFound, ServiceUnavailable) as exc:
            return error_response(exc)

    if runtime_lora_updating:
        @app.post("/v1/load_lora_adapter")
        async def load_adapter(body: LoadLoRAAdapterRequest):
            return await plain_text(load_lora_adapter, body)

        @app.post("/v1/unload_lora_adapter")
        async def unload_adapter(body: UnloadLoRAAdapterRequest):
            return await plain_text(unload_lora_adapter, body)

    @app.post("/tokenize")
    async def tokenize_prompt(body: TokenizeRequest):
        return await tokenize(gen, body)

    @app.post("/detokenize")
    async def detokenize_tokens(body: DetokenizeRequest):
        return await detokenize(gen, body)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        if await gen.client.healthy():
            return {"status": "ok"}
        return error_response(ServiceUnavailable(f"the scheduler at {gen.client.address} is not reachable or "
                                                 "not serving"))

    @app.get("/metrics")
    async def metrics():
        stats = await gen.client.stats()
        return Response(gen.metrics.render(stats, gen.client.routable(), gen.known_model_name()),
                        media_type=CONTENT_TYPE_LATEST)

    return app
