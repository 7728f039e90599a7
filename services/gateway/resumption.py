"""Requests that outlive the scheduler or worker they ran on.

When a request's Session stream is lost (its scheduler died, hung, or stopped with the request
still running, or the scheduler's engine failed with its worker), the gateway submits the request
again, to whichever scheduler the pool chooses now (the same one once it serves again, or
another): each of its unfinished sequences with the tokens it had generated, which the engine
takes as output already produced (shared/resumption.py). Until the request has produced nothing,
it is simply submitted again. The client's stream pauses, then goes on: no token comes twice or
goes missing, and greedy or seeded sampling continues as it would have without the failure.

A resumption waits up to `timeout_s` for a scheduler that takes the request, retrying a scheduler
that is unreachable or refuses it for now (its worker is down, it still holds the old request's
id, or it did not take the session: hung); each request is resumed at most `max_resumes` times,
counting every submission a scheduler took and lost again, with or without output (a request
that itself brings its worker down must not do so forever). What
the gateway holds for this, it holds anyway while the client is connected: the prompt, the
parameters and the tokens it passed on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from services.gateway.metrics import GatewayMetrics
from services.gateway.scheduler_session import SessionLost, SubmitStream
from services.gateway.scheduler_pool import SchedulerPool
from shared.grpc_errors import AlreadyExists, ServiceUnavailable
from shared.logging import setup_logging
from shared.request import EngineRequest

log = setup_logging("gateway")

# Between attempts of one resumption: soon at first (a scheduler failing over), then once a second.
FIRST_RETRY_S = 0.1
MAX_RETRY_S = 1.0


@dataclass(frozen=True)
class ResumePolicy:
    max_resumes: int = 3  # per request; 0: a request whose scheduler is lost fails (503)
    timeout_s: float = 30.0  # how long one resumption waits for a scheduler to take the request

    def __post_init__(self) -> None:
        if not isinstance(self.max_resumes, int) or self.max_resumes < 0:
            raise ValueError(f"max_resumes must be a non-negative integer, got {self.max_resumes!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"the resume timeout must be positive, got {self.timeout_s!r}")


class Resumer:
    def __init__(self, pool: SchedulerPool, policy: ResumePolicy, metrics: GatewayMetrics):
        self.pool, self.policy, self.metrics = pool, policy, metrics
        self.stopping = False  # set when the gateway gives up on its requests: nothing is resumed then

    def may_resume(self, error: BaseException, resumes_so_far: int) -> bool:
        return isinstance(error, SessionLost) and not self.stopping and resumes_so_far < self.policy.max_resumes

    async def resubmit(self, request: EngineRequest, lost: SessionLost, resumes_left: int,
                       on_stream: Callable[[SubmitStream], None], aborted: Callable[[], bool]):
        """Submit the request again (its resumption: its sequences' outputs so far; none, while nothing
        was generated: it starts over) until a scheduler answers it: (its first output, or None if it
        ended at once or was aborted meanwhile; the resumes this took). Each submission a scheduler
        took and then lost again counts as one more (at most resumes_left in all); one that was not
        reachable or refused is only tried again. on_stream gets each new stream as soon as it is
        submitted (the run aborts or cancels that one from then on)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.policy.timeout_s
        delay, attempts, used = FIRST_RETRY_S, 0, 1
        log.warning("resuming a request whose scheduler was lost", request_id=request.request_id, cause=str(lost),
                    output_tokens={i: len(t) for i, t in request.resumption.outputs.items()}
                    if request.resumption else {})
        while not aborted():
            attempts += 1
            try:
                # First elsewhere, if there is an elsewhere; then wherever the pool's health poll says.
                stream = await self.pool.submit(request, avoid=lost.address if attempts == 1 else None)
                on_stream(stream)
                if aborted():
                    stream.abort()  # the client's Abort came while this was being submitted
                first = await anext(stream, None)
            except SessionLost as again:  # taken, then lost before any output: it may be what kills them
                if used >= resumes_left:
                    self.metrics.resume_failures.inc()
                    raise
                used, lost = used + 1, again
            except (ServiceUnavailable, AlreadyExists) as exc:  # not taken (yet): try again, within the time
                if self.stopping or loop.time() + delay > deadline:
                    self.metrics.resume_failures.inc()
                    raise ServiceUnavailable(f"{lost}; no scheduler took the request again within "
                                             f"{self.policy.timeout_s:g} s ({exc})") from exc
            else:
                self.metrics.resumed.inc()
                log.info("request resumed", request_id=request.request_id, attempts=attempts, resumes=used)
                return first, used
            await asyncio.sleep(delay)
            delay = min(2 * delay, MAX_RETRY_S)
        return None, used
