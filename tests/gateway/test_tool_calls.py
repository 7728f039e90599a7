"""Forced tool calls: tool_choice into a JSON schema, and the text generated under it into calls
(test_chat.py drives them through the real gateway)."""

from __future__ import annotations

import json

import pytest

from services.gateway.tool_calls import ForcedToolCall
from shared.invalid_parameter import InvalidParameter


def test_forced_tool_calls_become_schemas_and_their_text_becomes_calls():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
             {"type": "function", "function": {"name": "ping"}}]  # no parameters: an empty object
    named = ForcedToolCall.from_request(tools, {"type": "function", "function": {"name": "add"}})
    assert json.loads(named.constraint().json)["properties"] == {"a": {"type": "integer"}}
    assert named.constraint().disable_any_whitespace
    (call,) = named.calls('{"a": 2}')
    assert call["function"] == {"name": "add", "arguments": '{"a": 2}'} and call["type"] == "function"
    assert named.calls('{"a": ')[0]["function"]["arguments"] == '{"a": '  # cut off: as far as it came
    assert named.finish_reason("stop") == "stop" and named.finish_reason("length") == "length"
    required = ForcedToolCall.from_request(tools, "required")
    schema = json.loads(required.constraint().json)
    assert schema["minItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required.calls('[{"name": "ping", "parameters": {}}, {"name": "add", "parameters": {"a": 1.50}}]')
    # The arguments as generated (1.50 stays 1.50).
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("ping", "{}"), ("add", '{"a": 1.50}')]
    assert required.calls('[{"name": "ping", "para') is None and required.finish_reason("stop") == "tool_calls"
    assert len({c["id"] for c in calls}) == 2
    assert ForcedToolCall.from_request(tools, "none") is None and ForcedToolCall.from_request(None, None) is None
    # "auto" (the default with tools) forces nothing: the model decides (tool_parsers.py reads its calls).
    assert ForcedToolCall.from_request(tools, "auto") is None and ForcedToolCall.from_request(tools, None) is None
    for tools_, choice in [(None, "required"), ([{"type": "function"}], "required"),
                           (tools, {"type": "function", "function": {"name": "nope"}}),
                           ([{"type": "function", "function": {"name": "x", "parameters": {"type": "nope"}}}],
                            "required")]:
        with pytest.raises(InvalidParameter):
            ForcedToolCall.from_request(tools_, choice).constraint()



def test_required_calls_keep_each_tool_s_definitions_and_parallel_false_makes_one():
    """openai.pydantic_function_tool gives nested models as $defs, referenced from the tool's root."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
        "$defs": {"Point": point}}}} for name in ("move", "look")]
    schema = json.loads(ForcedToolCall.from_request(tools, "required").constraint().json)
    assert schema["$defs"] == {"Point": point} and "maxItems" not in schema
    assert all("$defs" not in call["properties"]["parameters"] for call in schema["items"]["anyOf"])
    one = json.loads(ForcedToolCall.from_request(tools, "required", parallel=False).constraint().json)
    assert one["maxItems"] == 1
    other = {**point, "required": []}
    tools[1]["function"]["parameters"]["$defs"] = {"Point": other}  # the same name, another schema
    with pytest.raises(InvalidParameter, match="Point"):
        ForcedToolCall.from_request(tools, "required").constraint()
