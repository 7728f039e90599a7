"""Streams over the gateway stack the files here share (conftest.py): usage in the chunks, n > 1, stop strings,
many streams at once, a client that goes away, and the latency histograms of the tokens' arrivals."""

from __future__ import annotations

import asyncio
import json

import grpc
from tests import patient_http as httpx
import openai
import pytest

from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.gateway.shared_stack import PROMPTS, engine_stats, wait_blocks_free
from tests.services_harness import http_get


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
