"""Runs the engine core on its own thread; other threads talk to it through an inbox.

The engine is not thread-safe and need not be: only the loop thread touches it.
Gateways' Session streams submit requests and aborts without waiting (a refusal comes back
on the session); each step's outputs go to the sessions as one batch per session. Stats and
the Abort RPC wait for their answer.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass

from services.scheduler.engine_core import EngineCore
from services.scheduler.sequence import SequenceUpdate
from services.scheduler.session import RequestError, Session, SessionBatch
from shared.grpc_errors import ServiceUnavailable, status_for
from shared.logging import setup_logging
from shared.sampling_params import SamplingParams

log = setup_logging("scheduler")


@dataclass
class _InFlight:
    session: Session
    unfinished: int  # sequences that have not finished yet


class EngineLoop:
    def __init__(self, engine: EngineCore, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._requests: dict[str, _InFlight] = {}
        self._stopping = threading.Event()
        self._failed: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from any thread ---------------------------------------------------------------------

    def submit(self, session: Session, request_id: str, prompt_token_ids: list[int],
               params: SamplingParams) -> None:
        """Queue a request for admission; a refusal arrives on the session as a RequestError."""
        self._post(None, self._add, session, request_id, prompt_token_ids, params)

    def abort_soon(self, request_id: str) -> None:
        """Abort without waiting (a session's abort message)."""
        self._post(None, self._abort, request_id)

    def close_session(self, session: Session) -> None:
        """The gateway went away: abort its requests and end its stream."""
        try:
            self._post(None, self._close_session, session)
        except ServiceUnavailable:
            session.end()

    def abort(self, request_id: str) -> bool:
        return self._call(self._abort, request_id)

    def stats(self) -> dict:
        return self._call(self.engine.get_stats)

    @property
    def healthy(self) -> bool:
        return self._failed is None and not self._stopping.is_set()

    def num_in_flight(self) -> int:
        return len(self._requests)

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _call(self, fn, *args):
        future: Future = Future()
        self._post(future, fn, *args)
        return future.result(timeout=60)

    def _post(self, future: Future | None, fn, *args) -> None:
        if self._failed is not None:
            raise ServiceUnavailable(f"the engine has stopped: {self._failed}")
        if self._stopping.is_set():
            raise ServiceUnavailable("the scheduler is shutting down")
        self._inbox.put((future, fn, args))

    # --- the loop thread ------------------------------------------------------------------------------

    def _add(self, session: Session, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        try:
            self.engine.add_request(request_id, prompt_token_ids, params)
        except Exception as exc:  # refused at admission: tell the gateway, keep serving
            session.put(SessionBatch(errors=[RequestError(request_id, status_for(exc), str(exc))]))
            return
        self._requests[request_id] = _InFlight(session, params.n)
        session.request_ids.add(request_id)
        log.info("request admitted", request_id=request_id, prompt_tokens=len(prompt_token_ids), n=params.n)

    def _abort(self, request_id: str) -> bool:
        self.engine.abort_request(request_id)
        entry = self._requests.pop(request_id, None)
        if entry is None:
            return False
        entry.session.request_ids.discard(request_id)
        entry.session.put(SessionBatch(finished_request_ids=[request_id]))
        log.info("request aborted", request_id=request_id)
        return True

    def _close_session(self, session: Session) -> None:
        for request_id in list(session.request_ids):
            self.engine.abort_request(request_id)
            self._requests.pop(request_id, None)
            log.info("request aborted: its gateway stream closed", request_id=request_id)
        session.request_ids.clear()
        session.end()

    def _run(self) -> None:
        # The next plan goes to the worker before this step's tokens go out to the streams, so the
        # worker computes while the request threads serialise and send (they need the GIL too).
        in_flight = None
        try:
            while not self._stopping.is_set():
                updates = self.engine.finish_step(in_flight) if in_flight is not None else []
                in_flight = None
                self._drain_inbox(block=not updates and not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    in_flight = self.engine.start_step()
                self._dispatch(updates)
        except Exception as exc:  # a worker died or a bug: fail every request rather than hang them
            log.exception("engine loop failed")
            self._failed = exc
            for session in {entry.session for entry in self._requests.values()}:
                session.fail(ServiceUnavailable(f"the engine failed: {exc}"))
            self._requests.clear()
            self._fail_inbox(exc)
        finally:
            self._shutdown_engine(in_flight)

    def _shutdown_engine(self, in_flight) -> None:
        try:
            if in_flight is not None:  # its result must be read before anything else is sent
                self.engine.finish_step(in_flight)
        except Exception:  # the worker is gone; there is nothing left to tell it
            log.warning("the step in flight at shutdown did not finish")
            return
        self.engine.shutdown()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            future, fn, args = item
            try:
                result = fn(*args)
                if future is not None:
                    future.set_result(result)
            except Exception as exc:  # goes back to the caller
                if future is None:
                    raise
                future.set_exception(exc)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _fail_inbox(self, exc: Exception) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            future, fn, args = item
            if future is not None:
                future.set_exception(ServiceUnavailable(f"the engine failed: {exc}"))
            elif fn == self._add:  # a submission that never got in: refuse it on its session
                session, request_id = args[0], args[1]
                session.put(SessionBatch(errors=[RequestError(request_id, status_for(ServiceUnavailable()),
                                                              f"the engine failed: {exc}")]))

    def _dispatch(self, updates: list[SequenceUpdate]) -> None:
        """One batch per session with this step's outputs and the requests that ended."""
        batches: dict[Session, SessionBatch] = {}
        for update in updates:
            entry = self._requests.get(update.request_id)
            if entry is None:  # aborted while the step ran
                continue
            batch = batches.setdefault(entry.session, SessionBatch())
            batch.outputs.append(update)
            if update.finish_reason is not None:
                entry.unfinished -= 1
                if entry.unfinished == 0:
                    del self._requests[update.request_id]
                    entry.session.request_ids.discard(update.request_id)
                    batch.finished_request_ids.append(update.request_id)
                    log.info("request finished", request_id=update.request_id)
        for session, batch in batches.items():
            session.put(batch)
