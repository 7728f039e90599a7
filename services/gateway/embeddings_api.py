"""/v1/embeddings: OpenAI's embeddings API (with vLLM's extension fields) over a pooling engine.

Instead of ``input``, vLLM's chat form takes ``messages``: one conversation, rendered by the chat template
(with the generation prompt unless ``add_generation_prompt`` is false), embedded as one input. Each input
is one engine request; they run side by side and the answer lists their embeddings in input
order. ``encoding_format`` "base64" is the embedding's float32 little-endian bytes, base64-encoded (what
the openai client asks for by default, and decodes).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

from services.gateway.api_keys import ApiKey
from services.gateway.generation import Generator, InvalidParameter, Model, Run
from services.gateway.protocol import ChatMessage
from services.gateway.tokenizer_api import encode_chat_body
from shared.pooling import PoolingParams
from shared.sampling_params import SamplingParams


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's user, and fields of other servers: accepted, unused

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    # vLLM's
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # None: true for input; for messages the template holds them
    normalize: bool | None = None
    cache_salt: str | None = None
    messages: list[ChatMessage] | None = None  # vLLM's chat form, instead of input
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # as a chat completion's (--trust-request-chat-template)
    chat_template_kwargs: dict | None = None

    @field_validator("encoding_format", "add_generation_prompt", "continue_final_message", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens)
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None

    def inputs(self) -> list[str | list[int]]:
        """One entry per input: a string, or token ids."""
        if (self.input is None) == (self.messages is None):
            raise InvalidParameter("give exactly one of input and messages", "input")
        given = self.input
        if isinstance(given, str) or (given and isinstance(given[0], int)):
            given = [given]
        if not given:
            raise InvalidParameter("input is empty: give a string, a list of strings, or token ids", "input")
        return list(given)


def _encode(model: Model, body: EmbeddingRequest) -> list[list[int]]:
    if body.messages is not None and body.input is None:
        if not body.messages:
            raise InvalidParameter("messages is empty: give at least one message", "messages")
        return [encode_chat_body(model, body)]
    prompts = []
    for item in body.inputs():
        if isinstance(item, str):
            prompts.append(model.encode_input(item, add_special_tokens=body.add_special_tokens is not False))
        else:
            try:
                model.check_token_ids(item)
            except InvalidParameter as exc:
                raise InvalidParameter(str(exc), "input") from None
            prompts.append(list(item))
    return prompts


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(gen: Generator, body: EmbeddingRequest, request_id: str,
                            api_key: ApiKey | None = None) -> dict:
    async with gen.admitted(api_key) as admission:
        model = await gen.model()
        lora = model.resolve(body.model)
        pooling = body.pooling_params()
        prompts = await asyncio.to_thread(_encode, model, body)  # off the event loop, as for generation
        runs: list[Run] = await gen.start(model, request_id, prompts, SamplingParams(), cache_salt=body.cache_salt,
                                          admission=admission, lora=lora, pooling=pooling)
        data = [{"object": "embedding", "index": run.position, "embedding": _encoded(run.embedding, body.encoding_format)}
                for run in runs]
        prompt_tokens = sum(len(run.prompt) for run in runs)
        return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
                "model": model.answer_name(lora), "data": data,
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens,
                          "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)}}}
