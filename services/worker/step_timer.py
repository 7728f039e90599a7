"""How long a step's forward pass, its sampling and its draft proposals took, without host waits between.

Waiting for the GPU after the forward pass, only to read a clock, would keep the host from
queueing the sampler's launches behind it: they would then start on an idle GPU instead of
overlapping the forward pass (with decode graphs, a replay is one launch, so the sampler's
launches are most of what the host does in a step). On CUDA the marks are events on the stream,
and the one wait is at the end of the step, which the sampler's own read-back makes anyway.
Elsewhere the marks are host clock readings: a CPU runs each operation before returning.
"""

from __future__ import annotations

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        # Reused every step: finish() waits for the last one, so a step never re-records a pending event.
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if device.type == "cuda" else None
        self._clock = [0.0] * 4

    def start(self) -> None:
        self._mark(0)

    def forward_done(self) -> None:
        self._mark(1)

    def sampling_done(self) -> None:
        self._mark(2)

    def finish(self) -> tuple[float, float, float]:
        """(forward, sampling, proposing) seconds, once the step's work has run."""
        self._mark(3)
        if self._events is None:
            begin, forward, sampled, end = self._clock
        else:
            self._events[3].synchronize()
            begin, forward, sampled, end = 0.0, *(self._events[0].elapsed_time(e) / 1000 for e in self._events[1:])
        return forward - begin, sampled - forward, end - sampled

    def _mark(self, index: int) -> None:
        if self._events is None:
            self._clock[index] = time.perf_counter()
        else:
            self._events[index].record()
