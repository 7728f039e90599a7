"""Drives an engine core the way the scheduler service's loop does with async scheduling."""

from __future__ import annotations

from services.scheduler.engine_core import EngineCore


class Pipeline:
    """Drives the engine as the scheduler service does with async scheduling: the next step is
    planned while one is in flight whenever the engine allows, and results are applied in order."""

    def __init__(self, engine: EngineCore):
        self.engine = engine
        self.ahead = 0  # steps planned while another was in flight

    def step(self):
        engine = self.engine
        if engine.num_in_flight and engine.can_plan_ahead() and engine.start_step():
            self.ahead += 1
        updates = engine.finish_step() if engine.num_in_flight else []
        if not engine.num_in_flight and engine.has_unfinished():
            engine.start_step()
        return updates

    def has_unfinished(self) -> bool:
        return bool(self.engine.num_in_flight) or self.engine.has_unfinished()
