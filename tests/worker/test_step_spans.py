"""The worker's step spans (services/worker/step_spans.py), in process with spans in memory: a span per step
that runs a traced request's sequence, linked to each such request once, none for an untraced step."""

from __future__ import annotations

import threading

import pytest

from services.worker.server import ComputeThread, _StepStream
from services.worker.step_spans import StepSpans
from shared.sampling_params import SamplingParams
from shared.step_protocol import Fork, NewSequence, StepPlan, StepResult, running_sequence
from tests.span_capture import CLIENT_SPAN_ID, CLIENT_TRACE_ID, TRACEPARENT, SpanCapture

OTHER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"  # another request's trace
UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"  # recorded nowhere: not linked


def new(seq_id: int, traceparent: str | None, tokens: int = 4) -> NewSequence:
    return NewSequence(request_id=f"r{seq_id}", seq_id=seq_id, index=0, prompt_token_ids=[1] * tokens,
                       output_token_ids=[], sampling_params=SamplingParams(), block_table=[0],
                       num_computed_tokens=0, num_scheduled_tokens=tokens,
                       trace_context={"traceparent": traceparent} if traceparent else None)


def decode(seq_id: int):
    return running_sequence(seq_id=seq_id, new_token_ids=[], new_block_ids=[], num_computed_tokens=4,
                            num_scheduled_tokens=1, append_last_sample=True)


@pytest.fixture
def capture():
    capture = SpanCapture("worker")
    yield capture
    capture.close()


def linked(links) -> list[tuple[int, int]]:
    return sorted((link.context.trace_id, link.context.span_id) for link in links)


def test_links_follow_the_sequences_through_forks_and_drops(capture):
    spans = StepSpans(capture.tracing.tracer, tensor_parallel_rank=0)
    client, other = (CLIENT_TRACE_ID, CLIENT_SPAN_ID), (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    first = StepPlan(1, new=[new(1, TRACEPARENT), new(2, OTHER), new(3, None), new(4, UNSAMPLED)])
    assert linked(spans.links_for(first)) == sorted([client, other])
    # A fork inherits its parent's context: the two siblings are one request, one link.
    forked = StepPlan(2, running=[decode(1), decode(3)], forks=[Fork(1, 5, 1)], finished_seq_ids=[2])
    forked.running.append(decode(5))
    assert linked(spans.links_for(forked)) == [client]
    untraced = StepPlan(3, running=[decode(3), decode(4)], finished_seq_ids=[1, 5])
    assert spans.links_for(untraced) == []
    # Recomputed as new without a context (another scheduler's, untraced): no longer linked.
    assert spans.links_for(StepPlan(4, new=[new(2, None)])) == []


def test_a_step_span_wraps_the_step_with_its_links_and_attributes(capture):
    spans = StepSpans(capture.tracing.tracer, tensor_parallel_rank=1)
    plan = StepPlan(7, new=[new(1, TRACEPARENT, tokens=5)], running=[decode(2)])
    result = spans.run(plan, spans.links_for(plan), lambda p: StepResult(step_id=p.step_id, forward_time_s=0.25))
    assert result.step_id == 7
    step = capture.one("step")
    assert step.parent is None and linked(step.links) == [(CLIENT_TRACE_ID, CLIENT_SPAN_ID)]
    a = step.attributes
    assert (a["pagedserve.step.id"], a["pagedserve.step.num_sequences"], a["pagedserve.step.num_scheduled_tokens"],
            a["pagedserve.tensor_parallel_rank"], a["gen_ai.latency.time_in_model_forward"]) == (7, 2, 6, 1, 0.25)
    assert a["gen_ai.latency.time_in_model_execute"] >= 0


class RecordingWorker:
    def __init__(self):
        self.steps: list[int] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.steps.append(plan.step_id)
        return StepResult(step_id=plan.step_id)


def test_the_steps_stream_traces_only_the_steps_of_traced_requests(capture):
    """Plans as they come over the wire (the context in the proto), run on the compute thread."""
    compute, stop, worker = ComputeThread(), threading.Event(), RecordingWorker()
    thread = threading.Thread(target=compute.serve_until, args=(stop,), daemon=True)
    thread.start()
    try:
        stream = _StepStream(worker, compute, StepSpans(capture.tracing.tracer, 0))
        plans = [StepPlan(1, new=[new(1, None)]), StepPlan(2, new=[new(2, TRACEPARENT)], running=[decode(1)]),
                 StepPlan(3, running=[decode(1)], finished_seq_ids=[2])]
        stream.read(iter([plan.to_proto() for plan in plans]), lambda plan: None)
        results = [stream.results.get(timeout=60) for _ in plans]
        assert [r.step_id for r in results] == [1, 2, 3] and worker.steps == [1, 2, 3]
    finally:
        stop.set()
        thread.join(60)
    (step,) = capture.spans()
    assert step.attributes["pagedserve.step.id"] == 2 and linked(step.links) == [(CLIENT_TRACE_ID, CLIENT_SPAN_ID)]
