"""The gateway's side of resumption, against a scripted scheduler pool: what it sends again, what
it tries again, and what the client sees (every token once, in order)."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway.generator import Generator
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
from services.gateway.resumption import ResumePolicy
from services.gateway.scheduler_session import SessionLost
from shared.grpc_errors import AlreadyExists, ServiceUnavailable
from shared.proto import pagedserve_internal_pb2 as wire
from shared.request import EngineRequest
from shared.resumption import Resumption
from shared.sampling_params import SamplingParams
from shared.tokenizer import load_tokenizer

PROMPT = [5, 6, 7, 8]


def lost(message: str) -> SessionLost:
    return SessionLost(message, "sched-a")


def out(seq_index: int = 0, tokens=(), finish: str = "", prompt_logprobs: int = 0) -> wire.EngineOutput:
    positions = [wire.PositionLogprobs(token_id=PROMPT[1 + i], logprob=-1.0 - i, rank=1)
                 for i in range(prompt_logprobs)]
    return wire.EngineOutput(seq_index=seq_index, new_token_ids=list(tokens), finish_reason=finish,
                             prompt_logprobs=positions)


class ScriptedStream:
    """Yields its items (outputs; an exception is raised where it stands), then ends."""

    def __init__(self, items: list):
        self.items = list(items)
        self.aborted = self.cancelled = False

    async def __anext__(self):
        await asyncio.sleep(0)
        if self.aborted or not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def abort(self) -> None:
        self.aborted = True

    def cancel(self) -> None:
        self.cancelled = True

    def stop_sequence(self, seq_index: int, stop: str) -> None:
        pass


class ScriptedPool:
    """Each submission takes the next script entry: an exception to raise, or a stream's items."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.submissions: list[tuple[SamplingParams, Resumption | None, str | None]] = []
        self.avoided: list[str | None] = []

    async def submit(self, request: EngineRequest, avoid=None):
        assert request.prompt_token_ids == PROMPT
        self.submissions.append((request.params, request.resumption, request.cache_salt))
        self.avoided.append(avoid)
        script = self.scripts.pop(0) if self.scripts else ServiceUnavailable("no scheduler serves")
        if isinstance(script, BaseException):
            raise script
        return ScriptedStream(script)


@pytest.fixture(scope="module")
def model(llama_dir):
    return Model("m", 512, 512, 20, load_tokenizer(llama_dir))


def generate(model, pool, params, policy=ResumePolicy(max_resumes=2, timeout_s=5.0), during=None):
    """(deltas by sequence, the run, the metrics); `during(run)` runs once the first delta came."""
    metrics = GatewayMetrics()
    gen = Generator(pool, metrics, resume_policy=policy)

    async def main():
        run, = await gen.start(model, [EngineRequest("r", PROMPT, params, cache_salt="salt")])
        deltas = {}
        async for delta in run:
            deltas.setdefault(delta.index, []).append(delta)
            if during is not None:
                await during(run, gen)
        return deltas, run

    deltas, run = asyncio.run(main())
    return deltas, run, metrics


def count(metrics: GatewayMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"pagedserve_{name}_total")


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


def test_a_lost_run_carries_on_after_the_tokens_it_had(model):
    pool = ScriptedPool([out(0, [40, 41]), out(0, [42]), lost("the scheduler went away")],
                        [out(0, [43, 44]), out(0, [45], finish="length")])
    params = SamplingParams(max_tokens=6, seed=3, prompt_logprobs=1)
    deltas, run, metrics = generate(model, pool, params)
    assert tokens(deltas[0]) == [40, 41, 42, 43, 44, 45] and deltas[0][-1].finish_reason == "length"
    assert "".join(d.text for d in deltas[0]) == model.tokenizer.decode([40, 41, 42, 43, 44, 45])
    (first, none, salt), (again, resumption, salt_again) = pool.submissions
    assert none is None and resumption == Resumption({0: [40, 41, 42]}) and salt == salt_again == "salt"
    # The same request, less the prompt logprobs it has sent (they come before the first token).
    assert again == SamplingParams(max_tokens=6, seed=3) and first == params
    assert run.resumes == 1 and run.completion_tokens == 6
    assert count(metrics, "resumed_requests") == 1 and count(metrics, "resume_failures") == 0


def test_each_unfinished_sequence_resumes_with_its_own_tokens(model):
    """n = 3: sequence 1 ended (a stop token), 0 and 2 ran on: only those two are sent again."""
    pool = ScriptedPool([out(0, [40]), out(1, [50]), out(2, [60]), out(1, [51], finish="stop"), out(2, [61]),
                         lost("lost")],
                        [out(2, [62], finish="length"), out(0, [41]), out(0, [42], finish="length")])
    deltas, run, _ = generate(model, pool, SamplingParams(n=3, max_tokens=3))
    assert pool.submissions[1][1] == Resumption({0: [40], 2: [60, 61]})
    assert [tokens(deltas[i]) for i in range(3)] == [[40, 41, 42], [50, 51], [60, 61, 62]]


def test_a_run_lost_before_its_first_token_starts_over_without_repeating_prompt_logprobs(model):
    pool = ScriptedPool([out(0, prompt_logprobs=2), lost("lost in the prefill")],
                        [out(0, prompt_logprobs=3), out(0, [40], finish="length")])
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    deltas, run, _ = generate(model, pool, params)
    assert pool.submissions[1][:2] == (params, None)  # the request as it was: nothing came to carry on from
    assert [p.token_id for p in run.prompt_logprobs[1:]] == PROMPT[1:] and run.prompt_logprobs[0] is None
    assert tokens(deltas[0]) == [40]


def test_a_resumption_tries_again_until_a_scheduler_takes_it(model):
    """Unreachable, refused for now (its worker is down), the old id still held, lost again before
    any output: each is tried again; the one that answers counts once."""
    pool = ScriptedPool([out(0, [40]), lost("lost")],
                        ServiceUnavailable("not reachable"),
                        [ServiceUnavailable("the worker is not answering")],
                        [AlreadyExists("request id 'r' is already in use")],
                        [lost("lost again")],
                        [out(0, [41], finish="length")])
    deltas, run, metrics = generate(model, pool, SamplingParams(max_tokens=2))
    assert tokens(deltas[0]) == [40, 41] and len(pool.submissions) == 6
    assert all(r == Resumption({0: [40]}) for _, r, _ in pool.submissions[1:])
    assert pool.avoided == [None, "sched-a", None, None, None, None]  # the lost one goes last, first time only
    # The one taken and lost again counts: the request was resumed twice (a third loss would be too many).
    assert run.resumes == 2 and count(metrics, "resumed_requests") == 1


def test_a_request_lost_again_and_again_before_its_first_output_is_bounded_by_max_resumes(model):
    """Its prefill may be what brings the worker down: every taken-and-lost submission counts."""
    pool = ScriptedPool(*[[lost(f"the worker died, time {i}")] for i in range(10)], [out(0, [40], finish="length")])
    with pytest.raises(SessionLost, match="time 2"):
        generate(model, pool, SamplingParams(max_tokens=1), ResumePolicy(max_resumes=2, timeout_s=30))
    assert len(pool.submissions) == 3  # the first, and two resumes


def test_a_resumption_no_scheduler_takes_in_time_fails_with_503(model):
    pool = ScriptedPool([out(0, [40]), lost("the scheduler at x went away")])  # then: none serves
    with pytest.raises(ServiceUnavailable, match="went away; no scheduler took the request again within 0.3 s"):
        generate(model, pool, SamplingParams(max_tokens=4), ResumePolicy(max_resumes=1, timeout_s=0.3))


def test_resumes_are_counted_per_run_and_only_lost_sessions_resume(model):
    lost_twice = ScriptedPool([out(0, [40]), lost("first")], [out(0, [41]), lost("second")])
    with pytest.raises(SessionLost, match="second"):
        generate(model, lost_twice, SamplingParams(max_tokens=4), ResumePolicy(max_resumes=1))
    for error in (ServiceUnavailable("the gateway is shutting down"), ValueError("bad")):  # not a lost session
        pool = ScriptedPool([out(0, [40]), error])
        with pytest.raises(type(error)):
            generate(model, pool, SamplingParams(max_tokens=4))
        assert len(pool.submissions) == 1
    off = ScriptedPool([out(0, [40]), lost("lost")])
    with pytest.raises(SessionLost):
        generate(model, off, SamplingParams(max_tokens=4), policy=None)


def test_an_abort_while_waiting_to_resume_ends_the_run_as_aborted(model):
    async def abort_soon(run, gen):
        if run.resumes == 0:
            asyncio.get_running_loop().call_later(0.3, run.abort)

    pool = ScriptedPool([out(0, [40]), lost("lost")])  # no scheduler takes it again
    deltas, run, metrics = generate(model, pool, SamplingParams(max_tokens=4), during=abort_soon)
    assert deltas[0][-1].finish_reason == "abort" and tokens(deltas[0]) == [40]
    assert 1 < len(pool.submissions) < 10 and count(metrics, "resume_failures") == 0


def test_a_gateway_giving_up_on_its_requests_stops_their_resumptions(model):
    async def stop_soon(run, gen):
        asyncio.get_running_loop().call_later(0.3, setattr, gen.resumer, "stopping", True)

    pool = ScriptedPool([out(0, [40]), lost("lost")])
    with pytest.raises(ServiceUnavailable, match="no scheduler took"):
        generate(model, pool, SamplingParams(max_tokens=4), during=stop_soon)
    assert len(pool.submissions) < 10  # it stopped at once, not at the 5 s timeout


def test_the_policy_is_checked():
    with pytest.raises(ValueError, match="max_resumes"):
        ResumePolicy(max_resumes=-1)
    with pytest.raises(ValueError, match="timeout"):
        ResumePolicy(timeout_s=0)
