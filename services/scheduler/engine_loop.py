"""Runs the engine core on its own thread; other threads talk to it through an inbox.

The engine is not thread-safe and need not be: only the loop thread touches it.
Callers submit a request (admission errors come back at once), then read the
request's updates from its RequestStream; abort and stats go through the inbox too.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

from services.scheduler.engine_core import EngineCore
from services.scheduler.sequence import SequenceUpdate
from shared.grpc_errors import ServiceUnavailable
from shared.logging import setup_logging
from shared.sampling_params import SamplingParams

log = setup_logging("scheduler")
_END = object()


class RequestStream:
    """The updates of one request, in order; iteration ends when every sequence has finished."""

    def __init__(self, request_id: str, num_seqs: int):
        self.request_id = request_id
        self._pending = num_seqs
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, update: SequenceUpdate) -> bool:
        """Deliver an update; True when it was the request's last."""
        self._queue.put(update)
        if update.finish_reason is not None:
            self._pending -= 1
        if self._pending == 0:
            self._queue.put(_END)
            return True
        return False

    def fail(self, error: Exception) -> None:
        self._queue.put(error)

    def close(self) -> None:
        """End the stream early (the request was aborted)."""
        self._queue.put(_END)

    def __iter__(self):
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, Exception):
                raise item
            yield item


class EngineLoop:
    def __init__(self, engine: EngineCore, idle_wait_s: float = 0.05):
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stopping = threading.Event()
        self._failed: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # --- called from any thread ---------------------------------------------------------------------

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        return self._call(self._add, request_id, prompt_token_ids, params)

    def abort(self, request_id: str) -> bool:
        return self._call(self._abort, request_id)

    def stats(self) -> dict:
        return self._call(self.engine.get_stats)

    @property
    def healthy(self) -> bool:
        return self._failed is None and not self._stopping.is_set()

    def num_in_flight(self) -> int:
        return len(self._streams)

    def stop(self) -> None:
        self._stopping.set()
        self._inbox.put(None)
        self._thread.join(timeout=30)

    def _call(self, fn, *args):
        if self._failed is not None:
            raise ServiceUnavailable(f"the engine has stopped: {self._failed}")
        if self._stopping.is_set():
            raise ServiceUnavailable("the scheduler is shutting down")
        future: Future = Future()
        self._inbox.put((future, fn, args))
        return future.result(timeout=60)

    # --- the loop thread ------------------------------------------------------------------------------

    def _add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> RequestStream:
        self.engine.add_request(request_id, prompt_token_ids, params)
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        return stream

    def _abort(self, request_id: str) -> bool:
        stream = self._streams.pop(request_id, None)
        self.engine.abort_request(request_id)
        if stream is not None:
            stream.close()
        return stream is not None

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._drain_inbox(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    self._dispatch(self.engine.step())
        except Exception as exc:  # a worker died or a bug: fail every request rather than hang them
            log.exception("engine loop failed")
            self._failed = exc
            for stream in self._streams.values():
                stream.fail(ServiceUnavailable(f"the engine failed: {exc}"))
            self._streams.clear()
            self._fail_inbox(exc)
        finally:
            self.engine.shutdown()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=self.idle_wait_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            future, fn, args = item
            try:
                future.set_result(fn(*args))
            except Exception as exc:  # goes back to the caller, e.g. a ValueError at admission
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
            if item is not None:
                item[0].set_exception(ServiceUnavailable(f"the engine failed: {exc}"))

    def _dispatch(self, updates: list[SequenceUpdate]) -> None:
        for update in updates:
            stream = self._streams.get(update.request_id)
            if stream is not None and stream.put(update):
                del self._streams[update.request_id]
