"""A cheap bound that refuses a prompt which cannot fit the model's context before the gateway tokenizes
all of it: a megabyte-sized text costs seconds of tokenizer time and gigabytes of memory when tokenized
whole, only to be refused by the context check after.

A text far longer in characters than the context is in tokens (over CHARS_PER_TOKEN per token) is
counted a piece at a time from its start, and the count stops as soon as it passes MARGIN times the
context: then the whole text cannot fit, and the request is refused having tokenized a few contexts'
worth of it. The pieces are tokenized apart, which may count a token or two more than the whole text
has at each cut; MARGIN leaves room for far more than that. A text whose pieces come to less is tokenized
as before (the normal checks apply), so a bound that does not refuse changes nothing.

Only texts that reach the prompt as they are count: a completion's prompt, an input, a score's texts,
and a chat's messages other than the assistant's (a chat template may rewrite those: reasoning models'
drop earlier thinking). With truncate_prompt_tokens any length fits, and nothing is bounded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.gateway.generator import Generator
from services.gateway.model import Model
from services.gateway.pooling_inputs import PoolingRequest
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from services.gateway.responses_protocol import ResponsesRequest
from services.gateway.score_api import RerankRequest, ScoreRequest
from shared.invalid_parameter import InvalidParameter

CHARS_PER_TOKEN = 8  # above any tokenizer's average on text: a prompt that fits is (nearly always) shorter
MARGIN = 2


async def check_prompt_bound(gen: Generator, body) -> None:
    """InvalidParameter when one of the request's texts certainly has more tokens than the model's context."""
    texts = bounded_texts(body)
    if texts:
        await asyncio.to_thread(refuse_texts_too_long, await gen.model(), texts)  # off the event loop: it tokenizes


def refuse_texts_too_long(model: Model, texts: list[tuple[str, str]]) -> None:
    """InvalidParameter naming the field of the first text that certainly has more tokens than the context
    (texts are (field, text) pairs; the public gRPC API calls this too)."""
    at_least = MARGIN * model.max_model_len + 64
    for param, text in texts:
        if len(text) <= CHARS_PER_TOKEN * model.max_model_len:
            continue
        counted = counted_prefix(lambda piece: len(model.encode(piece, add_special_tokens=False)), text, at_least)
        if counted is not None:
            chars, tokens = counted
            raise InvalidParameter(f"This model's maximum context length is {model.max_model_len} tokens, but the "
                                   f"{param} is far longer: its first {chars} characters alone come to {tokens} "
                                   "tokens.", param)


def counted_prefix(count: Callable[[str], int], text: str, at_least: int) -> tuple[int, int] | None:
    """(characters, tokens) of the first pieces of ``text`` whose tokens, counted piece by piece, reach
    ``at_least``; None when the whole text comes to fewer. Each piece is twice the one before."""
    end, tokens, size = 0, 0, 4 * at_least
    while end < len(text):
        start, end = end, min(len(text), end + size)
        tokens += count(text[start:end])
        if tokens >= at_least:
            return end, tokens
        size *= 2
    return None


def bounded_texts(body) -> list[tuple[str, str]]:
    """(the request field, a text of it that reaches the prompt as it is) for a request without truncation."""
    if getattr(body, "truncate_prompt_tokens", None) is not None:
        return []
    if isinstance(body, CompletionRequest):
        prompts = body.prompt if isinstance(body.prompt, list) else [body.prompt]
        return [("prompt", p) for p in prompts if isinstance(p, str)]
    if isinstance(body, ChatCompletionRequest):
        return _message_texts(body.messages, "messages")
    if isinstance(body, ResponsesRequest):
        try:
            chat = body.chat
        except InvalidParameter:  # its own error comes when it runs
            return []
        return _message_texts(chat.messages, "input")
    if isinstance(body, PoolingRequest):
        inputs = body.input if isinstance(body.input, list) else [body.input]
        return [("input", i) for i in inputs if isinstance(i, str)] + _message_texts(body.messages or [], "messages")
    if isinstance(body, ScoreRequest):
        return _strings("text_1", body.text_1) + _strings("text_2", body.text_2)
    if isinstance(body, RerankRequest):
        return [("query", body.query)] + _strings("documents", [d if isinstance(d, str) else d.text
                                                               for d in body.documents])
    return []


def _strings(param: str, value: str | list[str]) -> list[tuple[str, str]]:
    return [(param, text) for text in ([value] if isinstance(value, str) else value)]


def _message_texts(messages, param: str) -> list[tuple[str, str]]:
    texts = []
    for message in messages:
        if message.role == "assistant":
            continue
        content = message.content
        parts = [content] if isinstance(content, str) else content or []
        texts += [(param, _part_text(part)) for part in parts if _part_text(part)]
    return texts


def _part_text(part) -> str:
    """A content part's text ('' for anything else: its own check comes later)."""
    if isinstance(part, str):
        return part
    text = part.get("text") if isinstance(part, dict) else getattr(part, "text", None)
    return text if isinstance(text, str) else ""
