"""The engine request: one object from the gateway to the sequences, one validation for every front,
and its wire form."""

from __future__ import annotations

import dataclasses

import pytest

from services.gateway.model import Model
from shared.invalid_parameter import InvalidParameter
from shared.lora import LoRARequest
from shared.pooling import PoolerConfig, PoolingParams
from shared.proto import pagedserve_internal_pb2 as wire
from shared.request import EngineRequest, RequestLimits, validate
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams
from shared.structured_outputs import StructuredOutputs
from tests.scheduler.test_scheduler import make_engine

LIMITS = RequestLimits(max_model_len=64, vocab_size=100, max_logprobs=5, max_num_seqs=4, eos_token_ids=(0,),
                       max_loras=2)
EMBEDDER = PoolerConfig("last", True, 16)
CLASSIFIER = PoolerConfig("last", False, 16, labels=("no", "yes"), activation="softmax")


def request(prompt=(1, 2, 3), **fields) -> EngineRequest:
    return EngineRequest("r", list(prompt), **fields)


def test_every_field_survives_the_wire():
    whole = request(params=SamplingParams(n=2, temperature=0.5, max_tokens=7, stop=["x"], logprobs=3, seed=11,
                                          structured_outputs=StructuredOutputs(regex="[ab]+")),
                    cache_salt="tenant", resumption=Resumption({0: [4, 5], 1: []}),
                    lora=LoRARequest("sql", "/adapters/sql"), priority=3, arrival_time=1_700_000_000.125,
                    trace_context={"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                                   "tracestate": "congo=t61rcWkgMzE"})
    pooled = request(pooling=PoolingParams(dimensions=8, normalize=False, task="embed"))
    for sent in (whole, pooled, request()):
        message = wire.EngineRequest.FromString(sent.to_proto().SerializeToString())
        assert EngineRequest.from_proto(message) == sent
    # Field for field: a field added on one side only fails here (resumption travels as "resumed").
    names = {f.name for f in dataclasses.fields(EngineRequest)} - {"resumption"} | {"resumed"}
    assert names == set(wire.EngineRequest.DESCRIPTOR.fields_by_name)


def test_a_request_keeps_its_arrival_when_it_is_made_again():
    first = request()
    resumed = dataclasses.replace(first, resumption=Resumption({0: [7]}))
    assert resumed.arrival_time == first.arrival_time and request().arrival_time >= first.arrival_time


@pytest.mark.parametrize("bad, limits, param, message", [
    (request([]), LIMITS, "prompt", "prompt is empty"),
    (request([1, 100]), LIMITS, "prompt", "prompt token id 100 is outside the vocabulary [0, 100)"),
    (request([1] * 64), LIMITS, "prompt", "prompt has 64 tokens, but the context length is 64"),
    (request([1] * 60, params=SamplingParams(max_tokens=5)), LIMITS, "max_tokens",
     "the prompt (60 tokens) + max_tokens (5) = 65 tokens exceeds the context length of 64 tokens"),
    (request(params=SamplingParams(max_tokens=None, min_tokens=62)), LIMITS, "min_tokens", "min_tokens (62)"),
    (request(params=SamplingParams(logprobs=6)), LIMITS, "logprobs", "logprobs=6 exceeds the maximum of 5"),
    (request(params=SamplingParams(prompt_logprobs=6)), LIMITS, "prompt_logprobs", "prompt_logprobs=6"),
    (request(params=SamplingParams(stop_token_ids=[100])), LIMITS, "stop_token_ids",
     "token id 100 in stop_token_ids is outside the vocabulary"),
    (request(params=SamplingParams(n=5)), LIMITS, "n", "SamplingParams.n (5) exceeds the engine's max_num_seqs (4)"),
    (request(params=SamplingParams(truncate_prompt_tokens=65)), LIMITS, "truncate_prompt_tokens", "(65)"),
    (request(params=SamplingParams(allowed_token_ids=[0], min_tokens=1)), LIMITS, "allowed_token_ids",
     "allows only stop tokens"),
    (request(cache_salt=""), LIMITS, "cache_salt", "cache_salt must not be empty"),
    (request(priority=1), LIMITS, "priority", "priority scheduling is not enabled"),
    (request(lora=LoRARequest("a", "/a")), dataclasses.replace(LIMITS, max_loras=0), "lora", "LoRA is not enabled"),
    (request(params=SamplingParams(use_beam_search=True, n=2), resumption=Resumption({0: [1]})), LIMITS,
     "resumption", "a beam search cannot be resumed"),
    (request(params=SamplingParams(n=2), resumption=Resumption({2: [1]})), LIMITS, "resumption",
     "not one of the request's n=2"),
    (request(params=SamplingParams(max_tokens=2), resumption=Resumption({0: [5, 6]})), LIMITS, "resumption",
     "it had finished"),
    (request(pooling=PoolingParams()), LIMITS, "model", "generates text and serves no embeddings"),
    (request(), dataclasses.replace(LIMITS, pooler=EMBEDDER), "model", "is a pooling model (an embedding model)"),
    (request(pooling=PoolingParams(task="classify")), dataclasses.replace(LIMITS, pooler=EMBEDDER), "model",
     "is an embedding model: it serves the embed task, not classify"),
    (request(pooling=PoolingParams(task="embed")), dataclasses.replace(LIMITS, pooler=CLASSIFIER), "model",
     "is a classifier"),
    (request(pooling=PoolingParams(dimensions=8)), dataclasses.replace(LIMITS, pooler=EMBEDDER), "dimensions",
     "does not support matryoshka"),
    (request([1] * 65, pooling=PoolingParams()), dataclasses.replace(LIMITS, pooler=EMBEDDER), "prompt",
     "prompt has 65 tokens, but the context length is 64"),
    (request(pooling=PoolingParams(), resumption=Resumption({0: []})), dataclasses.replace(LIMITS, pooler=EMBEDDER),
     "resumption", "not for an embedding request"),
])
def test_what_could_never_run_is_refused_naming_its_field(bad, limits, param, message):
    with pytest.raises(InvalidParameter) as refused:
        validate(bad, limits)
    assert refused.value.param == param and message in str(refused.value)


def test_what_fits_passes():
    validate(request([1] * 63, params=SamplingParams(max_tokens=1, logprobs=5, n=4)), LIMITS)
    validate(request([1] * 64, pooling=PoolingParams()), dataclasses.replace(LIMITS, pooler=EMBEDDER))
    validate(request(params=SamplingParams(n=2, max_tokens=4), resumption=Resumption({1: [5, 6, 7]})), LIMITS)
    validate(request(cache_salt="s", lora=LoRARequest("a", "/a")), LIMITS)


@pytest.mark.parametrize("bad", [
    request([]), request([1, 2, 100]), request([1] * 511, params=SamplingParams(max_tokens=2)),
    request(params=SamplingParams(logprobs=21)), request(params=SamplingParams(n=9)),
    request(params=SamplingParams(logit_bias={100: 1.0})), request(cache_salt=""), request(priority=-1),
    request([1] * 512),
])
def test_the_gateway_and_the_engine_refuse_alike(bad):
    """One check, one wording: the gateway's all-or-nothing pre-check says what admission would."""
    engine, _ = make_engine()  # vocabulary 100, context 512, 8 sequences, 20 logprobs
    with pytest.raises(ValueError) as at_admission:
        engine.add_request(bad)
    model = Model("m", 512, 100, 20, tokenizer=None, max_num_seqs=8, eos_token_ids=(0,))
    with pytest.raises(InvalidParameter) as at_the_gateway:
        model.checked(bad)
    # (the gateway's clients read the field without the SamplingParams. prefix)
    assert str(at_admission.value).removeprefix("SamplingParams.") == str(at_the_gateway.value)
    assert getattr(at_admission.value, "param", None) == at_the_gateway.value.param
    assert not engine.has_unfinished()


def test_an_embedding_input_is_named_as_the_api_names_it():
    model = Model("m", 64, 100, 5, tokenizer=None, pooler=EMBEDDER)
    with pytest.raises(InvalidParameter) as refused:
        model.checked(request([], pooling=PoolingParams()))
    assert refused.value.param == "input" and "prompt is empty" in str(refused.value)
    with pytest.raises(InvalidParameter) as refused:
        model.checked(request(pooling=PoolingParams(task="classify")))
    assert refused.value.param == "model" and "the model `m` is an embedding model" in str(refused.value)
