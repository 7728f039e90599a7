"""--otlp-traces-endpoint across real processes: gateway, scheduler and worker send their spans to an
OTLP/gRPC collector this test runs, and one request's spans, in all three, belong to the trace its client's
traceparent header named, each under the span it should be under."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc

from tests.services_harness import Stack
from tests.span_capture import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT

SPAN_WAIT_S = 120.0  # bounds a hang only: with a short batch delay the spans come within a second or two
WANTED = {("pagedserve-gateway", "POST /v1/completions"), ("pagedserve-gateway", "tokenize"),
          ("pagedserve-gateway", "llm_request"), ("pagedserve-scheduler", "engine_request"),
          ("pagedserve-scheduler", "queue"), ("pagedserve-scheduler", "prefill"), ("pagedserve-scheduler", "decode")}


class Collector(otlp_grpc.TraceServiceServicer):
    """OTLP/gRPC's trace receiver: keeps every span with its service's name."""

    def __init__(self):
        self.spans: list[tuple[str, object]] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next(a.value.string_value for a in resource_spans.resource.attributes
                               if a.key == "service.name")
                self.spans += [(service, span) for scope in resource_spans.scope_spans for span in scope.spans]
        return otlp.ExportTraceServiceResponse()

    def of_trace(self, trace_id: int) -> list[tuple[str, object]]:
        """The spans in the trace, and the worker's steps linked to it."""
        wanted = trace_id.to_bytes(16, "big")
        with self._lock:
            return [(service, span) for service, span in self.spans
                    if span.trace_id == wanted or any(link.trace_id == wanted for link in span.links)]


@pytest.fixture
def collector():
    collector, server = Collector(), grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    otlp_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def wait_for_spans(collector: Collector) -> dict[tuple[str, str], list]:
    deadline = time.monotonic() + SPAN_WAIT_S
    while True:
        found: dict[tuple[str, str], list] = {}
        for service, span in collector.of_trace(CLIENT_TRACE_ID):
            found.setdefault((service, span.name), []).append(span)
        if WANTED <= set(found) and ("pagedserve-worker", "step") in found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def test_one_requests_spans_in_every_service_share_its_clients_trace(llama_dir, tmp_path, collector, monkeypatch):
    collector, endpoint = collector
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # each service's batches leave every 0.1 s
    traced = ("--otlp-traces-endpoint", endpoint)
    with Stack(llama_dir, tmp_path, worker_args=("--num-gpu-blocks-override", "64", *traced), gateway_args=traced,
               scheduler_args=traced) as stack:
        body = json.dumps({"model": stack.model_name, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
        request = urllib.request.Request(f"{stack.base_url}/v1/completions", data=body.encode(), method="POST",
                                         headers={"Content-Type": "application/json", "traceparent": TRACEPARENT})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] == 4
        found = wait_for_spans(collector)
    assert WANTED <= set(found) and ("pagedserve-worker", "step") in found, sorted(found)
    (http,) = found["pagedserve-gateway", "POST /v1/completions"]
    (tokenize,), (llm,) = found["pagedserve-gateway", "tokenize"], found["pagedserve-gateway", "llm_request"]
    (engine,) = found["pagedserve-scheduler", "engine_request"]
    assert http.parent_span_id == CLIENT_SPAN_ID.to_bytes(8, "big")
    assert tokenize.parent_span_id == llm.parent_span_id == http.span_id
    assert engine.parent_span_id == llm.span_id
    for phase in ("queue", "prefill", "decode"):
        (span,) = found["pagedserve-scheduler", phase]
        assert span.parent_span_id == engine.span_id, phase
    steps = found["pagedserve-worker", "step"]
    assert all(any(link.span_id == engine.span_id for link in step.links) for step in steps)
    attributes = {a.key: a.value for a in engine.attributes}
    assert attributes["gen_ai.usage.completion_tokens"].int_value == 4
    assert attributes["gen_ai.usage.prompt_tokens"].int_value == {a.key: a.value for a in llm.attributes}[
        "gen_ai.usage.prompt_tokens"].int_value
