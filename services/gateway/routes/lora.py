"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter (lora_api.py), served
with --allow-runtime-lora-updating."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from services.gateway.generator import Generator
from services.gateway.http_errors import error_response
from services.gateway.lora_api import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, load_lora_adapter,
                                       unload_lora_adapter)
from services.gateway.openapi import PLAIN_TEXT
from shared.grpc_errors import NotFound, ServiceUnavailable


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    routes = APIRouter()

    async def plain_text(action, body):
        """vLLM's LoRA endpoints answer success as plain text, errors as OpenAI error objects."""
        try:
            return PlainTextResponse(await action(gen, body))
        except (ValueError, NotFound, ServiceUnavailable) as exc:
            return error_response(exc)

    @routes.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                 responses=doc(400, 404, 503, extra=PLAIN_TEXT))
    async def load_adapter(body: LoadLoRAAdapterRequest):
        return await plain_text(load_lora_adapter, body)

    @routes.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses=doc(400, 404, 503, extra=PLAIN_TEXT))
    async def unload_adapter(body: UnloadLoRAAdapterRequest):
        return await plain_text(unload_lora_adapter, body)

    return routes
