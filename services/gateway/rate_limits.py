"""Per-key rate limits, counted in Redis so that every gateway shares them.

Requests and tokens per minute, each over a sliding window approximated from two fixed one-minute
counters: the previous minute's count weighted by how much of it the sliding window still
covers, plus this minute's. (A fixed window alone would let a client send twice its limit across
a minute boundary; an exact log of timestamps would cost a sorted set per key.)

A request is counted when admitted, and taken back when refused. Tokens (prompt plus completion)
are charged when the request ends; a request is refused while the key's tokens in the window are
at or over the limit, so one request may overshoot it but the next waits.
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

    async def admit(self, key: ApiKey) -> None:
        """Count one request for the key, or raise RateLimited (and count nothing)."""
        if not key.is_limited:
            return
        now = self.clock()
        minute, elapsed = int(now // WINDOW_S), (now % WINDOW_S) / WINDOW_S
        requests_now = self._counter(key, "requests", minute)
        pipe = self.redis.pipeline(transaction=False)
        pipe.incr(requests_now)
        pipe.expire(requests_now, 2 * WINDOW_S)
        pipe.get(self._counter(key, "requests", minute - 1))
        pipe.get(self._counter(key, "tokens", minute))
        pipe.get(self._counter(key, "tokens", minute - 1))
        counted, _, requests_before, tokens_now, tokens_before = await pipe.execute()
        requests = Window(int(requests_before or 0), int(counted) - 1, elapsed)  # before this one
        tokens = Window(int(tokens_before or 0), int(tokens_now or 0), elapsed)
        refusal = self._refusal(key, requests, tokens)
        if refusal is not None:
            await self.redis.decr(requests_now)
            raise refusal

    @staticmethod
    def _refusal(key: ApiKey, requests: Window, tokens: Window) -> RateLimited | None:
        rpm, tpm = key.requests_per_minute, key.tokens_per_minute
        if rpm is not None and requests.estimate() + 1 > rpm:
            wait = requests.seconds_until(1, rpm)
            return RateLimited(f"rate limit reached for API key {key.name!r}: {rpm} requests per minute; "
                               f"retry in {wait} s", wait, "requests", rpm)
        if tpm is not None and tokens.estimate() >= tpm:
            wait = tokens.seconds_until(1, tpm)
            return RateLimited(f"rate limit reached for API key {key.name!r}: {tpm} tokens per minute "
                               f"(prompt and completion); retry in {wait} s", wait, "tokens", tpm)
        return None

    async def charge_tokens(self, key: ApiKey, num_tokens: int) -> None:
        if key.tokens_per_minute is None or num_tokens <= 0:
            return
        counter = self._counter(key, "tokens", int(self.clock() // WINDOW_S))
        pipe = self.redis.pipeline(transaction=False)
        pipe.incrby(counter, num_tokens)
        pipe.expire(counter, 2 * WINDOW_S)
        await pipe.execute()
