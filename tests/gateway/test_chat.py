"""Chat over the gateway stack the files here share (conftest.py): template options, logprobs, structured
outputs (over both APIs), and tool calls, forced and the model's own."""

from __future__ import annotations

import json

import grpc
from tests import patient_http as httpx
import openai
import pytest

from pagedserve import SamplingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.gateway.shared_stack import error_of


def test_chat_template_options(client, offline, llama_dir):
    """vLLM's add_generation_prompt and continue_final_message reach the template as offline."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Well, "}]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    for options in ({"add_generation_prompt": False, "continue_final_message": True},
                    {"add_generation_prompt": False}, {"chat_template_kwargs": {"unused_variable": 1}}):
        reply = client.chat.completions.create(model=llama_dir.name, messages=messages, temperature=0, max_tokens=5,
                                               extra_body=options)
        offline_options = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
        expected = offline.chat(messages, greedy, use_tqdm=False, chat_template_kwargs=options.get(
            "chat_template_kwargs"), **offline_options)[0]
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids), options
        assert reply.choices[0].message.content == expected.outputs[0].text, options
    # A template of the request's own (the gateway trusts them here), in the chat and in /tokenize.
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    own = offline.chat(messages, greedy, use_tqdm=False, chat_template=template)[0]
    reply = client.chat.completions.create(model=llama_dir.name, messages=messages, temperature=0, max_tokens=5,
                                           extra_body={"chat_template": template})
    assert reply.usage.prompt_tokens == len(own.prompt_token_ids) and own.prompt.startswith("[user] Hi")
    assert reply.choices[0].message.content == own.outputs[0].text
    base_url = str(client.base_url).removesuffix("/v1/")
    tokens = httpx.post(f"{base_url}/tokenize", json={"messages": messages, "chat_template": template}).json()
    assert tokens["tokens"] == own.prompt_token_ids
    with pytest.raises(openai.BadRequestError, match="chat template cannot render"):
        client.chat.completions.create(model=llama_dir.name, messages=messages, max_tokens=2,
                                       extra_body={"chat_template": "{% for %}"})
    plain = offline.chat(messages, greedy, use_tqdm=False)[0]
    continued = offline.chat(messages, greedy, use_tqdm=False, add_generation_prompt=False,
                             continue_final_message=True)[0]
    assert continued.prompt.endswith("Well, ") and not plain.prompt.endswith("Well, ")


def test_chat_logprobs(client, llama_dir):
    reply = client.chat.completions.create(model=llama_dir.name, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                           extra_body={"ignore_eos": True})
    content = reply.choices[0].logprobs.content
    assert len(content) == 4 and all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob for entry in content)


def test_structured_outputs_over_both_apis(stack, client, offline, llama_dir):
    """OpenAI's response_format, vLLM's structured_outputs and guided_*, and the gRPC field: the
    offline API's constrained tokens, over the wire."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    prompt = "Answer in JSON:"

    def offline_text(**constraint) -> str:
        params = SamplingParams(temperature=0, max_tokens=30, structured_outputs=constraint)
        return offline.generate(prompt, params, use_tqdm=False)[0].outputs[0].text

    # (A random model may emit whitespace until max_tokens where any is allowed: vLLM's switch turns it off.)
    chat_prompt = [{"role": "user", "content": prompt}]
    reply = client.chat.completions.create(model=llama_dir.name, messages=chat_prompt, max_tokens=30, temperature=0,
                                           extra_body={"structured_outputs": {"json": schema,
                                                                              "disable_any_whitespace": True}})
    value = json.loads(reply.choices[0].message.content)
    assert set(value) == {"ok", "n"} and value["n"] in (1, 2, 3) and reply.choices[0].finish_reason == "stop"
    expected = offline_text(json=schema)
    completion = client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=30, temperature=0,
                                           extra_body={"response_format": {"type": "json_schema",
                                                                           "json_schema": {"schema": schema}}})
    assert completion.choices[0].text == expected
    for extra, constraint in [({"guided_choice": ["red", "green"]}, {"choice": ["red", "green"]}),
                              ({"structured_outputs": {"regex": "[a-c]{2}[0-9]"}}, {"regex": "[a-c]{2}[0-9]"}),
                              ({"response_format": {"type": "json_object"}}, {"json_object": True})]:
        streamed = client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=30, temperature=0,
                                             stream=True, extra_body=extra)
        assert "".join(chunk.choices[0].text for chunk in streamed) == offline_text(**constraint), extra
    # A constraint the check lets through but no output can follow fails its own request, with a 400.
    dead_end = httpx.post(f"{stack.base_url}/v1/completions", timeout=30, json={
        "model": llama_dir.name, "prompt": prompt, "max_tokens": 30, "guided_regex": "a[^\\s\\S]"})
    assert "allows no next token" in error_of(dead_end, 400)["message"]
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        params = api.SamplingParameters(temperature=0, max_tokens=30,
                                        structured_outputs=api.StructuredOutputs(json=json.dumps(schema)))
        replies = list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(text=prompt, params=params)))
        assert "".join(r.text for r in replies) == expected
        bad = api.SamplingParameters(structured_outputs=api.StructuredOutputs(regex="a(b"))
        with pytest.raises(grpc.RpcError) as refused:
            list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(text=prompt, params=bad)))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in refused.value.details()


def test_forced_tool_calls(stack, client, llama_dir):
    """tool_choice naming a function, or "required": OpenAI's tool_calls, whole and streamed."""
    # Bounded arguments: a random model's integer or string could run past max_tokens.
    weather = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}, "days": {"enum": [1, 2, 3]},
                                                "rain": {"type": "boolean"}},
               "required": ["city", "days", "rain"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": weather}},
             {"type": "function", "function": {"name": "get_time", "parameters": {
                 "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                 "additionalProperties": False}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(model=llama_dir.name, messages=messages, tools=tools, tool_choice=named,
                                           max_tokens=40, temperature=0)
    choice = whole.choices[0]
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert arguments["city"] in ("Paris", "Oslo") and arguments["days"] in (1, 2, 3) and arguments["rain"] in (True, False)
    assert choice.finish_reason == "stop" and choice.message.content is None  # OpenAI's, for a named function
    streamed = client.chat.completions.create(model=llama_dir.name, messages=messages, tools=tools, tool_choice=named,
                                              max_tokens=40, temperature=0, stream=True)
    deltas = [c.choices[0] for c in streamed if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather" and all(c.id is None for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == call.function.arguments
    assert deltas[-1].finish_reason == "stop"
    # (A prompt whose greedy array ends within max_tokens: a random model may go on adding calls.)
    short = [{"role": "user", "content": "x"}]
    required = client.chat.completions.create(model=llama_dir.name, messages=short, tools=tools,
                                              tool_choice="required", max_tokens=60, temperature=0, n=2)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        assert {c.function.name for c in choice.message.tool_calls} <= {"get_weather", "get_time"}
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in choice.message.tool_calls)
    stream_required = client.chat.completions.create(model=llama_dir.name, messages=short, tools=tools,
                                                     tool_choice="required", max_tokens=60, temperature=0, stream=True)
    last = [c.choices[0] for c in stream_required if c.choices][-1]
    assert last.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in last.delta.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in required.choices[0].message.tool_calls]
    cut = client.chat.completions.create(model=llama_dir.name, messages=short, tools=tools, tool_choice="required",
                                         max_tokens=5, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("[")
    # A named call cut off: its arguments as far as they came, whole as streamed.
    cut = client.chat.completions.create(model=llama_dir.name, messages=messages, tools=tools, tool_choice=named,
                                         max_tokens=5, temperature=0)
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.tool_calls[0].function.arguments
    single = client.chat.completions.create(model=llama_dir.name, messages=short, tools=tools, tool_choice="required",
                                            max_tokens=60, temperature=0, parallel_tool_calls=False)
    assert len(single.choices[0].message.tool_calls) == 1
    # The next turn: the call and its result go back to the chat template.
    follow_up = messages + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert client.chat.completions.create(model=llama_dir.name, messages=follow_up, max_tokens=3).choices


def test_auto_tool_calls(stack, client, llama_dir):
    """tool_choice "auto": the model's own calls (Hermes' format, read by --tool-call-parser hermes)
    come back as tool_calls, whole and streamed; an answer without calls is text, as with "none"."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    ask = dict(model=llama_dir.name, messages=messages, tools=tools, max_tokens=12, temperature=0)
    text = client.chat.completions.create(**ask, tool_choice="none").choices[0]
    for choice in (None, "auto"):  # the same prompt (the template shows the tools either way): the same text
        plain = client.chat.completions.create(**ask, **({"tool_choice": choice} if choice else {})).choices[0]
        assert plain.message.content == text.message.content and plain.message.tool_calls is None
        assert plain.finish_reason == text.finish_reason
    streamed = client.chat.completions.create(**ask, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text.message.content
    # A model that calls: its output held (structured outputs) to text with two calls in it (144 tokens).
    said = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    calling = dict(ask, max_tokens=160, extra_body={"structured_outputs": {"choice": [said]}})
    whole = client.chat.completions.create(**calling, n=2).choices
    for choice in whole:
        assert choice.message.content == "Let me look." and choice.finish_reason == "tool_calls"
        assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
            [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
        assert all(c.id.startswith("chatcmpl-tool-") and c.type == "function" for c in choice.message.tool_calls)
    chunks = [c.choices[0] for c in client.chat.completions.create(**calling, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == "Let me look."
    calls = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [(c.index, c.function.name, c.function.arguments) for c in calls] == \
        [(i, c.function.name, c.function.arguments) for i, c in enumerate(whole[0].message.tool_calls)]
    assert all(c.id for c in calls) and chunks[-1].finish_reason == "tool_calls"
    # parallel_tool_calls false: the first call only (as OpenAI's).
    single = client.chat.completions.create(**calling, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments) for c in single.message.tool_calls] == [{"city": "Paris"}]
    chunks = [c.choices[0] for c in client.chat.completions.create(**calling, parallel_tool_calls=False, stream=True)
              if c.choices]
    assert [call.function.arguments for c in chunks for call in c.delta.tool_calls or []] == \
        [single.message.tool_calls[0].function.arguments]
    # Cut off inside a call: what came is text.
    cut = client.chat.completions.create(**dict(calling, max_tokens=40)).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert said.startswith(cut.message.content) and "<tool_call>" in cut.message.content
