"""POST /v1/responses through the real services, read by the openai client: each answer against the
chat completion it amounts to (greedy, so the same tokens), whole and streamed, with tools, formats,
logprobs, and the errors of what a stateless gateway cannot do."""

from __future__ import annotations

import json

from tests import patient_http as httpx
import openai
import pytest

from tests.services_harness import Stack

WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "256")
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}}, "required": ["city"],
                         "additionalProperties": False}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]
EVENT_ORDER = ("response.created", "response.in_progress", "response.output_item.added")


@pytest.fixture(scope="module")
def stack(llama_dir, tmp_path_factory):
    stack = Stack(llama_dir, tmp_path_factory.mktemp("responses-logs"), worker_args=WORKER_ARGS,
                  gateway_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                # Benign for other tests: qwen3 splits only outputs that open with <think>.
                                "--reasoning-parser", "qwen3")).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
    assert codes["gateway"] == 0, stack.log_tail("gateway")


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, llama_dir, messages, **kwargs):
    return client.chat.completions.create(model=llama_dir.name, messages=messages, temperature=0, **kwargs)


def events_of(client, llama_dir, **kwargs) -> list:
    return list(client.responses.create(model=llama_dir.name, temperature=0, stream=True, **kwargs))


def check_event_order(events: list) -> None:
    """Numbered from 0 without gaps; created, in_progress, then items each opened before their deltas and
    closed after them, at output indices 0, 1, ..., a message's text part added and done inside it; the last
    event the response's end, whose items are the ones closed (only the last incomplete, if it is)."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert tuple(e.type for e in events[:3]) == EVENT_ORDER
    final = events[-1]
    assert final.type in ("response.completed", "response.incomplete")
    open_items: list[str] = []
    closed, part_open = [], False
    for event in events[2:-1]:
        if event.type == "response.output_item.added":
            assert not open_items and event.output_index == len(closed)
            open_items.append(event.item.id)
        elif event.type == "response.output_item.done":
            assert open_items == [event.item.id] and not part_open and event.output_index == len(closed)
            open_items.clear()
            closed.append(event.item)
        else:
            assert open_items == [event.item_id] and event.output_index == len(closed), event.type
            if event.type.startswith("response.content_part."):
                assert part_open == event.type.endswith(".done")
                part_open = not part_open
            elif event.type.startswith(("response.output_text.", "response.reasoning_text.")):
                assert part_open
    assert not open_items
    assert [i.id for i in final.response.output] == [i.id for i in closed]
    statuses = [i.status for i in closed]
    assert statuses[:-1] == ["completed"] * (len(closed) - 1)
    assert statuses[-1] == ("incomplete" if final.type == "response.incomplete" else "completed")


def test_a_response_is_its_chat_completion_s_one_choice(client, llama_dir):
    expected = chat(client, llama_dir, [{"role": "user", "content": "Tell me about the sea."}], max_tokens=10)
    response = client.responses.create(model=llama_dir.name, input="Tell me about the sea.", max_output_tokens=10,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == llama_dir.name
    assert response.output_text == expected.choices[0].message.content
    (item,) = response.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text" and item.content[0].annotations == []
    assert response.usage.input_tokens == expected.usage.prompt_tokens
    assert response.usage.output_tokens == expected.usage.completion_tokens == 10
    assert response.usage.total_tokens == expected.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # Cut at max_output_tokens: incomplete, as OpenAI says.
    assert expected.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"


def test_instructions_and_message_items_are_the_chat_s_system_and_turns(client, llama_dir):
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
             {"role": "user", "content": "Name a colour."}]
    expected = chat(client, llama_dir, [{"role": "system", "content": "Be brief."}, *turns], max_tokens=8)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             # an earlier response's message, passed back as it came
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello! How can I help?", "annotations": []}]},
             {"role": "user", "content": "Name a colour."}]
    for kwargs in ({"input": items}, {"input": items[1:], "instructions": "Be brief."}):
        response = client.responses.create(model=llama_dir.name, max_output_tokens=8, temperature=0, **kwargs)
        assert response.output_text == expected.choices[0].message.content
    assert response.instructions == "Be brief."


def test_the_stream_is_ordered_events_that_add_up_to_the_whole_response(client, llama_dir):
    ask = dict(input="Write about mountains.", max_output_tokens=12)
    whole = client.responses.create(model=llama_dir.name, temperature=0, **ask)
    events = events_of(client, llama_dir, **ask)
    check_event_order(events)
    assert [e.type for e in events[3:5]] == ["response.content_part.added", "response.output_text.delta"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.status == whole.status == "incomplete"
    assert final.usage.output_tokens == 12 and events[0].response.status == "in_progress"
    # The client's own accumulating helper reads the same stream (its final response is only a completed one).
    with client.responses.stream(model=llama_dir.name, temperature=0, **ask) as stream:
        assert [e.type for e in stream][-1] == "response.incomplete"


def test_raw_events_are_named_and_the_stream_has_no_done_marker(stack, llama_dir):
    body = {"model": llama_dir.name, "input": "Hi", "max_output_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/responses", json=body, timeout=60) as reply:
        text = "".join(reply.iter_text())
    frames = [f for f in text.split("\n\n") if f.strip()]
    assert all(f.startswith("event: response.") and "\ndata: {" in f for f in frames)
    for frame in frames:
        name, data = frame.split("\n")
        assert json.loads(data.removeprefix("data: "))["type"] == name.removeprefix("event: ")
    assert "[DONE]" not in text


def test_a_named_function_is_called_and_its_output_read_back(client, llama_dir):
    ask = dict(model=llama_dir.name, input="Weather in Paris?", tools=TOOLS, max_output_tokens=40, temperature=0,
               tool_choice={"type": "function", "name": "get_weather"})
    response = client.responses.create(**ask)
    (call,) = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.id.startswith("fc_")
    assert call.call_id and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert response.status == "completed"
    events = events_of(client, llama_dir, **{k: v for k, v in ask.items() if k not in ("model", "temperature")})
    check_event_order(events)
    added = events[2]
    assert added.item.type == "function_call" and added.item.name == "get_weather" and added.item.arguments == ""
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas == done.arguments == call.arguments
    with client.responses.stream(**ask) as stream:
        assert stream.get_final_response().output[0].arguments == call.arguments
    # Cut inside its arguments: the call item is incomplete too, whole and streamed.
    cut = client.responses.create(**dict(ask, max_output_tokens=3))
    assert cut.status == "incomplete" and [i.status for i in cut.output] == ["incomplete"]
    assert call.arguments.startswith(cut.output[0].arguments) and cut.output[0].arguments != call.arguments
    events = events_of(client, llama_dir, **{k: v for k, v in dict(ask, max_output_tokens=3).items()
                                             if k not in ("model", "temperature")})
    assert [e.item.status for e in events if e.type == "response.output_item.done"] == ["incomplete"]
    # The call and its output go back as input: the same prompt as chat's tool turn.
    follow_up = [{"role": "user", "content": "Weather in Paris?"},
                 {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                 {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    answer = client.responses.create(model=llama_dir.name, input=follow_up, tools=TOOLS, tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    expected = chat(client, llama_dir, [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"}],
        tools=CHAT_TOOLS, tool_choice="none", max_tokens=8)
    assert answer.output_text == expected.choices[0].message.content


def test_the_model_s_own_calls_are_parsed_into_function_call_items(client, llama_dir):
    said = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    ask = dict(input="Weather in Oslo?", tools=TOOLS, max_output_tokens=80,
               extra_body={"structured_outputs": {"choice": [said]}})
    response = client.responses.create(model=llama_dir.name, temperature=0, **ask)
    message, call = response.output
    assert message.content[0].text == "Let me look." and response.status == "completed"
    assert (call.type, call.name, json.loads(call.arguments)) == ("function_call", "get_weather", {"city": "Oslo"})
    events = events_of(client, llama_dir, **ask)
    check_event_order(events)
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["message", "function_call"]
    assert events[-1].response.output[1].arguments == call.arguments


def test_text_format_json_schema_holds_the_output_to_it(client, llama_dir):
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}}, "required": ["colour"],
              "additionalProperties": False}
    response = client.responses.create(model=llama_dir.name, input="A colour?", max_output_tokens=30, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "colour", "schema": schema}})
    expected = chat(client, llama_dir, [{"role": "user", "content": "A colour?"}], max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "colour", "schema": schema}}).choices[0].message.content
    assert response.output_text == expected and response.text.format.type == "json_schema"
    # (A random model may emit whitespace where the schema allows it, so the text may be cut; it starts as JSON.)
    assert expected.startswith("{") and expected != chat(client, llama_dir, [{"role": "user", "content": "A colour?"}],
                                                         max_tokens=30).choices[0].message.content


def test_logprobs_come_with_the_output_text_when_included(client, llama_dir):
    expected = chat(client, llama_dir, [{"role": "user", "content": "Count."}], max_tokens=5, logprobs=True,
                    top_logprobs=2).choices[0].logprobs.content
    ask = dict(input="Count.", max_output_tokens=5, include=["message.output_text.logprobs"], top_logprobs=2)
    response = client.responses.create(model=llama_dir.name, temperature=0, **ask)
    entries = response.output[0].content[0].logprobs
    # (Tokens exactly; logprobs to rounding: the second prompt may come partly from the prefix cache.)
    assert [(e.token, [t.token for t in e.top_logprobs]) for e in entries] == \
        [(e.token, [t.token for t in e.top_logprobs]) for e in expected]
    assert [e.logprob for e in entries] == pytest.approx([e.logprob for e in expected], abs=1e-4)
    streamed = [lp for e in events_of(client, llama_dir, **ask) if e.type == "response.output_text.delta"
                for lp in e.logprobs]
    assert [e.token for e in streamed] == [e.token for e in expected]


def test_a_repeated_prompt_reports_its_cached_tokens(client, llama_dir):
    prompt = "The same long question about rivers and lakes, asked twice over. " * 6
    first = client.responses.create(model=llama_dir.name, input=prompt, max_output_tokens=2, temperature=0)
    second = client.responses.create(model=llama_dir.name, input=prompt, max_output_tokens=2, temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens_details.cached_tokens == 0
    # Whole blocks of 16, all but the last token's block at most (the last prompt token is always computed).
    assert cached > 0 and cached % 16 == 0 and cached < second.usage.input_tokens
    usage = chat(client, llama_dir, [{"role": "user", "content": prompt}], max_tokens=2).usage
    assert usage.prompt_tokens_details.cached_tokens == cached


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tool_choice": "auto", "tools": TOOLS[:0] + [{"type": "function"}]}, "tools"),
    ({"tool_choice": {"type": "function"}, "tools": TOOLS}, "tool_choice"),
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"extra_body": {"seed": "abc"}}, "seed"),  # an extension field, of the wrong type
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input"),
])
def test_what_cannot_be_done_is_a_400_naming_the_field(client, llama_dir, fields, param):
    ask = {"model": llama_dir.name, "input": "Hi", "max_output_tokens": 4, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(**ask)
    assert error.value.body["param"] == param, error.value.body
    assert client.responses.create(model=llama_dir.name, input="Hi", max_output_tokens=2).usage.output_tokens == 2


def test_a_stream_that_fails_ends_with_an_error_event_and_response_failed():
    from openai.types.responses import ResponseErrorEvent, ResponseFailedEvent

    from services.gateway.model import Model
    from services.gateway.responses_api import _Response
    from services.gateway.responses_protocol import ResponsesRequest

    model = Model("m", 4096, 32000, 20, tokenizer=None)
    reply = _Response(model, ResponsesRequest(input="hi", stream=True), "resp_1", [], ["hi"])
    events = reply.events()

    async def two_events():
        return [await events.__anext__(), await events.__anext__()]

    import asyncio

    assert [json.loads(e.split("data: ", 1)[1])["type"] for e in asyncio.run(two_events())] == \
        ["response.created", "response.in_progress"]
    failure = {"error": {"message": "the scheduler went away", "type": "ServiceUnavailableError", "param": None,
                         "code": "service_unavailable"}}
    error, failed = (json.loads(frame.split("data: ", 1)[1]) for frame in reply.error_event(failure).split("\n\n"))
    error, failed = ResponseErrorEvent.model_validate(error), ResponseFailedEvent.model_validate(failed)
    assert (error.type, error.sequence_number, error.code, error.message) == \
        ("error", 2, "service_unavailable", "the scheduler went away")
    assert failed.sequence_number == 3 and failed.response.status == "failed"
    assert failed.response.error.message == "the scheduler went away"


# --- reasoning (--reasoning-parser qwen3) ----------------------------------------------------------------

THINK = {"structured_outputs": {"regex": "<think>[a-z]{3,12}</think>[a-z]{3,12}"}}  # vLLM's field: a thinking shape


def test_reasoning_is_told_from_the_answer_whole_streamed_and_in_responses(client, llama_dir):
    messages = [{"role": "user", "content": "Think, then answer."}]
    answer = chat(client, llama_dir, messages, max_tokens=40, extra_body=THINK)
    whole = answer.choices[0].message
    reasoning, content = whole.model_extra["reasoning"], whole.content
    assert 0 < answer.usage.completion_tokens_details.reasoning_tokens < answer.usage.completion_tokens
    assert reasoning and content and whole.model_extra["reasoning_content"] == reasoning
    assert reasoning.isalpha() and content.isalpha() and "<" not in reasoning + content
    # Streamed: reasoning deltas, then content deltas, adding up to the whole answer's.
    pieces = {"reasoning_content": "", "content": ""}
    for chunk in chat(client, llama_dir, messages, max_tokens=40, extra_body=THINK, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is not None:
            pieces["content"] += delta.content or ""
            pieces["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            assert not (delta.content and pieces["reasoning_content"] != reasoning), "content before reasoning ended"
    assert pieces == {"reasoning_content": reasoning, "content": content}
    # include_reasoning false: the same answer without its reasoning.
    hidden = chat(client, llama_dir, messages, max_tokens=40, extra_body={**THINK, "include_reasoning": False})
    assert hidden.choices[0].message.content == content and hidden.choices[0].message.model_extra["reasoning"] is None
    # A plain answer (no <think> opening it) is all content.
    plain = chat(client, llama_dir, messages, max_tokens=6).choices[0].message
    assert plain.model_extra["reasoning"] is None and plain.content
    # Responses: a reasoning item before the message, whole and streamed.
    ask = dict(input="Think, then answer.", max_output_tokens=40, extra_body=THINK)
    response = client.responses.create(model=llama_dir.name, temperature=0, **ask)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning and response.output_text == content
    details = response.usage.output_tokens_details
    assert details.reasoning_tokens == answer.usage.completion_tokens_details.reasoning_tokens
    # A stateless client's next turn sends the output back, its reasoning item included.
    follow_up = client.responses.create(model=llama_dir.name, max_output_tokens=4, input=[
        {"role": "user", "content": "Think, then answer."}, *[item.model_dump() for item in response.output],
        {"role": "user", "content": "And then?"}])
    assert follow_up.usage.output_tokens == 4
    events = events_of(client, llama_dir, reasoning={"effort": "low"}, **ask)
    check_event_order(events)
    assert [e.type for e in events[2:5]] == ["response.output_item.added", "response.content_part.added",
                                             "response.reasoning_text.delta"]
    assert events[-1].response.reasoning.effort == "low"
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == details.reasoning_tokens
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning
    assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [reasoning]
    assert events[-1].response.output_text == content


def test_reasoning_asked_of_a_gateway_without_a_parser_is_refused():
    from shared.invalid_parameter import InvalidParameter
    from services.gateway.responses_protocol import ResponsesRequest

    request = ResponsesRequest(model="m", input="Hi", reasoning={"effort": "high"})
    with pytest.raises(InvalidParameter, match="no --reasoning-parser"):
        request.check_reasoning(None)
