"""OpenAI's completions and chat request bodies (plus vLLM's extension fields), each checked into its
SamplingParams. What they share, and how fields the engine cannot honour are treated, is sampling_request.py's:
here, completions refuse best_of other than n and suffix; chat messages hold text only."""

from __future__ import annotations

import functools
import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.gateway.sampling_request import SamplingRequest
from services.gateway.strict_input import Flag, check_message
from services.gateway.tool_calls import ForcedToolCall, chosen
from services.gateway.tool_parsers import ToolCallParser
from shared.generation_defaults import GenerationDefaults
from shared.invalid_parameter import InvalidParameter
from shared.sampling_params import SamplingParams
from shared.tokenizer import message_text


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: Flag = False
    logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    best_of: int | None = None
    suffix: str | None = None
    # OpenAI's and vLLM's default for completions; an explicit null runs up to the context length.
    max_tokens: int | None = Field(16, description="null: up to the context length")

    _LOGPROB_COUNTS = ("logprobs", "prompt_logprobs")

    def checked_params(self, defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
        if self.best_of is not None and self.best_of < self.n:
            raise InvalidParameter(f"best_of must be >= n, got best_of={self.best_of} and n={self.n}", "best_of")
        if self.best_of is not None and self.best_of > self.n:
            raise InvalidParameter("best_of > n is not supported", "best_of")
        if self.suffix:
            raise InvalidParameter("suffix is not supported", "suffix")
        # echo with logprobs: the prompt's logprobs come back too, as OpenAI does. With max_tokens=0
        # too, that is all that comes back (how a prompt is scored): the engine runs the prompt and
        # samples one token, which is not shown.
        max_tokens = 1 if self.echo_only else self.max_tokens
        # (Beam search returns no prompt logprobs: the echoed prompt's come back as null.)
        echoed = self.logprobs if self.echo and not self.use_beam_search else None
        asked = [k for k in (echoed, self.prompt_logprobs) if k is not None]
        return self.sampling_params(max_tokens, self.logprobs, max(asked) if asked else None, defaults=defaults)

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: the prompt (and its logprobs) and nothing generated, as OpenAI and vLLM."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or token ids."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not prompt or any(len(p) == 0 for p in prompt):
            raise InvalidParameter("the prompt is empty", "prompt")
        return list(prompt)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[TextPart | dict] | None = None

    def as_dict(self, i: int, image_placeholder: str | None = None) -> dict:
        """The message as a chat template reads it (the i-th of its request: errors say which), each image part
        as the model's placeholder text (``image_placeholder``; None: the model takes no images)."""
        check_message(i, self.role, self.content, self.model_extra or {})
        content = self.content
        if isinstance(content, list):
            content = [part.model_dump() if isinstance(part, TextPart)
                       else _image_as_text(part, image_placeholder, f"messages[{i}].content[{j}]")
                       for j, part in enumerate(content)]
        try:
            message = {"role": self.role, "content": message_text(content)}
        except ValueError as exc:
            raise InvalidParameter(str(exc), "messages") from None
        extra = self.model_extra or {}
        for key in ("name", "tool_call_id"):  # a tool's answer, as templates read it
            if extra.get(key) is not None:
                message[key] = extra[key]
        if extra.get("tool_calls"):  # an earlier turn's calls: templates want the arguments as objects
            message["tool_calls"] = [_template_tool_call(call) for call in extra["tool_calls"]]
        return message


def _template_tool_call(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def template_messages(messages: list[ChatMessage], image_placeholder: str | None = None) -> list[dict]:
    """A request's messages as a chat template reads them."""
    return [message.as_dict(i, image_placeholder) for i, message in enumerate(messages)]


def image_parts(messages: list[ChatMessage]) -> list[tuple[str, str]]:
    """(URL, the field holding it) of each image part, in the order the prompt holds them."""
    found = []
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                if isinstance(part, dict) and part.get("type") == "image_url":
                    found.append((_image_url(part, f"messages[{i}].content[{j}]"), f"messages[{i}].content[{j}]"))
    return found


def _image_as_text(part: Any, placeholder: str | None, field: str) -> Any:
    """An image part as the text that marks its place (a part of another type as it is, for its own check)."""
    if not (isinstance(part, dict) and part.get("type") == "image_url"):
        return part
    _image_url(part, field)
    if placeholder is None:
        raise _bad("is an image, but the model takes no images: it is a text model", field)
    return {"type": "text", "text": placeholder}


def _bad(why: str, field: str) -> InvalidParameter:
    """An error of one part of a message, naming it."""
    return InvalidParameter(f"{field} {why}", field)


def _image_url(part: dict, field: str) -> str:
    """OpenAI's image part: {"type": "image_url", "image_url": {"url": ..., "detail": "auto" | "low" | "high"}}."""
    image = part.get("image_url")
    if isinstance(image, str):  # (as vLLM also takes it)
        image = {"url": image}
    if not isinstance(image, dict) or not isinstance(image.get("url"), str) or set(image) - {"url", "detail"}:
        raise _bad("must hold image_url: {\"url\": ..., \"detail\": ...}", field)
    if image.get("detail", "auto") not in ("auto", "low", "high"):
        raise _bad(f"has detail {image['detail']!r}; it is 'auto', 'low' or 'high'", field)
    return image["url"]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: Flag = False
    top_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    # Forced tool calls (tool_choice "required" or a named function) are made with structured outputs
    # (tool_calls.py); "auto" calls are read from the text with the gateway's parser (tool_parsers.py).
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: Flag | None = None  # false: "required" makes exactly one call
    # vLLM's chat template extensions
    add_generation_prompt: Flag = True
    continue_final_message: Flag = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # a Jinja template for this request (--trust-request-chat-template)
    include_reasoning: Flag = True  # vLLM's: false leaves the reasoning out of the answer (--reasoning-parser)
    echo: Flag = False  # vLLM's: the answer starts with the last message's text, when it continues that message

    _LOGPROB_COUNTS = ("top_logprobs", "prompt_logprobs")

    def checked_params(self, defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParameter("top_logprobs needs logprobs=true", "top_logprobs")
        forced = self.forced_tool_call
        if forced is not None and self.structured_outputs_asked() is not None:
            raise InvalidParameter("tool_choice forces a tool call, whose output format is given: send no "
                                   "response_format or structured_outputs with it", "tool_choice")
        if self.continue_final_message and self.add_generation_prompt:
            raise InvalidParameter("continue_final_message needs add_generation_prompt=false",
                                   "continue_final_message")
        if not self.messages:
            raise InvalidParameter("messages must not be empty", "messages")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                    self.prompt_logprobs,
                                    structured=forced.constraint() if forced is not None else None,
                                    defaults=defaults)

    @property
    def response_role(self) -> str:
        """The answer's role (vLLM's): the assistant's, or without a generation prompt the last message's, which
        the answer continues."""
        return "assistant" if self.add_generation_prompt or not self.messages else self.messages[-1].role

    @property
    def echoed_text(self) -> str:
        """vLLM's echo: the last message's text, which the answer starts with when it continues that message
        (the same role); "" otherwise."""
        last = self.messages[-1] if self.echo and self.messages else None
        if last is None or last.role != self.response_role:
            return ""
        return message_text(last.content)

    @functools.cached_property
    def forced_tool_call(self) -> ForcedToolCall | None:
        return ForcedToolCall.from_request(self.tools, self.tool_choice, self.parallel_tool_calls)

    @property
    def auto_tool_choice(self) -> bool:
        """The model may call one of the tools, or answer in text (OpenAI's default with tools)."""
        return bool(self.tools) and chosen(self.tools, self.tool_choice) == "auto"

    def check_tool_parser(self, parser: ToolCallParser | None) -> None:
        if self.auto_tool_choice and parser is None:
            raise InvalidParameter("tool_choice 'auto' (the default with tools) needs the gateway started with "
                                   "--enable-auto-tool-choice and --tool-call-parser (the model's own tool-call "
                                   "format); or use 'required', a named function, or 'none'", "tool_choice")

    def public_error(self, exc: InvalidParameter) -> InvalidParameter:
        if exc.param == "prompt":  # the rendered messages (the message still says "prompt": it is one)
            return InvalidParameter(str(exc), "messages")
        names = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        name = names.get(exc.param)
        if name is None:
            return exc
        return InvalidParameter(re.sub(rf"\b{exc.param}\b", name, str(exc)), name)
