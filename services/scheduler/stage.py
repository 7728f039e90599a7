"""A stage: one worker group, the scheduler that plans its steps, and the steps sent to it whose results are
not applied yet. The engine core has one; prefill/decode disaggregation has one per worker."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from services.scheduler.block_manager import BlockManager
from services.scheduler.executor import Executor
from services.scheduler.request_stats import RequestStats
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.sequence import Sequence, SequenceUpdate
from services.scheduler.stats import EngineStats
from shared.step_protocol import StepPlan, StepResult


@dataclass
class InFlightStep:
    """A step sent to the worker whose result has not been applied yet."""
    plan: StepPlan
    scheduled: dict[int, int]  # tokens scheduled per seq id (the update needs them)
    started: float  # perf_counter when planning began
    sent: float  # perf_counter when the plan left


class Stage:
    def __init__(self, executor: Executor, scheduler: Scheduler, address: str = "", index: int = 0):
        """``address``: the worker's, as other workers reach it; ``index``: among the stages of its role."""
        self.executor = executor
        self.scheduler = scheduler
        self.address = address
        self.index = index
        self.stats = EngineStats(scheduler.blocks)
        self.in_flight: deque[InFlightStep] = deque()  # submitted, results not applied yet; oldest first
        self.last_done = 0.0  # perf_counter when the last result was applied

    @classmethod
    def for_worker(cls, executor: Executor, limits: SchedulerLimits, watermark: float, enable_prefix_caching: bool,
                   new_seq_id, *, hands_off: bool = False, request_stats: RequestStats | None = None,
                   address: str = "", index: int = 0) -> Stage:
        """A stage whose block manager and scheduler are sized by what the worker reports."""
        info = executor.worker_info()
        blocks = BlockManager(info.num_kv_blocks, info.block_size, watermark, enable_prefix_caching,
                              num_host_blocks=info.num_cpu_blocks, kv_window=info.kv_window,
                              num_offload_blocks=info.num_cpu_offload_blocks)
        scheduler = Scheduler(limits, blocks, info.eos_token_ids, info.max_model_len, new_seq_id=new_seq_id,
                              max_loras=info.max_loras, hands_off=hands_off, request_stats=request_stats,
                              whole_images=info.whole_images)
        return cls(executor, scheduler, address, index)

    @property
    def hands_off(self) -> bool:
        """A prefill stage (its sequences move on to a decode stage once their first token is sampled)."""
        return self.scheduler.hands_off

    @property
    def load(self) -> int:
        """Sequences it holds, running or not."""
        scheduler = self.scheduler
        return len(scheduler.running) + len(scheduler.waiting) + len(scheduler.swapped)

    def start_step(self) -> StepPlan | None:
        """Plan the next step and send it to the worker without waiting; None when there is nothing to run."""
        started = time.perf_counter()
        plan, scheduled = self.scheduler.schedule()
        self.stats.record_usage()  # blocks are at their peak now: allocated for this step's tokens
        if plan.is_empty:
            if self.in_flight:
                self.scheduler.cancel_empty(plan)
            elif plan.has_side_effects:  # drops or block moves still have to happen
                self.executor.execute(plan)
            return None
        sent = time.perf_counter()  # before submit: an in-process executor runs the step inside it
        self.executor.submit(plan)
        self.in_flight.append(InFlightStep(plan, scheduled, started, sent))
        return plan

    def apply(self, result: StepResult, seqs: dict[int, Sequence]) -> list[SequenceUpdate]:
        """Apply the oldest step's result (new tokens, finished sequences, forked beams, which join ``seqs``)."""
        step = self.in_flight.popleft()
        received = time.perf_counter()
        updates = self.scheduler.update(step.scheduled, result, seqs)
        for seq in self.scheduler.take_spawned():  # beams forked during the update
            seqs[seq.seq_id] = seq
        done = time.perf_counter()
        # A step planned ahead starts, for the worker, when the one before it is done.
        self.stats.record_step(step.plan, result, elapsed_s=done - max(step.started, self.last_done),
                               scheduler_s=(step.sent - step.started) + (done - received))
        self.last_done = done
        return updates

    def shutdown(self) -> None:
        """Tell the worker which sequences to drop (no step is about to run), then release it."""
        try:
            drops = self.scheduler.take_drops()
            if drops:
                self.executor.execute(StepPlan(step_id=0, finished_seq_ids=drops))
        finally:  # a worker that went away must not keep the others from being released
            self.executor.shutdown()
