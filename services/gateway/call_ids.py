"""Hand a gRPC request id over from a call whose client cancelled it to the next call that reuses it.

A gRPC `request_id` is the engine id itself, and the scheduler refuses one that is still running.
A client that cancels a stream and at once sends a new call with the same id expects the new call
to run. grpc.aio may start the new call before the old one has heard of its cancellation (seen
here about once in a hundred immediate reuses), and the old call's abort would then reach the
scheduler after the new submission. So a call whose id belongs to a call still open at this
gateway waits for that call to end (its abort is queued by then) before it submits, for at most
`grace_s`: a genuine duplicate of a running request is then refused by the scheduler as before.
"""

from __future__ import annotations

import asyncio
import contextlib


class CallIds:
    def __init__(self, grace_s: float = 1.0):
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {grace_s}")
        self.grace_s = grace_s
        self._ended: dict[str, asyncio.Event] = {}  # by request id: set once that call has ended

    @contextlib.asynccontextmanager
    async def claim(self, request_id: str):
        """Hold request_id for the body (a call's whole life), after the call before it with that id ended."""
        earlier = self._ended.get(request_id)
        if earlier is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.grace_s):
                    await earlier.wait()
        ended = asyncio.Event()
        self._ended[request_id] = ended  # a duplicate that outlived the grace replaces the entry
        try:
            yield
        finally:
            ended.set()
            if self._ended.get(request_id) is ended:
                del self._ended[request_id]

    def __len__(self) -> int:
        return len(self._ended)
