"""What /openapi.json says each route answers, as the gateway answers it: every error is an OpenAI error
object (invalid input is a 400, never FastAPI's 422), a streamed answer is server-sent events, /metrics is
Prometheus' text format.

Routes declare their own errors with ``documented(...)`` (FastAPI's ``responses``); what any route may
answer comes with every one of them: 413 for a body over --http-max-body-size and, where requests need an
API key, 401 (and 400 for two Authorization headers). A declared "default" stands for what the HTTP layer
answers before a route runs (408, 431, 503 past the connection cap) or a failure of the gateway (500),
each an error object too; it also keeps FastAPI from adding its 422. Errors are JSON on the routes whose
success is plain text too (errors_as_json).
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str  # the kind: BadRequestError, NotFoundError, RateLimitError's "requests" or "tokens", ...
    param: str | None = None  # the request field at fault, where one is
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the gateway answers, as OpenAI's API does."""
    error: ErrorInfo


WHY = {
    400: "invalid parameters, malformed JSON, or a request the engine cannot honour",
    401: "no API key, or an unknown one (the gateway runs with --api-key or --api-key-store)",
    404: "an unknown model or adapter",
    413: "the request body is larger than --http-max-body-size",
    429: "past --max-concurrent-requests, or the API key's rate limits (with Retry-After)",
    503: "no scheduler serves (or the API key store is unreachable), or the gateway is shutting down",
    "default": "anything else the gateway refuses or fails at: 408 (a request that did not arrive in time), 431 "
               "(headers too large), 503 (a connection past --http-max-connections), 500",
}

# A streamed answer's events (the schema of an event stream describes one event, before OpenAPI 3.2).
STREAMED = {200: {"description": "the answer; with \"stream\": true, server-sent events",
                  "content": {"text/event-stream": {"schema": {
                      "type": "object", "required": ["data"], "properties": {
                          "data": {"type": "string", "description": "a chunk as JSON (chat, completions: then "
                                                                    "[DONE]; Responses: an event object)"},
                          "event": {"type": "string", "description": "the Responses API's event type"}}}}}}}
PLAIN_TEXT = {200: {"description": "success, as plain text", "content": {"text/plain": {"schema": {"type": "string"}}}}}


def documented(*statuses: int, keyed: bool, extra: dict | None = None) -> dict:
    """FastAPI ``responses`` for a route that may answer these error statuses (besides those every route may:
    413, the "default", and 401 and 400 where requests need a key); ``extra``: more, such as STREAMED."""
    wanted = {*statuses, 413, *((400, 401) if keyed else ())}
    responses: dict = {status: {"model": ErrorResponse, "description": WHY[status]} for status in sorted(wanted)}
    responses["default"] = {"model": ErrorResponse, "description": WHY["default"]}
    return {**responses, **(extra or {})}


def errors_as_json(app: FastAPI) -> None:
    """/openapi.json gives every error response as a JSON error object: FastAPI would give a route's errors its
    success's media type (text/plain for /metrics and the LoRA routes)."""
    build = app.openapi

    def openapi() -> dict:
        fresh = app.openapi_schema is None
        schema = build()  # (FastAPI's keeps what it made in app.openapi_schema)
        if fresh:
            for operation in (op for path in schema["paths"].values() for op in path.values()):
                for status, response in operation["responses"].items():
                    if status == "default" or status[0] in "45":
                        response["content"] = {"application/json": {"schema": {
                            "$ref": "#/components/schemas/ErrorResponse"}}}
        return schema

    app.openapi = openapi
