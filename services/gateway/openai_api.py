"""/v1/completions and /v1/chat/completions: a request through the generation core (admitted, its prompts
tokenized and checked, its runs started) to its answer in OpenAI's shape (reply.py and its kinds), whole or
streamed. The Responses API answers through here too, as a chat."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

from services.gateway.api_keys import ApiKey
from services.gateway.chat_reply import ChatReply
from services.gateway.completion_reply import CompletionReply
from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.invalid_parameter import InvalidParameter


async def create_completion(gen: Generator, body: CompletionRequest, request_id: str, api_key: ApiKey | None = None):
    return await answer(gen, body, request_id, api_key, CompletionReply)


async def create_chat_completion(gen: Generator, body: ChatCompletionRequest, request_id: str,
                                 api_key: ApiKey | None = None):
    return await answer(gen, body, request_id, api_key, ChatReply)


async def answer(gen: Generator, body, request_id: str, api_key: ApiKey | None, reply_class):
    """The whole answer (a dict), or for stream=True the started reply (events(), then aclose())."""
    async with AsyncExitStack() as stack:
        admission = await stack.enter_async_context(gen.admitted(api_key))
        model = await gen.model()
        lora = model.resolve(body.model)
        try:
            # (Off the event loop too: checking a structured output's grammar can take long.)
            params = await asyncio.to_thread(reply_class.checked_params, model, body)
            prompts, texts, images = await gen.tokenized(reply_class.prompts, model, body)  # off the event loop
            runs = await gen.start(model, engine_requests(request_id, prompts, params=params, cache_salt=body.cache_salt,
                                                          lora=lora, priority=body.priority, images=images),
                                   admission=admission)
        except InvalidParameter as exc:
            raise body.public_error(exc) from None
        reply = reply_class(model, body, reply_class.response_id(request_id), runs, texts)
        if not body.stream:
            return await reply.whole()
        reply.slot = stack.pop_all()  # the stream holds the request's slot until reply.aclose()
        return reply
