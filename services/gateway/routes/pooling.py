"""The pooling APIs: OpenAI's /v1/embeddings, vLLM's /classify, /score and /rerank (each also at the paths
vLLM serves it under: SGLang's /v1/classify, /v1/score, Jina's /v1/rerank and Cohere's /v2/rerank)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request

from services.gateway.classify_api import ClassificationRequest, create_classification
from services.gateway.embeddings_api import EmbeddingRequest, create_embeddings
from services.gateway.generator import Generator
from services.gateway.respond import respond
from services.gateway.score_api import RerankRequest, ScoreRequest, create_rerank, create_score


def router(gen: Generator, doc: Callable[..., dict]) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/embeddings", responses=doc(400, 404, 429, 503))
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await respond(gen, request, create_embeddings, body)

    for path in ("/classify", "/v1/classify"):
        @routes.post(path, responses=doc(400, 404, 429, 503))
        async def classify(body: ClassificationRequest, request: Request):
            return await respond(gen, request, create_classification, body)

    for path in ("/score", "/v1/score"):
        @routes.post(path, responses=doc(400, 404, 429, 503))
        async def score(body: ScoreRequest, request: Request):
            return await respond(gen, request, create_score, body)

    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        @routes.post(path, responses=doc(400, 404, 429, 503))
        async def rerank(body: RerankRequest, request: Request):
            return await respond(gen, request, create_rerank, body)

    return routes
