"""SageMaker's POST /invocations, as vLLM serves it: one endpoint for every API, the request's kind told
from its body's shape. The body is tried against each kind of request the served model answers, in
vLLM's order (chat, completion; embedding, classification, score, rerank), and goes to the first it
validates as."""

from __future__ import annotations

from pydantic import BaseModel, ValidationError

from services.gateway.classify_api import ClassificationRequest, create_classification
from services.gateway.embeddings_api import EmbeddingRequest, create_embeddings
from services.gateway.model import Model
from services.gateway.openai_api import create_chat_completion, create_completion
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.score_api import RerankRequest, ScoreRequest, create_rerank, create_score
from shared.invalid_parameter import InvalidParameter

GENERATION = ((ChatCompletionRequest, create_chat_completion), (CompletionRequest, create_completion))
SCORING = ((ScoreRequest, create_score), (RerankRequest, create_rerank))
EMBEDDING = ((EmbeddingRequest, create_embeddings), *SCORING)
CLASSIFICATION = ((ClassificationRequest, create_classification), *SCORING)
EVERY_KIND = tuple(dict.fromkeys(kind for kind, _ in GENERATION + EMBEDDING + CLASSIFICATION))
# What /openapi.json says it takes (the route reads the body itself): any of them (their schemas are the
# other routes').
OPENAPI_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "anyOf": [{"$ref": f"#/components/schemas/{kind.__name__}"} for kind in EVERY_KIND]}}}}}


def served_kinds(model: Model) -> tuple[tuple[type[BaseModel], object], ...]:
    """(request class, its create function) for what the model answers, in the order they are tried."""
    if model.pooler is None:
        return GENERATION
    return CLASSIFICATION if model.pooler.classifies else EMBEDDING


def invocation(model: Model, body) -> tuple[BaseModel, object]:
    """The parsed request and its create function; InvalidParameter when the body is none of them."""
    if not isinstance(body, dict):
        raise InvalidParameter("the request body must be a JSON object")
    kinds = served_kinds(model)
    for kind, create in kinds:
        try:
            return kind.model_validate(body), create
        except ValidationError:
            continue
    names = ", ".join(kind.__name__ for kind, _ in kinds)
    raise InvalidParameter(f"the body is none of the requests this model answers ({names}): see their fields in "
                           "/openapi.json")
