"""Prefill/decode disaggregation in the engine core (disaggregated_core.py): prompts computed on prefill
stages, their KV pulled into decode stages, and the tokens exactly those of one colocated engine.

The fake workers simulate their pools slot by slot and check every context a sequence reads, so a pull
that moved the wrong block, a block freed on the prefill side before its pull, or a decode-side prefix hit on
the wrong block fails there. The fake worker's tokens depend on the sequence id and length only, which the
two setups share."""

from __future__ import annotations

import random

import pytest

from services.scheduler.disaggregated_core import DisaggregatedCore
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from tests.fake_worker import FakeWorker
from tests.pipeline import Pipeline

BS = 4
LIMITS = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=24, enable_chunked_prefill=True)


def tokens(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(length)]


def fake(num_blocks: int, window: int | None = None, fail_pulls: int = 0) -> FakeWorker:
    return FakeWorker(num_blocks, BS, vocab_size=1000, kv_window=window, fail_pulls=fail_pulls)


def disaggregated(num_prefill: int = 1, num_decode: int = 1, prefill_blocks: int = 40, decode_blocks: int = 40,
                  window: int | None = None, fail_pulls: int = 0, caching: bool = True,
                  limits: SchedulerLimits = LIMITS) -> tuple[DisaggregatedCore, list[FakeWorker], list[FakeWorker]]:
    prefill = [fake(prefill_blocks, window) for _ in range(num_prefill)]
    decode = [fake(decode_blocks, window, fail_pulls) for _ in range(num_decode)]
    for worker in decode:
        worker.peers = {f"prefill{i}": p for i, p in enumerate(prefill)}
    engine = DisaggregatedCore([(InProcessExecutor(w), f"prefill{i}") for i, w in enumerate(prefill)],
                               [(InProcessExecutor(w), f"decode{i}") for i, w in enumerate(decode)], limits,
                               enable_prefix_caching=caching)
    return engine, prefill, decode


def colocated(window: int | None = None, caching: bool = True, limits: SchedulerLimits = LIMITS) -> EngineCore:
    return EngineCore(InProcessExecutor(fake(40, window)), limits, enable_prefix_caching=caching)


def workload(seed: int, count: int = 12) -> list[EngineRequest]:
    """Prompts of 3 to 40 tokens, half of them starting with one of two shared system prompts; some n = 2."""
    rng = random.Random(seed)
    systems = [tokens(seed * 10 + 1, 13), tokens(seed * 10 + 2, 20)]
    requests = []
    for i in range(count):
        prompt = tokens(seed * 100 + i, rng.randint(3, 20))
        if rng.random() < 0.5:
            prompt = rng.choice(systems) + prompt
        params = SamplingParams(max_tokens=rng.randint(1, 12), ignore_eos=True, n=2 if rng.random() < 0.25 else 1)
        requests.append(EngineRequest(f"r{i}", prompt, params))
    return requests


def run(engine: EngineCore, requests: list[EngineRequest], pipelined: bool = False,
        waves: int = 1) -> dict[tuple[str, int], list[int]]:
    """Every request's tokens per sequence, sent in ``waves`` (a later wave hits what the earlier ones cached)."""
    driver = Pipeline(engine) if pipelined else engine
    outputs: dict[tuple[str, int], list[int]] = {}
    size = -(-len(requests) // waves)
    for first in range(0, len(requests), size):
        for request in requests[first:first + size]:
            engine.add_request(request)
        for _ in range(10_000):
            if not driver.has_unfinished():
                break
            for update in driver.step():
                outputs.setdefault((update.request_id, update.seq_index), []).extend(update.new_token_ids)
            check_stages(engine)
        assert not driver.has_unfinished(), "the engine stalled"
    return outputs


def check_stages(engine: EngineCore) -> None:
    for stage in getattr(engine, "stages", ()):
        stage.scheduler.blocks.check_invariants()


def check_all_released(engine: DisaggregatedCore) -> None:
    """Nothing runs any more: no stage holds a block (the prefix caches keep them cached-free) or a handoff."""
    assert len(engine.handoffs) == 0
    for stage in engine.stages:
        assert stage.scheduler.blocks.num_used_blocks == 0, f"stage {stage} still holds blocks"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("pipelined", [False, True])
def test_disaggregated_tokens_are_the_colocated_ones(seed, pipelined):
    expected = run(colocated(), workload(seed), pipelined)
    engine, _, decode = disaggregated()
    assert run(engine, workload(seed), pipelined) == expected
    check_all_released(engine)
    stats = engine.get_stats()
    assert stats["num_kv_pulls"] > 0 and stats["kv_pull_blocks"] > 0
    assert any(plan.pulls for plan in decode[0].plans)
    if not engine.decode[0].scheduler.num_preemptions:  # then the decode worker computed no prompt of its own
        assert all(new.num_scheduled_tokens == 1 and new.output_token_ids
                   and new.num_computed_tokens == len(new.prompt_token_ids) + len(new.output_token_ids) - 1
                   for plan in decode[0].plans for new in plan.new)


def test_prefix_hits_on_either_side_spare_a_prefill_and_a_pull():
    requests = workload(3, count=16)
    expected = run(colocated(), requests, waves=2)
    engine, _, _ = disaggregated()
    assert run(engine, workload(3, count=16), waves=2) == expected
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] > 0  # the prefill side's, for the shared system prompts
    assert stats["kv_pull_blocks_cached"] > 0  # the decode side already held some of those blocks
    check_all_released(engine)


@pytest.mark.parametrize("window", [None, 6])
def test_a_failed_pull_is_recomputed_on_the_decode_side(window):
    expected = run(colocated(window), workload(4), pipelined=True)
    engine, _, decode = disaggregated(window=window, fail_pulls=3)
    assert run(engine, workload(4), pipelined=True) == expected  # a sequence that read garbage fails the check
    assert decode[0].fail_pulls == 0 and engine.get_stats()["num_failed_swap_ins"] == 3
    check_all_released(engine)


def test_a_sliding_window_moves_only_the_blocks_the_window_reads():
    expected = run(colocated(window=6), workload(5))
    engine, _, decode = disaggregated(window=6)
    assert run(engine, workload(5)) == expected
    pulled = [sum(dst in new.block_table for pull in plan.pulls for _, dst in pull.moves)
              for plan in decode[0].plans for new in plan.new]
    assert 0 < max(pulled) <= -(-(6 + 16) // BS) + 1  # the window and the kernel's margin, not whole prompts
    check_all_released(engine)


@pytest.mark.parametrize("seed", [0, 1])
def test_several_prefill_and_decode_workers(seed):
    expected = run(colocated(), workload(seed, count=16))
    engine, prefill, decode = disaggregated(num_prefill=2, num_decode=2)
    assert run(engine, workload(seed, count=16)) == expected
    assert all(any(plan.new for plan in worker.plans) for worker in prefill + decode)  # each did some of it
    assert {pull.source for worker in decode for plan in worker.plans for pull in plan.pulls} == {"prefill0",
                                                                                                 "prefill1"}
    check_all_released(engine)


def test_a_small_decode_cache_holds_handed_off_sequences_back_without_losing_them():
    """The decode stage has room for a few sequences at a time: the rest wait, their blocks held on the prefill
    side, and preemption on the decode side (by recompute) still gives the same tokens."""
    limits = SchedulerLimits(max_num_seqs=8, max_num_batched_tokens=64, enable_chunked_prefill=True)
    expected = run(colocated(limits=limits), workload(6))
    engine, _, _ = disaggregated(decode_blocks=16, limits=limits)
    assert run(engine, workload(6)) == expected
    check_all_released(engine)


def test_beam_search_runs_whole_on_a_decode_stage():
    params = SamplingParams(use_beam_search=True, n=2, max_tokens=5, ignore_eos=True)
    request = EngineRequest("beams", tokens(7, 11), params)
    expected = run(colocated(), [request])
    engine, prefill, _ = disaggregated()
    assert run(engine, [EngineRequest("beams", tokens(7, 11), params)]) == expected
    assert not prefill[0].plans


def test_an_abort_while_awaiting_the_decode_stage_frees_the_prefill_blocks():
    engine, _, _ = disaggregated(decode_blocks=12)
    for i in range(3):
        engine.add_request(EngineRequest(f"long{i}", tokens(i, 30), SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(200):
        engine.step()
        if len(engine.handoffs) and any(s.kv_source is not None and not s.known_to_worker
                                        for stage in engine.decode for s in stage.scheduler.waiting):
            break
    waiting = next(s for stage in engine.decode for s in stage.scheduler.waiting if s.kv_source is not None)
    held = engine.prefill[0].scheduler.blocks.num_used_blocks
    engine.abort_request(waiting.request_id)
    assert engine.prefill[0].scheduler.blocks.num_used_blocks < held
    while engine.has_unfinished() or engine.num_in_flight:
        engine.step()
    check_all_released(engine)


def test_an_abort_while_its_blocks_are_pulled_frees_them_when_the_step_is_back():
    engine, _, _ = disaggregated()
    engine.add_request(EngineRequest("pulled", tokens(8, 30), SamplingParams(max_tokens=8, ignore_eos=True)))
    while not any(stage.in_flight and stage.in_flight[0].plan.pulls for stage in engine.decode):
        engine.step() if not engine.num_in_flight else engine.finish_step()
        engine.start_step()
    held = engine.prefill[0].scheduler.blocks.num_used_blocks
    engine.abort_request("pulled")
    assert engine.prefill[0].scheduler.blocks.num_used_blocks == held  # the decode worker may be reading them
    while engine.num_in_flight:
        engine.finish_step()
    check_all_released(engine)


def test_workers_of_different_models_are_refused():
    prefill, decode = fake(40), FakeWorker(40, 2 * BS, vocab_size=1000)
    with pytest.raises(ValueError, match="block_size"):
        DisaggregatedCore([(InProcessExecutor(prefill), "p")], [(InProcessExecutor(decode), "d")], LIMITS)


# --- through the real model: two workers in this process, the prefill one's blocks read over gRPC ------------


@pytest.fixture
def model_stages(llama_dir, tmp_path):
    """A prefill worker serving ReadBlocks on a Unix socket, and a decode worker: (engine, decode worker)."""
    from concurrent import futures

    import grpc

    from services.worker.server import WorkerServicer
    from services.worker.worker import Worker
    from shared.config import EngineConfig
    from shared.proto import pagedserve_internal_pb2_grpc as wire_grpc

    config = EngineConfig.from_kwargs(model=str(llama_dir), block_size=8, num_gpu_blocks_override=48)
    prefill, decode = Worker(config), Worker(config)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    wire_grpc.add_WorkerServicer_to_server(WorkerServicer(prefill, compute=None), server)
    address = f"unix:{tmp_path}/prefill.sock"
    server.add_insecure_port(address)
    server.start()
    limits = SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64, enable_chunked_prefill=True)
    engine = DisaggregatedCore([(InProcessExecutor(prefill), address)], [(InProcessExecutor(decode), "decode")],
                               limits)
    try:
        yield engine, decode
    finally:
        engine.shutdown()
        decode.kv_puller.close()  # its channel first: the server then goes without cancelling a call
        server.stop(None)


def model_prompts(seed: int) -> list[list[int]]:
    """Two sharing a start (a prefix hit on both sides for the second), one short, one of several blocks."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(37)]
    return [shared + [rng.randrange(1, 500) for _ in range(5)], shared + [rng.randrange(1, 500) for _ in range(9)],
            [rng.randrange(1, 500) for _ in range(3)], [rng.randrange(1, 500) for _ in range(61)]]


def generate_one_by_one(engine, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [next(iter(run(engine, [EngineRequest(f"p{i}", prompt, params)]).values()))
            for i, prompt in enumerate(prompts)]


def test_the_real_model_through_two_workers_equals_transformers(model_stages, llama_dir):
    from tests.oracle import assert_greedy_equal, hf_greedy

    engine, _ = model_stages
    prompts = model_prompts(5)
    for prompt, tokens_out in zip(prompts, generate_one_by_one(engine, prompts)):
        assert_greedy_equal(tokens_out, *hf_greedy(llama_dir, prompt, 8), what=f"prompt of {len(prompt)}")
    stats = engine.get_stats()
    assert stats["num_kv_pulls"] == 4 and stats["kv_pull_blocks_cached"] > 0 and stats["prefix_cache_hits"] > 0
    check_all_released(engine)


def test_a_failed_pull_between_real_workers_is_recomputed(model_stages, llama_dir):
    import torch

    from tests.oracle import assert_greedy_equal, hf_greedy

    engine, decode = model_stages
    fetch, failures = decode.kv_puller._fetch, []

    def fail_once(pull):
        if not failures:  # the destination half written: NaNs, if anything read it
            failures.append(pull)
            decode.kv_pool.view(torch.uint8)[:, :, [dst for _, dst in pull.moves]] = 0xFF
            raise RuntimeError("injected: the transfer broke")
        return fetch(pull)

    decode.kv_puller._fetch = fail_once
    prompts = model_prompts(6)
    for prompt, tokens_out in zip(prompts, generate_one_by_one(engine, prompts)):
        assert_greedy_equal(tokens_out, *hf_greedy(llama_dir, prompt, 8), what=f"prompt of {len(prompt)}")
    assert failures and engine.get_stats()["num_failed_swap_ins"] == 1
    check_all_released(engine)


@pytest.mark.parametrize("pipelined", [False, True])
def test_resumed_requests_and_their_siblings_hand_off_only_once_computed(pipelined):
    """A resumed request has outputs from the start: planned ahead whole, it must not leave the prefill stage
    before that step is back. Its sequences come each on its own; an abort finds each where it is."""
    from shared.resumption import Resumption

    def requests():
        params = SamplingParams(max_tokens=9, ignore_eos=True, n=2)
        return [EngineRequest("resumed", tokens(31, 14), params, resumption=Resumption({0: [5, 6], 1: [7]})),
                EngineRequest("fresh", tokens(32, 30), SamplingParams(max_tokens=6, ignore_eos=True))]

    expected = run(colocated(), requests(), pipelined)
    engine, _, _ = disaggregated(num_prefill=2, num_decode=2)
    assert run(engine, requests(), pipelined) == expected
    check_all_released(engine)
    for steps in range(4):  # again, aborted as its sequences sit on different stages, waiting or running
        engine.add_request(requests()[0])
        for _ in range(steps):
            engine.step()
        engine.abort_request("resumed")
        for _ in range(50):
            if not (engine.has_unfinished() or engine.num_in_flight):
                break
            engine.step()
        assert not any(stage.scheduler.waiting or stage.scheduler.running for stage in engine.stages)
        check_all_released(engine)
