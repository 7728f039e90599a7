"""Requests outlive their worker and their scheduler: killed in the middle of a stream and started
again, the stream goes on where it stopped, with the tokens an uninterrupted run gives (real
worker, scheduler and gateway processes on loopback)."""

from __future__ import annotations

import json
import signal
import time

import grpc
from tests import patient_http as httpx
import pytest

from benchmarks.serving import parse_engine_stats
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.services_harness import Stack, http_get

WORKER_ARGS = ("--block-size", "16", "--num-gpu-blocks-override", "512")


def crash(stack: Stack, name: str) -> None:
    """Freeze the service first (the request can make no progress from here), then kill it."""
    stack.procs[name].send_signal(signal.SIGSTOP)
    stack.kill(name)


def stream_completion(stack: Stack, body: dict, interrupt=None) -> dict:
    """Choice texts, finish reasons and usage of a streamed completion; interrupt() runs once the
    first tokens have come."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    with httpx.stream("POST", f"{stack.base_url}/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
                if choice["finish_reason"]:
                    finish[choice["index"]] = choice["finish_reason"]
            usage = chunk.get("usage") or usage
            if interrupt is not None and texts:
                interrupt()
                interrupt = None
    assert interrupt is None or body.get("max_tokens") == 0, "the stream ended before it could be interrupted"
    return {"texts": texts, "finish": finish, "usage": usage}


def grpc_generate(stack: Stack, request_id: str, params, interrupt=None) -> list:
    with grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}") as channel:
        replies = []
        for reply in api_grpc.GenerationStub(channel).Generate(
                api.GenerateRequest(request_id=request_id, text="A long way", params=params), timeout=120):
            replies.append(reply)
            if interrupt is not None and reply.token_ids:
                interrupt()
                interrupt = None
    return replies


def joined(replies, field: str):
    parts = [getattr(r, field) for r in replies]
    return "".join(parts) if field == "text" else [t for part in parts for t in part]


def resumed_count(stack: Stack) -> float:
    text = http_get(f"{stack.base_url}/metrics")[1]
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("pagedserve_resumed_requests_total "))


def test_streams_go_on_through_a_killed_worker_and_a_killed_scheduler(llama_dir, tmp_path):
    with Stack(llama_dir, tmp_path, worker_args=WORKER_ARGS) as stack:
        common = {"model": stack.model_name, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
        greedy = {**common, "temperature": 0}
        # n = 2, seeded, with penalties over each sequence's output so far: exact only if the engine
        # takes the resumed tokens as output, and each sequence's random stream goes on from its count.
        seeded = {**common, "n": 2, "temperature": 1.0, "top_k": 50, "seed": 7, "frequency_penalty": 0.5,
                  "presence_penalty": 0.2}
        for body, victim in ((greedy, "worker"), (seeded, "scheduler")):
            reference = stream_completion(stack, body)
            assert reference["usage"]["completion_tokens"] == 400 * body.get("n", 1)
            resumed_before = resumed_count(stack)
            restart = getattr(stack, f"start_{victim}")
            got = stream_completion(stack, body, interrupt=lambda: (crash(stack, victim), restart()))
            assert got == reference, f"after a killed {victim}"
            assert resumed_count(stack) == resumed_before + 1, f"the request did not cross the killed {victim}"
        # The public gRPC API, whose request id is the engine's: the same id goes on at the new engine.
        params = api.SamplingParameters(temperature=0, max_tokens=300, ignore_eos=True, logprobs=1)
        reference = grpc_generate(stack, "grpc-through-a-crash", params)
        resumed_before = resumed_count(stack)
        got = grpc_generate(stack, "grpc-through-a-crash", params,
                            interrupt=lambda: (crash(stack, "worker"), stack.start_worker()))
        for field in ("token_ids", "text"):
            assert joined(got, field) == joined(reference, field)
        assert [p.logprob for r in got for p in r.logprobs] == pytest.approx(
            [p.logprob for r in reference for p in r.logprobs], abs=1e-4)
        assert got[-1].usage.completion_tokens == 300 and got[-1].finish_reason == "length"
        assert resumed_count(stack) == resumed_before + 1
        assert "request resumed" in (tmp_path / "scheduler.log").read_text()
        deadline = time.monotonic() + 5
        while parse_engine_stats(http_get(f"{stack.base_url}/metrics")[1])["kv_blocks_used"] != 0:
            assert time.monotonic() < deadline, "a resumed request left blocks behind"
            time.sleep(0.05)
