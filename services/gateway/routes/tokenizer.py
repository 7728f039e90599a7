"""vLLM's tokenizer endpoints: POST /tokenize and /detokenize (tokenizer_api.py) and, with
--enable-tokenizer-info-endpoint, GET /tokenizer_info (tokenizer_info.py)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter

from services.gateway.generator import Generator
from services.gateway.tokenizer_api import DetokenizeRequest, TokenizeRequest, detokenize, tokenize
from services.gateway.tokenizer_info import tokenizer_info


def router(gen: Generator, doc: Callable[..., dict], info_endpoint: bool = False) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize", responses=doc(400, 404, 503))
    async def tokenize_prompt(body: TokenizeRequest):
        return await tokenize(gen, body)

    @routes.post("/detokenize", responses=doc(400, 404, 503))
    async def detokenize_tokens(body: DetokenizeRequest):
        return await detokenize(gen, body)

    if info_endpoint:
        @routes.get("/tokenizer_info", responses=doc(503))
        async def get_tokenizer_info():
            return tokenizer_info(await gen.model())

    return routes
