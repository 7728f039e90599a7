"""The scheduler's spans of a request (services/scheduler/request_spans.py), in process with spans in memory:
engine_request under the gateway's span, its queue, prefill and decode, vLLM's attributes, and the context
the workers get."""

from __future__ import annotations

import pytest

from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from shared.tracing import span_context_from
from tests.fake_worker import FakeWorker
from tests.span_capture import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT, SpanCapture, ids, parent_id


@pytest.fixture
def capture():
    capture = SpanCapture("scheduler")
    yield capture
    capture.close()


def traced_engine(capture: SpanCapture | None, num_blocks: int = 32) -> tuple[EngineCore, FakeWorker]:
    worker = FakeWorker(num_blocks, 4)
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=32, enable_chunked_prefill=True)
    return EngineCore(InProcessExecutor(worker), limits, watermark=0.0,
                      tracing=capture.tracing if capture is not None else None), worker


def run_to_end(engine: EngineCore) -> None:
    while engine.has_unfinished():
        engine.step()


def request(request_id: str = "r", n: int = 1, **context) -> EngineRequest:
    return EngineRequest(request_id, [1, 2, 3, 4, 5, 6], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                                          n=n), **context)


def test_a_request_spans_its_queue_prefill_and_decode_under_the_gateway_span(capture):
    engine, worker = traced_engine(capture)
    engine.add_request(request(trace_context={"traceparent": TRACEPARENT}))
    run_to_end(engine)
    top = capture.one("engine_request")
    assert top.context.trace_id == CLIENT_TRACE_ID and parent_id(top) == CLIENT_SPAN_ID
    phases = [capture.one(name) for name in ("queue", "prefill", "decode")]
    assert all(parent_id(p) == top.context.span_id and p.context.trace_id == CLIENT_TRACE_ID for p in phases)
    queue, prefill, decode = phases  # one after the other, on the same clock
    assert top.start_time <= queue.start_time <= queue.end_time == prefill.start_time <= prefill.end_time \
        == decode.start_time <= decode.end_time <= top.end_time
    a = top.attributes
    assert (a["gen_ai.request.id"], a["gen_ai.usage.prompt_tokens"], a["gen_ai.usage.completion_tokens"]) \
        == ("r", 6, 4)
    assert (a["gen_ai.request.temperature"], a["gen_ai.request.top_p"], a["gen_ai.request.max_tokens"],
            a["gen_ai.request.n"], a["gen_ai.response.model"]) == (0.0, 1.0, 4, 1, "fake")
    assert a["gen_ai.response.finish_reasons"] == ("length",) and a["gen_ai.usage.num_sequences"] == 1
    for name in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode", "time_in_model_inference"):
        assert a[f"gen_ai.latency.{name}"] >= 0, name
    # The worker got the scheduler's span as the sequence's context: its step spans link there.
    (new,) = [new for plan in worker.plans for new in plan.new]
    assert ids(span_context_from(new.trace_context)) == ids(top.context)


def test_a_request_without_a_context_starts_a_trace_and_siblings_share_it(capture):
    engine, worker = traced_engine(capture)
    engine.add_request(request(n=2))
    run_to_end(engine)
    top = capture.one("engine_request")
    assert top.parent is None and top.attributes["gen_ai.usage.completion_tokens"] == 8
    assert top.attributes["gen_ai.usage.num_sequences"] == 2
    assert [ids(span_context_from(new.trace_context)) for plan in worker.plans for new in plan.new] == [ids(top.context)]


def test_a_request_aborted_while_waiting_has_only_its_queue(capture):
    engine, _ = traced_engine(capture)
    engine.add_request(request(trace_context={"traceparent": TRACEPARENT}))
    engine.abort_request("r")
    top, queue = capture.one("engine_request"), capture.one("queue")
    assert parent_id(queue) == top.context.span_id and not capture.named("prefill")
    assert top.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    assert "gen_ai.latency.time_in_queue" not in top.attributes  # (vLLM's: only once it was scheduled)


def test_a_refused_request_ends_its_span_as_an_error(capture):
    engine, _ = traced_engine(capture, num_blocks=2)
    with pytest.raises(ValueError, match="could never run"):
        engine.add_request(request(trace_context={"traceparent": TRACEPARENT}))
    top = capture.one("engine_request")
    assert not top.status.is_ok and "could never run" in top.status.description
    assert parent_id(top) == CLIENT_SPAN_ID


def test_untraced_the_gateway_context_goes_to_the_workers_as_it_came():
    engine, worker = traced_engine(None)
    assert engine.spans is None and engine.scheduler.request_stats.on_finished is None
    engine.add_request(request(trace_context={"traceparent": TRACEPARENT}))
    run_to_end(engine)
    (new,) = [new for plan in worker.plans for new in plan.new]
    assert new.trace_context == {"traceparent": TRACEPARENT}


def test_a_request_whose_trace_is_not_sampled_records_nothing_and_tells_the_workers_so(capture):
    engine, worker = traced_engine(capture)
    engine.add_request(request(trace_context={"traceparent": TRACEPARENT[:-2] + "00"}))
    run_to_end(engine)
    assert capture.spans() == []
    (new,) = [new for plan in worker.plans for new in plan.new]
    assert new.trace_context["traceparent"].endswith("-00") and span_context_from(new.trace_context) is None
