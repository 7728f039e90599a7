"""The gRPC calls open at this gateway, by request id: what an id's reuse and its Abort must wait on.

A gRPC `request_id` is the engine id itself, and the scheduler refuses one that is still running.

Reuse: a client that cancels a stream and at once sends a new call with the same id expects the
new call to run. grpc.aio may start the new call before the old one has heard of its cancellation
(seen here about once in a hundred immediate reuses), and the old call's abort would then reach the
scheduler after the new submission. So a call whose id belongs to a call still open at this
gateway waits for that call to end (its abort is queued by then) before it submits, for at most
`grace_s`: a genuine duplicate of a running request is then refused by the scheduler as before.

Abort: an Abort sent right behind its Generate may arrive while that call is still tokenizing, or
before its submission reached the scheduler, which then knows no such request. An Abort naming a
call open here is therefore carried by the call itself, on the gateway's Session stream behind its
own submission (or at once after it, when it has not been submitted yet), so it cannot be lost.
gRPC runs a channel's calls concurrently, so the Abort may even overtake the Generate it names
(seen here in 6 of 150 immediate aborts): one that finds the id nowhere waits `arrival_s` for a
call with it to open here.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol


class Abortable(Protocol):
    def abort(self) -> None: ...


class Call:
    """One open call: ended once it is over; aborted by an Abort naming its id."""

    def __init__(self):
        self.ended = asyncio.Event()
        self.aborted = False
        self._run: Abortable | None = None

    def attach(self, run: Abortable) -> None:
        """The call's engine request was submitted: an Abort that came first takes effect now."""
        self._run = run
        if self.aborted:
            run.abort()

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            if self._run is not None:
                self._run.abort()


class CallIds:
    def __init__(self, grace_s: float = 1.0, arrival_s: float = 0.25):
        if grace_s < 0 or arrival_s < 0:
            raise ValueError(f"grace_s and arrival_s must be >= 0, got {grace_s} and {arrival_s}")
        self.grace_s = grace_s
        self.arrival_s = arrival_s
        self._calls: dict[str, Call] = {}  # by request id: the latest call that claimed it
        self._arrivals: dict[str, asyncio.Event] = {}  # by request id: Aborts waiting for its call to open

    @contextlib.asynccontextmanager
    async def claim(self, request_id: str):
        """Hold request_id for the body (a call's whole life), after the call before it with that id ended."""
        earlier = self._calls.get(request_id)
        if earlier is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.grace_s):
                    await earlier.ended.wait()
        call = Call()
        self._calls[request_id] = call  # a duplicate that outlived the grace replaces the entry
        if (arrival := self._arrivals.pop(request_id, None)) is not None:
            arrival.set()
        try:
            yield call
        finally:
            call.ended.set()
            if self._calls.get(request_id) is call:
                del self._calls[request_id]

    def abort(self, request_id: str) -> bool:
        """Abort the open call with this id through its own stream; False if no call here has it."""
        call = self._calls.get(request_id)
        if call is None:
            return False
        call.abort()
        return True

    async def abort_arriving(self, request_id: str) -> bool:
        """Abort the call with this id that opens here within arrival_s; False if none does."""
        if self.abort(request_id):
            return True
        arrival = self._arrivals.setdefault(request_id, asyncio.Event())
        try:
            async with asyncio.timeout(self.arrival_s):
                await arrival.wait()
        except TimeoutError:
            if self._arrivals.get(request_id) is arrival:
                del self._arrivals[request_id]
            return False
        return self.abort(request_id)

    def __len__(self) -> int:
        return len(self._calls)
