"""What a request costs its API key's rate limits (the keys of the Redis store): a request counted on
admission (taken back when the gateway fails it before it runs), and the tokens its runs may use reserved
before they are submitted, then settled to what they used when the request ends.

Changes that follow a request's end go to the store off the request's path (it may be ending by
cancellation): tasks kept here, which shutdown waits for (settle_charges)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.gateway.api_keys import ApiKey
from services.gateway.metrics import GatewayMetrics
from services.gateway.model import Model
from services.gateway.rate_limits import RateLimiter, Reservation
from shared.grpc_errors import ResourceExhausted, ServiceUnavailable
from shared.logging import setup_logging
from shared.request import EngineRequest

log = setup_logging("gateway")


@dataclass
class Admission:
    """One admitted request, and what it counts towards its key's tokens per minute: a reservation
    made when its runs are submitted, settled to what they used when it ends."""
    api_key: ApiKey | None = None  # set: the key's limits are kept
    runs: list = field(default_factory=list)
    reservation: Reservation | None = None
    counted_in: int | None = None  # the minute its request was counted in, if its key has a request limit

    def num_tokens(self) -> int:
        return sum(len(run.prompt) + run.completion_tokens for run in self.runs)


class Billing:
    def __init__(self, limiter: RateLimiter, metrics: GatewayMetrics):
        self.limiter, self.metrics = limiter, metrics
        self._charges: set[asyncio.Task] = set()  # charges on their way to the rate limit store

    async def count_request(self, admission: Admission) -> None:
        """Count the request against its key's requests per minute (RateLimited past them)."""
        admission.counted_in = await self._within_limits(self.limiter.admit(admission.api_key), admission.api_key)

    def take_back_request(self, admission: Admission) -> None:
        """The gateway failed the request before it ran: the client keeps its quota."""
        if admission.counted_in is not None and not admission.runs:
            self._later(self.limiter.take_back_request(admission.api_key, admission.counted_in), admission.api_key,
                        "request")

    async def reserve(self, admission: Admission, model: Model, requests: list[EngineRequest]) -> None:
        """The most the runs can use, against the key's tokens per minute (before they are submitted):
        an embedding uses its prompt only."""
        most = 0
        for request in requests:
            prompt_len, params = len(request.prompt_token_ids), request.params
            most += prompt_len
            if request.pooling is None:
                per_sequence = model.max_model_len - prompt_len if params.max_tokens is None else params.max_tokens
                most += params.n * per_sequence
        admission.reservation = await self._within_limits(
            self.limiter.reserve_tokens(admission.api_key, most), admission.api_key)

    def settle(self, admission: Admission) -> None:
        """The request ended: its reservation becomes the tokens its runs used."""
        if admission.reservation is not None:
            self._later(self.limiter.settle(admission.api_key, admission.reservation, admission.num_tokens()),
                        admission.api_key, "tokens")

    async def _within_limits(self, check, api_key: ApiKey):
        try:
            return await check
        except ResourceExhausted:
            self.metrics.count_rate_limited(api_key)
            raise
        except Exception as exc:  # redis' errors: the limits cannot be checked, so nothing is let through
            log.warning("rate limit store unreachable", error=str(exc))
            raise ServiceUnavailable("the rate limit store is unreachable; retry later") from exc

    def _later(self, charge, api_key: ApiKey, what: str) -> None:
        """A change to the key's counters, off the request's path: a task kept here."""
        async def run():
            try:
                await charge
            except Exception as exc:
                log.warning("could not update the API key's rate counters", api_key=api_key.name, what=what,
                            error=str(exc))

        task = asyncio.get_running_loop().create_task(run())
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    async def settle_charges(self) -> None:
        """Wait for the charges still on their way (at shutdown, before the store closes)."""
        if self._charges:
            await asyncio.wait(list(self._charges), timeout=5)
