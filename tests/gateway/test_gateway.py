"""The gateway end to end: real worker, scheduler and gateway processes on loopback, driven with the
official openai client, raw HTTP and the public gRPC API."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import signal
import subprocess
import sys
import time

import grpc
import httpx2 as httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from benchmarks.serving import parse_engine_stats
from pagedserve import LLM, SamplingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.lora_adapters import make_adapter
from tests.services_harness import START_LIMIT_S, Stack, free_port, http_get

PROMPTS = ["Hello there", "The quick brown fox", "Once upon a time"]
WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "512")


@pytest.fixture(scope="module")
def sql_adapter(llama_dir, tmp_path_factory):
    return make_adapter(llama_dir, tmp_path_factory.mktemp("adapters") / "sql", rank=8, seed=4)


@pytest.fixture(scope="module")
def stack(llama_dir, sql_adapter, tmp_path_factory):
    # LoRA on: requests without an adapter run as before (the adapters' matmuls are skipped).
    stack = Stack(llama_dir, tmp_path_factory.mktemp("gateway-logs"),
                  worker_args=WORKER_ARGS + ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"),
                  gateway_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                "--allow-runtime-lora-updating", "--trust-request-chat-template",
                                "--served-model-name", llama_dir.name, "llama-alias",
                                "--lora-modules", f"sql={sql_adapter}",  # several after one flag, as vLLM's
                                json.dumps({"name": "broken", "path": "/nowhere", "base_model_name": "hub/llama"}))
                  ).start()
    try:
        yield stack
    finally:
        codes = stack.stop()
    assert all(code is not None for code in codes.values()), codes
    assert codes["gateway"] == 0, f"the gateway did not shut down cleanly: {codes}\n{stack.log_tail('gateway')}"
    for name in codes:  # frozen start-up objects left to the exit: nanobind (Triton) reports them as leaks
        assert "nanobind: leaked" not in (stack.log_dir / f"{name}.log").read_text(errors="replace"), \
            stack.log_tail(name)


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(str(llama_dir), block_size=16)


def engine_stats(stack) -> dict[str, float]:
    status, text = http_get(f"{stack.base_url}/metrics")
    assert status == 200
    return parse_engine_stats(text)


def wait_blocks_free(stack, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine_stats(stack)
        if stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0 or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


# --- the basics ----------------------------------------------------------------------------------------


def test_models_health_openapi_and_request_id(stack, client, llama_dir):
    assert [m.id for m in client.models.list().data] == [llama_dir.name, "llama-alias", "sql", "broken"]
    # An alias (vLLM's --served-model-name with several) is served; answers carry the first name.
    aliased = client.completions.create(model="llama-alias", prompt="Hi", max_tokens=2)
    assert aliased.model == llama_dir.name and client.models.retrieve("llama-alias").id == "llama-alias"
    assert http_get(f"{stack.base_url}/health")[0] == 200
    status, spec = http_get(f"{stack.base_url}/openapi.json")
    assert status == 200 and "/v1/chat/completions" in spec["paths"]
    reply = httpx.post(f"{stack.base_url}/v1/completions", headers={"X-Request-Id": "my-id-1"},
                       json={"prompt": "Hi", "max_tokens": 2})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "my-id-1"
    assert reply.json()["id"] == "cmpl-my-id-1"
    assert client.models.retrieve(llama_dir.name).id == llama_dir.name
    assert _error(httpx.get(f"{stack.base_url}/v1/models/no-such-model"), 404)["code"] == "model_not_found"
    assert _error(httpx.get(f"{stack.base_url}/v1/nothing-here"), 404)["code"] == "not_found"
    # CORS, as vLLM: a browser's preflight is answered and any origin may call.
    preflight = httpx.options(f"{stack.base_url}/v1/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})
    allowed = preflight.headers["access-control-allow-origin"]
    assert preflight.status_code == 200 and allowed in ("*", "https://app.example")
    cross = httpx.post(f"{stack.base_url}/v1/completions", headers={"Origin": "https://app.example"},
                       json={"prompt": "Hi", "max_tokens": 2})
    assert cross.status_code == 200 and cross.headers["access-control-allow-origin"] == "*"


def test_a_lora_adapter_is_a_model_of_its_own(stack, client, llama_dir, sql_adapter):
    from pagedserve import LoRARequest

    cards = {m["id"]: m for m in http_get(f"{stack.base_url}/v1/models")[1]["data"]}
    assert cards["sql"]["parent"] == llama_dir.name and cards["sql"]["root"] == str(sql_adapter)
    assert cards["broken"]["parent"] == "hub/llama" and cards[llama_dir.name]["parent"] is None
    assert client.models.retrieve("sql").id == "sql"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    offline = LLM(str(llama_dir), enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("sql", str(sql_adapter))
    expected = [out.outputs[0].text for out in offline.generate(PROMPTS, params, use_tqdm=False, lora_request=lora)]
    base = [out.outputs[0].text for out in offline.generate(PROMPTS, params, use_tqdm=False)]
    assert expected != base
    reply = client.completions.create(model="sql", prompt=PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.model == "sql" and [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    plain = client.completions.create(model=llama_dir.name, prompt=PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(plain.choices, key=lambda c: c.index)] == base
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_expected = offline.chat(messages, params, use_tqdm=False, lora_request=lora)[0].outputs[0].text
    chunks = list(client.chat.completions.create(model="sql", messages=messages, max_tokens=12, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert {c.model for c in chunks} == {"sql"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_expected
    # An adapter the worker cannot read fails its own request, and only it.
    with pytest.raises(openai.BadRequestError, match="LoRA adapter 'broken' cannot be loaded"):
        client.completions.create(model="broken", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.NotFoundError, match="serves .*`sql`"):
        client.completions.create(model="no-such-adapter", prompt="Hi", max_tokens=2)
    assert client.completions.create(model="sql", prompt="Hi", max_tokens=2).choices[0].text is not None
    wait_blocks_free(stack)


def test_adapters_load_and_unload_while_serving(stack, client, llama_dir, sql_adapter):
    load, unload = f"{stack.base_url}/v1/load_lora_adapter", f"{stack.base_url}/v1/unload_lora_adapter"
    reply = httpx.post(load, json={"lora_name": "live", "lora_path": str(sql_adapter)})
    assert reply.status_code == 200 and reply.text == "Success: LoRA adapter 'live' added successfully."
    assert "live" in [m.id for m in client.models.list().data]
    live = client.completions.create(model="live", prompt="Hi", max_tokens=6, temperature=0)
    sql = client.completions.create(model="sql", prompt="Hi", max_tokens=6, temperature=0)
    assert live.model == "live" and live.choices[0].text == sql.choices[0].text  # the same directory
    assert _error(httpx.post(load, json={"lora_name": "live", "lora_path": str(sql_adapter)}), 400)["message"] \
        == "The lora adapter 'live' has already been loaded."
    assert "has no adapter_config.json" in _error(httpx.post(load, json={"lora_name": "x", "lora_path": "/none"}),
                                                  400)["message"]
    assert _error(httpx.post(load, json={"lora_name": "x"}), 400)["param"] == "lora_path"
    assert httpx.post(unload, json={"lora_name": "live"}).status_code == 200
    assert "live" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="live", prompt="Hi", max_tokens=2)
    assert _error(httpx.post(unload, json={"lora_name": "live"}), 404)["message"] == \
        "The lora adapter 'live' cannot be found."


def test_bad_words_as_offline(client, offline, llama_dir):
    greedy = SamplingParams(temperature=0, max_tokens=30)
    plain = offline.generate(PROMPTS[0], greedy, use_tqdm=False)[0].outputs[0]
    tokenizer = offline.get_tokenizer()
    # The first token the model says that is a word, one token with a space before it and without (vLLM bans
    # the spaced form only when it is as long as the other): banning the word bans it there.
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    word = next(w for t in plain.token_ids if (w := tokenizer.decode([t]).strip()).isalpha()
                and (encode(w) == [t] or encode(" " + w) == [t] and len(encode(w)) == 1))
    params = SamplingParams(temperature=0, max_tokens=30, bad_words=[word])
    expected = offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    reply = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=30, temperature=0,
                                      extra_body={"bad_words": [word]})
    assert reply.choices[0].text == expected.text and expected.token_ids != plain.token_ids
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model=llama_dir.name, prompt="Hi", max_tokens=2, extra_body={"bad_words": [" "]})


def test_greedy_matches_the_offline_api(client, offline, llama_dir):
    params = SamplingParams(temperature=0, max_tokens=8)
    expected = [out.outputs[0].text for out in offline.generate(PROMPTS, params, use_tqdm=False)]
    reply = client.completions.create(model=llama_dir.name, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == expected
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_expected = offline.chat(messages, params, use_tqdm=False)[0].outputs[0].text
    chat = client.chat.completions.create(model=llama_dir.name, messages=messages, max_tokens=8, temperature=0)
    assert chat.choices[0].message.content == chat_expected and chat.choices[0].message.role == "assistant"
    # Content given as text parts is the same conversation.
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}]
    again = client.chat.completions.create(model=llama_dir.name, messages=parts, max_completion_tokens=8,
                                           temperature=0)
    assert again.choices[0].message.content == chat_expected


def test_prompt_logprobs_as_vllm_returns_them(stack, offline, llama_dir):
    """Per prompt token (null first) its logprob and the top k, keyed by token id; per choice in
    completions, at the top in chat; equal to the offline API's."""
    ids = [5, 6, 7, 8, 200, 31]
    expected = offline.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=2),
                                use_tqdm=False)[0].prompt_logprobs

    def as_offline(got):
        return [None if p is None else {int(t): (round(v["logprob"], 4), v["rank"]) for t, v in p.items()} for p in got]

    want = [None if p is None else {t: (round(v.logprob, 4), v.rank) for t, v in p.items()} for p in expected]
    url = f"{stack.base_url}/v1/completions"
    reply = httpx.post(url, json={"prompt": ids, "max_tokens": 2, "prompt_logprobs": 2, "n": 2}).json()
    for choice in reply["choices"]:
        assert as_offline(choice["prompt_logprobs"]) == want
        assert all(p is None or len(p) in (2, 3) for p in choice["prompt_logprobs"])
        assert choice["prompt_logprobs"][1]["6"]["decoded_token"]  # the prompt's own token, first
        assert list(choice["prompt_logprobs"][1])[0] == "6"
    # With echo's logprobs (their own count) too.
    both = httpx.post(url, json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2, "echo": True,
                                 "logprobs": 1}).json()["choices"][0]
    assert as_offline(both["prompt_logprobs"]) == want
    assert all(len(top) <= 2 for top in both["logprobs"]["top_logprobs"][1:])
    messages = [{"role": "user", "content": "Hi"}]
    chat = httpx.post(f"{stack.base_url}/v1/chat/completions",
                      json={"messages": messages, "max_tokens": 2, "prompt_logprobs": 0}).json()
    rendered = offline.chat(messages, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert chat["usage"]["prompt_tokens"] == len(rendered.prompt_token_ids)
    assert [None if p is None else list(p) for p in chat["prompt_logprobs"]] == \
        [None] + [[str(t)] for t in rendered.prompt_token_ids[1:]]
    assert httpx.post(url, json={"prompt": ids, "max_tokens": 1}).json()["choices"][0]["prompt_logprobs"] is None
    for bad in ({"prompt_logprobs": 1, "stream": True}, {"prompt_logprobs": 21}, {"prompt_logprobs": -1},
                {"prompt_logprobs": 1, "use_beam_search": True, "n": 2, "temperature": 0}):
        assert _error(httpx.post(url, json={"prompt": ids, "max_tokens": 2, **bad}), 400)["param"] in \
            ("prompt_logprobs", "use_beam_search"), bad


def test_token_id_prompts_and_echo(client, offline, llama_dir):
    ids = [[5, 6, 7, 8], [9, 10]]
    expected = offline.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=4),
                                use_tqdm=False)
    reply = client.completions.create(model=llama_dir.name, prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in reply.choices] == [o.outputs[0].text for o in expected]
    single = client.completions.create(model=llama_dir.name, prompt=ids[0], max_tokens=4, temperature=0)
    assert single.choices[0].text == expected[0].outputs[0].text
    echoed = client.completions.create(model=llama_dir.name, prompt="Hello there", max_tokens=3, temperature=0,
                                       echo=True, logprobs=1)
    choice = echoed.choices[0]
    assert choice.text.startswith("Hello there")
    prompt_len = echoed.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == prompt_len + 3 and choice.logprobs.token_logprobs[0] is None
    assert all(isinstance(lp, float) for lp in choice.logprobs.token_logprobs[1:])
    # text_offset points into the text, also where a character spans tokens (each alone decodes to U+FFFD).
    for prompt in ("日本 and ü", "Hello there"):
        echoed = client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=3, temperature=0,
                                           echo=True, logprobs=0, extra_body={"ignore_eos": True})
        logprobs, text = echoed.choices[0].logprobs, echoed.choices[0].text
        offsets = logprobs.text_offset
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text), offsets
        prompt_len = echoed.usage.prompt_tokens
        assert offsets[prompt_len] == len(prompt)  # the completion starts right after the prompt's text
        whole = [i for i in range(prompt_len) if "\ufffd" not in logprobs.tokens[i]]
        assert all(text[offsets[i]:].startswith(logprobs.tokens[i]) for i in whole if logprobs.tokens[i]), prompt


def test_echo_with_max_tokens_0_scores_the_prompt(client, llama_dir):
    """As OpenAI and vLLM: the prompt and its logprobs, nothing generated (how clients score a prompt)."""
    prompts = ["Hello there", "The quick brown fox"]
    generated = client.completions.create(model=llama_dir.name, prompt=prompts, max_tokens=2, temperature=0,
                                          echo=True, logprobs=2, extra_body={"ignore_eos": True})
    scored = client.completions.create(model=llama_dir.name, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    assert scored.usage.completion_tokens == 0 and scored.usage.total_tokens == scored.usage.prompt_tokens
    for one, full, prompt in zip(scored.choices, generated.choices, prompts):
        assert one.text == prompt and one.finish_reason == "length"
        count = len(one.logprobs.tokens)
        assert count == len(full.logprobs.tokens) - 2 and one.logprobs.token_logprobs[0] is None
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert getattr(one.logprobs, field) == getattr(full.logprobs, field)[:count], field
    chunks = list(client.completions.create(model=llama_dir.name, prompt=prompts[0], max_tokens=0, echo=True,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompts[0] and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError):  # without echo, max_tokens must be at least 1
        client.completions.create(model=llama_dir.name, prompt=prompts[0], max_tokens=0)


def test_n_logprobs_and_usage(client, llama_dir):
    reply = client.completions.create(model=llama_dir.name, prompt="Once upon a time", n=3, max_tokens=5,
                                      temperature=1.0, seed=7, logprobs=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in reply.choices) == [0, 1, 2]
    for choice in reply.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
        assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)  # top 3 plus the sampled token
        assert lp.text_offset == sorted(lp.text_offset) and choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 15
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 15


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


# --- streaming -----------------------------------------------------------------------------------------


def test_stream_completion_with_usage(client, llama_dir):
    whole = client.completions.create(model=llama_dir.name, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=llama_dir.name, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def _sse_chunks(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=30) as reply:
        assert reply.status_code == 200
        data = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(item) for item in data[:-1]]


def test_stream_usage_is_null_until_the_last_chunk(stack, llama_dir):
    # OpenAI's wire format with include_usage: every chunk has "usage", null but on the last one;
    # without it, no chunk has the field.
    for path, extra in (("completions", {"prompt": PROMPTS[1]}),
                        ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = {"model": llama_dir.name, "max_tokens": 5, "temperature": 0, "stream": True, **extra}
        chunks = _sse_chunks(f"{stack.base_url}/v1/{path}", {**body, "stream_options": {"include_usage": True}})
        assert len(chunks) > 2 and all("usage" in c for c in chunks), path
        assert all(c["usage"] is None for c in chunks[:-1]), path
        assert chunks[-1]["usage"]["completion_tokens"] >= 1 and chunks[-1]["choices"] == [], path
        assert not any("usage" in c for c in _sse_chunks(f"{stack.base_url}/v1/{path}", body)), path
        # vLLM's continuous_usage_stats: every chunk carries the usage so far, the last the whole.
        continuous = _sse_chunks(f"{stack.base_url}/v1/{path}", {**body, "max_tokens": 8, "logprobs": None,
                                                                   "stream_options": {"include_usage": True,
                                                                                      "continuous_usage_stats": True}})
        counts = [c["usage"]["completion_tokens"] for c in continuous]
        assert counts == sorted(counts) and counts[-1] == continuous[-1]["usage"]["total_tokens"] - \
            continuous[-1]["usage"]["prompt_tokens"], (path, counts)
        first = 0 if path == "chat/completions" else 1  # chat opens with the role, before any token
        assert counts[0] == first and counts[-2] == counts[-1], (path, counts)  # the last token's chunk counts all
        assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in continuous), path


def test_latency_histograms_count_each_request(stack, client, llama_dir):
    def scrape() -> dict[str, float]:
        """Every sample without a histogram bucket label, by name and labels."""
        text = http_get(f"{stack.base_url}/metrics")[1]
        return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
                if line and not line.startswith("#") and "le=" not in line}

    def counts(samples: dict[str, float]) -> dict[str, float]:
        return {name: value for name, value in samples.items() if name.endswith("_seconds_count")}

    before = counts(scrape())
    client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=1, temperature=0)
    samples = scrape()
    after = counts(samples)
    for name, new in (("time_to_first_token", 2), ("e2e_request_latency", 2), ("time_per_output_token", 1)):
        key = f"pagedserve_{name}_seconds_count"
        assert after[key] - before.get(key, 0) == new, name  # one token has no time per output token
    # A gap between each two of the six tokens' arrivals (fewer where steps arrive together); none for one token.
    gaps = after["pagedserve_inter_token_latency_seconds_count"] - before.get(
        "pagedserve_inter_token_latency_seconds_count", 0)
    assert 1 <= gaps <= 5, gaps
    # vLLM's names for the same series (and the engine's), labelled with the served model, for dashboards,
    # autoscalers and routers made for vLLM.
    label = f'{{model_name="{llama_dir.name}"}}'
    engine = f'{{engine="0",model_name="{llama_dir.name}"}}'  # the engine's, per scheduler
    scheduler = f'{{scheduler="{stack.scheduler_address}"}}'
    for ours, theirs in (("pagedserve_prompt_tokens_total", "vllm:prompt_tokens_total" + label),
                         ("pagedserve_generation_tokens_total", "vllm:generation_tokens_total" + label),
                         ("pagedserve_time_to_first_token_seconds_count",
                          "vllm:time_to_first_token_seconds_count" + label),
                         ("pagedserve_inter_token_latency_seconds_count",
                          "vllm:inter_token_latency_seconds_count" + label),
                         ("pagedserve_inter_token_latency_seconds_count",
                          "vllm:time_per_output_token_seconds_count" + label),
                         ("pagedserve_engine_num_requests_waiting" + scheduler, "vllm:num_requests_waiting" + engine),
                         ("pagedserve_engine_prefix_cache_hits" + scheduler, "vllm:prefix_cache_hits_total" + engine)):
        assert samples[theirs] == samples[ours], (ours, theirs)
    assert samples["vllm:request_prompt_tokens_count" + label] >= 2
    finished = f'{{finished_reason="length",model_name="{llama_dir.name}"}}'
    assert samples["vllm:request_success_total" + finished] == samples['pagedserve_request_success_total'
                                                                        '{finished_reason="length"}'] >= 2
    assert 0 <= samples["vllm:kv_cache_usage_perc" + engine] <= 1


def test_stream_chat_n2(client, llama_dir):
    messages = [{"role": "user", "content": "Count to ten"}]
    whole = client.chat.completions.create(model=llama_dir.name, messages=messages, max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model=llama_dir.name, messages=messages, max_tokens=6, temperature=0,
                                            n=2, stream=True, stream_options={"include_usage": True})
    texts, roles, finished = ["", ""], [None, None], [None, None]
    for chunk in stream:
        for choice in chunk.choices:
            if texts[choice.index] == "" and roles[choice.index] is None:
                roles[choice.index] = choice.delta.role  # the first delta of each choice carries the role
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] = choice.finish_reason or finished[choice.index]
    assert roles == ["assistant", "assistant"]
    assert texts == [whole.choices[0].message.content] * 2 and None not in finished
    assert chunk.usage.completion_tokens == 2 * whole.usage.completion_tokens


def test_stop_strings(stack, client, llama_dir):
    full = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    expected = full[:full.find(stop)]
    reply = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                      stop=[stop, "never-appears"], extra_body={"ignore_eos": True})
    assert reply.choices[0].text == expected and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 16
    streamed = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                         stop=stop, stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed) == expected
    kept = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                     stop=stop, extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop
    # A stop token's text is left out, as vLLM does, unless include_stop_str_in_output.
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        replies = api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(
            text=PROMPTS[0], params=api.SamplingParameters(temperature=0, max_tokens=8, ignore_eos=True)), timeout=30)
        greedy = [t for reply in replies for t in reply.token_ids]
    end = next(i for i in range(1, len(greedy)) if greedy[i] not in greedy[:i])  # its first appearance
    texts = {}
    for include in (False, True):
        reply = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=16, temperature=0,
                                          extra_body={"stop_token_ids": [greedy[end]], "ignore_eos": True,
                                                      "include_stop_str_in_output": include}).choices[0]
        assert reply.finish_reason == "stop" and reply.model_extra["stop_reason"] == greedy[end]
        texts[include] = reply.text
    # The same as the text of the tokens before it (or up to it), cut by max_tokens.
    cut = {n: client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=n, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text for n in (end, end + 1)}
    assert texts == {False: cut[end], True: cut[end + 1]} and cut[end] != cut[end + 1]
    # The stop string aborted the request at the scheduler: nothing is left holding blocks.
    stats = wait_blocks_free(stack)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0


def test_a_stop_string_ends_its_own_sequence_at_the_scheduler_while_its_siblings_run_on(stack, client, llama_dir):
    """With n = 2, the sequence that hits a stop string stops decoding (and frees its blocks) at once."""
    def run(stop=None):
        before = engine_stats(stack)["num_scheduled_tokens"]
        reply = client.completions.create(model=llama_dir.name, prompt=PROMPTS[0], max_tokens=120, n=2,
                                          temperature=1.0, seed=11, stop=stop, extra_body={"ignore_eos": True})
        by_index = sorted(reply.choices, key=lambda c: c.index)
        return [c.text for c in by_index], [c.finish_reason for c in by_index], \
            engine_stats(stack)["num_scheduled_tokens"] - before
    texts, _, full_cost = run()
    # A stop string early in the first sequence's text and nowhere in the second's.
    stop = next(texts[0][i:i + 3] for i in range(len(texts[0]) // 4)
                if texts[0][i:i + 3].strip() and texts[0][i:i + 3] not in texts[1])
    stopped, finishes, cost = run(stop=[stop])
    assert stopped == [texts[0][:texts[0].find(stop)], texts[1]] and finishes == ["stop", "length"]
    # Without the per-sequence stop the first sequence decoded on to 120 tokens beside its sibling.
    assert cost < full_cost - 120 * 0.5, (cost, full_cost)
    stats = wait_blocks_free(stack)
    assert stats["kv_blocks_used"] == 0 and stats["num_requests_running"] == 0


def test_tokenize_and_detokenize_see_prompts_as_the_engine_does(stack, client, llama_dir):
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    base, name = stack.base_url, llama_dir.name
    got = httpx.post(f"{base}/tokenize", json={"model": name, "prompt": PROMPTS[1]}).json()
    completion = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=1)
    assert got["tokens"] == tokenizer(PROMPTS[1]).input_ids and got["count"] == completion.usage.prompt_tokens
    assert got["max_model_len"] == 512 and got["token_strs"] is None
    bare = httpx.post(f"{base}/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False,
                                                "return_token_strs": True}).json()
    assert bare["tokens"] == tokenizer(PROMPTS[1], add_special_tokens=False).input_ids
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])  # as the vocabulary spells them
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPTS[2]}]
    chat = httpx.post(f"{base}/tokenize", json={"messages": messages}).json()
    reply = client.chat.completions.create(model=name, messages=messages, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    assert chat["tokens"] == tokenizer(tokenizer.apply_chat_template(messages, tokenize=False,
                                                                     add_generation_prompt=True),
                                       add_special_tokens=False).input_ids
    back = httpx.post(f"{base}/detokenize", json={"model": name, "tokens": got["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(got["tokens"])}
    assert _error(httpx.post(f"{base}/tokenize", json={"prompt": "x", "messages": messages}), 400)["param"] == "prompt"
    _error(httpx.post(f"{base}/tokenize", json={}), 400)
    _error(httpx.post(f"{base}/tokenize", json={"prompt": "x", "add_special_token": False}), 400)  # a typo
    assert _error(httpx.post(f"{base}/tokenize", json={"model": "nope", "prompt": "x"}), 404)["type"] == \
        "NotFoundError"
    for bad in ([-1], [tokenizer.vocab_size + 1000]):
        assert _error(httpx.post(f"{base}/detokenize", json={"tokens": bad}), 400)["param"] == "tokens"
    from pagedserve import __version__
    assert http_get(f"{base}/version") == (200, {"version": __version__})


def test_many_concurrent_streams(client, stack, llama_dir):
    prompts = [f"Request number {i}" for i in range(8)]
    expected = {p: client.completions.create(model=llama_dir.name, prompt=p, max_tokens=8, temperature=0)
                .choices[0].text for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)

    async def one(prompt: str) -> tuple[str, str, int]:
        stream = await aclient.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=8, temperature=0,
                                                  stream=True, stream_options={"include_usage": True})
        text, finish, tokens = "", None, 0
        async for chunk in stream:
            for choice in chunk.choices:
                text += choice.text
                finish = choice.finish_reason or finish
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return text, finish, tokens

    async def all_of_them():
        try:
            return await asyncio.gather(*(one(prompts[i % 8]) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(all_of_them())
    for i, (text, finish, tokens) in enumerate(results):
        assert text == expected[prompts[i % 8]] and finish in ("stop", "length") and tokens >= 1


def test_client_disconnect_aborts_the_request(stack):
    before = engine_stats(stack)
    body = {"prompt": "Hello", "max_tokens": 480, "n": 4, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=30) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        assert engine_stats(stack)["kv_blocks_used"] > 0
    # Closing the connection mid-stream aborts the request at the scheduler, which frees its blocks.
    after = wait_blocks_free(stack)
    assert after["kv_blocks_used"] == 0 and after["num_requests_running"] == 0
    assert after["num_steps"] - before["num_steps"] < 480, "the request ran to the end instead of being aborted"
    # A non-streamed request whose client gives up is aborted as well.
    before = after
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{stack.base_url}/v1/completions", json={**body, "stream": False}, timeout=0.3)
    after = wait_blocks_free(stack)
    assert after["kv_blocks_used"] == 0 and after["num_steps"] - before["num_steps"] < 480


def test_cache_salt_keeps_prefix_caches_apart(stack, llama_dir):
    """Only requests with the same cache_salt share cached prefix blocks (REST and gRPC)."""
    url = f"{stack.base_url}/v1/completions"
    prompt = [random.randrange(1, 500) for _ in range(40)]  # two full blocks of 16, fresh to the cache
    def hits_after(**fields) -> float:
        before = engine_stats(stack)["prefix_cache_hits"]
        assert httpx.post(url, json={"prompt": prompt, "max_tokens": 1, **fields}, timeout=30).status_code == 200
        return engine_stats(stack)["prefix_cache_hits"] - before

    assert hits_after(cache_salt="tenant-a") == 0
    assert hits_after(cache_salt="tenant-b") == 0  # the same prompt, another tenant: nothing shared
    assert hits_after() == 0  # nor with no salt
    assert hits_after(cache_salt="tenant-a") > 0
    assert hits_after() > 0
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        before = engine_stats(stack)["prefix_cache_hits"]
        list(stub.Generate(api.GenerateRequest(token_ids=api.TokenIds(ids=prompt), cache_salt="tenant-c",
                                               params=api.SamplingParameters(max_tokens=1)), timeout=30))
        assert engine_stats(stack)["prefix_cache_hits"] == before
        list(stub.Generate(api.GenerateRequest(token_ids=api.TokenIds(ids=prompt), cache_salt="tenant-b",
                                               params=api.SamplingParameters(max_tokens=1)), timeout=30))
        assert engine_stats(stack)["prefix_cache_hits"] > before
    assert _error(httpx.post(url, json={"prompt": prompt, "max_tokens": 1, "cache_salt": ""}), 400)["param"] == \
        "cache_salt"


# --- the public gRPC API ----------------------------------------------------------------------------------


def test_grpc_generate(stack, offline, llama_dir):
    expected = offline.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        params = api.SamplingParameters(temperature=0, max_tokens=6, logprobs=2)
        replies = list(stub.Generate(api.GenerateRequest(request_id="grpc-1", text=PROMPTS[2], params=params),
                                     timeout=30))
        assert [t for r in replies for t in r.token_ids] == expected.token_ids
        assert "".join(r.text for r in replies) == expected.text
        assert all(len(r.logprobs) == len(r.token_ids) for r in replies)
        assert replies[-1].finish_reason == expected.finish_reason and replies[-1].request_id == "grpc-1"
        assert replies[-1].usage.completion_tokens == len(expected.token_ids)
        by_ids = list(stub.Generate(api.GenerateRequest(token_ids=api.TokenIds(ids=[5, 6, 7]), params=params)))
        assert by_ids[-1].finish_reason
        card, alias, *adapters = stub.ListModels(api.ListModelsRequest()).models
        assert card.id == llama_dir.name and card.max_model_len == 512 and card.vocab_size == 512
        assert alias.id == "llama-alias" and [a.id for a in adapters] == ["sql", "broken"]
        # An adapter by its model name, as over HTTP; a broken one fails with INVALID_ARGUMENT.
        tuned = list(stub.Generate(api.GenerateRequest(model="sql", text=PROMPTS[2], params=params)))
        assert [t for r in tuned for t in r.token_ids] != expected.token_ids
        with pytest.raises(grpc.RpcError) as broken:
            list(stub.Generate(api.GenerateRequest(model="broken", text="x")))
        assert broken.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be loaded" in broken.value.details()
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.Generate(api.GenerateRequest(text="x", params=api.SamplingParameters(temperature=-1))))
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in bad.value.details()
        with pytest.raises(grpc.RpcError) as unknown:
            list(stub.Generate(api.GenerateRequest(model="nope", text="x")))
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        assert not stub.Abort(api.AbortRequest(request_id="no-such-request")).found
        for service in ("", "pagedserve.api.v1.Generation"):
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING, service
        assert "pagedserve.api.v1.Generation" in ProtoReflectionDescriptorDatabase(channel).get_services()
        with pytest.raises(grpc.RpcError) as bad:
            list(stub.Generate(api.GenerateRequest(text="x", params=api.SamplingParameters(top_p=2))))
        assert bad.value.details().startswith("top_p")  # as over HTTP, without the class name
        for bad_call in (lambda: stub.Abort(api.AbortRequest(request_id="")),
                         lambda: list(stub.Generate(api.GenerateRequest(text="x", cache_salt="")))):
            with pytest.raises(grpc.RpcError) as bad:
                bad_call()
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("n", [1, 3])
def test_grpc_prompt_logprobs_come_whole_in_the_first_message(llama_dir, tmp_path, n):
    """With n > 1 too, and over a prefill chunked into several steps (budget 64 < 150 tokens)."""
    prompt = [(7 * i) % 500 + 1 for i in range(150)]
    expected = LLM(str(llama_dir), block_size=16).generate(
        {"prompt_token_ids": prompt}, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1),
        use_tqdm=False)[0].prompt_logprobs
    budget = ("--max-num-batched-tokens", "64")
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS + budget, scheduler_args=budget) as stack:
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            params = api.SamplingParameters(max_tokens=2, temperature=0, prompt_logprobs=1, n=n, seed=1)
            replies = list(api_grpc.GenerationStub(channel).Generate(
                api.GenerateRequest(token_ids=api.TokenIds(ids=prompt), params=params), timeout=60))
    assert all(r.token_ids or r.finish_reason for r in replies)  # no empty messages for prefill chunks
    first = replies[0].prompt_logprobs
    assert [e.token_id for e in first] == prompt[1:]
    assert [e.logprob for e in first] == pytest.approx([p[t].logprob for p, t in zip(expected[1:], prompt[1:])],
                                                       abs=1e-4)
    assert not any(r.prompt_logprobs for r in replies[1:])


def test_grpc_abort_ends_the_stream(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        params = api.SamplingParameters(max_tokens=480, ignore_eos=True)
        stream = stub.Generate(api.GenerateRequest(request_id="grpc-abort", text="Hello", params=params), timeout=30)
        first = next(stream)
        assert first.request_id == "grpc-abort"
        assert stub.Abort(api.AbortRequest(request_id="grpc-abort"), timeout=5).found
        rest = list(stream)
        assert rest and rest[-1].finish_reason == "abort"
    assert wait_blocks_free(stack)["kv_blocks_used"] == 0


def test_a_grpc_abort_sent_right_behind_its_generate_is_not_lost(stack):
    """The Abort may reach the gateway before the call it names has reached the scheduler, or even before
    the call itself (before the fix: 20 of 100 lost; after the call-level abort alone, 6 of 150)."""
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        params = api.SamplingParameters(max_tokens=400, ignore_eos=True, n=2)
        lost = []
        for attempt in range(100):
            request_id = f"abort-at-once-{attempt}"
            stream = stub.Generate(api.GenerateRequest(request_id=request_id, text="Hello " * (attempt % 20 + 1),
                                                       params=params), timeout=60)
            found = stub.Abort(api.AbortRequest(request_id=request_id), timeout=5).found
            replies = list(stream)
            finishes = {r.index: r.finish_reason for r in replies if r.finish_reason}
            if not found or finishes != {0: "abort", 1: "abort"}:
                lost.append((attempt, found, finishes))
        assert not lost
    after = wait_blocks_free(stack)
    assert after["kv_blocks_used"] == 0 and after["num_requests_running"] == 0


def test_grpc_cancel_aborts_and_the_id_may_be_reused_at_once(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        stub = api_grpc.GenerationStub(channel)
        for attempt in range(5):
            long = api.GenerateRequest(request_id="grpc-reuse", text="Hello",
                                       params=api.SamplingParameters(max_tokens=480, ignore_eos=True, n=2))
            stream = stub.Generate(long, timeout=30)
            next(stream)
            stream.cancel()
            short = api.GenerateRequest(request_id="grpc-reuse", text="Hello",
                                        params=api.SamplingParameters(max_tokens=3, ignore_eos=True))
            replies = list(stub.Generate(short, timeout=30))
            assert replies[-1].finish_reason == "length", attempt
    after = wait_blocks_free(stack)
    assert after["kv_blocks_used"] == 0 and after["num_requests_running"] == 0


# --- bad requests ---------------------------------------------------------------------------------------


def _error(reply: httpx.Response, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


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
    assert "allows no next token" in _error(dead_end, 400)["message"]
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


def test_bad_requests_get_openai_errors(stack, client, llama_dir):
    url = f"{stack.base_url}/v1/completions"
    ok = {"model": llama_dir.name, "prompt": "Hello", "max_tokens": 3}
    assert _error(httpx.post(url, json={**ok, "model": "no-such-model"}), 404)["type"] == "NotFoundError"
    too_long = _error(httpx.post(url, json={**ok, "max_tokens": 600}), 400)
    assert "512" in too_long["message"] and "600" in too_long["message"] and too_long["param"] == "max_tokens"
    assert "JSON" in _error(httpx.post(url, content=b'{"prompt": ', headers={"content-type": "application/json"}),
                            400)["message"]
    form = _error(httpx.post(url, content=json.dumps(ok).encode(),  # curl -d without -H sends a form type
                             headers={"content-type": "application/x-www-form-urlencoded"}), 400)["message"]
    assert "Content-Type: application/json" in form and "x-www-form-urlencoded" in form
    assert "JSON object" in _error(httpx.post(url, json=[1, 2]), 400)["message"]
    for field in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
        value = {str(10**6): 1} if field == "logit_bias" else [10**6]
        vocab = _error(httpx.post(url, json={**ok, field: value}), 400)
        assert vocab["param"] == field and "vocabulary" in vocab["message"], vocab
    assert _error(httpx.post(url, json={**ok, "temperature": -0.5}), 400)["param"] == "temperature"
    assert _error(httpx.post(url, json={**ok, "logprobs": 21}), 400)["param"] == "logprobs"
    assert _error(httpx.post(url, json={**ok, "top_p": 1e-300}), 400)["param"] == "top_p"  # 0 as a float32
    assert "vocabulary" in _error(httpx.post(url, json={**ok, "prompt": [1, 2, 512]}), 400)["message"]
    assert "vocabulary" in _error(httpx.post(url, json={**ok, "prompt": [1, -1]}), 400)["message"]
    assert "vocabulary" in _error(httpx.post(url, json={**ok, "prompt": [[1, 2], [-3]], "echo": True}), 400)["message"]
    assert _error(httpx.post(url, json={**ok, "prompt": ""}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={**ok, "prompt": []}), 400)["param"] == "prompt"
    assert _error(httpx.post(url, json={**ok, "n": 2, "best_of": 3}), 400)["param"] == "best_of"
    assert _error(httpx.post(url, json={**ok, "n": 3, "best_of": 2}), 400)["param"] == "best_of"
    assert _error(httpx.post(url, json={**ok, "stream": True, "max_tokens": 0}), 400)["param"] == "max_tokens"
    assert _error(httpx.post(url, json={**ok, "max_tokens": None, "min_tokens": 2**32 - 1}), 400)["param"] == \
        "min_tokens"
    # Refused before the gateway builds anything per sequence (2**31 detokenizers took all memory).
    assert _error(httpx.post(url, json={**ok, "n": 2**31}, timeout=10), 400)["param"] == "n"
    beams = {**ok, "use_beam_search": True, "beam_width": 10**6}
    assert _error(httpx.post(url, json=beams, timeout=10), 400)["param"] == "beam_width"
    chat = f"{stack.base_url}/v1/chat/completions"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    _error(httpx.post(chat, json={"model": llama_dir.name, "messages": image}), 400)
    _error(httpx.post(chat, json={"model": llama_dir.name, "messages": [], "max_tokens": 2}), 400)
    # Errors name chat's own fields, not the engine's.
    top = _error(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30,
                                        "logprobs": True}), 400)
    assert top["param"] == "top_logprobs" and "top_logprobs=30" in top["message"]
    assert _error(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": -1,
                                         "logprobs": True}), 400)["param"] == "top_logprobs"
    longest = _error(httpx.post(chat, json={"messages": [{"role": "user", "content": "x"}],
                                            "max_completion_tokens": 600}), 400)
    assert longest["param"] == "max_completion_tokens" and "max_completion_tokens" in longest["message"]
    assert _error(httpx.post(chat, json={"messages": [{"role": "user", "content": "x " * 600}]}), 400)["param"] == \
        "messages"
    hi = {"model": llama_dir.name, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert httpx.post(chat, json={**hi, "tools": tools, "tool_choice": "none"}).status_code == 200
    for tool_choice, why in [({"type": "function", "function": {"name": "g"}}, "g"),
                             ("sometimes", "tool_choice must be")]:
        refused = _error(httpx.post(chat, json={**hi, "tools": tools, "tool_choice": tool_choice}), 400)
        assert refused["param"] == "tool_choice" and why in refused["message"], refused
    assert _error(httpx.post(chat, json={**hi, "tool_choice": "required"}), 400)["param"] == "tool_choice"
    assert _error(httpx.post(chat, json={**hi, "tools": [{"type": "function", "function": {}}],
                                         "tool_choice": "required"}), 400)["param"] == "tools"
    assert _error(httpx.post(chat, json={**hi, "tools": tools, "tool_choice": "required",
                                         "response_format": {"type": "json_object"}}), 400)["param"] == "tool_choice"
    assert httpx.post(chat, json={**hi, "response_format": {"type": "text"}}).status_code == 200
    # Structured outputs: a bad constraint, or two of them, is a 400 naming the field it came in.
    for name, value in [("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
                        ("response_format", {"type": "yaml"}),
                        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}),
                        ("guided_regex", "a(b"), ("guided_grammar", "root ::= missing"), ("guided_choice", []),
                        ("structured_outputs", {"json": {}, "regex": "a"}), ("structured_outputs", {"xml": "a"})]:
        assert _error(httpx.post(chat, json={**hi, name: value}), 400)["param"] == name, (name, value)
    both = _error(httpx.post(url, json={**ok, "guided_regex": "a", "response_format": {"type": "json_object"}}), 400)
    assert both["param"] in ("guided_regex", "response_format") and "one of" in both["message"]
    _error(httpx.get(f"{stack.base_url}/v1/no-such-endpoint"), 404)
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
        assert _error(httpx.post(url, json={**ok, name: value}), 400)["param"] == name, name
    assert httpx.post(url, json={**ok, "logits_processors": None}).status_code == 200  # null is not asking
    # allowed_token_ids (vLLM's): only those are sampled.
    allowed = httpx.post(url, json={**ok, "max_tokens": 8, "allowed_token_ids": [40, 41, 42], "ignore_eos": True,
                                    "logprobs": 0}).json()["choices"][0]
    names = {httpx.post(f"{stack.base_url}/detokenize", json={"tokens": [t]}).json()["prompt"] for t in (40, 41, 42)}
    assert len(allowed["logprobs"]["tokens"]) == 8 and set(allowed["logprobs"]["tokens"]) <= names
    assert _error(httpx.post(url, json={**ok, "allowed_token_ids": []}), 400)["param"] == "allowed_token_ids"
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
        assert _error(httpx.post(url, json={**ok, "truncate_prompt_tokens": value}), 400)["param"] == \
            "truncate_prompt_tokens", value
    assert _error(httpx.post(url, json={**ok, "top_k": 1 << 31}), 400)["param"] == "top_k"
    only_stops = _error(httpx.post(url, json={**ok, "allowed_token_ids": [7], "stop_token_ids": [7],
                                              "min_tokens": 1}), 400)
    assert only_stops["param"] == "allowed_token_ids" and "min_tokens" in only_stops["message"]
    functions = [{"name": "f", "parameters": {"type": "object"}}]
    assert _error(httpx.post(chat, json={**hi, "functions": functions}), 400)["param"] == "functions"
    assert _error(httpx.post(chat, json={**hi, "continue_final_message": True}), 400)["param"] == \
        "continue_final_message"
    assert "reserved" in _error(httpx.post(chat, json={**hi, "chat_template_kwargs": {"tokenize": True}}),
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


def test_context_length(client, llama_dir):
    # max_tokens null: generate up to the context length (absent: OpenAI's 16, for completions).
    prompt = list(range(10, 10 + 500))
    reply = client.completions.create(model=llama_dir.name, prompt=prompt, temperature=0, max_tokens=None,
                                      extra_body={"ignore_eos": True})
    assert reply.usage.completion_tokens == 12 and reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="516"):
        client.completions.create(model=llama_dir.name, prompt=prompt)
    short = client.completions.create(model=llama_dir.name, prompt=[5, 6], extra_body={"ignore_eos": True})
    assert short.usage.completion_tokens == 16
    chat = client.chat.completions.create(model=llama_dir.name, messages=[{"role": "user", "content": "Hi"}],
                                          extra_body={"ignore_eos": True})
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 512
    with pytest.raises(openai.BadRequestError, match="512"):
        client.completions.create(model=llama_dir.name, prompt=prompt, max_tokens=13)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=llama_dir.name, prompt=list(range(512)), max_tokens=1)


# --- failures of the backend ------------------------------------------------------------------------------


def test_overload_then_dead_worker_then_dead_scheduler(llama_dir, tmp_path):
    # A request the dead worker catches in flight waits for one to take it again (resumption), at most 3 s here.
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS,
                  gateway_args=("--max-concurrent-requests", "1", "--resume-timeout", "3")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        long = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=long, timeout=30) as first:  # holds the only slot
            lines = first.iter_lines()  # (keep it: a dropped line iterator closes the response)
            assert next(lines).startswith("data: ")
            turned_away = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2})
            assert _error(turned_away, 429)["type"] == "TooManyRequestsError"
            assert turned_away.headers["retry-after"] == "1"
        # Leaving the stream early gives the slot back.
        deadline = time.monotonic() + 5
        while httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}).status_code == 429:
            assert time.monotonic() < deadline, "the slot of a closed stream was never freed"
            time.sleep(0.05)
        stack.kill("worker")
        started = time.monotonic()
        error = _error(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=90), 503)
        # The engine failing on the lost worker (then no scheduler taking the request again), or (once
        # the health poll has seen it) the refusal it sets: an answer, not a hang (the bound is generous:
        # a loaded machine may take seconds; a hang would take the 120 s backend timeout).
        assert time.monotonic() - started < 60
        assert "unavailable" in error["message"] or "worker" in error["message"], error
        assert error["type"] == "ServiceUnavailableError"
        deadline = time.monotonic() + 5  # the scheduler notices within its health poll
        while http_get(f"{stack.base_url}/health")[0] != 503 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert http_get(f"{stack.base_url}/health")[0] == 503
        # A restarted worker is picked up: the scheduler builds a new engine on it and serves again.
        stack.start_worker()
        deadline = time.monotonic() + START_LIMIT_S
        while httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, stack.log_tail("scheduler")
            time.sleep(0.5)
        while http_get(f"{stack.base_url}/health")[0] != 200:  # the health poll catches up within 0.5 s
            assert time.monotonic() < deadline, stack.log_tail("scheduler")
            time.sleep(0.1)

        stack.kill("scheduler")
        started = time.monotonic()
        error = _error(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "stream": True}, timeout=90), 503)
        assert time.monotonic() - started < 60 and "scheduler" in error["message"]  # not the 120 s backend timeout
        status, body = http_get(f"{stack.base_url}/health")
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
            with pytest.raises(grpc.RpcError) as failed:
                list(api_grpc.GenerationStub(channel).Generate(api.GenerateRequest(text="Hi"), timeout=10))
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            # The gRPC health service says what /health says (a gRPC-only probe would route to it).
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 10
            for service in ("", "pagedserve.api.v1.Generation"):
                while health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status != \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    assert time.monotonic() < deadline, service
                    time.sleep(0.1)
    finally:
        codes = stack.stop()
    assert codes["gateway"] == 0, stack.log_tail("gateway")


def test_a_worker_restarted_while_idle_serves_the_very_next_request(llama_dir, tmp_path):
    """However briefly it was gone: the scheduler rebuilds its engine once the worker's stream ends,
    not when a request finds the stream broken (that request got a 503)."""
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS) as stack:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        for attempt in range(2):
            stack.kill("worker")
            if attempt == 0:  # gone for a while: requests meanwhile get 503s that say why
                deadline = time.monotonic() + 30
                while "went away" not in (stack.log_dir / "scheduler.log").read_text():
                    assert time.monotonic() < deadline, stack.log_tail("scheduler")
                    time.sleep(0.1)
                with concurrent.futures.ThreadPoolExecutor(10) as pool:  # a new session's submissions at once
                    replies = list(pool.map(lambda _: httpx.post(url, json={"prompt": "Hi", "max_tokens": 2},
                                                                 timeout=30), range(10)))
                messages = [_error(reply, 503)["message"] for reply in replies]
                assert all("worker" in m for m in messages), messages  # not "Internal error from Core"
            stack.start_worker()  # on the same address (the second time at once)
            deadline = time.monotonic() + START_LIMIT_S
            while "engine restarted" not in (stack.log_dir / "scheduler.log").read_text():
                assert time.monotonic() < deadline, stack.log_tail("scheduler")
                time.sleep(0.1)
            while http_get(f"{stack.base_url}/health")[0] != 200:
                assert time.monotonic() < deadline, stack.log_tail("scheduler")
                time.sleep(0.1)
            reply = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
            assert reply.status_code == 200, reply.text
            (stack.log_dir / "scheduler.log").write_text("")  # the next round's restart must log anew


def test_a_stopping_scheduler_finishes_its_requests_and_refuses_new_ones(llama_dir, tmp_path):
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS) as stack:
        url = f"{stack.base_url}/v1/completions"
        long = {"prompt": "Hi", "max_tokens": 300, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.stream("POST", url, json=long, timeout=60) as running:
            lines = running.iter_lines()
            assert next(lines).startswith("data: ")
            stack.procs["scheduler"].send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while (reply := httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)).status_code == 200:
                assert time.monotonic() < deadline  # (a request may slip in before the signal lands)
                time.sleep(0.05)
            assert reply.status_code == 503 and "shutting down" in reply.json()["error"]["message"], reply.text
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the running one finished


def test_a_scheduler_without_a_worker_exits_saying_why(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pagedserve", "scheduler", "--listen", f"127.0.0.1:{free_port()}",
                           "--worker", f"127.0.0.1:{free_port()}", "--connect-timeout", "1"],
                          capture_output=True, text=True, timeout=START_LIMIT_S)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "is not reachable (no connection within 1 s)" in done.stderr, done.stderr


def test_beam_search_over_the_openai_api(stack, llama_dir):
    """The extension fields reach the engine: the same beams as the offline API."""
    from openai import OpenAI

    from pagedserve import LLM, SamplingParams

    client = OpenAI(base_url=f"{stack.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=2,
                                      extra_body={"use_beam_search": True, "beam_width": 3, "ignore_eos": True})
    offline = LLM(str(llama_dir)).generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                                           SamplingParams(use_beam_search=True, beam_width=3, n=2, max_tokens=6,
                                                          ignore_eos=True), use_tqdm=False)[0]
    assert [c.text for c in sorted(reply.choices, key=lambda c: c.index)] == [c.text for c in offline.outputs]
    # With logprobs: the same text, and one entry per token (the beams once came back empty).
    scored = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=2, logprobs=2,
                                       extra_body={"use_beam_search": True, "beam_width": 3, "ignore_eos": True})
    choices = sorted(scored.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [c.text for c in offline.outputs]
    assert all(len(c.logprobs.tokens) == 6 and "".join(c.logprobs.tokens) == c.text for c in choices)
    # Echo with logprobs: the prompt's come back null (beams carry none), the request is not refused.
    echoed = client.completions.create(model=model, prompt=[5, 6, 7, 8, 9], max_tokens=6, n=2, logprobs=1, echo=True,
                                       extra_body={"use_beam_search": True, "beam_width": 3, "ignore_eos": True})
    assert all(len(c.logprobs.tokens) == 5 + 6 and c.logprobs.token_logprobs[:5] == [None] * 5
               for c in echoed.choices)
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          logprobs=True, top_logprobs=1,
                                          extra_body={"use_beam_search": True, "beam_width": 2, "ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and "".join(e.token for e in content) == chat.choices[0].message.content


def test_every_hop_logs_the_request_id(stack):
    import json as _json
    import urllib.request as _request

    body = _json.dumps({"model": _json.loads(_request.urlopen(f"{stack.base_url}/v1/models").read())["data"][0]["id"],
                        "prompt": "trace me", "max_tokens": 2}).encode()
    req = _request.Request(f"{stack.base_url}/v1/completions", data=body, method="POST",
                           headers={"Content-Type": "application/json", "X-Request-Id": "trace-4711"})
    with _request.urlopen(req, timeout=30) as reply:
        assert reply.headers.get("X-Request-Id") in (None, "trace-4711")
    for service in ("gateway", "scheduler", "worker"):
        lines = [_json.loads(line) for line in (stack.log_dir / f"{service}.log").read_text().splitlines()
                 if line.startswith("{")]
        assert any(str(line.get("request_id", "")).startswith("trace-4711") for line in lines), service


def _wait_for_engine_requests(stack: Stack, count: int) -> None:
    """Until the schedulers hold at least ``count`` requests, running or waiting (their GetStats, on /metrics)."""
    deadline = time.monotonic() + START_LIMIT_S
    while True:
        text = httpx.get(f"{stack.base_url}/metrics", timeout=30).text
        held = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running{", "vllm:num_requests_waiting{")))
        if held >= count:
            return
        assert time.monotonic() < deadline, f"the engines never held {count} requests: {held}"
        time.sleep(0.05)


def _wait_until_answered(url: str, timeout_s: float = 15) -> None:
    deadline = time.monotonic() + timeout_s
    while (reply := httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)).status_code != 200:
        assert time.monotonic() < deadline, reply.text
        time.sleep(0.2)


def test_a_hung_scheduler_or_worker_fails_requests_and_serving_resumes(llama_dir, tmp_path):
    # Without resumption: abandoned requests would otherwise wait for the hung scheduler to take them again.
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS,
                  gateway_args=("--backend-timeout", "2", "--max-resumes", "0")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30).status_code == 200
        stack.procs["scheduler"].send_signal(signal.SIGSTOP)  # alive, connected, silent
        try:
            started = time.monotonic()
            error = _error(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=90), 503)
            # After the 2 s backend timeout, never before; the upper bound only tells a hang from an answer.
            assert 2 <= time.monotonic() - started < 60, "abandoned after the backend timeout, not before"
            assert "sent nothing" in error["message"]
        finally:
            stack.procs["scheduler"].send_signal(signal.SIGCONT)
        # The next request opens a new session and is answered.
        _wait_until_answered(url)
        # A stream already under way when the scheduler hangs ends in an error event, then [DONE].
        body = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url, json=body, timeout=30) as reply:
            events = reply.iter_lines()
            first = next(line for line in events if line.startswith("data: "))
            stack.procs["scheduler"].send_signal(signal.SIGSTOP)
            try:
                rest = [line[6:] for line in events if line.startswith("data: ")]
            finally:
                stack.procs["scheduler"].send_signal(signal.SIGCONT)
        assert "choices" in json.loads(first[6:])
        assert rest[-1] == "[DONE]" and "sent nothing" in json.loads(rest[-2])["error"]["message"], rest[-3:]
        assert all("choices" in json.loads(event) for event in rest[:-2])
        # A worker that hangs (alive, silent) under a running request: the scheduler's health says so.
        with httpx.stream("POST", url, json=body, timeout=30) as reply:
            next(line for line in reply.iter_lines() if line.startswith("data: "))
            stack.procs["worker"].send_signal(signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 15
                while http_get(f"{stack.base_url}/health")[0] != 503:
                    assert time.monotonic() < deadline, "a hung worker was never reported"
                    time.sleep(0.2)
                # ... and a new request is refused at once rather than queued behind the hung step.
                refused = _error(httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30), 503)
                assert "worker" in refused["message"], refused  # not the gateway's "sent nothing" timeout
            finally:
                stack.procs["worker"].send_signal(signal.SIGCONT)
        _wait_until_answered(url)
    finally:
        stack.stop()


def test_requests_still_running_at_the_end_of_the_drain_get_a_503_not_a_cut_connection(llama_dir, tmp_path):
    stack = Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS, gateway_args=("--drain-timeout", "0.5")).start()
    try:
        url = f"{stack.base_url}/v1/completions"
        long = {"prompt": "Hi", "max_tokens": 480, "ignore_eos": True, "n": 4}
        with httpx.stream("POST", url, json={**long, "stream": True}, timeout=60) as stream:
            events = stream.iter_lines()
            next(line for line in events if line.startswith("data: "))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                # Eight sequences of 480 tokens: still running when the 0.5 s drain ends, however idle the
                # machine (four of them once finished in time and failed the test).
                whole = pool.submit(httpx.post, url, json={**long, "n": 8}, timeout=60)
                _wait_for_engine_requests(stack, 2)  # both under way (a loaded machine may take a while)
                stack.procs["gateway"].send_signal(signal.SIGTERM)
                rest = [line[6:] for line in events if line.startswith("data: ")]
                error = _error(whole.result(), 503)
        assert stack.procs["gateway"].wait(60) == 0  # the 0.5 s drain, then its farewell: an exit, not a hang
        assert "shutting down" in error["message"]
        assert rest[-1] == "[DONE]" and "shutting down" in json.loads(rest[-2])["error"]["message"], rest[-3:]
    finally:
        stack.stop()
