"""Counters and gauges of the engine: what LLM.stats() and, later, /metrics report."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from shared.step_protocol import StepPlan, StepResult


class EngineStats:
    def __init__(self, blocks: BlockManager):
        self.blocks = blocks
        self.num_steps = 0
        self.num_scheduled_tokens = 0
        self.step_time_s = 0.0
        self.scheduler_time_s = 0.0  # planning and applying results: the scheduler's own share of a step
        self.forward_time_s = 0.0
        self.sample_time_s = 0.0
        self.propose_time_s = 0.0  # speculative decoding's draft proposals
        self.kv_waste_pct_peak = 0.0
        self.kv_blocks_used_peak = 0

    def record_step(self, plan: StepPlan, result: StepResult, elapsed_s: float, scheduler_s: float) -> None:
        self.num_steps += 1
        self.num_scheduled_tokens += plan.num_scheduled_tokens
        self.step_time_s += elapsed_s
        self.scheduler_time_s += scheduler_s
        self.forward_time_s += result.forward_time_s
        self.sample_time_s += result.sample_time_s
        self.propose_time_s += result.propose_time_s

    def record_usage(self) -> None:
        """When a step is planned: every allocated slot holds a token or is about to, but each table's tail."""
        self.kv_waste_pct_peak = max(self.kv_waste_pct_peak, self.kv_waste_pct())
        self.kv_blocks_used_peak = max(self.kv_blocks_used_peak, self.blocks.num_used_blocks)

    def kv_waste_pct(self) -> float:
        allocated = self.blocks.allocated_slots()
        return 100.0 * self.blocks.wasted_slots() / allocated if allocated else 0.0

    def as_dict(self, scheduler) -> dict:
        return {
            "num_requests_waiting": len(scheduler.waiting),
            "num_requests_running": len(scheduler.running),
            "num_requests_swapped": len(scheduler.swapped),
            "num_preemptions": scheduler.num_preemptions,
            "num_preemptions_swap": scheduler.num_preemptions_swap,
            "num_preemptions_recompute": scheduler.num_preemptions_recompute,
            "num_swaps_out": scheduler.num_swaps_out,
            "num_swaps_in": scheduler.num_swaps_in,
            "num_steps": self.num_steps,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_cached": self.blocks.num_cached_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks - self.blocks.num_cached_blocks,
            "kv_host_blocks_total": self.blocks.host_pool.num_blocks if self.blocks.host_pool else 0,
            "kv_host_blocks_used": self.blocks.host_pool.num_used_blocks if self.blocks.host_pool else 0,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
            "spec_decode_num_drafts": scheduler.num_spec_drafts,
            "spec_decode_num_draft_tokens": scheduler.num_spec_draft_tokens,
            "spec_decode_num_accepted_tokens": scheduler.num_spec_accepted_tokens,
            "kv_blocks_used_peak": self.kv_blocks_used_peak,
            "kv_waste_pct": self.kv_waste_pct(),
            "kv_waste_pct_peak": self.kv_waste_pct_peak,
            "step_time_s": self.step_time_s,
            "scheduler_time_s": self.scheduler_time_s,
            "forward_time_s": self.forward_time_s,
            "sample_time_s": self.sample_time_s,
            "propose_time_s": self.propose_time_s,
        }
