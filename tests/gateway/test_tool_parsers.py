"""Tool calls told from a model's text (tool_choice "auto"): whole, and in any pieces a stream
brings (test_chat.py drives them through the real gateway)."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway.protocol import ChatCompletionRequest
from services.gateway.tool_parsers import Parsed, ParsedCall, ToolCallParser
from shared.invalid_parameter import InvalidParameter

HERMES, LLAMA = ToolCallParser("hermes"), ToolCallParser("llama3_json")
WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
HERMES_TEXTS = [
    "Plain text, kept exactly.  \n",
    "a < b and <tool is not a marker <tool_cal",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    'Let me look.\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
    '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>\n',
    '<tool_call>{"name": "broken", "arguments": {</tool_call> then text',
    '<tool_call>\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n',  # ended before its end marker
    '<tool_call>{"name": "get_weather", "argu',  # cut off
    'x <tool_call>{"name": "a", "arguments": {}}</tool_call> between '
    '<tool_call>{"name": "b", "arguments": {}}</tool_call> after  ',
]
LLAMA_TEXTS = [
    "  Plain text {not json} kept exactly ",
    '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
    ' \n{"name": "get_weather", "parameters": {"city": ',  # cut off: content
    '{"name": "get_weather", "parameters": {}} and then prose',  # not calls only: content
    "<|pyth",
    '{"name": "Alice", "age": 30}',  # an answer in JSON: no arguments, so not a call
]


def test_hermes_calls_and_content():
    parse = lambda text: HERMES.stream().parse(text)  # noqa: E731
    assert parse(HERMES_TEXTS[0]) == Parsed(HERMES_TEXTS[0])
    assert parse(HERMES_TEXTS[1]) == Parsed(HERMES_TEXTS[1])
    assert parse(HERMES_TEXTS[2]) == Parsed("", [WEATHER])
    # The whitespace around calls is not content; arguments written as a JSON string are read as the object.
    assert parse(HERMES_TEXTS[3]) == Parsed("Let me look.", [WEATHER, ParsedCall("get_time", '{"zone": "UTC"}')])
    assert parse(HERMES_TEXTS[4]) == Parsed(HERMES_TEXTS[4])  # not a call after all: kept as written
    assert parse(HERMES_TEXTS[5]) == Parsed("", [WEATHER])
    assert parse(HERMES_TEXTS[6]) == Parsed(HERMES_TEXTS[6])
    assert parse(HERMES_TEXTS[7]) == Parsed("x between after  ", [ParsedCall("a", "{}"), ParsedCall("b", "{}")])
    assert parse('<tool_call>{"name": "x", "arguments": [1]}</tool_call>').calls == []  # arguments must be an object
    assert parse('<tool_call>{"name": "café", "arguments": {"q": "naïve"}}</tool_call>').calls == \
        [ParsedCall("café", '{"q": "naïve"}')]
    # Arguments as written (decoded and encoded again, 1.50 would be 1.5 and 1e999 Infinity, not JSON).
    assert parse('<tool_call>{ "name":"f" , "arguments" :{"x": 1.50, "y": 1e999} }</tool_call>').calls == \
        [ParsedCall("f", '{"x": 1.50, "y": 1e999}')]
    for not_json in ('{"x": NaN}', '{"x": -Infinity}'):
        text = '<tool_call>{"name": "f", "arguments": ' + not_json + '}</tool_call>'
        assert parse(text) == Parsed(text)
    assert parse('<tool_call>{"name": "f"}</tool_call>').calls == []  # no arguments: not a call


def test_llama3_json_calls_and_content():
    parse = lambda text: LLAMA.stream().parse(text)  # noqa: E731
    assert parse(LLAMA_TEXTS[0]) == Parsed(LLAMA_TEXTS[0])
    assert parse(LLAMA_TEXTS[1]) == Parsed("", [WEATHER])
    assert parse(LLAMA_TEXTS[2]) == Parsed("", [WEATHER, ParsedCall("get_time", "{}")])
    for text in LLAMA_TEXTS[3:]:
        assert parse(text) == Parsed(text)


@pytest.mark.parametrize("parser, texts", [(HERMES, HERMES_TEXTS), (LLAMA, LLAMA_TEXTS)], ids=["hermes", "llama3_json"])
def test_any_pieces_read_as_the_whole(parser, texts):
    """What a stream hands back, delta by delta, adds up to the whole output read at once; and
    what it hands back as content is never taken back (it is a prefix of the whole's content,
    as far as calls allow)."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    for text in texts:
        whole = parser.stream().parse(text)
        splits = [[i] for i in range(len(text) + 1)] + [sorted(rng.sample(range(len(text) + 1), min(6, len(text))))
                                                       for _ in range(20)]
        splits.append(list(range(len(text) + 1)))  # a character at a time
        for cuts in splits:
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            stream, got = parser.stream(), Parsed()
            for piece in pieces:
                got.extend(stream.feed(piece))
                assert whole.content.startswith(got.content), (seed, text, pieces)
            assert got.extend(stream.finish()) == whole, (seed, text, pieces)


def test_calls_are_json_objects():
    for call in HERMES.stream().parse(HERMES_TEXTS[3]).calls + LLAMA.stream().parse(LLAMA_TEXTS[2]).calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_auto_needs_a_parser():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        ToolCallParser("pythonic")
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in (None, "auto"):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
        assert body.auto_tool_choice and body.forced_tool_call is None
        with pytest.raises(InvalidParameter, match="--enable-auto-tool-choice"):
            body.check_tool_parser(None)
        body.check_tool_parser(HERMES)
    for choice in ("none", "required"):
        body = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
        assert not body.auto_tool_choice
        body.check_tool_parser(None)
    assert not ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]).auto_tool_choice


def test_the_gateway_needs_a_parser_for_auto():
    from services.gateway.server import main

    with pytest.raises(SystemExit):
        main(["--enable-auto-tool-choice"])
    with pytest.raises(SystemExit):
        main(["--tool-call-parser", "nope"])


def test_the_built_in_template_shows_tools_and_writes_calls_as_hermes_reads_them():
    from services.worker.model_factory import train_tokenizer

    tokenizer = train_tokenizer(512)
    city = {"type": "object", "properties": {"city": {"type": "string"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "description": "the weather now",
                                             "parameters": city}}
    # Arguments as OpenAI sends them back (JSON text), or as an object.
    calls = [{"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
             for arguments in ({"city": "Paris"}, '{"city": "Oslo"}')]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "18 C"}]
    text = tokenizer.apply_chat_template(messages, tools=[tool], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n") and json.dumps(tool["function"]) in text
    assert text.count("<|im_start|>system") == 1 and text.endswith("<|im_start|>tool\n18 C<|im_end|>\n"
                                                                  "<|im_start|>assistant\n")
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert HERMES.stream().parse(turn) == Parsed("", [WEATHER, ParsedCall("get_weather", '{"city": "Oslo"}')])
    # Without tools, plain ChatML.
    assert tokenizer.apply_chat_template(messages[:2], tokenize=False) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWeather?<|im_end|>\n"
