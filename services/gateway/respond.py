"""How a route that runs the engine answers: its create function (openai_api.py, embeddings_api.py, ...) runs
while the client waits, and its result goes out as JSON, or as an event stream for a streamed reply."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from services.gateway.api_key_auth import API_KEY
from services.gateway.event_stream import EventStream
from services.gateway.generator import Generator
from services.gateway.http_errors import error_response
from services.gateway.prompt_bound import check_prompt_bound
from services.gateway.request_context import REQUEST_ID
from shared.grpc_errors import NotFound, ResourceExhausted, ServiceUnavailable
from shared.logging import setup_logging

log = setup_logging("gateway")


async def respond(gen: Generator, request: Request, create, body) -> Response:
    """``create(gen, body, request_id, api_key)``'s answer: a dict as JSON, a reply as server-sent events."""
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
