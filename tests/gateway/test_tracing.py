"""The gateway's spans, in process with spans in memory: a POST's server span continues the client's
traceparent, tokenization and each engine request (llm_request) are its children, and the request the
scheduler gets carries llm_request's context. The same over the public gRPC API, from its metadata."""

from __future__ import annotations

import asyncio
import threading

import pytest
from opentelemetry import trace

from services.gateway.engine_requests import engine_requests
from services.gateway.generator import Generator
from services.gateway.grpc_tracing import call_span
from services.gateway.http_tracing import TraceRequests
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
from services.gateway.request_context import REQUEST_ID
from shared.grpc_errors import ServiceUnavailable
from shared.proto import pagedserve_internal_pb2 as wire
from shared.sampling_params import SamplingParams
from shared.tokenizer import load_tokenizer
from shared.tracing import span_context_from
from tests.span_capture import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT, SpanCapture, ids, parent_id


@pytest.fixture
def capture():
    capture = SpanCapture("gateway")
    yield capture
    capture.close()


def call(app, method: str, path: str, headers: dict[str, str]) -> list[dict]:
    """One HTTP request through an ASGI app; the messages it sent."""
    sent = []
    scope = {"type": "http", "method": method, "path": path, REQUEST_ID: "req-7",
             "headers": [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]}

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent


class Answering:
    """An app that answers with ``status`` and notes the span current while it runs."""

    def __init__(self, status: int = 200):
        self.status, self.current = status, None

    async def __call__(self, scope, receive, send):
        self.current = trace.get_current_span().get_span_context()
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_a_post_continues_the_clients_trace_and_is_current_while_served(capture):
    inner = Answering()
    call(TraceRequests(inner, capture.tracing), "POST", "/v1/chat/completions",
         {"traceparent": TRACEPARENT, "tracestate": "congo=t61rcWkgMzE", "content-type": "application/json"})
    span = capture.one("POST /v1/chat/completions")
    assert span.kind == trace.SpanKind.SERVER and parent_id(span) == CLIENT_SPAN_ID
    assert span.context.trace_id == CLIENT_TRACE_ID and ids(inner.current) == ids(span.context)
    assert span.context.trace_state.get("congo") == "t61rcWkgMzE"
    assert (span.attributes["http.response.status_code"], span.attributes["gen_ai.request.id"],
            span.attributes["url.path"]) == (200, "req-7", "/v1/chat/completions")
    assert span.status.is_unset


def test_without_a_traceparent_a_post_starts_a_trace_and_gets_are_not_traced(capture):
    app = TraceRequests(Answering(503), capture.tracing)
    call(app, "POST", "/made/up/path", {})
    call(app, "GET", "/health", {"traceparent": TRACEPARENT})
    (span,) = capture.spans()
    assert span.name == "POST" and span.parent is None  # unknown paths share one name
    assert span.attributes["url.path"] == "/made/up/path" and not span.status.is_ok  # a 5xx is the server's error


@pytest.fixture(scope="module")
def model(llama_dir) -> Model:
    return Model("tiny", 512, 512, 20, load_tokenizer(llama_dir))


class OneOutputClient:
    """A scheduler that takes every request and answers each with two tokens, its last output."""

    def __init__(self, refuse: bool = False):
        self.refuse, self.submitted = refuse, []

    async def submit(self, request):
        if self.refuse:
            raise ServiceUnavailable("no scheduler serves")
        self.submitted.append(request)
        return OneOutput()


class OneOutput:
    def __init__(self):
        self.outputs = [wire.EngineOutput(seq_index=0, new_token_ids=[5, 6], finish_reason="length")]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.outputs:
            raise StopAsyncIteration
        return self.outputs.pop()

    def cancel(self):
        pass


def generate(gen: Generator, model: Model, tracer) -> list:
    """Two prompts through gen.start under a server span, read to their ends."""
    async def main():
        with tracer.start_as_current_span("POST /v1/completions"):
            prompts = await gen.tokenized(lambda: [[1, 2, 3], [4, 5]])
            runs = await gen.start(model, engine_requests("r", prompts, params=SamplingParams(temperature=0.5,
                                                                                           max_tokens=2)))
        for run in runs:
            async for _ in run:
                pass
        return threading.get_ident()
    return asyncio.run(main())


def test_each_engine_request_is_an_llm_request_whose_context_the_scheduler_gets(capture, model):
    client = OneOutputClient()
    gen = Generator(client, GatewayMetrics(), tracing=capture.tracing)
    generate(gen, model, capture.tracing.tracer)
    server, tokenize = capture.one("POST /v1/completions"), capture.one("tokenize")
    assert parent_id(tokenize) == server.context.span_id
    spans = sorted(capture.named("llm_request"), key=lambda span: span.attributes["gen_ai.request.id"])
    assert [parent_id(span) for span in spans] == [server.context.span_id] * 2
    assert [ids(span_context_from(r.trace_context)) for r in client.submitted] == [ids(s.context) for s in spans]
    first = spans[0].attributes
    assert first["gen_ai.request.id"] == client.submitted[0].request_id and first["gen_ai.response.model"] == "tiny"
    assert (first["gen_ai.usage.prompt_tokens"], first["gen_ai.usage.completion_tokens"],
            first["gen_ai.request.temperature"], first["gen_ai.request.max_tokens"]) == (3, 2, 0.5, 2)
    assert first["gen_ai.response.finish_reasons"] == ("length",)
    assert first["gen_ai.latency.time_to_first_token"] <= first["gen_ai.latency.e2e"]


def test_a_request_no_scheduler_takes_ends_its_span_as_an_error(capture, model):
    gen = Generator(OneOutputClient(refuse=True), GatewayMetrics(), tracing=capture.tracing)
    with pytest.raises(ServiceUnavailable):
        generate(gen, model, capture.tracing.tracer)
    span = capture.one("llm_request")
    assert not span.status.is_ok and "no scheduler serves" in span.status.description


def test_untraced_requests_go_as_they_came_and_tokenize_off_the_event_loop(model):
    client = OneOutputClient()
    gen = Generator(client, GatewayMetrics())
    assert gen.tracing is None
    loop_thread = generate(gen, model, trace.NoOpTracer())
    assert [r.trace_context for r in client.submitted] == [None, None]
    tokenizing = asyncio.run(gen.tokenized(threading.get_ident))
    assert tokenizing != loop_thread


class CallContext:
    def __init__(self, metadata):
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


def test_a_grpc_call_continues_the_trace_its_metadata_names(capture):
    metadata = (("authorization", "Bearer k"), ("traceparent", TRACEPARENT))
    with call_span(capture.tracing, CallContext(metadata), "Generate"):
        current = trace.get_current_span().get_span_context()
    span = capture.one("pagedserve.api.v1.Generation/Generate")
    assert parent_id(span) == CLIENT_SPAN_ID and ids(current) == ids(span.context)
    assert span.attributes["rpc.method"] == "Generate"
    with call_span(None, CallContext(metadata), "Generate"):  # untraced: nothing at all
        assert not trace.get_current_span().get_span_context().is_valid
