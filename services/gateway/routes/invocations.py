"""SageMaker's POST /invocations: every API at one endpoint (invocations.py tells which from the body)."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Request

from services.gateway.generator import Generator
from services.gateway.invocations import OPENAPI_BODY, invocation
from services.gateway.openapi import STREAMED
from services.gateway.respond import respond
from shared.invalid_parameter import InvalidParameter


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    routes = APIRouter()

    @routes.post("/invocations", responses=doc(400, 404, 429, 503, extra=STREAMED), openapi_extra=OPENAPI_BODY)
    async def invocations(request: Request):
        """SageMaker's: the body's shape says which API it is for (invocations.py)."""
        body, create = invocation(await gen.model(), await json_body(request))
        return await respond(gen, request, create, body)

    return routes


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
