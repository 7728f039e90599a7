"""How the scheduler reaches its workers: one interface, in-process or over gRPC."""

from __future__ import annotations

from typing import Protocol

from shared.step_protocol import StepPlan, StepResult, WorkerInfo


class Executor(Protocol):
    def worker_info(self) -> WorkerInfo:
        """Start-up facts of the worker(s): KV capacity, block size, vocabulary, EOS ids."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step plan to completion."""

    def shutdown(self) -> None:
        """Release the workers."""


class InProcessExecutor:
    """Calls a worker living in this process: the offline API and most tests."""

    def __init__(self, worker):
        self.worker = worker

    def worker_info(self) -> WorkerInfo:
        return self.worker.info

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        self.worker = None
