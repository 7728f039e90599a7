"""Per-key rate limits, counted in Redis so that every gateway shares them.

Requests and tokens per minute, each over a sliding window approximated from two fixed one-minute
counters: the previous minute's count weighted by how much of it the sliding window still
covers, plus this minute's. (A fixed window alone would let a client send twice its limit across
a minute boundary; an exact log of timestamps would cost a sorted set per key.)

A request is counted when admitted, and taken back when refused, or when the service fails it
before it started (a 503: a client retrying through an outage keeps its quota). Its tokens are reserved when it
is submitted (the prompt plus what max_tokens allows, for every sequence) and settled to what it
used when it ends: concurrent requests see each other's reservations. A request is refused while
the key's tokens in the window are at or over the limit, so one request may overshoot it (its
reservation alone may be larger), but the next waits.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from services.gateway.api_keys import ApiKey
from shared.grpc_errors import ResourceExhausted

WINDOW_S = 60


class RateLimited(ResourceExhausted):
    """An API key is over one of its limits."""

    def __init__(self, message: str, retry_after_s: int, kind: str, limit: int):
        super().__init__(message, retry_after_s)
        self.kind = kind  # "requests" or "tokens", as OpenAI's error type and x-ratelimit-* headers say
        self.limit = limit


@dataclass(frozen=True)
class Window:
    """One counter's previous and current minute, and how far into the current one we are."""
    previous: int
    current: int
    elapsed: float  # fraction of the current minute gone, in [0, 1)

    def estimate(self) -> float:
        return self.previous * (1.0 - self.elapsed) + self.current

    def seconds_until(self, room: int, limit: int) -> int:
        """Seconds until `room` more fits under `limit` if nothing else is counted (at least 1)."""
        left = limit - room - self.current
        if left >= 0:  # this minute: once the previous minute's weight has shrunk enough
            fraction = 1.0 - left / self.previous if self.previous else self.elapsed
            wait = (fraction - self.elapsed) * WINDOW_S
        else:  # next minute, as this one's count becomes the previous
            fraction = max(0.0, 1.0 - (limit - room) / self.current)
            wait = (1.0 - self.elapsed + fraction) * WINDOW_S
        return max(1, math.ceil(wait - 1e-9))  # 80.00000001 s is 80


class RateLimiter:
    def __init__(self, redis, prefix: str, clock=time.time):
        self.redis = redis  # a redis.asyncio client
        self.prefix = prefix
        self.clock = clock

    def _counter(self, key: ApiKey, kind: str, minute: int) -> str:
        return f"{self.prefix}rate:{key.key_id}:{kind}:{minute}"

    def _now(self) -> tuple[int, float]:
        now = self.clock()
        return int(now // WINDOW_S), (now % WINDOW_S) / WINDOW_S

    async def admit(self, key: ApiKey) -> int | None:
        """Count one request for the key, or raise RateLimited (and count nothing); the minute it
        was counted in (None: the key has no request limit)."""
        if key.requests_per_minute is None:
            return None
        return await self._take(key, "requests", 1, key.requests_per_minute)

    async def take_back_request(self, key: ApiKey, minute: int) -> None:
        """A request that the service failed (503) does not count against its key."""
        if minute >= self._now()[0] - 1:  # older counters are read no more
            await self.redis.decr(self._counter(key, "requests", minute))

    async def reserve_tokens(self, key: ApiKey, num_tokens: int) -> Reservation | None:
        """Count the most a request can use, or raise RateLimited (and count nothing); None when the
        key has no token limit."""
        if key.tokens_per_minute is None:
            return None
        minute = await self._take(key, "tokens", num_tokens, key.tokens_per_minute)
        return Reservation(minute, num_tokens)

    async def settle(self, key: ApiKey, reservation: Reservation, used: int) -> None:
        """Replace the reservation by what the request used, counted in the minute it ends."""
        minute, _ = self._now()
        pipe = self.redis.pipeline(transaction=False)
        if reservation.minute >= minute - 1:  # older counters are read no more (and may have expired)
            reserved = self._counter(key, "tokens", reservation.minute)
            pipe.decrby(reserved, reservation.num_tokens)
            pipe.expire(reserved, 2 * WINDOW_S)
        if used > 0:
            counter = self._counter(key, "tokens", minute)
            pipe.incrby(counter, used)
            pipe.expire(counter, 2 * WINDOW_S)
        await pipe.execute()

    async def _take(self, key: ApiKey, kind: str, amount: int, limit: int) -> int:
        """Add amount to this minute's counter, unless the window was already at its limit (requests:
        would go over it); the minute it was counted in."""
        minute, elapsed = self._now()
        counter = self._counter(key, kind, minute)
        pipe = self.redis.pipeline(transaction=False)
        pipe.incrby(counter, amount)
        pipe.expire(counter, 2 * WINDOW_S)
        pipe.get(self._counter(key, kind, minute - 1))
        counted, _, before = await pipe.execute()
        window = Window(int(before or 0), int(counted) - amount, elapsed)  # as it was before this one
        full = window.estimate() + 1 > limit if kind == "requests" else window.estimate() >= limit
        if full:
            await self.redis.decrby(counter, amount)
            wait = window.seconds_until(1, limit)
            what = "requests per minute" if kind == "requests" else "tokens per minute (prompt and completion)"
            raise RateLimited(f"rate limit reached for API key {key.name!r}: {limit} {what}; retry in {wait} s",
                              wait, kind, limit)
        return minute


@dataclass(frozen=True)
class Reservation:
    minute: int  # the window it was counted in
    num_tokens: int
