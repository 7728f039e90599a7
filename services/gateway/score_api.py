"""vLLM's /score and /rerank (Jina's and Cohere's shape). Over an embedding model each pair's score is the
cosine similarity of the two texts' embeddings, each distinct text embedded once (a query against many
documents: the query once). Over a one-label classifier (a cross-encoder reranker) it is the model's score
of the pair tokenized together (through its activation, unless ``use_activation`` is false), one engine
request per pair; with a shared query first, pairs after the first step find its blocks in the prefix cache.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np

from pydantic import BaseModel, ConfigDict, field_validator

from services.gateway.api_keys import ApiKey
from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from shared.invalid_parameter import InvalidParameter
from shared.pooling import PoolingParams, check_cross_encoder, score_pairs, token_limit
from shared.request import check_runner


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    text_1: str | list[str]  # one text against each of text_2, or one per text_2 entry
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share prefix-cache blocks
    use_activation: bool | None = None  # vLLM's, for a cross-encoder: false gives its raw logit

    def pairs(self) -> tuple[list[str], list[str]]:
        try:
            return score_pairs(self.text_1, self.text_2)
        except ValueError as exc:
            mismatch = "give one text_1" in str(exc)  # as many text_2 as text_1: text_2's count is off
            raise InvalidParameter(str(exc), "text_2" if mismatch else "text_1") from None


class RerankDocument(BaseModel):
    text: str


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None  # the best this many; None or 0: all of them
    truncate_prompt_tokens: int | None = None
    cache_salt: str | None = None
    use_activation: bool | None = None

    @field_validator("top_n")
    @classmethod
    def _top_n(cls, value):
        if value is not None and value < 0:
            raise ValueError("top_n must be >= 0")
        return value

    def texts(self) -> list[str]:
        if not self.documents:
            raise InvalidParameter("documents is empty: give at least one", "documents")
        return [d if isinstance(d, str) else d.text for d in self.documents]


def cosines(pairs: list[tuple[list[float], list[float]]]) -> list[float]:
    """Each pair's cosine similarity (numpy, float64: a thousand 4096-wide pairs in milliseconds)."""
    first = np.asarray([a for a, _ in pairs], dtype=np.float64)
    second = np.asarray([b for _, b in pairs], dtype=np.float64)
    norms = np.linalg.norm(first, axis=1) * np.linalg.norm(second, axis=1)
    dots = np.einsum("ij,ij->i", first, second)
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0).tolist()


async def _scores(gen: Generator, body: ScoreRequest | RerankRequest, first: list[str], second: list[str],
                  request_id: str, api_key: ApiKey | None) -> tuple[str, list[float], int]:
    """(the answering model's name, each pair's score, the prompt tokens pooled)."""
    async with gen.admitted(api_key) as admission:
        model = await gen.model()
        lora = model.resolve(body.model)
        cross_encoder = model.pooler is not None and model.pooler.classifies
        if cross_encoder:
            try:
                check_cross_encoder(model.pooler)
            except ValueError as exc:
                raise InvalidParameter(str(exc), "model") from None
        elif body.use_activation is not None:
            raise InvalidParameter("use_activation is for a cross-encoder (a classifier); an embedding model's "
                                   "scores are cosine similarities", "use_activation")
        try:
            if cross_encoder:  # the tokenizer trims each pair (its longer text), not the engine
                limit = token_limit(body.truncate_prompt_tokens, model.max_model_len)
                pooling = PoolingParams(use_activation=body.use_activation, task="classify")
            else:
                pooling = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens, task="embed")
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None
        check_runner(pooling, model.limits)
        if cross_encoder:
            prompts = await gen.tokenized(lambda: [model.encode_pair(a, b, limit) for a, b in zip(first, second)])
        else:
            distinct = list(dict.fromkeys(first + second))
            prompts = await gen.tokenized(lambda: [model.encode_input(t) for t in distinct])  # off the event loop
        runs = await gen.start(model, engine_requests(request_id, prompts, cache_salt=body.cache_salt, lora=lora,
                                                      pooling=pooling), admission=admission)
    tokens = sum(len(run.prompt) for run in runs)
    if cross_encoder:
        return model.answer_name(lora), [run.embedding[0] for run in runs], tokens
    embeddings = {text: run.embedding for text, run in zip(distinct, runs)}
    scores = await asyncio.to_thread(cosines, [(embeddings[a], embeddings[b]) for a, b in zip(first, second)])
    return model.answer_name(lora), scores, tokens


async def create_score(gen: Generator, body: ScoreRequest, request_id: str, api_key: ApiKey | None = None) -> dict:
    first, second = body.pairs()
    name, scores, tokens = await _scores(gen, body, first, second, request_id, api_key)
    data = [{"index": i, "object": "score", "score": score} for i, score in enumerate(scores)]
    return {"id": f"score-{request_id}", "object": "list", "created": int(time.time()), "model": name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


async def create_rerank(gen: Generator, body: RerankRequest, request_id: str, api_key: ApiKey | None = None) -> dict:
    documents = body.texts()
    name, scores, tokens = await _scores(gen, body, [body.query] * len(documents), documents, request_id, api_key)
    results = sorted(({"index": i, "document": {"text": text}, "relevance_score": score}
                      for i, (text, score) in enumerate(zip(documents, scores))), key=lambda r: -r["relevance_score"])
    if body.top_n:
        results = results[:body.top_n]
    return {"id": f"rerank-{request_id}", "model": name, "usage": {"total_tokens": tokens}, "results": results}
