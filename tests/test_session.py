"""The scheduler's side of the gateway Session stream: per-session batches from the engine loop."""

from __future__ import annotations

import grpc
import pytest

from services.scheduler.engine_loop import EngineLoop
from services.scheduler.session import RequestError, Session, SessionBatch
from shared.grpc_errors import ServiceUnavailable, error_for_code, status_from_int
from shared.sampling_params import SamplingParams
from tests.test_scheduler import make_engine


def drain(session: Session, request_ids: set[str]) -> SessionBatch:
    """Everything the session receives until every one of request_ids has ended or been refused."""
    seen = SessionBatch()
    for batch in session:
        seen.merge(batch)
        ended = set(seen.finished_request_ids) | {e.request_id for e in seen.errors}
        if request_ids <= ended:
            return seen
    raise AssertionError("the session ended early")


def test_batches_that_queue_up_are_merged():
    session = Session()
    session.put(SessionBatch(finished_request_ids=["a"]))
    session.put(SessionBatch(finished_request_ids=["b"]))
    session.end()
    assert [b.finished_request_ids for b in session] == [["a", "b"]]
    failing = Session()
    failing.put(SessionBatch(finished_request_ids=["c"]))
    failing.fail(ServiceUnavailable("down"))
    batches = iter(failing)
    assert next(batches).finished_request_ids == ["c"]
    with pytest.raises(ServiceUnavailable):
        next(batches)


def test_request_error_travels_as_its_status_number():
    proto = RequestError("r", grpc.StatusCode.INVALID_ARGUMENT, "bad").to_proto()
    error = error_for_code(status_from_int(proto.code), proto.message)
    assert isinstance(error, ValueError) and str(error) == "bad"


def test_each_session_gets_only_its_own_requests():
    engine, _ = make_engine(num_blocks=32)
    loop = EngineLoop(engine)
    try:
        first, second = Session(), Session()
        params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        loop.submit(first, "a", [1, 2, 3], params)
        loop.submit(second, "b", [4, 5], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, n=2))
        loop.submit(second, "bad", [], params)  # refused at admission, on its own session
        got_first, got_second = drain(first, {"a"}), drain(second, {"b", "bad"})
        assert {o.request_id for o in got_first.outputs} == {"a"} and got_first.finished_request_ids == ["a"]
        assert sum(len(o.new_token_ids) for o in got_first.outputs) == 5
        assert {o.request_id for o in got_second.outputs} == {"b"}
        assert sum(len(o.new_token_ids) for o in got_second.outputs) == 6  # two sequences of three
        (refused,) = got_second.errors
        assert refused.request_id == "bad" and refused.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "empty" in refused.message
        assert loop.num_in_flight() == 0
    finally:
        loop.stop()


def test_closing_a_session_aborts_its_requests_and_frees_their_blocks():
    engine, _ = make_engine(num_blocks=256, max_model_len=1024)
    loop = EngineLoop(engine)
    try:
        session, other = Session(), Session()
        long = SamplingParams(temperature=0, max_tokens=900, ignore_eos=True)
        loop.submit(session, "x", list(range(1, 20)), long)
        loop.submit(session, "y", list(range(1, 9)), long)
        loop.close_session(session)  # queued behind the submissions: both are admitted, then aborted
        received = SessionBatch()
        for batch in session:  # the stream ends; whatever a step produced before the close may come first
            received.merge(batch)
        assert not received.errors and not received.finished_request_ids
        loop.submit(other, "z", [1, 2], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
        drain(other, {"z"})
        assert loop.num_in_flight() == 0 and loop.stats()["kv_blocks_used"] == 0
        assert loop.abort("x") is False  # already gone
    finally:
        loop.stop()


def test_abort_ends_the_request_on_its_session():
    engine, _ = make_engine(num_blocks=256, max_model_len=1024)
    loop = EngineLoop(engine)
    try:
        session = Session()
        loop.submit(session, "x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=900, ignore_eos=True))
        assert loop.abort("x") is True  # runs after the submission (one inbox, in order)
        received = drain(session, {"x"})
        assert received.finished_request_ids == ["x"] and not received.errors
        assert loop.stats()["kv_blocks_used"] == 0
    finally:
        loop.stop()
