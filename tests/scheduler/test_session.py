"""The scheduler's side of the gateway Session stream: per-session batches from the engine loop."""

from __future__ import annotations

import itertools
import time
import types

import grpc
import pytest

from services.scheduler.engine_loop import EngineLoop
from services.scheduler.sequence import SequenceStatus, SequenceUpdate
from services.scheduler.session import RequestError, Session, SessionBatch
from shared.grpc_errors import ServiceUnavailable, error_for_code, status_from_int
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from tests.scheduler.test_scheduler import make_engine


def drain(session: Session, keys: set[int]) -> SessionBatch:
    """Everything the session receives until every one of keys has ended or been refused."""
    seen = SessionBatch()
    for batch in session:
        seen.merge(batch)
        if keys <= set(seen.finished) | {e.key for e in seen.errors}:
            return seen
    raise AssertionError("the session ended early")


def opened(loop: EngineLoop) -> Session:
    session = Session()
    loop.open_session(session)
    return session


def test_batches_that_queue_up_are_merged():
    session = Session()
    session.put(SessionBatch(finished=[1]))
    session.put(SessionBatch(finished=[2]))
    session.end()
    assert [b.finished for b in session] == [[1, 2]]
    failing = Session()
    failing.put(SessionBatch(finished=[3]))
    failing.fail(ServiceUnavailable("down"))
    batches = iter(failing)
    assert next(batches).finished == [3]
    with pytest.raises(ServiceUnavailable):
        next(batches)


def test_request_error_travels_as_its_status_number():
    proto = RequestError(7, grpc.StatusCode.INVALID_ARGUMENT, "bad").to_proto()
    error = error_for_code(status_from_int(proto.code), proto.message)
    assert isinstance(error, ValueError) and str(error) == "bad"


def test_each_session_gets_only_its_own_requests():
    engine, _ = make_engine(num_blocks=32)
    loop = EngineLoop(engine)
    try:
        first, second = opened(loop), opened(loop)
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        loop.submit(first, 1, EngineRequest("a", [1, 2, 3], params))
        loop.submit(second, 1, EngineRequest("b", [4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True,
                                                                          n=2)))
        loop.submit(second, 2, EngineRequest("bad", [], params))  # refused at admission, on its own session
        loop.submit(second, 3, EngineRequest("a", [1], params))  # an id in use elsewhere: refused, the other unharmed
        got_first, got_second = drain(first, {1}), drain(second, {1, 2, 3})
        assert {key for key, _ in got_first.outputs} == {1} and got_first.finished == [1]
        assert sum(len(u.new_token_ids) for _, u in got_first.outputs) == 5
        assert {key for key, _ in got_second.outputs} == {1}
        assert sum(len(u.new_token_ids) for _, u in got_second.outputs) == 6  # two sequences of three
        refused = {e.key: e for e in got_second.errors}
        assert refused[2].code == grpc.StatusCode.INVALID_ARGUMENT and "empty" in refused[2].message
        assert refused[3].code == grpc.StatusCode.ALREADY_EXISTS and "already in use" in refused[3].message
        assert loop.num_in_flight() == 0
    finally:
        loop.stop()


def test_closing_a_session_aborts_its_requests_and_frees_their_blocks():
    engine, _ = make_engine(num_blocks=256, max_model_len=1024)
    loop = EngineLoop(engine)
    try:
        session, other = opened(loop), opened(loop)
        long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        loop.submit(session, 1, EngineRequest("x", list(range(1, 20)), long))
        loop.submit(session, 2, EngineRequest("y", list(range(1, 9)), long))
        loop.close_session(session)  # queued behind the submissions: both are admitted, then aborted
        received = SessionBatch()
        for batch in session:  # the stream ends; whatever a step produced before the close may come first
            received.merge(batch)
        assert not received.errors and not received.finished
        loop.submit(other, 1, EngineRequest("z", [1, 2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)))
        drain(other, {1})
        assert loop.num_in_flight() == 0 and loop.stats()["kv_blocks_used"] == 0
        assert loop.abort("x") is False  # already gone
    finally:
        loop.stop()


def test_aborts_end_the_request_on_its_session_and_only_the_owner_can_abort_by_key():
    engine, _ = make_engine(num_blocks=256, max_model_len=1024)
    loop = EngineLoop(engine)
    try:
        session, stranger = opened(loop), opened(loop)
        long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        loop.submit(session, 1, EngineRequest("x", [1, 2, 3], long))
        loop.abort_soon(stranger, 1)  # key 1 means nothing on another session
        first = next(iter(session))  # a step ran after both messages
        assert {key for key, _ in first.outputs} == {1} and not first.finished  # (batches may have merged)
        assert loop.num_in_flight() == 1 and loop.stats()["kv_blocks_used"] > 0
        assert loop.abort("x") is True  # the Abort RPC, by request id
        assert drain(session, {1}).finished == [1]
        # The same request id again, on the same session: a new key, a new request.
        loop.submit(session, 2, EngineRequest("x", [4, 5, 6], long))
        loop.abort_soon(session, 2)
        received = drain(session, {2})
        assert received.finished == [2] and not received.errors
        assert loop.stats()["kv_blocks_used"] == 0 and loop.num_in_flight() == 0
    finally:
        loop.stop()


def test_a_sequence_stopped_by_its_session_ends_alone_and_the_request_with_its_last_sibling():
    engine, _ = make_engine(num_blocks=512, max_model_len=1024)
    loop = EngineLoop(engine)
    try:
        session = opened(loop)
        params = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True, n=3)
        loop.submit(session, 1, EngineRequest("x", [1, 2, 3], params))
        received = SessionBatch()
        while {u.seq_index for _, u in received.outputs} != {0, 1, 2}:  # every sequence has forked and run
            received.merge(next(iter(session)))
        stopped = engine._requests["x"][1]
        loop.stop_sequence_soon(session, 1, 1, "stop!")
        loop.stop_sequence_soon(session, 1, 1, "again")  # ended already: ignored
        loop.stop_sequence_soon(session, 1, 7, "no such")  # no such sequence: ignored
        loop.stats()  # answered after the stops were applied
        assert stopped.status is SequenceStatus.FINISHED_STOPPED and stopped.stop_reason == "stop!"
        tokens_at_stop = len(stopped.output_token_ids)
        received.merge(drain(session, {1}))
        tokens = {i: sum(len(u.new_token_ids) for _, u in received.outputs if u.seq_index == i) for i in range(3)}
        assert tokens[0] == tokens[2] == 900  # its siblings ran on to max_tokens
        assert tokens[1] <= tokens_at_stop + 1 < 900  # (a step planned ahead may carry one more token)
        assert len(stopped.output_token_ids) <= tokens_at_stop + 1
        assert not any(u.seq_index == 1 and u.finish_reason for _, u in received.outputs)  # the gateway reports it
        assert loop.num_in_flight() == 0 and loop.stats()["kv_blocks_used"] == 0
        # Stopping the last running sequence ends the request (no step output says so).
        loop.submit(session, 2, EngineRequest("y", [4, 5], SamplingParams(temperature=0, max_tokens=900,
                                                                          ignore_eos=True)))
        assert {key for key, _ in next(iter(session)).outputs} == {2}
        loop.stop_sequence_soon(session, 2, 0, "stop!")
        assert drain(session, {2}).finished == [2]
        assert loop.num_in_flight() == 0 and loop.stats()["kv_blocks_used"] == 0
    finally:
        loop.stop()


class ScriptedEngine:
    """Steps that return given updates, one step in flight at most; an inbox message can be posted
    while a step runs (on_step), so that the loop reads it in the same turn as that step's outputs."""

    def __init__(self, steps: list[list[SequenceUpdate]]):
        self.steps, self.num_in_flight, self.on_step, self.stopped = list(steps), 0, None, set()
        self.admitted = False

    def can_plan_ahead(self) -> bool:
        return False

    def publish_cache(self):
        return None  # no prefix cache to tell of

    def has_unfinished(self) -> bool:
        return self.admitted and bool(self.steps)

    def has_idle_work(self) -> bool:
        return not self.num_in_flight and self.has_unfinished()

    def start_step(self) -> bool:
        self.num_in_flight = int(self.has_unfinished())
        return bool(self.num_in_flight)

    def finish_step(self) -> list[SequenceUpdate]:
        self.num_in_flight = 0
        if self.on_step is not None:
            self.on_step(len(self.steps))
        return self.steps.pop(0)

    def add_request(self, request: EngineRequest) -> int:
        self.admitted = True
        return request.params.n

    def abort_request(self, request_id: str) -> None:
        pass

    def finish_by_stop_string(self, request_id: str, seq_index: int, stop: str) -> bool:
        ended = (request_id, seq_index) not in self.stopped
        self.stopped.add((request_id, seq_index))
        return ended

    def get_stats(self) -> dict:
        return {}

    def shutdown(self) -> None:
        pass


def update(index: int, tokens: list[int], finish_reason: str | None = None) -> SequenceUpdate:
    seq = types.SimpleNamespace(request=types.SimpleNamespace(request_id="x"), index=index, output_token_ids=[],
                                num_cached_tokens=None)
    out = SequenceUpdate(seq)
    out.new_token_ids, out.finish_reason = tokens, finish_reason
    return out


def test_a_request_ended_by_an_inbox_message_ends_after_the_outputs_of_the_same_turn():
    """Sibling 1's last tokens and the stop that ends sibling 0 (the request's last) meet in one turn:
    the request's end must not overtake those tokens (the gateway drops what comes after it)."""
    engine = ScriptedEngine([[update(0, [1]), update(1, [2])], [update(1, [3, 4], "length")]])
    loop = EngineLoop(engine)
    try:
        session = opened(loop)
        engine.on_step = lambda left: left == 1 and loop.stop_sequence_soon(session, 1, 0, "stop!")
        loop.submit(session, 1, EngineRequest("x", [1, 2], SamplingParams(max_tokens=4, n=2)))
        received = []
        while not received or received[-1][0] != "end":  # batch by batch as put (reading would merge them)
            batch = session._queue.get(timeout=10)
            received += [(u.seq_index, u.new_token_ids) for _, u in batch.outputs] + [("end", k) for k in batch.finished]
        assert received == [(0, [1]), (1, [2]), (1, [3, 4]), ("end", 1)]
        assert loop.num_in_flight() == 0
    finally:
        loop.stop()


def test_sessions_with_requests_in_flight_hear_from_the_loop_while_it_steps_with_nothing_for_them():
    """A queued request or a beam search has no outputs for a long time; the gateway must not take
    the scheduler for hung (it gives up on a session that is silent for --backend-timeout)."""
    engine = ScriptedEngine([[] for _ in range(30)] + [[update(0, [1], "length")]])
    engine.on_step = lambda left: time.sleep(0.1)  # 3 s of steps with no outputs for this request
    loop = EngineLoop(engine)
    try:
        session, idle = opened(loop), opened(loop)
        loop.submit(session, 1, EngineRequest("x", [1, 2], SamplingParams(max_tokens=4)))
        arrivals = []
        while True:
            batch = session._queue.get(timeout=10)
            arrivals.append(time.monotonic())
            if batch.finished:
                break
            assert not batch.outputs and not batch.errors
        gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
        assert len(arrivals) >= 3 and max(gaps) < 2.0, gaps
        assert idle._queue.empty()  # a session with nothing in flight gets no heartbeats
    finally:
        loop.stop()


class StalledEngine(ScriptedEngine):
    """Work waits but nothing can ever be scheduled (a scheduler bug, if it ever happens)."""

    def __init__(self):
        super().__init__([])
        self.attempts = 0

    def has_unfinished(self) -> bool:
        return self.admitted

    def start_step(self) -> bool:
        self.attempts += 1
        return False

    def abort_request(self, request_id: str) -> None:
        self.admitted = False


def test_a_stalled_engine_does_not_spin_and_still_answers_its_inbox():
    engine = StalledEngine()
    loop = EngineLoop(engine, idle_wait_s=0.05)
    try:
        session = opened(loop)
        loop.submit(session, 1, EngineRequest("x", [1, 2], SamplingParams(max_tokens=4)))
        time.sleep(0.5)
        assert engine.attempts < 30, engine.attempts  # spinning made over half a million
        started = time.monotonic()
        loop.abort_soon(session, 1)
        assert drain(session, {1}).finished == [1]
        assert time.monotonic() - started < 10.0  # answered between attempts (0.05 s apart), not after a backoff
    finally:
        loop.stop()


def test_stopping_ends_every_open_session():
    engine, _ = make_engine(num_blocks=32)
    loop = EngineLoop(engine)
    idle = opened(loop)
    loop.stop()
    assert list(idle) == []  # ended, not left waiting
    with pytest.raises(ServiceUnavailable):
        loop.open_session(Session())


def test_session_events_keep_every_output_in_order_through_the_wire():
    """Token-only updates travel as columns, the others whole; the gateway reads them back in order."""
    import random

    from services.gateway.scheduler_session import step_outputs
    from services.scheduler.sequence import SequenceUpdate
    from shared.proto import pagedserve_internal_pb2 as wire
    from shared.step_protocol import PositionLogprobs

    class Seq:
        request, index, output_token_ids, num_cached_tokens = types.SimpleNamespace(request_id="r"), 0, (), None

    rng = random.Random()
    for _ in range(50):
        outputs = []
        for key in rng.sample(range(1000), rng.randrange(0, 30)):
            update = SequenceUpdate(Seq(), rng.randrange(4))
            update.new_token_ids = [rng.randrange(32000) for _ in range(rng.choice([0, 1, 1, 2]))]
            kind = rng.random()
            if kind < 0.15:
                update.finish_reason, update.stop_reason = "stop", rng.choice([2, "END"])
            elif kind < 0.3:
                update.new_logprobs = [PositionLogprobs(t, -0.5, 1, [t], [-0.5]) for t in update.new_token_ids]
            elif kind < 0.4:  # a first output, after prefix-cache hits
                update.num_cached_tokens = rng.choice([16, 48])
            outputs.append((key, update))
        message = wire.SessionEvents.FromString(SessionBatch(outputs=outputs).to_proto().SerializeToString())
        got = [(key, out.seq_index, list(out.new_token_ids), out.finish_reason or None, len(out.new_logprobs),
                out.num_cached_tokens) for key, out in step_outputs(message)]
        assert got == [(key, u.seq_index, u.new_token_ids, u.finish_reason, len(u.new_logprobs), u.num_cached_tokens)
                       for key, u in outputs]


def test_malformed_session_events_are_refused():
    from services.gateway.scheduler_session import step_outputs
    from shared.proto import pagedserve_internal_pb2 as wire

    message = wire.SessionEvents()
    message.tokens.keys.extend([1, 2])
    message.tokens.seq_indexes.extend([0, 0])
    message.tokens.num_tokens.extend([1, 1])
    message.tokens.token_ids.extend([5])  # one token short
    with pytest.raises(ValueError, match="malformed session events"):
        list(step_outputs(message))


def test_a_session_broken_with_any_status_fails_its_requests_as_unavailable():
    """INTERNAL from the transport (e.g. 'Internal error from Core') was a RuntimeError: a bare 500."""
    import asyncio

    from services.gateway.scheduler_session import Session as GatewaySession
    from shared.proto import pagedserve_internal_pb2 as wire

    class BrokenCall:
        async def read(self):
            await asyncio.sleep(0.01)
            raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                       details="Internal error from Core")

        def cancel(self):
            pass

    class Stub:
        def Session(self, requests):
            return BrokenCall()

    async def main():
        session = GatewaySession(Stub(), "unix:/nowhere", idle_timeout_s=60)
        stream = session.submit(wire.EngineRequest(request_id="r", prompt_token_ids=[1]))
        with pytest.raises(ServiceUnavailable, match="Internal error from Core"):
            await anext(stream)
        assert session.closed
        await session.close()

    asyncio.run(main())


def test_a_submission_queued_when_the_engine_fails_is_lost_with_its_session_not_refused():
    """Submitted while the step in which the worker dies runs: the scheduler was serving, so the
    gateway must see the session fail (and resume it), not an admission refusal (a 503)."""
    import threading

    engine, _ = make_engine(num_blocks=64, max_model_len=256)
    executor = engine.executor
    in_step, die = threading.Event(), threading.Event()
    real_wait = executor.wait
    steps = itertools.count()

    # The first step's result comes back; the second step is the one the worker dies in. (Dying
    # only once the test had seen a batch raced the loop: the fake worker can finish all 200
    # tokens before the test thread runs again.)
    def wait():
        if next(steps) >= 1:
            in_step.set()
            die.wait(5)
            raise ConnectionError("the worker died")
        return real_wait()

    executor.wait = wait
    loop = EngineLoop(engine)
    session = Session()
    loop.open_session(session)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    loop.submit(session, 1, EngineRequest("running", [1, 2, 3], params))
    batches = iter(session)
    next(batches)  # it runs
    assert in_step.wait(5)
    loop.submit(session, 2, EngineRequest("arrived-during-the-step", [4, 5, 6], params))
    die.set()
    seen: list = []
    with pytest.raises(ServiceUnavailable, match="the worker died"):
        for batch in batches:
            seen.append(batch)
    assert not [e for batch in seen for e in batch.errors]
    loop.stop()



def test_a_hung_scheduler_s_session_fails_its_requests_and_resumes_only_those_it_had_seen():
    """A session the scheduler never takes fails its requests at the open timeout (not resumable:
    nothing had them); one that goes silent after taking them is lost for the requests sent before
    its last word, and only refuses those sent after it."""
    import asyncio

    from services.gateway.scheduler_session import Session as GatewaySession
    from services.gateway.scheduler_session import SessionLost
    from shared.proto import pagedserve_internal_pb2 as wire

    class SilentCall:
        def __init__(self, opens: bool):
            self.opens, self.cancelled = opens, asyncio.Event()

        async def read(self):
            if self.opens:
                self.opens = False
                await asyncio.sleep(0.05)
                return wire.SessionEvents()  # the first message: the session is taken
            await self.cancelled.wait()
            raise grpc.aio.AioRpcError(grpc.StatusCode.CANCELLED, grpc.aio.Metadata(), grpc.aio.Metadata())

        def cancel(self):
            self.cancelled.set()

    class Stub:
        def __init__(self, opens: bool):
            self.opens = opens

        def Session(self, requests):
            return SilentCall(self.opens)

    async def failure(stream) -> BaseException:
        with pytest.raises(ServiceUnavailable) as failed:
            await anext(stream)
        return failed.value

    async def main():
        never = GatewaySession(Stub(opens=False), "unix:/hung", idle_timeout_s=0.4)
        started = asyncio.get_running_loop().time()
        error = await failure(never.submit(wire.EngineRequest(request_id="a", prompt_token_ids=[1])))
        assert type(error) is ServiceUnavailable and "did not take the session within 0.4 s" in str(error)
        assert asyncio.get_running_loop().time() - started < 2
        quiet = GatewaySession(Stub(opens=True), "unix:/hung", idle_timeout_s=0.4)
        seen = quiet.submit(wire.EngineRequest(request_id="seen", prompt_token_ids=[1]))
        await asyncio.sleep(0.2)  # the scheduler has spoken since "seen" was sent, and not since "unseen"
        unseen = quiet.submit(wire.EngineRequest(request_id="unseen", prompt_token_ids=[1]))
        assert isinstance(await failure(seen), SessionLost)
        assert type(await failure(unseen)) is ServiceUnavailable
        for session in (never, quiet):
            await session.close()

    asyncio.run(main())


def test_every_session_hears_exactly_what_the_prefix_caches_hold():
    """A session opened first and one opened midway (a snapshot, then changes) both end up with the caches'
    keys, counted per cache, through device evictions into the host tier and loads back."""
    from collections import Counter

    from services.gateway.prefix_routing import PrefixIndex
    from tests.scheduler.test_host_tier import chat_engine, tokens

    engine, _ = chat_engine(tier_blocks=12)  # a small tier: it evicts as well
    loop = EngineLoop(engine)
    heard = {}
    try:
        early = opened(loop)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        for key in range(1, 7):
            loop.submit(early, key, EngineRequest(f"r{key}", tokens(key % 3, 30 + key), params))
        received = [drain(early, set(range(1, 7)))]
        for key in range(7, 13):
            loop.submit(early, key, EngineRequest(f"r{key}", tokens(key % 4, 40 + key), params))
            if key == 8:
                late = opened(loop)  # (while steps run: changes are pending when its snapshot is taken)
        received.append(drain(early, set(range(7, 13))))
    finally:
        loop.stop()
    for name, session, batches in (("early", early, received), ("late", late, [])):
        index = PrefixIndex()
        for batch in [*batches, *session]:
            index.apply(batch.to_proto())
        heard[name] = index._counts
    held = Counter(engine.scheduler.blocks.cached_keys())
    assert engine.get_stats()["kv_offload_blocks_stored"] > 0 and engine.get_stats()["host_cache_hits"] > 0
    assert heard["early"] == dict(held) == heard["late"] and held
