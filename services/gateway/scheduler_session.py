"""The Session stream to a scheduler: all of a gateway's requests to it share one bidirectional stream.
Submissions, aborts and stopped sequences go up it; each engine step comes down as one message holding
every new output, which a reader task hands to the request it belongs to (its SubmitStream). When the
scheduler sends nothing on the session for `idle_timeout_s` while requests are in flight, they are all
abandoned with ServiceUnavailable (a hung scheduler; a request merely waiting in a long queue behind
others that progress, or a beam search, is not abandoned: while its engine steps, the scheduler sends a
session with requests in flight a message every second).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque

import grpc

from services.gateway.prefix_routing import PrefixIndex
from shared.columns import merge_by_position
from shared.grpc_errors import ServiceUnavailable, error_for_code, status_from_int
from shared.logging import setup_logging
from shared.proto import pagedserve_internal_pb2 as wire
from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc

log = setup_logging("gateway")

_END = object()  # the request ended: no more outputs
# A scheduler takes a session at once (its first message); one that has not within this long (or
# the backend timeout, if shorter) is taken for hung, and the session's requests fail.
SESSION_OPEN_TIMEOUT_S = 10.0


class SessionLost(ServiceUnavailable):
    """The Session stream broke, or was abandoned as hung, with the request still running: its
    scheduler (or that scheduler's engine) may be gone, and the request may be resumed elsewhere.
    A refusal at admission, or a request this gateway gave up on itself, is not this."""

    def __init__(self, message: str, address: str):
        super().__init__(message)
        self.address = address  # the scheduler that was lost


class TokenOutput:
    """An output that is only new tokens (an entry of SessionEvents' token columns), read like the
    EngineOutput message that carries any other output."""
    __slots__ = ("seq_index", "new_token_ids")
    new_logprobs = prompt_logprobs = ()
    finish_reason = ""
    num_cached_tokens = 0

    def __init__(self, seq_index: int, new_token_ids: list[int]):
        self.seq_index, self.new_token_ids = seq_index, new_token_ids


def step_outputs(events: wire.SessionEvents) -> list[tuple[int, wire.EngineOutput | TokenOutput]]:
    """(key, output) for every output of a SessionEvents, in step order: a TokenOutput for a column
    entry, the EngineOutput itself for a detailed one."""
    columns = events.tokens
    keys, seq_indexes, num_tokens = list(columns.keys), list(columns.seq_indexes), list(columns.num_tokens)
    token_ids = list(columns.token_ids)
    if len(seq_indexes) != len(keys) or len(num_tokens) != len(keys) or sum(num_tokens) != len(token_ids):
        raise ValueError("malformed session events: the output columns do not line up")
    plain, start = [], 0
    for key, seq_index, count in zip(keys, seq_indexes, num_tokens):
        plain.append((key, TokenOutput(seq_index, token_ids[start:start + count])))
        start += count
    return merge_by_position(plain, [(output.key, output) for output in events.detailed],
                             list(events.detailed_positions), "session events")


class SubmitStream:
    """One request's outputs (EngineOutput or TokenOutput); cancel() (or leaving early) aborts it.

    Its own small queue (a deque and at most one waiting future) rather than an asyncio.Queue:
    every streamed token passes through here, and the reader is the only producer."""

    def __init__(self, session: Session, key: int, submitted_at: float = 0.0):
        self._session = session
        self._key = key
        self.submitted_at = submitted_at  # (the event loop's clock)
        self._items: deque = deque()
        self._waiter: asyncio.Future | None = None
        self._ended = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> wire.EngineOutput | TokenOutput:
        if self._ended:
            raise StopAsyncIteration
        while not self._items:  # a silent scheduler is the session's watchdog's business
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, Exception):
            self._ended = True
            raise item
        return item

    def deliver(self, item) -> None:
        """From the session's reader: an EngineOutput, _END, or the error that ends the request."""
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def stop_sequence(self, seq_index: int, stop: str) -> None:
        """End one sequence at the scheduler (its text hit a stop string); its siblings run on."""
        if not self._ended:
            self._session.stop_sequence(self._key, seq_index, stop)

    def cancel(self) -> None:
        """Abort the request at the scheduler (its blocks are free at the next step); no-op once ended."""
        if not self._ended:
            self._ended = True
            self._session.abort(self._key)

    def abort(self) -> None:
        """Abort the request at the scheduler and keep listening: its end comes back on this stream,
        so the reader sees the sequences end as aborted (an Abort RPC) rather than a cancelled stream."""
        if not self._ended:
            self._session.send_abort(self._key)


class Session:
    """The Session stream: one writer queue, one reader task that routes outputs to their requests.

    Requests are known on the stream by a key this session hands out (client request ids may
    repeat; keys never do). A scheduler that sends nothing for idle_timeout_s while requests are
    in flight is taken for hung: the session ends and every one of them fails with 503 (one
    watchdog per session rather than a timer per token: the token path is the gateway's hot path)."""

    def __init__(self, stub: wire_grpc.SchedulerStub, address: str, idle_timeout_s: float):
        self.address = address
        self._outgoing: asyncio.Queue = asyncio.Queue()
        self._streams: dict[int, SubmitStream] = {}
        self._keys = itertools.count(1)
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._last_heard = self._loop.time()  # the last message, or when requests were first in flight
        self._failure: Exception | None = None  # why the session ended, when this side ended it
        self._opened = False  # the scheduler took the session (its first message came)
        self._last_message_at = float("-inf")  # when the scheduler last sent anything
        self._silenced = False  # abandoned by the watchdog: the scheduler went silent
        self.prefix_index = PrefixIndex()  # what the scheduler's prefix caches hold, as it tells this session
        self._call = stub.Session(self._requests())
        self._reader = self._loop.create_task(self._read())
        self._watchdog = self._loop.create_task(self._watch(idle_timeout_s))

    async def _requests(self):
        while True:
            message = await self._outgoing.get()
            if message is None:
                return
            yield message

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def submit(self, request: wire.EngineRequest) -> SubmitStream:
        key = next(self._keys)
        stream = SubmitStream(self, key, self._loop.time())
        if not self._streams:
            self._last_heard = self._loop.time()  # silence while nothing was asked for does not count
        self._streams[key] = stream
        self._outgoing.put_nowait(wire.SessionRequest(submit=wire.SessionSubmit(key=key, request=request)))
        return stream

    def abort(self, key: int) -> None:
        """Abort a request and stop listening to it."""
        self.send_abort(key)
        self._streams.pop(key, None)

    def send_abort(self, key: int) -> None:
        """Abort a request; its stream stays to hear that it ended."""
        if key in self._streams and not self.closed:
            self._outgoing.put_nowait(wire.SessionRequest(abort=key))

    def stop_sequence(self, key: int, seq_index: int, stop: str) -> None:
        if key in self._streams and not self.closed:
            stop_sequence = wire.SessionStopSequence(key=key, seq_index=seq_index, stop_string=stop)
            self._outgoing.put_nowait(wire.SessionRequest(stop_sequence=stop_sequence))

    def _lost(self, message: str) -> ServiceUnavailable:
        """Why the requests of a session that ended failed: lost in flight once the scheduler had
        taken the session, refused before."""
        return SessionLost(message, self.address) if self._opened else ServiceUnavailable(message)

    async def _read(self) -> None:
        error: Exception | None = None
        try:
            while (events := await self._call.read()) is not grpc.aio.EOF:
                self._last_heard = self._last_message_at = self._loop.time()
                self._opened = True
                self._route(events)
            error = self._lost(f"the scheduler at {self.address} closed the session")
        except grpc.aio.AioRpcError as exc:  # whatever its code, a broken session means the scheduler is not there
            error = self._lost(f"the scheduler at {self.address} is unavailable: {exc.details()}")
        except Exception as exc:  # a bug here must not leave requests waiting or running unseen
            log.exception("scheduler session reader failed")
            error = self._lost(f"the session with the scheduler at {self.address} failed: {exc}")
        finally:
            self.closed = True
            self.prefix_index.clear()
            self._call.cancel()  # the scheduler aborts whatever this session still has running
            self._watchdog.cancel()
            failure = self._failure or error or self._lost(f"the session with the scheduler at {self.address} closed")
            for stream in self._streams.values():
                # Gone silent: a request sent since it last spoke was never seen taken (not resumed).
                unseen = self._silenced and stream.submitted_at > self._last_message_at
                stream.deliver(ServiceUnavailable(str(failure)) if unseen else failure)
            self._streams.clear()

    async def _watch(self, idle_timeout_s: float) -> None:
        open_timeout_s = min(idle_timeout_s, SESSION_OPEN_TIMEOUT_S)
        while not self.closed:
            await asyncio.sleep(max(0.05, min(1.0, open_timeout_s / 4)))
            silent = self._loop.time() - self._last_heard
            if self._streams and not self._opened and silent > open_timeout_s:
                log.warning("scheduler did not take the session: failing its requests", requests=len(self._streams))
                self.abandon(ServiceUnavailable(f"the scheduler at {self.address} did not take the session within "
                                                f"{open_timeout_s:g} s"))
                return
            if self._streams and silent > idle_timeout_s:
                log.warning("scheduler session silent: abandoning its requests", requests=len(self._streams))
                self._silenced = True
                self.abandon(self._lost(
                    f"the scheduler at {self.address} sent nothing for {silent:.0f} s; its requests were abandoned"))
                return

    def abandon(self, error: Exception) -> None:
        """Fail every request of this session with error and end it (the scheduler aborts them)."""
        if not self.closed:
            self._failure = error
            self.closed = True  # no new request joins it from now on
            self._call.cancel()  # the reader ends and fails every request with the error

    def _route(self, events: wire.SessionEvents) -> None:
        if events.cache_snapshot or events.cache_added or events.cache_removed:
            self.prefix_index.apply(events)
        for key, output in step_outputs(events):
            stream = self._streams.get(key)
            if stream is not None:
                stream.deliver(output)
        for key in events.finished:
            stream = self._streams.pop(key, None)
            if stream is not None:
                stream.deliver(_END)
        for refused in events.errors:
            stream = self._streams.pop(refused.key, None)
            if stream is not None:
                stream.deliver(error_for_code(status_from_int(refused.code), refused.message))

    async def close(self) -> None:
        self._outgoing.put_nowait(None)
        self._call.cancel()
        self._reader.cancel()
        self._watchdog.cancel()
