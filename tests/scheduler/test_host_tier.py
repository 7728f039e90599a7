"""The prefix cache's host tier (host_blocks.py): blocks the device evicts are stored in host memory and
loaded back on a later hit, planned as block moves; a load that fails costs a recompute, never a wrong token.

The engine tests run on the fake worker, which simulates the pools slot by slot and checks every context
a sequence reads: a store or load that moved the wrong block, or ran in the wrong order, fails there."""

from __future__ import annotations

import random

import pytest

from services.gateway.vllm_metrics import VllmMetrics
from services.scheduler.block_manager import BlockManager
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from services.scheduler.stats import stats_to_proto
from shared.block_hash import hash_full_blocks
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from tests.fake_worker import FakeWorker
from tests.scheduler.test_scheduler import check_invariants

BS = 4


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


def cache_prompt(manager: BlockManager, seq_id: int, prompt: list[int]) -> list[int]:
    """Admit, compute and free a sequence: its full blocks stay in the device cache, cached-free."""
    hits = manager.cached_prefix(prompt)
    manager.allocate_with_hits(seq_id, hits, len(prompt))
    manager.cache_full_blocks(seq_id, len(prompt), lambda start, end: prompt[start:end])
    table = manager.block_table(seq_id)
    manager.free(seq_id)
    return table


def tier_block_ids(manager: BlockManager, prompt: list[int]) -> list[int | None]:
    """Per full block of the prompt, the host block keeping it (None: the tier does not have it)."""
    blocks = [manager.host.cached_block(h) for h in hash_full_blocks(None, prompt, BS)]
    return [None if block is None else block.block_id for block in blocks]


def test_an_evicted_prefix_is_stored_then_loaded_back_into_fresh_blocks():
    manager = BlockManager(5, BS, enable_caching=True, num_host_blocks=4, num_offload_blocks=4)
    first = tokens(1, 4 * BS + 1)
    table = cache_prompt(manager, 0, first)
    assert manager.seal_plan() == ([], [])  # nothing was evicted
    cache_prompt(manager, 1, tokens(2, 5 * BS))  # takes every device block: the first prompt's four go to the tier
    stores, loads = manager.seal_plan()
    kept = tier_block_ids(manager, first)
    assert sorted(stores) == sorted(zip(table[:4], kept)) and loads == []
    manager.check_invariants()

    hits = manager.cached_prefix(first)
    assert hits.num_blocks == 4 and hits.on_host == (0, 1, 2, 3)
    assert manager.can_allocate(2, len(first), hits=hits)
    manager.allocate_with_hits(2, hits, len(first))
    stores, loads = manager.seal_plan()
    assert loads == list(zip(kept, manager.block_table(2)[:4]))
    # The device blocks it took held the second prompt's prefix, but the tier's only blocks were being read
    # in this plan: none could take a store (no host block is handed to two copies in one plan).
    assert stores == []
    manager.check_invariants()
    assert manager.cached_prefix(first).on_host == ()  # loaded blocks are indexed on the device at once
    assert manager.host.num_stored_blocks == 4 and manager.host.num_loaded_blocks == 4


def test_a_prefix_the_tier_holds_is_not_copied_again_and_becomes_the_most_recent():
    manager = BlockManager(5, BS, enable_caching=True, num_host_blocks=8, num_offload_blocks=8)
    first, second, third, fourth = (tokens(seed, 4 * BS + 1) for seed in range(1, 5))
    cache_prompt(manager, 0, first)
    cache_prompt(manager, 1, second)  # evicts the first's four into the tier
    kept = tier_block_ids(manager, first)
    assert len(manager.seal_plan()[0]) == 4
    cache_prompt(manager, 2, first)  # loads them back, evicting the second's into the tier: now full
    stores, loads = manager.seal_plan()
    assert len(stores) == 4 and len(loads) == 4
    cache_prompt(manager, 3, third)  # evicts the first's device copies: the tier has them, so nothing moves
    assert manager.seal_plan() == ([], []) and tier_block_ids(manager, first) == kept
    # That eviction made the first's copies the most recent: the fourth's four stores take the second's.
    cache_prompt(manager, 4, fourth)
    assert len(manager.seal_plan()[0]) == 4
    assert tier_block_ids(manager, first) == kept and None not in tier_block_ids(manager, third)
    assert tier_block_ids(manager, second) == [None] * 4
    manager.check_invariants()


def test_swapped_sequences_come_first_but_never_take_the_tiers_share():
    manager = BlockManager(6, BS, enable_caching=True, num_host_blocks=4, num_offload_blocks=2)
    cache_prompt(manager, 0, tokens(1, 4 * BS + 1))
    for seq_id, seed in ((1, 2), (2, 3)):  # each plan stores two (its stores leave the swap space free) ...
        cache_prompt(manager, seq_id, tokens(seed, 6 * BS))
        assert len(manager.seal_plan()[0]) == 2
    assert manager.host.num_tier_blocks == 4  # ... and together they fill the whole pool while nothing is swapped
    assert manager.append_slots(5, 2 * BS) is not None
    assert manager.can_swap_out(5)
    manager.swap_out(5)  # its two blocks evict the tier's two oldest
    manager.seal_plan()
    assert manager.host.num_tier_blocks == 2 and manager.host.num_swapped == 2
    assert manager.append_slots(3, BS) is not None
    assert not manager.can_swap_out(3)  # swap space is 2 blocks: the rest stays the tier's
    manager.seal_plan()
    manager.check_invariants()


def test_a_plans_stores_leave_the_swap_space_a_later_preemption_needs():
    manager = BlockManager(9, BS, enable_caching=True, num_host_blocks=6, num_offload_blocks=3)
    cache_prompt(manager, 0, tokens(1, 8 * BS + 1))
    assert manager.append_slots(1, 2 * BS) is not None
    assert manager.append_slots(2, 7 * BS) is not None  # the eight cached blocks are evicted: three are stored
    assert len(manager.host.stores) == 3  # more would hold the swap space until the plan is sealed
    assert manager.can_swap_out(1)  # so a preemption later in the same plan still swaps
    manager.swap_out(1)
    stores, _ = manager.seal_plan()
    assert len(stores) == 3 and manager.host.num_swapped == 2
    manager.check_invariants()


def test_stores_beyond_the_free_host_blocks_in_one_plan_are_dropped_not_doubled():
    manager = BlockManager(9, BS, enable_caching=True, num_host_blocks=3, num_offload_blocks=3)
    cache_prompt(manager, 0, tokens(1, 8 * BS + 1))
    cache_prompt(manager, 1, tokens(2, 9 * BS))  # evicts eight cached blocks in one plan: three fit
    stores, _ = manager.seal_plan()
    assert len(stores) == 3 and len({host for _, host in stores}) == 3
    manager.check_invariants()


def test_forgetting_a_block_drops_its_prefix_from_both_caches():
    manager = BlockManager(5, BS, enable_caching=True, num_host_blocks=4, num_offload_blocks=4)
    first = tokens(1, 4 * BS + 1)
    cache_prompt(manager, 0, first)
    cache_prompt(manager, 1, tokens(2, 5 * BS))
    manager.seal_plan()
    hits = manager.cached_prefix(first)
    manager.allocate_with_hits(2, hits, len(first))
    manager.seal_plan()
    manager.forget_cached(set(manager.block_table(2)[:2]))
    manager.free(2)
    assert manager.cached_prefix(first).num_blocks == 0  # the chain breaks at its first block
    assert tier_block_ids(manager, first)[:2] == [None, None]
    manager.check_invariants()


# --- the engine: a multi-turn chat whose live prefixes exceed the device cache several times ---------------


def chat_engine(tier_blocks: int, swap_blocks: int = 0, fail_swap_ins: int = 0,
                window: int | None = None) -> tuple[EngineCore, FakeWorker]:
    """With swap space, four sequences at once and preemption by swapping: swap-outs and tier stores, swap-ins
    and tier loads share plans and the host pool."""
    worker = FakeWorker(24, BS, vocab_size=1000, num_cpu_blocks=swap_blocks + tier_blocks, num_cpu_offload_blocks=tier_blocks,
                        fail_swap_ins=fail_swap_ins, kv_window=window)
    limits = SchedulerLimits(max_num_seqs=4 if swap_blocks else 2, max_num_batched_tokens=32, enable_chunked_prefill=True,
                             preemption_mode="swap" if swap_blocks else None)
    return EngineCore(InProcessExecutor(worker), limits, enable_prefix_caching=True), worker


def run_chat(engine: EngineCore, conversations: int = 6, turns: int = 4, seed: int = 0) -> dict[str, list[int]]:
    """Each round sends every conversation's next turn (its history, its last reply and new user tokens)."""
    rng = random.Random(seed)
    history = {c: tokens(100 + c, rng.randint(10, 20)) for c in range(conversations)}
    outputs: dict[str, list[int]] = {}
    for turn in range(turns):
        for c in range(conversations):
            params = SamplingParams(max_tokens=rng.randint(2, 6), ignore_eos=True)
            engine.add_request(EngineRequest(f"c{c}t{turn}", history[c], params))
        for _ in range(10_000):
            if not engine.has_unfinished():
                break
            for update in engine.step():
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            check_invariants(engine)
        for c in range(conversations):
            history[c] = history[c] + outputs[f"c{c}t{turn}"] + tokens(1000 * turn + c, rng.randint(3, 8))
    engine.scheduler.blocks.check_invariants()
    return outputs


@pytest.mark.parametrize("swap_blocks,seed", [(0, 0), (0, 1), (16, 0), (16, 2)])
def test_returning_turns_load_their_history_instead_of_computing_it(swap_blocks, seed):
    plain, _ = chat_engine(tier_blocks=0, swap_blocks=swap_blocks)
    expected = run_chat(plain, seed=seed)
    tiered, worker = chat_engine(tier_blocks=96, swap_blocks=swap_blocks)
    assert run_chat(tiered, seed=seed) == expected  # (and the fake worker found every context intact)
    stats, before = tiered.get_stats(), plain.get_stats()
    assert stats["host_cache_hits"] > 0 and stats["kv_offload_blocks_loaded"] * BS == stats["host_cache_hits"]
    assert stats["num_scheduled_tokens"] < before["num_scheduled_tokens"]
    assert stats["prompt_tokens_loaded"] > 0 and before["host_cache_queries"] == 0
    assert any(plan.swap_in for plan in worker.plans) and any(plan.swap_out for plan in worker.plans)
    assert (stats["num_swaps_out"] > 0) == bool(swap_blocks)


@pytest.mark.parametrize("window,seed", [(None, 0), (None, 3), (6, 0), (6, 1), (6, 2)])
def test_a_failed_load_recomputes_its_sequences(window, seed):
    """With a sliding window, the worker's tables keep the ids of entries released behind it, where the
    scheduler's hold none: the sequences the worker left out are the ones recomputed."""
    plain, _ = chat_engine(tier_blocks=0, window=window)
    expected = run_chat(plain, seed=seed)
    failures = 3 if window is None else 50
    tiered, worker = chat_engine(tier_blocks=96, fail_swap_ins=failures, window=window)
    assert run_chat(tiered, seed=seed) == expected  # a sequence that read garbage fails the fake worker's check
    stats = tiered.get_stats()
    assert stats["num_failed_swap_ins"] == failures - worker.fail_swap_ins > 0
    assert window is not None or stats["host_cache_hits"] > 0  # later loads succeed


def test_no_plan_is_made_ahead_of_a_step_that_swaps_blocks_in():
    engine, _ = chat_engine(tier_blocks=96)
    first = tokens(1, 60)
    for request_id, prompt in (("first", first), ("evicts it", tokens(2, 90))):
        engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
        while engine.has_unfinished():
            engine.step()
    engine.add_request(EngineRequest("again", first, SamplingParams(max_tokens=4, ignore_eos=True)))
    assert engine.start_step()
    assert engine._in_flight[0].plan.swap_in  # its prefix comes back from the tier
    assert not engine.can_plan_ahead()
    engine.finish_step()
    assert engine.start_step() and engine.can_plan_ahead()  # a plain decode step: the next may be planned ahead


def test_the_tiers_lookups_and_tokens_reach_vllms_metric_names():
    engine, _ = chat_engine(tier_blocks=96)
    run_chat(engine)
    stats = engine.get_stats()
    collector = VllmMetrics(own=[])
    collector.update({"scheduler": stats_to_proto(stats)}, "fake")
    samples = {(s.name, s.labels.get("source")): s.value for family in collector.collect() for s in family.samples}
    assert samples[("vllm:external_prefix_cache_hits_total", None)] == stats["host_cache_hits"] > 0
    assert samples[("vllm:external_prefix_cache_queries_total", None)] == stats["host_cache_queries"]
    loaded = samples[("vllm:prompt_tokens_by_source_total", "external_kv_transfer")]
    local = samples[("vllm:prompt_tokens_by_source_total", "local_cache_hit")]
    assert loaded == stats["prompt_tokens_loaded"] > 0 and local + loaded == stats["prompt_tokens_cached"]
