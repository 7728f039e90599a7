"""The OpenAI-compatible HTTP API (FastAPI): routes, SSE, errors as OpenAI error objects, metrics."""

from __future__ import annotations

import asyncio
import functools
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from services.gateway.auth import OPEN_PATHS, Authenticator, DuplicateCredentials, single_authorization
from services.gateway.body_limit import BodySizeLimit
from services.gateway.classify_api import ClassificationRequest, create_classification
from services.gateway.embeddings_api import EmbeddingRequest, create_embeddings
from services.gateway.generator import Generator
from services.gateway.health import serving_problem
from services.gateway.http_limits import HttpLimits
from services.gateway.invocations import OPENAPI_BODY, invocation
from services.gateway.lora_api import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, load_lora_adapter,
                                       unload_lora_adapter)
from services.gateway.openai_api import create_chat_completion, create_completion
from services.gateway.openapi import PLAIN_TEXT, STREAMED, documented, errors_as_json
from services.gateway.prompt_bound import check_prompt_bound
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.rate_limits import RateLimited
from services.gateway.responses_api import create_response
from services.gateway.responses_protocol import ResponsesRequest
from services.gateway.score_api import RerankRequest, ScoreRequest, create_rerank, create_score
from services.gateway.server_load import LoadTracking, ServerLoad
from services.gateway.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from services.gateway.tokenizer_info import tokenizer_info
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable, Unauthenticated
from shared.invalid_parameter import InvalidParameter
from shared.logging import bind_request_id, clear_request_id, setup_logging
from shared.version import __version__

log = setup_logging("gateway")

REQUEST_ID = "pagedserve.request_id"  # where the middleware leaves the request id in the ASGI scope
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/classify",
             "/v1/classify", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/v1/models", "/tokenize", "/detokenize", "/version", "/health",
             "/metrics", "/invocations", "/ping", "/load", "/tokenizer_info"}
API_KEY = "pagedserve.api_key"  # where the auth middleware leaves the caller's ApiKey in the ASGI scope


# --- errors ------------------------------------------------------------------------------------------

HTTP_KINDS = {404: ("NotFoundError", "not_found"), 405: ("MethodNotAllowedError", "method_not_allowed"),
              408: ("RequestTimeoutError", "request_timeout"), 413: ("RequestTooLargeError", "request_too_large"),
              431: ("RequestHeaderFieldsTooLargeError", "request_header_fields_too_large"),
              503: ("ServiceUnavailableError", "service_unavailable")}


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
    elif isinstance(exc, HTTPException):  # the router's and the HTTP layer's (http_protocol.py, body_limit.py)
        status = exc.status_code
        kind, code = HTTP_KINDS.get(status, ("BadRequestError", "invalid_request") if status < 500 else
                                    ("InternalServerError", "internal_error"))
        return status, {"error": {"message": str(exc.detail), "type": kind, "param": None, "code": code}}
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
    status, body = error_body(exc)
    return JSONResponse(body, status_code=status, headers=exc.headers)


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
        try:
            authorization = single_authorization([value.decode("latin-1") for name, value in scope.get("headers") or ()
                                                  if name == b"authorization"])
            scope[API_KEY] = await self.auth.authenticate(authorization)
        except (Unauthenticated, ServiceUnavailable, DuplicateCredentials) as exc:
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


async def json_body(request: Request):
    """The request's body as JSON, for a route that parses it itself."""
    content_type = request.headers.get("content-type", "")
    if "json" not in content_type:
        raise InvalidParameter(f"the request body must be a JSON object with Content-Type: application/json (it was "
                               f"sent as {content_type or 'no content type'!r})")
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidParameter(f"malformed JSON: {exc}") from None


def create_app(gen: Generator, allowed_origins: tuple[str, ...] = ("*",), auth: Authenticator | None = None,
               runtime_lora_updating: bool = False, limits: HttpLimits = HttpLimits(),
               server_load_tracking: bool = False, tokenizer_info_endpoint: bool = False) -> FastAPI:
    """allowed_origins: the browser origins CORS lets call the API (as vLLM: any, by default; none: no CORS).
    auth: the API keys a request must carry (None or none configured: the gateway is open);
    runtime_lora_updating: serve vLLM's load/unload LoRA adapter endpoints (lora_api.py);
    limits: the HTTP server's (the app keeps the body size; http_protocol.py the rest);
    server_load_tracking, tokenizer_info_endpoint: serve vLLM's /load and /tokenizer_info."""
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
    app.add_middleware(RequestContext, metrics=gen.metrics)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    for kind in (ValueError, TypeError, NotFound, ServiceUnavailable, ResourceExhausted, Unauthenticated, TimeoutError):
        app.add_exception_handler(kind, lambda request, exc: error_response(exc))
    app.add_exception_handler(Exception, _internal_error)  # still an OpenAI error object, never a bare 500
    doc = functools.partial(documented, keyed=keyed)  # what /openapi.json says a route answers (openapi.py)
    open_doc = functools.partial(documented, keyed=False)  # (a route of OPEN_PATHS)

    async def respond(request: Request, create, body):
        try:
            await check_prompt_bound(gen, body)
            result = await _unless_disconnected(request, create(gen, body, request.scope[REQUEST_ID],
                                                                request.scope.get(API_KEY)))
        except (ValueError, TypeError, NotFound, ServiceUnavailable, ResourceExhausted, TimeoutError) as exc:
            return error_response(exc)
        if result is None:  # nobody to answer; 499 as nginx logs a client that closed the request
            return Response(status_code=499)
        if isinstance(result, dict):
            return JSONResponse(result)
        return EventStream(result)

    @app.post("/v1/completions", responses=doc(400, 404, 429, 503, extra=STREAMED))
    async def completions(body: CompletionRequest, request: Request):
        return await respond(request, create_completion, body)

    @app.post("/v1/chat/completions", responses=doc(400, 404, 429, 503, extra=STREAMED))
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

    @app.post("/v1/embeddings", responses=doc(400, 404, 429, 503))
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await respond(request, create_embeddings, body)

    for path in ("/classify", "/v1/classify"):  # vLLM's path, and SGLang's
        @app.post(path, responses=doc(400, 404, 429, 503))
        async def classify(body: ClassificationRequest, request: Request):
            return await respond(request, create_classification, body)

    # vLLM's paths: scores at /score and /v1/score; reranking also at Jina's /v1 and Cohere's /v2.
    for path in ("/score", "/v1/score"):
        @app.post(path, responses=doc(400, 404, 429, 503))
        async def score(body: ScoreRequest, request: Request):
            return await respond(request, create_score, body)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @app.post(path, responses=doc(400, 404, 429, 503))
        async def rerank(body: RerankRequest, request: Request):
            return await respond(request, create_rerank, body)

    @app.post("/v1/responses", responses=doc(400, 404, 429, 503, extra=STREAMED))
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(request, create_response, body)

    @app.post("/invocations", responses=doc(400, 404, 429, 503, extra=STREAMED), openapi_extra=OPENAPI_BODY)
    async def invocations(request: Request):
        """SageMaker's: the body's shape says which API it is for (invocations.py)."""
        body, create = invocation(await gen.model(), await json_body(request))
        return await respond(request, create, body)

    @app.get("/v1/models", responses=doc(503))
    async def models():
        served = await gen.model()
        return {"object": "list", "data": [model_card(served, name=name) for name in served.names] +
                [model_card(served, adapter) for adapter in served.adapters.values()]}

    @app.get("/v1/models/{model_id:path}", responses=doc(404, 503))
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
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                  responses=doc(400, 404, 503, extra=PLAIN_TEXT))
        async def load_adapter(body: LoadLoRAAdapterRequest):
            return await plain_text(load_lora_adapter, body)

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                  responses=doc(400, 404, 503, extra=PLAIN_TEXT))
        async def unload_adapter(body: UnloadLoRAAdapterRequest):
            return await plain_text(unload_lora_adapter, body)

    @app.post("/tokenize", responses=doc(400, 404, 503))
    async def tokenize_prompt(body: TokenizeRequest):
        return await tokenize(gen, body)

    @app.post("/detokenize", responses=doc(400, 404, 503))
    async def detokenize_tokens(body: DetokenizeRequest):
        return await detokenize(gen, body)

    @app.get("/version", responses=open_doc())
    async def version():
        return {"version": __version__}

    @app.get("/health", responses=open_doc(503))
    @app.get("/ping", responses=open_doc(503), operation_id="ping_get")  # SageMaker's (as vLLM's: /health)
    @app.post("/ping", responses=open_doc(503), operation_id="ping_post")
    async def health():
        problem = await serving_problem(gen, auth)
        return {"status": "ok"} if problem is None else error_response(ServiceUnavailable(problem))

    if load is not None:
        @app.get("/load", responses=open_doc())
        async def server_load():
            return {"server_load": load.in_flight}

    if tokenizer_info_endpoint:
        @app.get("/tokenizer_info", responses=doc(503))
        async def get_tokenizer_info():
            return tokenizer_info(await gen.model())

    @app.get("/metrics", response_class=PlainTextResponse, responses=open_doc())
    async def metrics():
        stats = await gen.client.stats()
        return Response(gen.metrics.render(stats, gen.client.routable(), gen.known_model_name()),
                        media_type=CONTENT_TYPE_LATEST)

    errors_as_json(app)
    return app
