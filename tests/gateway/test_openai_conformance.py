"""The gateway as vLLM's own OpenAI-server tests see it: the shapes, fields, extensions and refusals their
assertions check, through the real services (the openai client and raw HTTP), and the pieces that decide
them without a server.

The stack runs as vLLM's tests run theirs where they need a flag (and with --scheduling-policy priority, which
only orders requests): --return-tokens-as-token-ids at the
gateway (requests may say otherwise) and a scheduler whose --max-logprobs is the whole vocabulary (-1)."""

from __future__ import annotations

import json

from tests import patient_http as httpx
import grpc
import openai
import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from services.gateway.deltas import TokenLogprob, TopToken
from services.gateway.logprob_format import completion_logprobs, top_sampled_first
from services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from shared.invalid_parameter import InvalidParameter
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.services_harness import Stack, http_get

WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "256")
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def vocab_size(llama_dir) -> int:
    return json.loads((llama_dir / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def stack(llama_dir, vocab_size, tmp_path_factory):
    with Stack(llama_dir, tmp_path_factory.mktemp("conformance-logs"), worker_args=WORKER_ARGS,
               scheduler_args=("--max-logprobs", str(vocab_size), "--scheduling-policy", "priority"),
               gateway_args=("--return-tokens-as-token-ids",)) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(str(llama_dir))


def ids_of(tokens: list[str]) -> list[int]:
    """The ids of logprobs' tokens named "token_id:<id>"."""
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


def sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as reply:
        assert reply.status_code == 200, reply.read()
        data = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def error(reply: httpx.Response) -> dict:
    assert reply.status_code == 400, reply.text
    return reply.json()["error"]


# --- without a server ---------------------------------------------------------------------------------


def _entry(token_id: int, *top_ids: int) -> TokenLogprob:
    top = [TopToken(t, f"t{t}", -float(rank)) for rank, t in enumerate(top_ids, 1)]
    return TokenLogprob(token_id, f"t{token_id}", -1.5, 0, top)


def test_the_sampled_token_leads_the_top_ones_when_it_is_among_them():
    assert [t.token_id for t in top_sampled_first(_entry(7, 3, 7, 5), 3)] == [7, 3, 5]
    assert [t.token_id for t in top_sampled_first(_entry(7, 3, 5, 7), 2)] == [3, 5]  # not among the top 2
    assert top_sampled_first(_entry(7, 3, 5), 0) == []
    lp = completion_logprobs([_entry(7, 3, 5, 7)], 0, as_ids=True)
    assert list(lp["top_logprobs"][0]) == ["token_id:7", "token_id:3", "token_id:5"] and lp["tokens"] == ["token_id:7"]


def test_minus_one_counts_the_whole_vocabulary_where_the_server_allows_it():
    body = CompletionRequest(prompt="x", logprobs=-1, prompt_logprobs=-1)
    body.count_whole_vocabulary(512, 512)
    assert (body.logprobs, body.prompt_logprobs) == (512, 512)
    chat = ChatCompletionRequest(messages=HI, logprobs=True, top_logprobs=-1)
    with pytest.raises(InvalidParameter, match=r"whole vocabulary \(512 tokens\).*--max-logprobs") as refused:
        chat.count_whole_vocabulary(512, 20)
    assert refused.value.param == "top_logprobs"
    with pytest.raises(ValidationError, match="greater_than_equal"):
        ChatCompletionRequest(messages=HI, logprobs=True, top_logprobs=-2)


def test_flags_are_json_booleans_or_their_names():
    assert CompletionRequest(prompt="x", echo="true").echo and not CompletionRequest(prompt="x", echo="false").echo
    for value in ("yes", "on", 1, "True"):
        with pytest.raises(ValidationError, match="bool_type"):
            CompletionRequest(prompt="x", stream=value)


# --- through the services ---------------------------------------------------------------------------------


def test_a_held_back_token_streams_as_empty_content(stack, tokenizer):
    # A character's first byte alone is not text yet: its chunk says so with "content": "" (not an empty delta).
    lead = tokenizer("东", add_special_tokens=False).input_ids[0]
    assert tokenizer.decode([lead]).endswith("\ufffd")
    chunks = sse(f"{stack.base_url}/v1/chat/completions",
                 {"messages": HI, "max_tokens": 2, "ignore_eos": True, "allowed_token_ids": [lead], "stream": True})
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1] == {"content": ""} and all(isinstance(d["content"], str) for d in deltas)


def test_whole_answers_carry_every_field_vllm_s_do(stack, client, llama_dir):
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).json()
    assert {"prompt_logprobs", "prompt_token_ids", "system_fingerprint", "service_tier"} <= chat.keys()
    assert chat["prompt_logprobs"] is None and chat["choices"][0]["token_ids"] is None
    message = chat["choices"][0]["message"]
    assert {k: message[k] for k in ("refusal", "annotations", "audio", "function_call", "reasoning")} == \
        dict.fromkeys(("refusal", "annotations", "audio", "function_call", "reasoning"))
    completion = httpx.post(f"{stack.base_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).json()
    choice = completion["choices"][0]
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None and choice["token_ids"] is None
    # What vLLM's tests read off the openai client's objects.
    assert client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=2).prompt_logprobs is None
    asked = client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=2,
                                           extra_body={"prompt_logprobs": 0})
    assert asked.prompt_logprobs[0] is None and all(len(p) == 1 for p in asked.prompt_logprobs[1:])


def test_the_model_s_card_names_its_root(stack, llama_dir):
    cards = http_get(f"{stack.base_url}/v1/models")[1]["data"]
    assert [(c["id"], c["root"], c["parent"]) for c in cards] == [(llama_dir.name, str(llama_dir), None)]


def test_chat_echo_starts_the_answer_with_the_message_it_continues(stack, client, llama_dir):
    saying = "An apple a day keeps"
    messages = [{"role": "user", "content": "Finish the saying."}, {"role": "assistant", "content": saying}]
    ask = dict(model=llama_dir.name, messages=messages, max_tokens=6, temperature=0)
    body = {"continue_final_message": True, "add_generation_prompt": False, "ignore_eos": True}
    plain = client.chat.completions.create(**ask, extra_body=body).choices[0].message.content
    echoed = client.chat.completions.create(**ask, extra_body={**body, "echo": True}).choices[0].message.content
    assert echoed == saying + plain
    streamed = client.chat.completions.create(**ask, stream=True, extra_body={**body, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == echoed
    # A generation prompt starts a new assistant message: nothing of the user's is echoed.
    new_turn = client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=3, temperature=0,
                                              extra_body={"echo": True, "ignore_eos": True})
    assert new_turn.choices[0].message.content == \
        client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].message.content


def test_minus_one_logprobs_are_the_whole_vocabulary(stack, client, llama_dir, vocab_size):
    # As vLLM's test sends them: logprobs as the string "true".
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions",
                      json={"messages": HI, "max_tokens": 1, "logprobs": "true", "top_logprobs": -1}).json()
    top = chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(top) == vocab_size and len(set(ids_of([t["token"] for t in top]))) == vocab_size
    completion = client.completions.create(model=llama_dir.name, prompt="Hi", max_tokens=1, logprobs=-1)
    assert len(completion.choices[0].logprobs.top_logprobs[0]) == vocab_size
    scored = client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=1,
                                            extra_body={"prompt_logprobs": -1})
    assert scored.prompt_logprobs[0] is None and all(len(p) == vocab_size for p in scored.prompt_logprobs[1:])


def test_tokens_as_token_ids_by_flag_or_request(client, llama_dir, tokenizer):
    prompt = "Say 'Hello, world! 东'"
    reply = client.completions.create(model=llama_dir.name, prompt=prompt, echo=True, temperature=0, max_tokens=6,
                                      logprobs=1)
    choice = reply.choices[0]
    tokens = choice.logprobs.tokens
    # (A character the output cut short decodes to U+FFFD at the end, where the text leaves it out, as vLLM's.)
    assert tokenizer.decode(ids_of(tokens), skip_special_tokens=True).rstrip("\ufffd") == choice.text.rstrip("\ufffd")
    # Each top map starts with its token, the prompt's tokens (rarely the most likely) included.
    assert tokens[1:] == [next(iter(top)) for top in choice.logprobs.top_logprobs[1:]]
    text = client.completions.create(model=llama_dir.name, prompt=prompt, temperature=0, max_tokens=3, logprobs=1,
                                     extra_body={"return_tokens_as_token_ids": False, "return_token_ids": True})
    assert text.choices[0].logprobs.tokens == [tokenizer.decode([t]) for t in text.choices[0].token_ids]
    chat = client.chat.completions.create(model=llama_dir.name, messages=HI, temperature=0, max_tokens=6,
                                          logprobs=True, top_logprobs=3).choices[0]
    assert tokenizer.decode(ids_of([e.token for e in chat.logprobs.content]), skip_special_tokens=True) \
        .rstrip("\ufffd") == chat.message.content.rstrip("\ufffd")
    sampled = client.chat.completions.create(model=llama_dir.name, messages=HI, temperature=1.5, seed=7, max_tokens=8,
                                             logprobs=True, top_logprobs=4).choices[0].logprobs.content
    for entry in sampled:  # vLLM's order: the sampled token first when it is among the top ones
        top = [t.token for t in entry.top_logprobs]
        assert entry.token not in top or top[0] == entry.token


def test_return_token_ids(stack, client, llama_dir, tokenizer):
    prompt = "The quick brown fox"
    prompt_ids = tokenizer(prompt).input_ids
    whole = client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=5, temperature=0,
                                      extra_body={"return_token_ids": True}).choices[0]
    assert whole.prompt_token_ids == prompt_ids and tokenizer.decode(whole.token_ids).startswith(whole.text)
    chunks = sse(f"{stack.base_url}/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0,
                                                      "logprobs": 1, "return_token_ids": True, "stream": True})
    choices = [c["choices"][0] for c in chunks]
    assert choices[0]["prompt_token_ids"] == prompt_ids and all("prompt_token_ids" not in c for c in choices[1:])
    streamed = [t for c in choices for t in c["token_ids"]]
    assert streamed == whole.token_ids == ids_of([t for c in choices for t in c["logprobs"]["tokens"]])
    chat = client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=5, temperature=0,
                                          extra_body={"return_token_ids": True})
    rendered = httpx.post(f"{stack.base_url}/tokenize", json={"messages": HI}).json()["tokens"]
    assert chat.prompt_token_ids == rendered
    assert tokenizer.decode(chat.choices[0].token_ids, skip_special_tokens=True) == chat.choices[0].message.content
    stream = sse(f"{stack.base_url}/v1/chat/completions", {"messages": HI, "max_tokens": 5, "temperature": 0,
                                                           "return_token_ids": True, "stream": True})
    assert stream[0]["prompt_token_ids"] == rendered and all("prompt_token_ids" not in c for c in stream[1:])
    assert [t for c in stream for t in c["choices"][0].get("token_ids", [])] == chat.choices[0].token_ids
    plain = client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=2)
    assert plain.prompt_token_ids is None and plain.choices[0].token_ids is None


def test_truncation_side_right_keeps_the_first_tokens(stack):
    ids = list(range(40, 50))
    ask = {"prompt": ids, "max_tokens": 1, "truncate_prompt_tokens": 3, "return_token_ids": True}
    right = httpx.post(f"{stack.base_url}/v1/completions", json={**ask, "truncation_side": "right"}).json()
    left = httpx.post(f"{stack.base_url}/v1/completions", json={**ask, "truncation_side": "left"}).json()
    assert right["choices"][0]["prompt_token_ids"] == ids[:3] and right["usage"]["prompt_tokens"] == 3
    assert left["choices"][0]["prompt_token_ids"] == ids[-3:]
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions",
                      json={"messages": HI, "max_tokens": 1, "truncate_prompt_tokens": 2, "truncation_side": "right",
                            "return_token_ids": True}).json()
    rendered = httpx.post(f"{stack.base_url}/tokenize", json={"messages": HI}).json()["tokens"]
    assert chat["prompt_token_ids"] == rendered[:2]
    assert error(httpx.post(f"{stack.base_url}/v1/completions", json={**ask, "truncation_side": "middle"}))["param"] \
        == "truncation_side"


def test_tokenize_shows_tools_and_the_vocabulary_s_strings(stack, tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    url = f"{stack.base_url}/tokenize"
    bare = httpx.post(url, json={"messages": HI}).json()
    shown = httpx.post(url, json={"messages": HI, "tools": tools}).json()
    assert shown["count"] > bare["count"] and "get_weather" in tokenizer.decode(shown["tokens"])
    spelled = httpx.post(url, json={"prompt": " i am", "return_token_strs": True}).json()
    assert spelled["token_strs"] == tokenizer.convert_ids_to_tokens(spelled["tokens"]) and "Ġi" in spelled["token_strs"]


def test_what_openai_refuses_is_refused(stack, client, llama_dir):
    chat, completions = f"{stack.base_url}/v1/chat/completions", f"{stack.base_url}/v1/completions"
    assert error(httpx.post(chat, json={"messages": HI, "stream": "yes"}))["param"] == "stream"
    for messages, why in [([{"role": "robot", "content": "x"}], "role"),
                          ([*HI, {"role": "tool", "content": "42"}], "tool_call_id"),
                          ([{"role": "user", "content": None}], "content"),
                          ([{"role": "user"}], "content"),
                          ([{"role": "assistant", "content": None}], "content")]:
        refused = error(httpx.post(chat, json={"messages": messages}))
        assert refused["param"] == "messages" and why in refused["message"], (messages, refused)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    answered = [*HI, {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert httpx.post(chat, json={"messages": answered, "max_tokens": 1}).status_code == 200
    # A lone surrogate, escaped in JSON as clients send it: refused by name, not by the tokenizer.
    for url, body, param in [(chat, {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages"),
                             (completions, {"prompt": "a\ud800"}, "prompt"),
                             (completions, {"prompt": "a", "stop": ["\udfff"]}, "stop"),
                             (f"{stack.base_url}/tokenize", {"prompt": "\ud800"}, "prompt"),
                             (f"{stack.base_url}/v1/responses", {"input": "a\ud800"}, "input")]:
        refused = error(httpx.post(url, content=json.dumps(body), headers={"content-type": "application/json"}))
        assert refused["param"] == param and "lone surrogate" in refused["message"], (url, refused)
    # Range errors in pydantic's words, which vLLM's clients match.
    for seed, words in [(-(1 << 63) - 1, "greater_than_equal"), (1 << 63, "less_than_equal")]:
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=llama_dir.name, messages=HI, seed=seed)
        assert words in refused.value.message
    assert error(httpx.post(f"{stack.base_url}/v1/responses", json={"input": "x", "stream": "yes"}))["param"] == \
        "stream"
    assert client.chat.completions.create(model=llama_dir.name, messages=HI, max_tokens=2).choices[0].message.role \
        == "assistant"  # and the server serves on


def test_priority_is_taken_under_priority_scheduling_and_refused_when_not_an_integer(stack, llama_dir):
    """vLLM's priority field, on completions, chat, Responses and the gRPC API; lower runs first
    (tests/scheduler checks the order)."""
    base = stack.base_url
    for url, body in [(f"{base}/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
                      (f"{base}/v1/chat/completions", {"messages": HI, "max_tokens": 2}),
                      (f"{base}/v1/responses", {"input": "Hello", "max_output_tokens": 2})]:
        for priority in (-3, 0, 7):
            answer = httpx.post(url, json={**body, "priority": priority})
            assert answer.status_code == 200, (url, priority, answer.text)
        for priority in ("high", 1.5, 1 << 31):
            refused = error(httpx.post(url, json={**body, "priority": priority}))
            assert refused["param"] == "priority", (url, priority, refused)
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        replies = list(stub.Generate(api.GenerateRequest(
            text="Hello", priority=-5, params=api.SamplingParameters(max_tokens=2)), timeout=60))
        assert replies[-1].finish_reason
