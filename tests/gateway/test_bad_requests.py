"""Bad requests over the gateway stack the files here share (conftest.py): an OpenAI error object naming the
field, and the server serves on."""

from __future__ import annotations

import json

from tests import patient_http as httpx
import openai
import pytest

from tests.gateway.shared_stack import error_of, wait_blocks_free


def test_bad_requests_get_openai_errors(stack, client, llama_dir):
    url = f"{stack.base_url}/v1/completions"
    ok = {"model": llama_dir.name, "prompt": "Hello", "max_tokens": 3}
    assert error_of(httpx.post(url, json={**ok, "model": "no-such-model"}), 404)["type"] == "NotFoundError"
    too_long = error_of(httpx.post(url, json={**ok, "max_tokens": 600}), 400)
    assert "512" in too_long["message"] and "600" in too_long["message"] and too_long["param"] == "max_tokens"
    assert "JSON" in error_of(httpx.post(url, content=b'{"prompt": ', headers={"content-type": "application/json"}),
                            400)["message"]
    form = error_of(httpx.post(url, content=json.dumps(ok).encode(),  # curl -d without -H sends a form type
                             headers={"content-type": "application/x-www-form-urlencoded"}), 400)["message"]
    assert "Content-Type: application/json" in form and "x-www-form-urlencoded" in form
    assert "JSON object" in error_of(httpx.post(url, json=[1, 2]), 400)["message"]
    for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        value = {str(10**6): 1} if field == "logit_bias" else [10**6]
        vocab = error_of(httpx.post(url, json={**ok, field: value}), 400)
        assert vocab["param"] == field and "vocabulary" in vocab["message"], vocab
    assert error_of(httpx.post(url, json={**ok, "temperature": -0.5}), 400)["param"] == "temperature"
    assert error_of(httpx.post(url, json={**ok, "logprobs": 21}), 400)["param"] == "logprobs"
    assert error_of(httpx.post(url, json={**ok, "top_p": 1e-300}), 400)["param"] == "top_p"  # 0 as a float32
    assert "vocabulary" in error_of(httpx.post(url, json={**ok, "prompt": [1, 2, 512]}), 400)["message"]
    assert "vocabulary" in error_of(httpx.post(url, json={**ok, "prompt": [1, -1]}), 400)["message"]
    assert "vocabulary" in error_of(httpx.post(url, json={**ok, "prompt": [[1, 2], [-3]], "echo": True}),
                                    400)["message"]
    assert error_of(httpx.post(url, json={**ok, "prompt": ""}), 400)["param"] == "prompt"
    assert error_of(httpx.post(url, json={**ok, "prompt": []}), 400)["param"] == "prompt"
    assert error_of(httpx.post(url, json={**ok, "n": 2, "best_of": 3}), 400)["param"] == "best_of"
    assert error_of(httpx.post(url, json={**ok, "n": 3, "best_of": 2}), 400)["param"] == "best_of"
    assert error_of(httpx.post(url, json={**ok, "stream": True, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert error_of(httpx.post(url, json={**ok, "max_tokens": None, "min_tokens": 2**32 - 1}), 400)["param"] == \
        "min_tokens"
    # Refused before the gateway builds anything per sequence (2**31 detokenizers took all memory).
    assert error_of(httpx.post(url, json={**ok, "n": 2**31}, timeout=10), 400)["param"] == "n"
    beams = {**ok, "use_beam_search": True, "beam_width": 10**6}
    assert error_of(httpx.post(url, json=beams, timeout=10), 400)["param"] == "beam_width"
    chat = f"{stack.base_url}/v1/chat/completions"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    error_of(httpx.post(chat, json={"model": llama_dir.name, "messages": image}), 400)
    error_of(httpx.post(chat, json={"model": llama_dir.name, "messages": [], "max_tokens": 2}), 400)
    # Errors name chat's own fields, not the engine's.
    top = error_of(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                                        "logprobs": True}), 400)
    assert top["param"] == "top_logprobs" and "top_logprobs=30" in top["message"]
    assert error_of(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1,
                                         "logprobs": True}), 400)["param"] == "top_logprobs"
    longest = error_of(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}],
                                            "max_completion_tokens": 600}), 400)
    assert longest["param"] == "max_completion_tokens" and "max_completion_tokens" in longest["message"]
    assert error_of(httpx.post(chat, json={"messages": [{"role": "user", "content": "x " * 600}]}), 400)["param"] == \
        "messages"
    hi = {"model": llama_dir.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert httpx.post(chat, json={**hi, "tools": tools, "tool_choice": "none"}).status_code == 200
    for tool_choice, why in [({"type": "function", "function": {"name": "g"}}, "g"),
                             ("sometimes", "tool_choice must be")]:
        refused = error_of(httpx.post(chat, json={**hi, "tools": tools, "tool_choice": tool_choice}), 400)
        assert refused["param"] == "tool_choice" and why in refused["message"], refused
    assert error_of(httpx.post(chat, json={**hi, "tool_choice": "required"}), 400)["param"] == "tool_choice"
    assert error_of(httpx.post(chat, json={**hi, "tools": [{"type": "function", "function": {}}],
                                         "tool_choice": "required"}), 400)["param"] == "tools"
    assert error_of(httpx.post(chat, json={**hi, "tools": tools, "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}), 400)["param"] == "tool_choice"
    assert httpx.post(chat, json={**hi, "response_format": {"type": "text"}}).status_code == 200
    # Structured outputs: a bad constraint, or two of them, is a 400 naming the field it came in.
    for name, value in [("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
                        ("response_format", {"type": "yaml"}),
                        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
                        ("guided_regex", "a(b"), ("guided_grammar", "root ::= missing"), ("guided_choice", []),
                        ("structured_outputs", {"json": {}, "regex": "a"}), ("structured_outputs", {"xml": "a"})]:
        assert error_of(httpx.post(chat, json={**hi, name: value}), 400)["param"] == name, (name, value)
    both = error_of(httpx.post(url, json={**ok, "guided_regex": "a", "response_format": {"type": "json_object"}}), 400)
    assert both["param"] in ("guided_regex", "response_format") and "one of" in both["message"]
    error_of(httpx.get(f"{stack.base_url}/v1/no-such-endpoint"), 404)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=llama_dir.name, prompt="Hi", max_tokens=3, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    # The extension fields vLLM users send are accepted.
    extras = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True,
              "stop_token_ids": [3], "skip_special_tokens": False, "include_stop_str_in_output": False, "seed": 3,
              "logit_bias": {"7": 1.5}, "best_of": 1, "user": "someone"}
    assert httpx.post(url, json={**ok, **extras}).status_code == 200
    # What would change the kind of answer, and this engine does not do, is refused by name.
    for name, value in [("logits_processors", ["x"]), ("stream_options", {"include_usage": True})]:
        assert error_of(httpx.post(url, json={**ok, name: value}), 400)["param"] == name, name
    assert httpx.post(url, json={**ok, "logits_processors": None}).status_code == 200  # null is not asking
    # allowed_token_ids (vLLM's): only those are sampled.
    allowed = httpx.post(url, json={**ok, "max_tokens": 8, "allowed_token_ids": [40, 41, 42], "ignore_eos": True,
                                    "logprobs": 0}).json()["choices"][0]
    names = {httpx.post(f"{stack.base_url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (40, 41, 42)}
    assert len(allowed["logprobs"]["tokens"]) == 8 and set(allowed["logprobs"]["tokens"]) <= names
    assert error_of(httpx.post(url, json={**ok, "allowed_token_ids": []}), 400)["param"] == "allowed_token_ids"
    # truncate_prompt_tokens (vLLM's): the prompt's last k tokens, as usage and echo count them.
    ids = httpx.post(f"{stack.base_url}/tokenize", json={"prompt": "The quick brown fox jumps over the lazy dog"}) \
        .json()["tokens"]
    cut = httpx.post(url, json={**ok, "prompt": "The quick brown fox jumps over the lazy dog", "temperature": 0,
                                "truncate_prompt_tokens": 4, "echo": True}).json()
    tail = httpx.post(url, json={**ok, "prompt": ids[-4:], "temperature": 0, "echo": True}).json()
    assert cut["usage"]["prompt_tokens"] == 4 and cut["choices"][0]["text"] == tail["choices"][0]["text"]
    whole = httpx.post(url, json={**ok, "prompt": "The quick brown fox", "echo": True}).json()["choices"][0]["text"]
    uncut = httpx.post(url, json={**ok, "prompt": "The quick brown fox", "echo": True,
                                  "truncate_prompt_tokens": 100}).json()["choices"][0]["text"]
    assert uncut.startswith("The quick brown fox") and uncut[:19] == whole[:19]  # nothing cut: echoed as given
    cut_chat = httpx.post(chat, json={**hi, "truncate_prompt_tokens": 3}).json()
    assert cut_chat["usage"]["prompt_tokens"] == 3
    for value in (0, 600, 1 << 31):  # 600: beyond the context (use -1); 2**31: beyond the wire's int32
        assert error_of(httpx.post(url, json={**ok, "truncate_prompt_tokens": value}), 400)["param"] == \
            "truncate_prompt_tokens", value
    assert error_of(httpx.post(url, json={**ok, "top_k": 1 << 31}), 400)["param"] == "top_k"
    only_stops = error_of(httpx.post(url, json={**ok, "allowed_token_ids": [7], "stop_token_ids": [7],
                                              "min_tokens": 1}), 400)
    assert only_stops["param"] == "allowed_token_ids" and "min_tokens" in only_stops["message"]
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    assert error_of(httpx.post(chat, json={**hi, "functions": functions}), 400)["param"] == "functions"
    assert error_of(httpx.post(chat, json={**hi, "continue_final_message": True}), 400)["param"] == \
        "continue_final_message"
    assert "reserved" in error_of(httpx.post(chat, json={**hi, "chat_template_kwargs": {"tokenize": True}}),
                                400)["message"]
    # An explicit null is the field's default, as the openai client sends for None.
    nulls = httpx.post(url, json={**ok, "n": None, "stream": None, "echo": None, "stream_options": None,
                                  "temperature": None})
    assert nulls.status_code == 200 and len(nulls.json()["choices"]) == 1
    reply = client.chat.completions.create(model=llama_dir.name, messages=hi["messages"], max_tokens=2, n=None,
                                           logprobs=None, stream=None)
    assert len(reply.choices) == 1
    # ... and the server still serves correctly.
    reply = client.completions.create(model=llama_dir.name, prompt="Hello", max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert wait_blocks_free(stack)["kv_blocks_used"] == 0
