"""OpenAI's Responses API request (POST /v1/responses), as the chat request it amounts to.

A response is a chat completion with one choice in another shape: ``instructions`` become the system
message, the ``input`` items become the messages (an earlier response's messages and function calls
become assistant turns, function call outputs become tool messages), ``max_output_tokens`` is
``max_tokens``, ``text.format`` is ``response_format`` and the flat function tools are chat's nested
ones. So everything a chat request checks and does (tool calls forced or parsed, structured
outputs, sampling) is done by the same code; errors name the Responses fields.

The gateway keeps no state, so what needs stored responses is refused with a 400 that says so
(``previous_response_id``, ``conversation``, ``background``, item references); ``store`` is accepted
and nothing is kept. Hosted tools (web search, file search, ...), images and files are refused too.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from services.gateway.protocol import ChatCompletionRequest
from services.gateway.strict_input import Flag
from shared.invalid_parameter import InvalidParameter

# The engine's sampling fields (vLLM's extensions) a Responses request may carry, passed as they are.
_PASSED = ("seed", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
           "ignore_eos", "min_tokens", "stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias", "skip_special_tokens",
           "include_stop_str_in_output", "structured_outputs", "cache_salt", "chat_template_kwargs",
           "truncate_prompt_tokens", "truncation_side", "priority")
_STATEFUL = {"previous_response_id": "continuing a stored response (send the whole conversation as input)",
             "conversation": "stored conversations (send the whole conversation as input)",
             "prompt": "stored prompt templates"}
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# Chat's field names in its errors -> this request's.
_PUBLIC_NAMES = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
                 "messages": "input", "response_format": "text.format", "logprobs": "top_logprobs"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: Flag | None = None
    text: dict | None = None
    stream: Flag = False
    store: Flag | None = None  # accepted; the gateway keeps nothing (GET /v1/responses/{id} finds nothing)
    metadata: dict[str, str] | None = None
    background: Flag | None = None
    truncation: str | None = None
    reasoning: dict | None = None
    user: str | None = None

    @functools.cached_property
    def chat(self) -> ChatCompletionRequest:
        """The chat request this one amounts to; raises InvalidParameter (naming this request's field)."""
        self._check_supported()
        logprobs = LOGPROBS_INCLUDE in (self.include or ())
        fields: dict[str, Any] = {name: value for name, value in (self.model_extra or {}).items()
                                  if name in _PASSED and value is not None}
        fields.update(model=self.model, messages=self._messages(), stream=self.stream, top_p=self.top_p,
                      temperature=self.temperature, max_tokens=self.max_output_tokens,
                      logprobs=logprobs, top_logprobs=self.top_logprobs if logprobs else None,
                      tools=[_chat_tool(t) for t in self.tools] if self.tools else None,
                      tool_choice=_chat_tool_choice(self.tool_choice), parallel_tool_calls=self.parallel_tool_calls,
                      response_format=_response_format(self.text))
        if self.top_logprobs is not None and not logprobs:
            raise InvalidParameter(f"top_logprobs needs include=[{LOGPROBS_INCLUDE!r}]", "top_logprobs")
        try:
            return ChatCompletionRequest(**fields)
        except ValidationError as exc:  # an extension field of the wrong type (the others were checked above)
            first = exc.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else None
            raise InvalidParameter(f"{name}: {first['msg']}", name) from None

    # What _answer reads off a request besides its chat form.
    @property
    def cache_salt(self) -> str | None:
        return self.chat.cache_salt

    @property
    def priority(self) -> int:
        return self.chat.priority

    def public_error(self, exc: InvalidParameter) -> InvalidParameter:
        exc = self.chat.public_error(exc)
        if exc.param is not None and exc.param.startswith("messages["):  # a part of the chat made of the input
            return InvalidParameter(str(exc), "input")
        name = _PUBLIC_NAMES.get(exc.param)
        if name is None:
            return exc
        return InvalidParameter(re.sub(rf"\b{exc.param}\b", name, str(exc)), name)

    def check_reasoning(self, parser) -> None:
        """``reasoning`` asks for a model's thinking: only one whose reasoning the gateway can tell from its
        answer (--reasoning-parser) has any. Its effort is the model's own (it is not told one)."""
        if parser is None and self.reasoning and any(v is not None for v in self.reasoning.values()):
            raise InvalidParameter("reasoning is not supported: this model does not reason before answering "
                                   "(the gateway runs no --reasoning-parser)", "reasoning")

    def _check_supported(self) -> None:
        extra = self.model_extra or {}
        for name, what in _STATEFUL.items():
            if extra.get(name) is not None:
                raise InvalidParameter(f"{name} is not supported: this gateway keeps no {what}", name)
        if self.background:
            raise InvalidParameter("background responses are not supported: this gateway keeps no responses "
                                   "to poll", "background")
        if self.truncation not in (None, "disabled"):
            raise InvalidParameter("truncation must be 'disabled': an input longer than the context is refused, "
                                   "not cut", "truncation")
        if extra.get("n") not in (None, 1):
            raise InvalidParameter("a response has one output: n must be 1", "n")

    def _messages(self) -> list[dict]:
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        if not items:
            raise InvalidParameter("input must not be empty", "input")
        for item in items:
            _append_item(messages, item)
        return messages


def _append_item(messages: list[dict], item: Any) -> None:
    """One input item onto the chat messages."""
    if not isinstance(item, dict):
        raise InvalidParameter("each input item must be an object", "input")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise InvalidParameter(f"an input message's role must be user, assistant, system or developer, "
                                   f"got {role!r}", "input")
        # developer is the newer name of system; chat templates know system.
        messages.append({"role": "system" if role == "developer" else role, "content": _content(item.get("content"))})
    elif kind == "function_call":
        call = {"id": _required(item, "call_id"), "type": "function",
                "function": {"name": _required(item, "name"), "arguments": _required(item, "arguments")}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # calls of the same turn (after its text, if any)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _required(item, "call_id"),
                         "content": output if isinstance(output, str) else _text(output)})
    elif kind == "reasoning":
        pass  # an earlier turn's thinking, passed back with its output: templates leave it out of history
    elif kind == "item_reference":
        raise InvalidParameter("item references are not supported: this gateway keeps no items", "input")
    else:
        raise InvalidParameter(f"input items of type {kind!r} are not supported (messages, function_call, "
                               "function_call_output and reasoning are)", "input")


def _content(content: Any) -> str | list[dict]:
    """A message's content for chat: its text, or with input_image parts, chat's parts in their order."""
    if not (isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image" for p in content)):
        return _text(content)
    parts = []
    for part in content:
        if isinstance(part, dict) and part.get("type") == "input_image":
            if not isinstance(part.get("image_url"), str):
                raise InvalidParameter("an input_image part needs image_url (a data:, https: or file: URL); file_id "
                                       "is not supported: this gateway keeps no files", "input")
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"],
                                                             "detail": part.get("detail") or "auto"}})
        else:
            parts.append({"type": "text", "text": _text([part])})
    return parts


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameter("a message's content must be a string or a list of text parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise InvalidParameter(f"content parts of type {kind!r} are not supported (input_text, output_text and "
                                   "input_image are)", "input")
        if not isinstance(part.get("text"), str):
            raise InvalidParameter(f"an {kind} part needs text (a string)", "input")
        texts.append(part["text"])
    return "".join(texts)


def _required(item: dict, key: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidParameter(f"a {item.get('type')} item needs {key} (a string)", "input")
    return value


def _chat_tool(tool: Any) -> dict:
    """A Responses function tool (flat) as chat's (nested under "function")."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidParameter(f"tools of type {kind!r} are not supported: only function tools are (this "
                               "server runs no hosted tools)", "tools")
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: Any) -> Any:
    if choice is None:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    if choice in ("none", "auto", "required"):
        return choice
    raise InvalidParameter("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                           "tool_choice")


def _response_format(text: dict | None) -> dict | None:
    """text.format as chat's response_format (whose json_schema nests what this one has flat)."""
    spec = (text or {}).get("format")
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise InvalidParameter("text.format must be an object", "text.format")
    if spec.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": spec.get("name"), "schema": spec.get("schema")}}
    return spec
