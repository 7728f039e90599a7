"""Completions over the gateway stack the files here share (conftest.py), driven with the official openai
client and raw HTTP: the models served (LoRA adapters among them), answers equal to the offline API's (greedy,
logprobs, echo, bad words, beam search), tokenization, cache salts, the context length, and the request id on
every hop."""

from __future__ import annotations

import random

import grpc
from tests import patient_http as httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.gateway.shared_stack import PROMPTS, engine_stats, error_of, wait_blocks_free
from tests.services_harness import http_get


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
    assert error_of(httpx.get(f"{stack.base_url}/v1/models/no-such-model"), 404)["code"] == "model_not_found"
    assert error_of(httpx.get(f"{stack.base_url}/v1/nothing-here"), 404)["code"] == "not_found"
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
    assert error_of(httpx.post(load, json={"lora_name": "live", "lora_path": str(sql_adapter)}), 400)["message"] \
        == "The lora adapter 'live' has already been loaded."
    assert "has no adapter_config.json" in error_of(httpx.post(load, json={"lora_name": "x", "lora_path": "/none"}),
                                                  400)["message"]
    assert error_of(httpx.post(load, json={"lora_name": "x"}), 400)["param"] == "lora_path"
    assert httpx.post(unload, json={"lora_name": "live"}).status_code == 200
    assert "live" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="live", prompt="Hi", max_tokens=2)
    assert error_of(httpx.post(unload, json={"lora_name": "live"}), 404)["message"] == \
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
        assert error_of(httpx.post(url, json={"prompt": ids, "max_tokens": 2, **bad}), 400)["param"] in \
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
    assert error_of(httpx.post(f"{base}/tokenize", json={"prompt": "x", "messages": messages}), 400)["param"] == \
        "prompt"
    error_of(httpx.post(f"{base}/tokenize", json={}), 400)
    error_of(httpx.post(f"{base}/tokenize", json={"prompt": "x", "add_special_token": False}), 400)  # a typo
    assert error_of(httpx.post(f"{base}/tokenize", json={"model": "nope", "prompt": "x"}), 404)["type"] == \
        "NotFoundError"
    for bad in ([-1], [tokenizer.vocab_size + 1000]):
        assert error_of(httpx.post(f"{base}/detokenize", json={"tokens": bad}), 400)["param"] == "tokens"
    from pagedserve import __version__
    assert http_get(f"{base}/version") == (200, {"version": __version__})


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
    assert error_of(httpx.post(url, json={"prompt": prompt, "max_tokens": 1, "cache_salt": ""}), 400)["param"] == \
        "cache_salt"


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
