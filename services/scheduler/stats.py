"""Counters, gauges and histograms of the engine: what LLM.stats() and GetStats (so /metrics) report.

LLM.stats() is a dict: numbers, histograms as dicts (Histogram.snapshot) and, with LoRA, the
adapters running and waiting as comma-separated names; GetStats carries each kind in its own field.
"""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager
from services.scheduler.histogram import Histogram
from shared.proto import pagedserve_internal_pb2 as wire
from shared.step_protocol import StepPlan, StepResult

ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)  # vLLM's buckets


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
        self.iteration_tokens = Histogram(ITERATION_TOKENS)  # tokens each step computed (drafts included)

    def record_step(self, plan: StepPlan, result: StepResult, elapsed_s: float, scheduler_s: float) -> None:
        num_tokens = plan.num_scheduled_tokens
        self.num_steps += 1
        self.num_scheduled_tokens += num_tokens
        self.iteration_tokens.observe(num_tokens)
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
        return {**self._numbers(scheduler), **_lora_adapters(scheduler),
                **{name: h.snapshot() for name, h in self._histograms(scheduler).items()}}

    def _histograms(self, scheduler) -> dict[str, Histogram]:
        return {"iteration_tokens_total": self.iteration_tokens, **scheduler.request_stats.histograms}

    def _numbers(self, scheduler) -> dict[str, float]:
        requests, drafts = scheduler.request_stats, scheduler.draft_acceptance
        return {
            "num_requests_waiting": len(scheduler.waiting),
            # of those, held back by a passing limit (a LoRA adapter beyond max_loras, a beam awaiting its group)
            "num_requests_waiting_deferred": scheduler.num_deferred(),
            "num_requests_running": len(scheduler.running),
            "num_requests_swapped": len(scheduler.swapped),
            "num_preemptions": scheduler.num_preemptions,
            "num_preemptions_swap": scheduler.num_preemptions_swap,
            "num_preemptions_recompute": scheduler.num_preemptions_recompute,
            "num_swaps_out": scheduler.num_swaps_out,
            "num_swaps_in": scheduler.num_swaps_in,
            "num_failed_swap_ins": scheduler.num_failed_swap_ins,
            "num_steps": self.num_steps,
            "num_scheduled_tokens": self.num_scheduled_tokens,
            "kv_blocks_total": self.blocks.num_blocks,
            "kv_blocks_used": self.blocks.num_used_blocks,
            "kv_blocks_cached": self.blocks.num_cached_blocks,
            "kv_blocks_free": self.blocks.num_free_blocks - self.blocks.num_cached_blocks,
            **_host_numbers(self.blocks.host),
            "block_size": self.blocks.block_size,
            "enable_prefix_caching": float(self.blocks.enable_caching),
            "max_loras": scheduler.max_loras,
            "prefix_cache_queries": scheduler.prefix_cache_queries,
            "prefix_cache_hits": scheduler.prefix_cache_hits,
            "host_cache_queries": scheduler.host_cache_queries,
            "host_cache_hits": scheduler.host_cache_hits,
            # prompts at their first prefill (request_stats.first_admitted): computed, or found in the prefix cache
            "prompt_tokens_computed": requests.prompt_tokens_computed,
            "prompt_tokens_cached": requests.prompt_tokens_cached,
            "prompt_tokens_loaded": requests.prompt_tokens_loaded,
            "prompt_tokens_local_hit": requests.prompt_tokens_cached - requests.prompt_tokens_loaded,
            "spec_decode_num_drafts": drafts.num_drafts,
            "spec_decode_num_draft_tokens": drafts.num_draft_tokens,
            "spec_decode_num_accepted_tokens": drafts.num_accepted_tokens,
            **{f"spec_decode_num_accepted_tokens_per_pos_{i}": count
               for i, count in enumerate(drafts.num_accepted_per_pos)},
            "kv_blocks_used_peak": self.kv_blocks_used_peak,
            "kv_waste_pct": self.kv_waste_pct(),
            "kv_waste_pct_peak": self.kv_waste_pct_peak,
            "step_time_s": self.step_time_s,
            "scheduler_time_s": self.scheduler_time_s,
            "forward_time_s": self.forward_time_s,
            "sample_time_s": self.sample_time_s,
            "propose_time_s": self.propose_time_s,
        }


def _lora_adapters(scheduler) -> dict[str, str]:
    """With LoRA: the adapters of running and of waiting (or swapped) sequences, as vLLM's labels name them."""
    if not scheduler.max_loras:
        return {}

    def names(seqs) -> str:
        return ",".join(sorted({seq.request.lora.name for seq in seqs if seq.request.lora is not None}))

    return {"running_lora_adapters": names(scheduler.running),
            "waiting_lora_adapters": names([*scheduler.waiting, *scheduler.swapped])}


def stats_to_proto(stats: dict) -> wire.EngineStats:
    """LLM.stats()'s dict as GetStats sends it: numbers, histograms and text each in their field."""
    message = wire.EngineStats()
    for name, value in stats.items():
        if isinstance(value, str):
            message.labels[name] = value
        elif isinstance(value, dict):
            bounds = [b for b in value["buckets"] if b != "+Inf"]
            message.histograms[name].CopyFrom(wire.Histogram(
                bounds=[float(b) for b in bounds], cumulative_counts=[value["buckets"][b] for b in bounds],
                count=value["count"], sum=value["sum"]))
        else:
            message.values[name] = float(value)
    return message


def _host_numbers(host) -> dict[str, float]:
    """Host memory's blocks: in all, held by swapped sequences, keeping offloaded prefixes, and the tier's copies."""
    if host is None:
        return {"kv_host_blocks_total": 0, "kv_host_blocks_used": 0, "kv_host_blocks_cached": 0,
                "kv_offload_blocks_stored": 0, "kv_offload_blocks_loaded": 0}
    return {"kv_host_blocks_total": host.pool.num_blocks, "kv_host_blocks_used": host.pool.num_used_blocks,
            "kv_host_blocks_cached": host.num_tier_blocks, "kv_offload_blocks_stored": host.num_stored_blocks,
            "kv_offload_blocks_loaded": host.num_loaded_blocks}
