"""The public gRPC API over the gateway stack the files here share (conftest.py): generation as the offline
API's, models, health and reflection, prompt logprobs, abort and cancel."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from pagedserve import LLM, SamplingParams
from shared.proto import pagedserve_api_pb2 as api
from shared.proto import pagedserve_api_pb2_grpc as api_grpc
from tests.gateway.shared_stack import PROMPTS, WORKER_ARGS, wait_blocks_free
from tests.services_harness import Stack


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
        with pytest.raises(grpc.RpcError) as unordered:  # this stack schedules first come, first served
            list(stub.Generate(api.GenerateRequest(text="x", priority=2)))
        assert unordered.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert unordered.value.details().startswith("priority")


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
