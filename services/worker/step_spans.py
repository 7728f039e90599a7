"""The worker's span of each step that runs a traced request's sequence (--otlp-traces-endpoint): "step",
linked to the scheduler's span of every traced request in it.

A step serves many requests at once, so it is the child of none: it starts a trace of its own and carries
a link per request, as OpenTelemetry models one operation over a batch (a consumer's span of a batch of
messages). A trace viewer shows the links from either side. A step with no traced request makes no span.

Each sequence's context comes once, in its NewSequence; forks inherit their parent's."""

from __future__ import annotations

import itertools
import time

from opentelemetry.trace import Link, SpanContext, Tracer

from shared import span_attributes as attrs
from shared.step_protocol import StepPlan, StepResult
from shared.tracing import span_context_from


class StepSpans:
    """One Steps stream's (a scheduler's): which of its sequences belong to traced requests."""

    def __init__(self, tracer: Tracer, tensor_parallel_rank: int):
        self.tracer, self.rank = tracer, tensor_parallel_rank
        self._contexts: dict[int, SpanContext] = {}  # seq id -> its request's (sampled) span context

    def links_for(self, plan: StepPlan) -> list[Link]:
        """The plan's changes to the sequences, then the step's links. On the thread that reads the plans, in
        their order: looked up when the step runs, a later plan's drops could race them."""
        contexts = self._contexts
        for fork in plan.forks:
            if fork.parent_seq_id in contexts:
                contexts[fork.child_seq_id] = contexts[fork.parent_seq_id]
        for seq_id in plan.finished_seq_ids:
            contexts.pop(seq_id, None)
        for new in plan.new:  # (a sequence preempted by recompute comes back as new)
            context = span_context_from(new.trace_context) if new.trace_context else None
            if context is None:
                contexts.pop(new.seq_id, None)
            else:
                contexts[new.seq_id] = context
        if not contexts:
            return []
        by_request = {}  # siblings (n > 1, beams) share their request's context: one link
        for seq_id in itertools.chain((new.seq_id for new in plan.new), (delta.seq_id for delta in plan.running)):
            context = contexts.get(seq_id)
            if context is not None:
                by_request[context.span_id] = context
        return [Link(context) for context in by_request.values()]

    def run(self, plan: StepPlan, links: list[Link], execute) -> StepResult:
        """execute(plan) inside the step's span."""
        attributes = {attrs.STEP_ID: plan.step_id, attrs.STEP_NUM_SEQUENCES: len(plan.new) + len(plan.running),
                      attrs.STEP_NUM_SCHEDULED_TOKENS: plan.num_scheduled_tokens, attrs.TENSOR_PARALLEL_RANK: self.rank}
        with self.tracer.start_as_current_span("step", links=links, attributes=attributes) as span:
            started = time.perf_counter()
            result = execute(plan)
            span.set_attributes({attrs.LATENCY_TIME_IN_MODEL_EXECUTE: time.perf_counter() - started,
                                 attrs.LATENCY_TIME_IN_MODEL_FORWARD: result.forward_time_s})
        return result
