"""What the pooling endpoints (/v1/embeddings, /classify) take alike: OpenAI's ``input`` (a string,
strings, token ids or lists of them) or vLLM's chat form, ``messages``: one conversation rendered by the
chat template (with the generation prompt unless ``add_generation_prompt`` is false), pooled as one input.
"""

from __future__ import annotations


from pydantic import BaseModel, ConfigDict, field_validator

from services.gateway.api_keys import ApiKey
from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from services.gateway.model import Model
from services.gateway.protocol import ChatMessage
from services.gateway.run import Run
from services.gateway.tokenizer_api import encode_chat_body
from shared.invalid_parameter import InvalidParameter
from shared.lora import LoRARequest
from shared.pooling import PoolingParams
from shared.request import check_runner


class PoolingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # OpenAI's user, and fields of other servers: accepted, unused

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] | None = None
    # vLLM's
    truncate_prompt_tokens: int | None = None
    add_special_tokens: bool | None = None  # None: true for input; for messages the template holds them
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks
    messages: list[ChatMessage] | None = None  # vLLM's chat form, instead of input
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # as a chat completion's (--trust-request-chat-template)
    chat_template_kwargs: dict | None = None

    @field_validator("add_generation_prompt", "continue_final_message", mode="before")
    @classmethod
    def _null_is_default(cls, value, info):
        return cls.model_fields[info.field_name].default if value is None else value

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

    def encode(self, model: Model) -> list[list[int]]:
        """Each input's tokens (blocking: run it off the event loop)."""
        if self.messages is not None and self.input is None:
            if not self.messages:
                raise InvalidParameter("messages is empty: give at least one message", "messages")
            return [encode_chat_body(model, self)]
        prompts = []
        for item in self.inputs():
            if isinstance(item, str):
                prompts.append(model.encode_input(item, add_special_tokens=self.add_special_tokens is not False))
            else:
                try:
                    model.check_token_ids(item)
                except InvalidParameter as exc:
                    raise InvalidParameter(str(exc), "input") from None
                prompts.append(list(item))
        return prompts


async def pool_inputs(gen: Generator, body: PoolingRequest, pooling: PoolingParams, request_id: str,
                      api_key: ApiKey | None) -> tuple[Model, LoRARequest | None, list[Run]]:
    """Every input of the request pooled side by side: (the model, the adapter it ran with, the runs)."""
    async with gen.admitted(api_key) as admission:
        model = await gen.model()
        lora = model.resolve(body.model)
        # Before tokenizing: a model of the other task would tokenize for nothing.
        check_runner(pooling, model.limits)
        prompts = await gen.tokenized(body.encode, model)  # off the event loop, as for generation
        runs = await gen.start(model, engine_requests(request_id, prompts, cache_salt=body.cache_salt, lora=lora,
                                                      pooling=pooling), admission=admission)
    return model, lora, runs


def pooling_usage(runs) -> dict:
    """The usage of a pooling answer: prompt tokens only (and how many the prefix cache held)."""
    prompt_tokens = sum(len(run.prompt) for run in runs)
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens, "completion_tokens": 0,
            "prompt_tokens_details": {"cached_tokens": sum(run.cached_tokens for run in runs)}}
