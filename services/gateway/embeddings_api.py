"""/v1/embeddings: OpenAI's embeddings API (with vLLM's extension fields) over a pooling engine.

Its inputs are pooling_inputs' (``input``, or vLLM's chat form ``messages``). Each input is one engine
request; they run side by side and the answer lists their embeddings in input order. ``encoding_format``
"base64" is the embedding's float32 little-endian bytes, base64-encoded (what the openai client asks for
by default, and decodes).
"""

from __future__ import annotations

import base64
import struct
import time
from typing import Literal

from pydantic import field_validator

from services.gateway.api_keys import ApiKey
from services.gateway.generator import Generator
from services.gateway.pooling_inputs import PoolingRequest, pool_inputs, pooling_usage
from shared.invalid_parameter import InvalidParameter
from shared.pooling import PoolingParams


class EmbeddingRequest(PoolingRequest):
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None  # vLLM's

    @field_validator("encoding_format", mode="before")
    @classmethod
    def _null_is_float(cls, value):
        return "float" if value is None else value

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(dimensions=self.dimensions, normalize=self.normalize,
                                 truncate_prompt_tokens=self.truncate_prompt_tokens, task="embed")
        except ValueError as exc:
            raise InvalidParameter.from_params_error(exc) from None


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


async def create_embeddings(gen: Generator, body: EmbeddingRequest, request_id: str,
                            api_key: ApiKey | None = None) -> dict:
    model, lora, runs = await pool_inputs(gen, body, body.pooling_params(), request_id, api_key)
    data = [{"object": "embedding", "index": run.position, "embedding": _encoded(run.embedding, body.encoding_format)}
            for run in runs]
    return {"id": f"embd-{request_id}", "object": "list", "created": int(time.time()),
            "model": model.answer_name(lora), "data": data, "usage": pooling_usage(runs)}
