"""OpenAI's model list, GET /v1/models, and one model's card, GET /v1/models/{id}: the served model under each
of its names, and its LoRA adapters (vLLM's fields: an adapter's directory as its root, its base as parent)."""

from __future__ import annotations

import time
from collections.abc import Callable

from fastapi import APIRouter

from services.gateway.generator import Generator
from services.gateway.http_errors import error_response
from services.gateway.lora_modules import LoRAModule
from services.gateway.model import Model
from shared.grpc_errors import NotFound


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    routes = APIRouter()

    @routes.get("/v1/models", responses=doc(503))
    async def models():
        served = await gen.model()
        return {"object": "list", "data": [model_card(served, name=name) for name in served.names] +
                [model_card(served, adapter) for adapter in served.adapters.values()]}

    @routes.get("/v1/models/{model_id:path}", responses=doc(404, 503))
    async def model(model_id: str):
        served = await gen.model()
        try:
            lora = served.resolve(model_id)
        except NotFound as exc:
            return error_response(exc)
        if lora is not None:
            return model_card(served, served.adapters[lora.name])
        return model_card(served, name=model_id if model_id in served.names else None)

    return routes


def model_card(model: Model, adapter: LoRAModule | None = None, name: str | None = None) -> dict:
    """The model's card (under ``name``, one of its names), or an adapter's."""
    card = {"id": name or model.name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
            "root": model.path, "max_model_len": model.max_model_len, "parent": None}
    if adapter is not None:
        card.update(id=adapter.lora.name, root=adapter.lora.path, parent=adapter.base_model_name or model.name)
    return card
