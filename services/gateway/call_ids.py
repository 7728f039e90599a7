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
        # By request id, oldest first: the calls open with it (a reuse waiting on its predecessor, or
        # a duplicate the scheduler will refuse, besides the call that owns the engine request).
        self._calls: dict[str, list[Call]] = {}
        self._arrivals: dict[str, list[asyncio.Event]] = {}  # by request id: Aborts waiting for its call
        self._ended: dict[str, float] = {}  # by request id: when its last call here ended (within arrival_s)

    @contextlib.asynccontextmanager
    async def claim(self, request_id: str):
        """Hold request_id for the body (a call's whole life), after the call before it with that id ended."""
        calls = self._calls.setdefault(request_id, [])
        earlier = calls[-1] if calls else None
        call = Call()
        calls.append(call)  # an Abort from now on reaches this call too, even while it waits
        for arrival in self._arrivals.pop(request_id, ()):
            arrival.set()
        try:
            if earlier is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.grace_s):
                        await earlier.ended.wait()
            yield call
        finally:
            call.ended.set()
            calls.remove(call)
            if not calls:
                del self._calls[request_id]
            self._note_end(request_id)

    def abort(self, request_id: str) -> bool:
        """Abort the open calls with this id through their own streams; False if no call here has it."""
        calls = self._calls.get(request_id, [])
        for call in calls:
            call.abort()
        return bool(calls)

    async def abort_arriving(self, request_id: str) -> bool:
        """Abort the call with this id that opens here within arrival_s; False if none does. An id
        whose call ended here just now names that call: a new call reusing it is not aborted."""
        if self.abort(request_id):
            return True
        ended = self._ended.get(request_id)
        if ended is not None and asyncio.get_running_loop().time() - ended < self.arrival_s:
            return False
        arrival = asyncio.Event()
        self._arrivals.setdefault(request_id, []).append(arrival)
        try:
            async with asyncio.timeout(self.arrival_s):
                await arrival.wait()
        except TimeoutError:
            return False
        finally:  # also when the Abort itself is cancelled
            waiting = self._arrivals.get(request_id, [])
            if arrival in waiting:
                waiting.remove(arrival)
                if not waiting:
                    del self._arrivals[request_id]
        return self.abort(request_id)

    def _note_end(self, request_id: str) -> None:
        now = asyncio.get_running_loop().time()
        self._ended.pop(request_id, None)
        self._ended[request_id] = now  # insertion order is end order: the stale ones are at the front
        while self._ended and now - next(iter(self._ended.values())) >= self.arrival_s:
            del self._ended[next(iter(self._ended))]

    def __len__(self) -> int:
        return len(self._calls)
