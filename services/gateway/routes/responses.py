"""OpenAI's Responses API: POST /v1/responses."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from services.gateway.generator import Generator
from services.gateway.openapi import STREAMED
from services.gateway.respond import respond
from services.gateway.responses_api import create_response
from services.gateway.responses_protocol import ResponsesRequest


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses", responses=doc(400, 404, 429, 503, extra=STREAMED))
    async def responses(body: ResponsesRequest, request: Request):
        return await respond(gen, request, create_response, body)

    return routes
