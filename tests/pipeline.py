"""Drives an engine core the way the scheduler service's loop does with async scheduling."""

from __future__ import annotations

from collections import deque

from services.scheduler.engine_core import EngineCore


class Pipeline:
    """Drives the engine as the scheduler service does with async scheduling: the next step is
    planned while one is in flight whenever the engine allows, and results are applied in order."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.in_flight: deque = deque()
        self.ahead = 0  # steps planned while another was in flight

    def step(self):
        if self.in_flight and self.engine.can_plan_ahead():
            step = self.engine.start_step()
            if step is not None:
                self.in_flight.append(step)
                self.ahead += 1
        updates = self.engine.finish_step(self.in_flight.popleft()) if self.in_flight else []
        if not self.in_flight and self.engine.has_unfinished():
            step = self.engine.start_step()
            if step is not None:
                self.in_flight.append(step)
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.in_flight) or self.engine.has_unfinished()
