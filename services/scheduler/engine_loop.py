"""Runs the engine core on its own thread; other threads talk to it through an inbox.

The engine is not thread-safe and need not be: only the loop thread touches it.
Gateways' Session streams submit requests and aborts without waiting (a refusal comes back
on the session); each step's outputs go to the sessions as one batch per session. Stats and
the Abort RPC wait for their answer. Every request is known by its id to the engine and by its
session key to its gateway.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

import grpc

from services.scheduler.engine_core import EngineCore
from services.scheduler.sequence import SequenceUpdate
from services.scheduler.session import RequestError, Session, SessionBatch
from shared.grpc_errors import ServiceUnavailable
from shared.logging import setup_logging
from shared.request import EngineRequest

log = setup_logging("scheduler")


# While the engine steps, every session with requests in flight hears from the loop at least this
# often, outputs or not: a gateway takes a silent scheduler for hung (--backend-timeout), and a
# request queued behind others, or a beam search (whose beams come at its end), has nothing to say.
HEARTBEAT_S = 1.0


@dataclass(slots=True)
class _Submission:
    """A request on its way to admission, from a session's stream (refused on it if the loop stops first)."""
    session: Session
    key: int  # the request's key in its session
    request: EngineRequest


@dataclass
class _InFlight:
    session: Session
    key: int  # the request's key in its session
    unfinished: int  # sequences that have not finished yet


class EngineLoop:
    def __init__(self, engine: EngineCore, idle_wait_s: float = 0.05, async_scheduling: bool = True):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self.async_scheduling = async_scheduling  # plan step N+1 while the worker computes step N
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _InFlight] = {}  # by request id; loop thread only
        # What this turn of the loop sends each session, once the inbox is read: a request that an
        # inbox message ends (an abort, its last sequence stopped) ends after this step's outputs.
        self._outgoing: dict[Session, SessionBatch] = {}  # loop thread only
        self._sessions: set[Session] = set()  # open sessions, ended or failed when the loop exits
        # What the prefix caches index and unindex, for the gateways' routing (None: no prefix caching), and
        # the sessions told so far (after a snapshot each). Loop thread only.
        self._cache_digest = engine.publish_cache()
        self._cache_subscribers: set[Session] = set()
        self._lock = threading.Lock()  # orders posting against the loop's exit (nothing is posted after it)
        self._stopping = threading.Event()
        self._failed: Exception | None = None
        self._closed = False
        self._last_step_done = time.monotonic()  # when a step last came back (or started from idle)
        self._last_heartbeat = time.monotonic()
        self._stalled_turns = 0  # turns in a row that found work waiting but nothing to run
        # Set (by the health poll) while the worker is known dead or hung: why new requests are refused
        # at once with UNAVAILABLE, rather than queued behind a step that may never come back.
        self.refusing: str | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from any thread ---------------------------------------------------------------------

    def open_session(self, session: Session) -> None:
        with self._lock:
            self._check_open()
            self._sessions.add(session)
        if self._cache_digest is not None:
            self._post(None, self._send_cache_snapshot, session)

    def submit(self, session: Session, key: int, request: EngineRequest) -> None:
        """Queue a request for admission; a refusal arrives on the session as a RequestError."""
        if self.refusing is not None:
            session.refuse(key, ServiceUnavailable(self.refusing))
            return
        self._put(_Submission(session, key, request))

    def abort_soon(self, session: Session, key: int) -> None:
        """Abort one of the session's own requests, without waiting (a session's abort message)."""
        self._post(None, self._abort_key, session, key)

    def stop_sequence_soon(self, session: Session, key: int, seq_index: int, stop: str) -> None:
        """End one sequence of the session's request by a stop string, without waiting."""
        self._post(None, self._stop_sequence, session, key, seq_index, stop)

    def close_session(self, session: Session) -> None:
        """The gateway went away: abort its requests and end its stream. Safe to call twice (the
        stream's callback and its reader both do: whichever runs last also catches a submission
        that the reader queued after the first close)."""
        try:
            self._post(None, self._close_session, session)
        except ServiceUnavailable:
            session.end()

    def fail_if_idle(self, reason: str) -> None:
        """The worker went away while nothing ran: end this loop now (no request is lost), so the
        scheduler builds a fresh engine as soon as a worker answers, rather than the next request
        finding the old engine's broken stream."""
        try:
            self._post(None, self._fail_if_idle, reason)
        except ServiceUnavailable:
            pass  # failed or stopping already

    def abort(self, request_id: str) -> bool:
        return self._call(self._abort, request_id)

    def stats(self) -> dict:
        return self._call(self.engine.get_stats)

    @property
    def healthy(self) -> bool:
        return self._failed is None and not self._stopping.is_set()

    @property
    def failed(self) -> bool:
        """The loop died (its worker went away, or a bug): every request was failed, the worker let go."""
        return self._failed is not None

    def num_in_flight(self) -> int:
        return len(self._requests)

    def seconds_since_last_step(self) -> float:
        return time.monotonic() - self._last_step_done

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _call(self, fn, *args):
        future: Future = Future()
        self._post(future, fn, *args)
        return future.result(timeout=60)

    def _post(self, future: Future | None, fn, *args) -> None:
        self._put((future, fn, args))

    def _put(self, item: _Submission | tuple) -> None:
        """Into the inbox: a submission, or (future or None, a function the loop thread calls, its args)."""
        with self._lock:
            self._check_open()
            self._inbox.put(item)

    def _check_open(self) -> None:
        if self._failed is not None:
            raise ServiceUnavailable(f"the engine has stopped: {self._failed}")
        if self._stopping.is_set() or self._closed:
            raise ServiceUnavailable("the scheduler is shutting down")

    # --- the loop thread ------------------------------------------------------------------------------

    def _add(self, submission: _Submission) -> None:
        session, key, request = submission.session, submission.key, submission.request
        try:
            num_seqs = self.engine.add_request(request)
        except Exception as exc:  # refused at admission: tell the gateway, keep serving
            session.refuse(key, exc)
            return
        request_id, prompt_tokens = request.request_id, len(request.prompt_token_ids)
        self._requests[request_id] = _InFlight(session, key, num_seqs)
        session.requests[key] = request_id
        if request.pooling is not None:
            log.info("embedding request admitted", request_id=request_id, prompt_tokens=prompt_tokens)
        elif request.resumption is None:
            log.info("request admitted", request_id=request_id, prompt_tokens=prompt_tokens, n=request.params.n)
        else:
            log.info("request resumed", request_id=request_id, prompt_tokens=prompt_tokens,
                     output_tokens={i: len(t) for i, t in request.resumption.outputs.items()})

    def _fail_if_idle(self, reason: str) -> None:
        if not self._requests and not self.engine.num_in_flight:
            raise ServiceUnavailable(reason)  # the loop's own failure path: sessions told, engine shut down

    def _abort_key(self, session: Session, key: int) -> None:
        request_id = session.requests.get(key)
        if request_id is not None:  # else it has ended already
            self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        self.engine.abort_request(request_id)
        entry = self._requests.get(request_id)
        if entry is None:
            return False
        self._end(request_id, entry)
        log.info("request aborted", request_id=request_id)
        return True

    def _stop_sequence(self, session: Session, key: int, seq_index: int, stop: str) -> None:
        request_id = session.requests.get(key)
        if request_id is None or not self.engine.finish_by_stop_string(request_id, seq_index, stop):
            return  # the request or that sequence has ended already
        entry = self._requests[request_id]
        entry.unfinished -= 1
        if entry.unfinished == 0:  # its siblings had ended: the request is done
            self._end(request_id, entry)
            log.info("request finished", request_id=request_id)

    def _end(self, request_id: str, entry: _InFlight) -> None:
        del self._requests[request_id]
        entry.session.requests.pop(entry.key, None)
        self._batch_for(entry.session).finished.append(entry.key)

    def _fail(self, request_id: str, entry: _InFlight, error: str) -> None:
        self.engine.abort_request(request_id)
        del self._requests[request_id]
        entry.session.requests.pop(entry.key, None)
        self._batch_for(entry.session).errors.append(RequestError(entry.key, grpc.StatusCode.INVALID_ARGUMENT, error))
        log.warning("request failed", request_id=request_id, error=error)

    def _batch_for(self, session: Session) -> SessionBatch:
        batch = self._outgoing.get(session)
        if batch is None:
            batch = self._outgoing[session] = SessionBatch()
        return batch

    def _send_cache_snapshot(self, session: Session) -> None:
        """The session's first word on the prefix caches: every key held, after which it gets the changes
        (the ones before the snapshot go to the sessions told before it)."""
        with self._lock:
            if session not in self._sessions:
                return  # closed already
        self._share_cache_changes()
        batch = self._batch_for(session)
        batch.cache_snapshot, batch.cache_added = True, self.engine.cached_keys()
        self._cache_subscribers.add(session)

    def _share_cache_changes(self) -> None:
        if self._cache_digest is None:
            return
        added, removed = self._cache_digest.take()
        if added or removed:
            for session in self._cache_subscribers:
                batch = self._batch_for(session)
                batch.cache_added += added
                batch.cache_removed += removed

    def _close_session(self, session: Session) -> None:
        for request_id in session.requests.values():
            self.engine.abort_request(request_id)
            self._requests.pop(request_id, None)
            log.info("request aborted: its gateway stream closed", request_id=request_id)
        session.requests.clear()
        self._outgoing.pop(session, None)  # nobody reads it any more
        self._cache_subscribers.discard(session)
        session.end()
        with self._lock:
            self._sessions.discard(session)

    def _run(self) -> None:
        # With async scheduling, step N+1 is planned and sent while the worker computes step N,
        # so the worker finds it waiting and never idles on the round trip; when the engine cannot
        # plan ahead (beams, n > 1 forks, blocks short), the next plan waits for step N's result.
        # Either way the next plan goes to the worker before this step's tokens go out to the
        # sessions, so the worker computes while the session threads serialise and send (they need
        # the GIL too). The step's outputs are matched to their requests before the inbox is read,
        # though: an abort or a new request with the same id must not receive them.
        engine = self.engine
        try:
            while not self._stopping.is_set():
                if engine.num_in_flight:
                    if self.async_scheduling and engine.can_plan_ahead():
                        engine.start_step()
                    self._route(engine.finish_step())
                    self._last_step_done = time.monotonic()
                idle = not engine.num_in_flight and (not engine.has_unfinished() or self._stalled_turns >= 2)
                self._drain_inbox(block=not self._outgoing and idle)
                if engine.has_idle_work():  # (with prefill/decode stages: one of them is idle)
                    if not engine.num_in_flight:
                        self._last_step_done = time.monotonic()  # from idle: the wait for a step starts now
                    self._note_stall(started=engine.start_step() or engine.num_in_flight > 0)
                self._send_outgoing()
        except Exception as exc:  # a worker died or a bug: fail every request rather than hang them
            log.exception("engine loop failed")
            self._failed = exc
            self._requests.clear()
        finally:
            self._close_everything()
            self._shutdown_engine()

    def _note_stall(self, started: bool) -> None:
        """Work that waits with nothing runnable should not happen (the scheduler's rule always lets
        the oldest advance); if it does, the loop waits on its inbox instead of spinning a core."""
        if started:
            self._stalled_turns = 0
            return
        self._stalled_turns += 1  # one turn may be a plan of block moves only: the next one runs
        if self._stalled_turns == 2:
            log.warning("requests wait but nothing can be scheduled", stats=self.engine.get_stats())

    def _close_everything(self) -> None:
        """Nothing is posted after this; what was, and every open session, gets its answer."""
        with self._lock:
            self._closed = True
            sessions, self._sessions = self._sessions, set()
        error = ServiceUnavailable(f"the engine failed: {self._failed}" if self._failed is not None
                                   else "the scheduler is shutting down")
        self._fail_inbox(error)
        for session in sessions:
            if self._failed is not None:
                session.fail(error)
            else:
                session.end()

    def _shutdown_engine(self) -> None:
        try:
            while self.engine.num_in_flight:  # their results must be read before anything else is sent
                self.engine.finish_step()
        except Exception:  # the worker is gone (or applying a result failed): nothing more to tell it
            log.warning("a step in flight at shutdown did not finish")
            self.engine.abandon()  # still close the streams: the workers serve the next scheduler
            return
        self.engine.shutdown()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if isinstance(item, _Submission):
                self._add(item)
            else:
                self._run_message(*item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    @staticmethod
    def _run_message(future: Future | None, fn, args) -> None:
        try:
            result = fn(*args)
            if future is not None:
                future.set_result(result)
        except Exception as exc:  # goes back to the caller
            if future is None:
                raise
            future.set_exception(exc)

    def _fail_inbox(self, error: Exception) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, _Submission):
                if self._failed is None:  # stopping: refuse it on its session
                    item.session.refuse(item.key, error)
                # (A submission the failed engine never took is lost with its session, which fails: the
                # gateway then resumes it like the requests the engine held, rather than refusing it.)
            elif item is not None and item[0] is not None:
                item[0].set_exception(error)

    def _route(self, updates: list[SequenceUpdate]) -> None:
        """This step's outputs, and the requests that ended, into each session's outgoing batch."""
        for update in updates:
            entry = self._requests.get(update.request_id)
            if entry is None:  # not in flight any more (the engine drops aborted sequences' outputs; a guard)
                continue
            if update.error is not None:  # the worker could not go on with it: it fails, the others run on
                self._fail(update.request_id, entry, update.error)
                continue
            self._batch_for(entry.session).outputs.append((entry.key, update))
            if update.finish_reason is not None:
                entry.unfinished -= 1
                if entry.unfinished == 0:
                    self._end(update.request_id, entry)
                    log.info("request finished", request_id=update.request_id)

    def _send_outgoing(self) -> None:
        self._share_cache_changes()
        if time.monotonic() - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = time.monotonic()
            with self._lock:
                sessions = list(self._sessions)
            for session in sessions:
                if session.requests:
                    self._batch_for(session)  # an empty batch, if nothing else goes out to it
        outgoing, self._outgoing = self._outgoing, {}
        for session, batch in outgoing.items():
            session.put(batch)
