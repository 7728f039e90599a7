"""How the scheduler reaches its workers: one interface, in-process or over gRPC."""

from __future__ import annotations

from typing import Protocol

from shared.step_protocol import StepPlan, StepResult, WorkerInfo


class Executor(Protocol):
    def worker_info(self) -> WorkerInfo:
        """Start-up facts of the worker(s): KV capacity, block size, vocabulary, EOS ids."""

    def submit(self, plan: StepPlan) -> None:
        """Send a step plan; the worker starts on it while the caller goes on (one in flight at a time)."""

    def wait(self) -> StepResult:
        """The result of the plan last submitted."""

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one step plan to completion: submit, then wait."""

    def shutdown(self) -> None:
        """Release the workers."""


class InProcessExecutor:
    """Calls a worker living in this process: the offline API and most tests."""

    def __init__(self, worker):
        self.worker = worker
        self._result: StepResult | None = None

    def worker_info(self) -> WorkerInfo:
        return self.worker.info

    def submit(self, plan: StepPlan) -> None:
        self._result = self.worker.execute(plan)  # same thread: nothing runs beside it

    def wait(self) -> StepResult:
        result, self._result = self._result, None
        if result is None:
            raise RuntimeError("wait() without a submitted plan")
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def shutdown(self) -> None:
        self.worker = None
