"""vLLM's /tokenize and /detokenize: the served model's tokenizer, as the completions and chat
endpoints apply it (a client counts tokens, or renders a chat prompt, exactly as the engine will)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel, ConfigDict

from services.gateway.generator import Generator
from services.gateway.model import Model
from services.gateway.protocol import ChatMessage, template_messages
from services.gateway.strict_input import Flag, check_text
from shared.invalid_parameter import InvalidParameter


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages rendered with the model's chat template (exactly one of them)."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Flag | None = None  # default: true for a prompt; for messages the template holds them
    add_generation_prompt: Flag = True
    continue_final_message: Flag = False
    chat_template_kwargs: dict | None = None
    chat_template: str | None = None  # as a chat completion's (--trust-request-chat-template)
    tools: list[dict] | None = None  # the functions a chat's template shows, as a chat completion's
    return_token_strs: Flag = False  # each token as the vocabulary spells it


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]


def _tokenize(model: Model, body: TokenizeRequest) -> list[int]:
    if (body.prompt is None) == (body.messages is None):
        raise InvalidParameter("give exactly one of prompt and messages", "prompt")
    check_text(body)
    if body.prompt is not None:
        return model.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    return encode_chat_body(model, body, body.tools)


def encode_chat_body(model: Model, body, tools: list[dict] | None = None) -> list[int]:
    """A request's ``messages`` through the chat template, with vLLM's chat fields (add_generation_prompt,
    continue_final_message, chat_template_kwargs, chat_template, add_special_tokens: the template's own by
    default) and the ``tools`` it shows; /tokenize's and /v1/embeddings' alike."""
    if body.continue_final_message and body.add_generation_prompt:
        raise InvalidParameter("continue_final_message needs add_generation_prompt=false", "continue_final_message")
    text, tokens = model.encode_chat(template_messages(body.messages),
                                     add_generation_prompt=body.add_generation_prompt,
                                     continue_final_message=body.continue_final_message,
                                     template_kwargs=body.chat_template_kwargs, chat_template=body.chat_template,
                                     tools=tools or None)
    return model.encode(text) if body.add_special_tokens else tokens


async def tokenize(gen: Generator, body: TokenizeRequest) -> dict:
    model = await gen.model()
    model.check_name(body.model)
    tokens = await asyncio.to_thread(_tokenize, model, body)  # off the event loop, as for generation
    strings = model.vocabulary_strings(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens, "token_strs": strings}


async def detokenize(gen: Generator, body: DetokenizeRequest) -> dict:
    model = await gen.model()
    model.check_name(body.model)
    try:
        model.check_token_ids(body.tokens)
    except InvalidParameter as exc:
        raise InvalidParameter(str(exc), "tokens") from None
    return {"prompt": await asyncio.to_thread(model.decode, body.tokens)}
