"""The step protocol's wire form: plans and results survive the trip through protobuf exactly,
and a malformed message is refused with a clear error."""

from __future__ import annotations

import dataclasses
import inspect
import random

import pytest

from shared.proto import pagedserve_internal_pb2 as wire
from shared.sampling_params import SamplingParams
from shared.step_protocol import (Fork, NewSequence, PositionLogprobs, RunningSequence, Sample, SequenceOutput,
                                  StepPlan, StepResult, running_sequence)


def random_delta(rng: random.Random, seq_id: int) -> RunningSequence:
    replaced = rng.random() < 0.2
    return RunningSequence(
        seq_id, [rng.randrange(32000) for _ in range(rng.choice([0, 0, 1, 1, 3]))],
        [] if replaced else [rng.randrange(5000) for _ in range(rng.choice([0, 0, 0, 1, 2]))],
        rng.randrange(4096), rng.randrange(1, 600), [rng.randrange(5000) for _ in range(rng.randrange(1, 9))]
        if replaced else None, append_last_sample=rng.random() < 0.5,
        draft_token_ids=[rng.randrange(32000) for _ in range(rng.choice([0, 0, 0, 1, 4]))])


def random_logprobs(rng: random.Random) -> PositionLogprobs:
    k = rng.randrange(0, 4)
    # float32 on the wire: values that float32 holds exactly come back equal
    return PositionLogprobs(rng.randrange(100), -rng.randrange(1, 64) / 8, rng.randrange(1, 9),
                            [rng.randrange(100) for _ in range(k)], [-rng.randrange(1, 64) / 8 for _ in range(k)])


def random_output(rng: random.Random, seq_id: int) -> SequenceOutput:
    out = _random_output(rng, seq_id)
    if out.token_id is not None and rng.random() < 0.3:  # speculative decoding: accepted drafts, new drafts
        out.accepted_token_ids = [rng.randrange(32000) for _ in range(rng.randrange(4))]
        if out.logprobs is not None:
            out.accepted_logprobs = [random_logprobs(rng) for _ in out.accepted_token_ids]
        out.draft_token_ids = [rng.randrange(32000) for _ in range(rng.randrange(4))]
    return out


def _random_output(rng: random.Random, seq_id: int) -> SequenceOutput:
    kind = rng.random()
    if kind < 0.6:
        return SequenceOutput(seq_id, rng.randrange(32000))  # plain: a token, nothing else
    if kind < 0.7:  # a prefill chunk with prompt logprobs and no token
        return SequenceOutput(seq_id, None, prompt_logprobs=[random_logprobs(rng)], prompt_logprobs_start=5)
    if kind < 0.85:
        return SequenceOutput(seq_id, rng.randrange(32000), logprobs=random_logprobs(rng))
    return SequenceOutput(seq_id, rng.randrange(32000), siblings=[Sample(rng.randrange(32000))])


def round_trip(message, kind):
    return kind.FromString(message.SerializeToString())


def test_random_plans_round_trip():
    rng = random.Random()
    for _ in range(100):
        running = [random_delta(rng, seq_id) for seq_id in rng.sample(range(10_000), rng.randrange(0, 40))]
        new = [NewSequence(f"req-{i}", 20_000 + i, 0, [1, 2, 3], [], SamplingParams(max_tokens=4), [7], 0, 3,
                           trace_context=rng.choice([None, {"traceparent": f"00-{i:032x}-{i + 1:016x}-01"}]))
               for i in range(rng.randrange(0, 3))]
        plan = StepPlan(step_id=rng.randrange(1, 1000), new=new, running=running, finished_seq_ids=[5, 6],
                        forks=[Fork(1, 2, 1)], swap_out=[(1, 2)], swap_in=[(3, 4)], copies=[(5, 6)])
        assert StepPlan.from_proto(round_trip(plan.to_proto(), wire.StepPlan)) == plan


def test_random_results_round_trip_in_order():
    rng = random.Random()
    for _ in range(100):
        outputs = [random_output(rng, seq_id) for seq_id in rng.sample(range(10_000), rng.randrange(0, 40))]
        failed = sorted(rng.sample(range(1000), rng.randrange(0, 3)))  # swap-ins that failed: usually none
        result = StepResult(rng.randrange(1, 1000), outputs, 0.25, 0.125, failed_block_ids=failed)
        assert StepResult.from_proto(round_trip(result.to_proto(), wire.StepResult)) == result


def test_plain_outputs_travel_as_columns():
    message = StepResult(1, [SequenceOutput(i, 100 + i) for i in range(5)]).to_proto()
    assert list(message.outputs.seq_ids) == [0, 1, 2, 3, 4] and not message.outputs.detailed
    assert not message.outputs.num_accepted and not message.outputs.num_drafts  # no speculative columns
    speculative = [SequenceOutput(1, 5, accepted_token_ids=[3, 4], draft_token_ids=[6]), SequenceOutput(2, 7)]
    message = StepResult(1, speculative).to_proto()
    assert not message.outputs.detailed and list(message.outputs.num_accepted) == [2, 0]
    assert StepResult.from_proto(message).outputs == speculative


def test_the_keyword_constructor_of_running_deltas_follows_their_fields():
    """running_sequence passes its parameters on by position: a field moved in RunningSequence must move there."""
    fields = [f.name for f in dataclasses.fields(RunningSequence)]
    assert list(inspect.signature(running_sequence).parameters) == fields
    values = {name: [i] for i, name in enumerate(fields)}
    assert dataclasses.asdict(running_sequence(**values)) == values


def test_malformed_columns_are_refused():
    plan = StepPlan(step_id=1, running=[RunningSequence(1, [5], [], 10, 1)]).to_proto()
    del plan.running.num_new_tokens[:]
    with pytest.raises(ValueError, match="malformed plan"):
        StepPlan.from_proto(plan)
    plan = StepPlan(step_id=1, running=[RunningSequence(1, [5], [], 10, 1)]).to_proto()
    plan.running.new_block_tables[3].ids.append(9)  # a table for an entry that is not there
    with pytest.raises(ValueError, match="malformed plan"):
        StepPlan.from_proto(plan)
    result = StepResult(1, [SequenceOutput(1, 5), SequenceOutput(2, None, prompt_logprobs=[])]).to_proto()
    result.outputs.detailed_positions[0] = 7
    with pytest.raises(ValueError, match="malformed result"):
        StepResult.from_proto(result)
    plan = StepPlan(step_id=1, running=[RunningSequence(1, [5], [], 10, 3, draft_token_ids=[6, 7])]).to_proto()
    plan.running.draft_token_ids.append(8)  # more drafts than the counts say
    with pytest.raises(ValueError, match="malformed plan"):
        StepPlan.from_proto(plan)
    result = StepResult(1, [SequenceOutput(1, 5, draft_token_ids=[6]), SequenceOutput(2, 5)]).to_proto()
    del result.outputs.num_drafts[1:]  # a column shorter than the outputs
    with pytest.raises(ValueError, match="malformed result"):
        StepResult.from_proto(result)
