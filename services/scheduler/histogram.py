"""A Prometheus-style histogram kept by the engine loop thread: a count per bucket and a sum.

The engine's histograms (vLLM's per-request times, its tokens per step) travel to the gateway in
GetStats, cumulative since the scheduler started, like its counters; LLM.stats() shows them too.
"""

from __future__ import annotations

from bisect import bisect_left


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``largest`` (vLLM's buckets for token counts, to the context length)."""
    bounds, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > largest:
                return tuple(bounds)
            bounds.append(mantissa * scale)
        scale *= 10


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds  # upper bounds, increasing; a value above the last one counts in +Inf
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative: the last one is +Inf's own
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # a value equal to a bound is in that bucket (le)
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> dict:
        """As LLM.stats() shows it: ``buckets`` maps each upper bound (Prometheus' ``le``, "+Inf" last)
        to the observations at or below it."""
        buckets, total = {}, 0
        for bound, count in zip((*map(str, self.bounds), "+Inf"), self.counts):
            total += count
            buckets[bound] = total
        return {"count": total, "sum": self.sum, "buckets": buckets}
