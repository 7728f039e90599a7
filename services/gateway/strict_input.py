"""What OpenAI refuses that a lenient reading would take: a request is answered as asked, or refused.

pydantic's lax mode reads "yes", "on" or 1 as true; OpenAI answers them with a 400, so flags here are
JSON booleans (and the strings "true" and "false", which vLLM's own clients send). Chat messages
need a role OpenAI knows, content where OpenAI requires it, and a tool message the id of the call it
answers. A JSON string may escape a lone surrogate ("\\ud800"), which is no text at all: it is
refused by name before a tokenizer fails on it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator
from pydantic_core import PydanticCustomError

from shared.invalid_parameter import InvalidParameter

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def _json_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise PydanticCustomError("bool_type", "Input should be a JSON boolean, true or false")


Flag = Annotated[bool, BeforeValidator(_json_bool)]


def check_message(i: int, role: str, content: Any, fields: dict) -> None:
    """One chat message (the i-th) as OpenAI checks it; ``fields``: its other fields."""
    where = f"messages.[{i}]"
    if role not in ROLES:
        raise InvalidParameter(f"Invalid value for {where}.role: {role!r}. Supported values are: "
                               f"{', '.join(repr(r) for r in ROLES[:-1])} and {ROLES[-1]!r}.", "messages")
    if role == "tool" and not isinstance(fields.get("tool_call_id"), str):
        raise InvalidParameter(f"Missing required parameter: '{where}.tool_call_id' (a tool message answers the "
                               "call with that id).", "messages")
    calls = fields.get("tool_calls") or fields.get("function_call")
    if content is None and not (role == "assistant" and calls):
        needs = "an assistant message without tool_calls" if role == "assistant" else f"a {role} message"
        raise InvalidParameter(f"Missing required parameter: '{where}.content' ({needs} needs content: a string or "
                               "a list of text parts).", "messages")


def check_text(request: BaseModel) -> None:
    """Every string a request holds is text: a lone surrogate anywhere in a field is refused, naming the field."""
    for name, value in _fields(request).items():
        if _holds_lone_surrogate(value):
            raise InvalidParameter(f"{name} holds a lone surrogate (such as \\ud800), which is not valid Unicode text: "
                                   "send UTF-8, or a character beyond U+FFFF as a surrogate pair (\\ud83c\\udf89)",
                                   name)


def _fields(model: BaseModel) -> dict:
    return {**{name: getattr(model, name) for name in type(model).model_fields}, **(model.model_extra or {})}


def _holds_lone_surrogate(value: Any) -> bool:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, dict):
        return any(_holds_lone_surrogate(k) or _holds_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(map(_holds_lone_surrogate, value))
    if isinstance(value, BaseModel):
        return _holds_lone_surrogate(_fields(value))
    return False
