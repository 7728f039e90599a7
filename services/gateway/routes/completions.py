"""OpenAI's /v1/completions and /v1/chat/completions."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from services.gateway.generator import Generator
from services.gateway.openai_api import create_chat_completion, create_completion
from services.gateway.openapi import STREAMED
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.respond import respond


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    """doc: what /openapi.json says a route answers (openapi.documented, for this gateway's keys)."""
    routes = APIRouter()

    @routes.post("/v1/completions", responses=doc(400, 404, 429, 503, extra=STREAMED))
    async def completions(body: CompletionRequest, request: Request):
        return await respond(gen, request, create_completion, body)

    @routes.post("/v1/chat/completions", responses=doc(400, 404, 429, 503, extra=STREAMED))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await respond(gen, request, create_chat_completion, body)

    return routes
