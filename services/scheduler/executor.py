"""How the scheduler reaches its workers: one interface, in-process or over gRPC."""

from __future__ import annotations

from collections import deque
from typing import Protocol

from shared.step_protocol import StepPlan, StepResult, WorkerInfo


class Executor(Protocol):
    def worker_info(self) -> WorkerInfo:
        """Start-up facts of the worker(s): KV capacity, block size, vocabulary, EOS ids."""

    def submit(self, plan: StepPlan) -> None:
        """Send a step plan; the worker starts on it (or queues it behind the one it runs) while
        the caller goes on."""

    def wait(self) -> StepResult:
        """The result of the oldest plan submitted and not yet waited for."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step plan to completion: submit, then wait."""

    def shutdown(self) -> None:
        """Release the workers."""


class InProcessExecutor:
    """Calls a worker living in this process: the offline API and most tests."""

    def __init__(self, worker):
        self.worker = worker
        self._results: deque[StepResult] = deque()

    def worker_info(self) -> WorkerInfo:
        return self.worker.info

    def submit(self, plan: StepPlan) -> None:
        self._results.append(self.worker.execute(plan))  # same thread: nothing runs beside it

    def wait(self) -> StepResult:
        if not self._results:
            raise RuntimeError("wait() without a submitted plan")
        return self._results.popleft()

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        self.worker = None
