"""Tool calls the request forces: `tool_choice` naming a function, or "required".

A call the model *may* make ("auto") is told from its text by the model family's own parser
(tool_parsers.py). A call the request forces needs none: the output is held (structured outputs)
to what the call must look like, as vLLM does. For a named function it is that function's
arguments, a JSON object following its `parameters` schema; for "required", a JSON array of one or
more {"name": ..., "parameters": {...}} objects, each naming one of the tools. The text that comes
out is then turned into OpenAI's `tool_calls`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from shared.invalid_parameter import InvalidParameter
from shared.structured_outputs import StructuredOutputs

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: dict

    @classmethod
    def parse(cls, tool: Any) -> Tool:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" \
                or not isinstance(tool.get("function"), dict):
            raise InvalidParameter("each tool must be {'type': 'function', 'function': {'name': ..., 'parameters': ...}}",
                           "tools")
        function = tool["function"]
        name, parameters = function.get("name"), function.get("parameters") or EMPTY_PARAMETERS
        if not isinstance(name, str) or not name:
            raise InvalidParameter("each tool's function needs a name", "tools")
        if not isinstance(parameters, dict):
            raise InvalidParameter(f"the parameters of tool {name!r} must be a JSON schema object", "tools")
        return cls(name, parameters)


@dataclass(frozen=True)
class ForcedToolCall:
    """What the request's tool_choice forces: one named function, or at least one of the tools (just
    one, with parallel_tool_calls false)."""
    tools: tuple[Tool, ...]
    named: str | None  # the function tool_choice names; None: "required"
    parallel: bool = True

    @classmethod
    def from_request(cls, tools: list | None, tool_choice: Any, parallel: bool | None = None) -> ForcedToolCall | None:
        """None where nothing is forced (no tools, tool_choice "none", or "auto": the model decides)."""
        tool_choice = chosen(tools, tool_choice)
        if tool_choice == "none":
            return None
        if not tools:
            raise InvalidParameter("tool_choice needs tools", "tool_choice")
        parsed = tuple(Tool.parse(t) for t in tools)
        if tool_choice == "auto":
            return None
        if tool_choice == "required":
            return cls(parsed, None, parallel is not False)
        function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):
            raise InvalidParameter("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                                   "'function': {'name': ...}}", "tool_choice")
        if name not in {t.name for t in parsed}:
            raise InvalidParameter(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice")
        return cls(parsed, name)

    def constraint(self) -> StructuredOutputs:
        """JSON without free whitespace (arguments are data for a program; free whitespace only risks
        a model that never stops writing it)."""
        if self.named is not None:
            schema = next(t.parameters for t in self.tools if t.name == self.named)
        else:
            schema = self._calls_schema()
        try:
            return StructuredOutputs(json=schema, disable_any_whitespace=True)
        except ValueError as exc:
            raise InvalidParameter(f"a tool's parameters are not a usable JSON schema: "
                                   f"{str(exc).removeprefix('SamplingParams.')}", "tools") from None

    def _calls_schema(self) -> dict:
        """An array of {"name", "parameters"} objects. Each tool's definitions ($defs, definitions)
        move to the array's root, where their references (#/$defs/...) point once nested."""
        hoisted: dict[str, dict] = {}
        calls = []
        for tool in self.tools:
            parameters = dict(tool.parameters)
            for key in ("$defs", "definitions"):
                for name, definition in (parameters.pop(key, None) or {}).items():
                    known = hoisted.setdefault(key, {})
                    if known.get(name, definition) != definition:
                        raise InvalidParameter(f"tools define {key} {name!r} differently; give each its own name",
                                               "tools")
                    known[name] = definition
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                           "parameters": parameters},
                          "required": ["name", "parameters"]})
        return {"type": "array", "minItems": 1, **({"maxItems": 1} if not self.parallel else {}),
                "items": {"anyOf": calls}, **hoisted}

    def finish_reason(self, reason: str | None) -> str | None:
        """As OpenAI's: a completed call for a named function ends as "stop", "required" calls as "tool_calls"."""
        return "tool_calls" if self.named is None and reason == "stop" else reason

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI's tool_calls for the text generated (each call's arguments as generated). A named
        call's arguments as far as they came; "required" calls only once whole (None before: which
        calls a partial array holds is not known)."""
        if self.named is not None:
            return [tool_call(self.named, text)]
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [tool_call(call["name"], arguments) for call, arguments in zip(value, _parameters_texts(text))]


def chosen(tools: list | None, tool_choice: Any) -> Any:
    """tool_choice, its default (OpenAI's) made explicit: "auto" with tools, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def _parameters_texts(text: str) -> list[str]:
    """Each call's "parameters" value as it stands in the text of a calls array (the schema puts
    "name" before "parameters"; re-encoding it could change its numbers)."""
    decoder, texts, position = json.JSONDecoder(), [], 0
    while (key := text.find('"parameters":', position)) != -1:
        start = key + len('"parameters":')
        while text[start] in " \t\n\r":
            start += 1
        _, end = decoder.raw_decode(text, start)
        texts.append(text[start:end])
        position = end
    return texts


def tool_call(name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}
