"""Prefill/decode disaggregation: one engine core over prefill stages and decode stages, each stage a scheduler
of its own (its block tables, its steps) driving one worker.

A request's prompt is computed on a prefill stage, which samples its first token, so its time to first
token is the prefill worker's. The sequence then moves to a decode stage. In the step that first decodes
it, the decode worker pulls the sequence's KV from the prefill worker, worker to worker (kv_transfer.py),
except for the blocks the decode stage's own prefix cache holds. The prefill stage frees its blocks once
that step has come back (kv_handoff.py). A pull that fails is recomputed on the decode stage, as a failed
swap-in is.

The stages step independently, so a burst of long prompts never stalls the decode workers' next tokens.
While a prefill worker computes the next prompt, a decode worker reads the blocks of the one before. Beam
search runs whole on a decode stage: its beams fork at every step, so there is nothing to hand over.
"""

from __future__ import annotations

import queue
import threading

from services.scheduler.cache_digest import CacheDigest
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import Executor
from services.scheduler.kv_handoff import Handoffs
from services.scheduler.scheduler import Scheduler, SchedulerLimits
from services.scheduler.sequence import Sequence, SequenceUpdate
from services.scheduler.stage import Stage
from shared.step_protocol import StepResult, WorkerInfo
from shared.tracing import Tracing


class DisaggregatedCore(EngineCore):
    def __init__(self, prefill: list[tuple[Executor, str]], decode: list[tuple[Executor, str]],
                 limits: SchedulerLimits, watermark: float = 0.01, max_logprobs: int = 20,
                 enable_prefix_caching: bool = True, tracing: Tracing | None = None, async_scheduling: bool = True):
        """``prefill`` and ``decode``: each worker's executor and its address (a decode worker pulls from the
        prefill workers' addresses); ``async_scheduling``: a stage plans its next step while one runs."""
        if not prefill or not decode:
            raise ValueError("disaggregation needs at least one prefill worker and one decode worker")
        super().__init__(decode[0][0], limits, watermark, max_logprobs, enable_prefix_caching, tracing)
        for executor, address in prefill + decode:
            _check_alike(self.info, executor.worker_info(), address)
        self.async_scheduling = async_scheduling
        self._watermark, self._enable_prefix_caching = watermark, enable_prefix_caching
        self.stage.address = decode[0][1]
        self.decode = [self.stage] + [self._stage(i, False, executor, address)
                                      for i, (executor, address) in enumerate(decode) if i]
        self.prefill = [self._stage(i, True, executor, address) for i, (executor, address) in enumerate(prefill)]
        self.stages = self.prefill + self.decode
        self.handoffs = Handoffs()
        self._stage_of: dict[int, Stage] = {}  # seq id -> the stage holding it (a forked beam: its first beam's)
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (stage, result, error) as the waiters get them
        self._failure: BaseException | None = None  # a stage's worker went away: every later finish_step raises it
        self._expected = {stage: queue.SimpleQueue() for stage in self.stages}  # per waiter: True per step, False: stop
        for stage in self.stages:
            threading.Thread(target=self._wait_results, args=(stage,), name="step-results", daemon=True).start()

    def _stage(self, index: int, hands_off: bool, executor: Executor, address: str) -> Stage:
        return Stage.for_worker(executor, self.scheduler.limits, self._watermark, self._enable_prefix_caching,
                                new_seq_id=lambda: next(self._seq_ids), hands_off=hands_off,
                                request_stats=self.scheduler.request_stats, address=address, index=index)

    # --- where sequences go -----------------------------------------------------------------------------

    def _check_blocks_suffice(self, prompt_len, params) -> None:
        super()._check_blocks_suffice(prompt_len, params)  # a decode worker holds the whole sequence
        limits = self.scheduler.limits
        longest = prompt_len + (params.max_tokens or self.info.max_model_len - prompt_len)
        for stage in self.decode[1:]:  # (the first is the engine core's own: checked above)
            blocks = stage.scheduler.blocks
            needed = blocks.most_blocks_held(longest, limits.max_num_batched_tokens
                                             if limits.enable_chunked_prefill else None)
            if needed > blocks.num_blocks:
                raise ValueError(f"the request can grow to {longest} tokens, needing {needed} KV blocks at once, "
                                 f"but a decode worker's cache has only {blocks.num_blocks}: it could never run")
        for stage in self.prefill:  # a prefill worker, the prompt
            blocks = stage.scheduler.blocks
            needed = blocks.most_blocks_held(prompt_len, limits.max_num_batched_tokens if limits.enable_chunked_prefill
                                             else None)
            if needed > blocks.num_blocks:
                raise ValueError(f"the prompt needs {needed} KV blocks at once, but a prefill worker's cache has only "
                                 f"{blocks.num_blocks}: it could never run")

    def _enqueue(self, seq: Sequence) -> None:
        stage = min(self.decode, key=lambda s: s.load) if seq.beam_group is not None else self._prefill_stage_for(seq)
        for member in [seq, *seq.pending_siblings]:  # (a resumed request's siblings come each on its own)
            self._stage_of[member.seq_id] = stage
        stage.scheduler.add(seq)

    def _prefill_stage_for(self, seq: Sequence) -> Stage:
        """The prefill stage caching the longest start of the prompt; among equals, the least loaded."""
        if len(self.prefill) == 1:
            return self.prefill[0]
        tokens = seq.token_ids()

        def cached(stage: Stage) -> int:
            return stage.scheduler.blocks.cached_prefix(tokens, seq.cache_extra, seq.image_keys).num_blocks

        return max(self.prefill, key=lambda stage: (cached(stage), -stage.load))

    def _hand_to_decode(self, seq: Sequence, prefill: Stage) -> None:
        """A sequence the prefill stage is done with goes where its siblings went, else to the least loaded."""
        stage = next((self._stage_of[s.seq_id] for s in seq.siblings
                      if s is not seq and not self._stage_of[s.seq_id].hands_off), None)
        stage = stage or min(self.decode, key=lambda s: s.load)
        self.handoffs.hand_off(seq, prefill.scheduler.blocks, prefill.address)
        self._stage_of[seq.seq_id] = stage
        stage.scheduler.take_over(seq)

    def _scheduler_of(self, seq: Sequence) -> Scheduler:
        stage = self._stage_of.get(seq.seq_id) or self._stage_of[seq.siblings[0].seq_id]
        return stage.scheduler

    def _left(self, seq: Sequence) -> None:
        self.handoffs.dropped(seq)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id, [])
        super()._forget_if_done(request_id)
        if request_id not in self._requests:
            for seq in seqs:
                self._stage_of.pop(seq.seq_id, None)
                self.handoffs.dropped(seq)  # a sibling ended with its request while it waited for the decode stage

    # --- stepping ---------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return any(stage.scheduler.has_unfinished() for stage in self.stages)

    def step(self) -> list[SequenceUpdate]:
        """Start what may start, then apply the first result to come back."""
        self.start_step()
        return self.finish_step() if self.num_in_flight else []

    @property
    def num_in_flight(self) -> int:
        return sum(len(stage.in_flight) for stage in self.stages)

    def has_idle_work(self) -> bool:
        return any(not stage.in_flight and stage.scheduler.has_unfinished() for stage in self.stages)

    def can_plan_ahead(self) -> bool:
        return any(self._may_start(stage) for stage in self.stages)

    def _may_start(self, stage: Stage) -> bool:
        """An idle stage with work, or (async scheduling) a stage with one step in flight that may plan ahead."""
        if not stage.in_flight:
            return stage.scheduler.has_unfinished()
        return self.async_scheduling and len(stage.in_flight) == 1 and not self.info.num_speculative_tokens \
            and stage.scheduler.can_plan_ahead()

    def start_step(self) -> bool:
        """Plan and send a step on every stage that may start one; whether any did."""
        started = False
        for stage in self.stages:
            if self._may_start(stage) and (plan := stage.start_step()) is not None:
                started = True
                self._expected[stage].put(True)
                if not stage.hands_off:
                    self.handoffs.planned(stage.index, plan.step_id, [new.seq_id for new in plan.new])
        return started

    def _wait_results(self, stage: Stage) -> None:
        """A stage's waiter thread: each result in turn, into the queue finish_step reads."""
        while self._expected[stage].get():
            try:
                self._done.put((stage, stage.executor.wait(), None))
            except BaseException as exc:  # the worker went away: finish_step raises it
                self._done.put((stage, None, exc))
                return

    def finish_step(self) -> list[SequenceUpdate]:
        """Apply the result that comes back first, from whichever stage."""
        if self._failure is not None:  # (its stage's steps will never come back: no waiting for them)
            raise self._failure
        stage, result, error = self._done.get()
        if error is not None:
            self._failure = error
            raise error
        return self._apply(stage, result)

    def _apply(self, stage: Stage, result: StepResult) -> list[SequenceUpdate]:
        updates = stage.apply(result, self._seqs)
        if stage.hands_off:
            for seq in stage.scheduler.take_handoffs():
                self._hand_to_decode(seq, stage)
        else:
            self.handoffs.step_done(stage.index, result.step_id)
        self._forget_finished(updates)
        return updates

    # --- the rest -----------------------------------------------------------------------------------------

    @property
    def executors(self) -> list[Executor]:
        return [stage.executor for stage in self.stages]

    def publish_cache(self) -> CacheDigest | None:
        """The prefill stages' caches: where a prompt's start is cached is where its prefill is quick."""
        if not self._enable_prefix_caching:
            return None
        digest = CacheDigest()
        for stage in self.prefill:
            stage.scheduler.blocks.publish_cache(digest)
        return digest

    def cached_keys(self) -> list[int]:
        return [key for stage in self.prefill for key in stage.scheduler.blocks.cached_keys()]

    def get_stats(self) -> dict:
        """The stages' counts summed (the request-level ones are shared, so counted once), and the transfers'."""
        merged: dict = {}
        for stage in self.stages:
            for name, value in stage.stats.as_dict(stage.scheduler).items():
                merged[name] = value if name not in merged else _merge(name, merged[name], value)
        schedulers = [stage.scheduler for stage in self.decode]
        merged.update(prefill_workers=len(self.prefill), decode_workers=len(self.decode),
                      num_kv_pulls=sum(s.num_kv_pulls for s in schedulers),
                      kv_pull_blocks=sum(s.kv_pull_blocks for s in schedulers),
                      kv_pull_blocks_cached=sum(s.kv_pull_blocks_cached for s in schedulers),
                      num_sequences_awaiting_decode=len(self.handoffs))
        return merged

    def shutdown(self) -> None:
        errors = []
        for stage in self.stages:  # each, even after one whose worker went away
            try:
                stage.shutdown()
            except Exception as exc:
                errors.append(exc)
        self._stop_waiters()
        if errors:
            raise errors[0]

    def abandon(self) -> None:
        self._stop_waiters()
        super().abandon()

    def _stop_waiters(self) -> None:
        for expected in self._expected.values():
            expected.put(False)


# Stats that are the same object in every stage (the request's own), or settings: taken once, not summed.
_SHARED = {"block_size", "enable_prefix_caching", "max_loras", "prompt_tokens_computed", "prompt_tokens_cached",
           "prompt_tokens_loaded", "prompt_tokens_local_hit"}


def _merge(name: str, first, other):
    if name in _SHARED or isinstance(first, str):
        return first
    if name.startswith("kv_waste_pct"):
        return max(first, other)
    if isinstance(first, dict):  # a histogram: the per-request ones are shared; the per-step ones add up
        if name != "iteration_tokens_total":
            return first
        return {"buckets": {b: first["buckets"][b] + other["buckets"][b] for b in first["buckets"]},
                "count": first["count"] + other["count"], "sum": first["sum"] + other["sum"]}
    return first + other


def _check_alike(info: WorkerInfo, other: WorkerInfo, address: str) -> None:
    """The workers must run the same model alike: blocks move between them as they are."""
    for name in ("model", "block_size", "max_model_len", "vocab_size", "dtype", "kv_cache_dtype", "kv_window",
                 "num_speculative_tokens", "max_loras", "pooler", "image_token_id", "whole_images"):
        if getattr(info, name) != getattr(other, name):
            raise ValueError(f"the worker at {address} differs from the first decode worker in {name}: "
                             f"{getattr(other, name)!r} against {getattr(info, name)!r}; prefill and decode workers "
                             "must serve the same model with the same settings")
    if other.kv_scales_measured:
        raise ValueError(f"the worker at {address} measures its own FP8 KV scales (--calculate-kv-scales): blocks "
                         "moved between workers would be read with another worker's scales")
    if other.tensor_parallel_size > 1:
        raise ValueError(f"the worker at {address} is a tensor-parallel rank: prefill/decode disaggregation runs "
                         "one worker per stage")
