"""Block manager and scheduler: unit tests and property tests of DESIGN.md's invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from services.scheduler.block_manager import BlockManager
from services.scheduler.block_pool import BlockPool
from services.scheduler.engine_core import EngineCore
from services.scheduler.executor import InProcessExecutor
from services.scheduler.scheduler import SchedulerLimits
from services.scheduler.sequence import SequenceStatus
from shared.sampling_params import SamplingParams
from tests.fake_worker import FakeWorker
from tests.pipeline import Pipeline
from shared.request import EngineRequest


def make_engine(num_blocks=16, block_size=4, max_num_seqs=8, budget=32, chunked=True, max_model_len=512,
                caching=False, host_blocks=0, preemption_mode=None, watermark=0.0, speculate=0, window=None,
                policy="fcfs"):
    worker = FakeWorker(num_blocks, block_size, max_model_len=max_model_len, num_cpu_blocks=host_blocks,
                        num_speculative_tokens=speculate, kv_window=window)
    limits = SchedulerLimits(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked,
                             preemption_mode=preemption_mode, scheduling_policy=policy)
    return EngineCore(InProcessExecutor(worker), limits, watermark=watermark, enable_prefix_caching=caching), worker


def check_invariants(engine: EngineCore) -> None:
    blocks = engine.scheduler.blocks
    blocks.check_invariants()
    sched = engine.scheduler
    # Forked siblings may take a request past max_num_seqs sequences, never past that many requests.
    assert len({s.request_id for s in sched.running}) <= sched.limits.max_num_seqs
    order = [(s.request.priority, s.arrival, s.index) for s in sched.running]
    assert order == sorted(order)
    priorities = [s.request.priority for s in sched.waiting]
    assert priorities == sorted(priorities)
    for seq in sched.running:
        assert seq.status is SequenceStatus.RUNNING
        assert len(blocks.block_table(seq.seq_id)) == blocks.blocks_for(seq.num_planned_tokens)
        assert 0 <= seq.num_placeholders <= 1 + (seq.num_inflight_tokens > 0)
    for seq in sched.waiting:
        assert seq.status is SequenceStatus.WAITING
        assert blocks.block_table(seq.seq_id) == [] and seq.num_computed_tokens == 0
    # Shared prefixes count once; entries released behind the window hold no block.
    used = {b for s in sched.running for b in blocks.block_table(s.seq_id)[blocks.num_released_blocks(s.seq_id):]}
    assert len(used) == blocks.num_used_blocks


def add_numbered_request(engine: EngineCore, i: int, prompt_len: int, max_tokens: int, n: int,
                         stop_token_ids: list[int]) -> bool:
    """Request f"r{i}" with a prompt made from i; False if admission refused it."""
    prompt = [1 + (i * 7 + j) % 40 for j in range(prompt_len)]
    try:
        params = SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    except ValueError:
        return False
    return True


def step_and_collect(driver, engine: EngineCore, outputs: dict[tuple[str, int], list[int]]) -> None:
    """One step; its new tokens added to ``outputs`` by (request, sequence); the invariants checked."""
    for update in driver.step():
        outputs.setdefault((update.request_id, update.seq_index), []).extend(update.new_token_ids)
    check_invariants(engine)


def run_to_completion(engine: EngineCore, max_steps: int = 10_000, pipeline: Pipeline | None = None
                      ) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    driver = pipeline or engine
    for _ in range(max_steps):
        if not driver.has_unfinished():
            return outputs
        for update in driver.step():
            outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        check_invariants(engine)
    raise AssertionError("the engine did not finish: livelock")


# --- block pool -------------------------------------------------------------------------------------

def test_free_queue_is_lru_and_removal_is_anywhere():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    assert pool.free_queue.block_ids() == [3]
    pool.free([c, a])
    assert pool.free_queue.block_ids() == [3, 2, 0]
    pool.free_queue.remove(pool.blocks[2])
    assert pool.free_queue.block_ids() == [3, 0]
    with pytest.raises(ValueError):
        pool.free([a])
    with pytest.raises(ValueError):
        pool.allocate(5)


def test_append_slots_grows_one_block_at_a_time_and_accounts_waste():
    manager = BlockManager(num_blocks=8, block_size=4)
    assert manager.append_slots(1, 5).new_block_ids == (0, 1)
    assert manager.wasted_slots() == 3
    assert manager.append_slots(1, 8).new_block_ids == ()
    assert manager.wasted_slots() == 0
    assert manager.append_slots(1, 9).new_block_ids == (2,)
    assert manager.append_slots(2, 100) is None  # nothing partial on failure
    assert manager.block_table(2) == []
    manager.free(1)
    assert manager.num_free_blocks == 8
    manager.check_invariants()


# --- scheduler --------------------------------------------------------------------------------------

def test_decodes_and_chunked_prefill_share_the_token_budget():
    engine, worker = make_engine(num_blocks=64, budget=10)
    engine.add_request(EngineRequest("a", list(range(1, 4)), SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.add_request(EngineRequest("b", list(range(1, 26)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    first = worker.plans[-1]
    assert [(s.seq_id, s.num_scheduled_tokens) for s in first.new] == [(0, 3), (1, 7)]
    engine.step()
    second = worker.plans[-1]
    # a decodes one token first; b's prefill continues with what the budget leaves.
    assert [(s.seq_id, s.num_scheduled_tokens) for s in second.running] == [(0, 1), (1, 9)]
    run_to_completion(engine)
    assert engine.scheduler.blocks.num_free_blocks == 64


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    engine, worker = make_engine(num_blocks=64, budget=20, chunked=False, max_model_len=20)
    engine.add_request(EngineRequest("a", list(range(1, 16)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.add_request(EngineRequest("b", list(range(1, 11)), SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    assert [s.num_scheduled_tokens for s in worker.plans[-1].new] == [15]
    run_to_completion(engine)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_prompt_needing_the_watermarked_blocks_runs_once_nothing_else_does(chunked):
    # 10 blocks, 2 of them watermark: the 37-token prompt needs all 10 (the request fits, 39 tokens).
    engine, worker = make_engine(num_blocks=10, block_size=4, budget=40, chunked=chunked, max_model_len=40,
                                 watermark=0.2)
    engine.add_request(EngineRequest("small", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)))
    engine.add_request(EngineRequest("big", list(range(1, 38)), SamplingParams(max_tokens=2, ignore_eos=True)))
    first = engine.step()
    assert [s.seq_id for s in worker.plans[-1].new] == [0]  # big waits: small runs and may grow
    outputs = run_to_completion(engine, max_steps=20)
    assert len(first[0].new_token_ids + outputs["small"]) == 3 and len(outputs["big"]) == 2
    assert engine.scheduler.blocks.num_free_blocks == 10


def test_preemption_takes_the_newest_and_it_resumes_first():
    engine, worker = make_engine(num_blocks=6, block_size=4, budget=64)
    engine.add_request(EngineRequest("old", list(range(1, 9)), SamplingParams(max_tokens=12, ignore_eos=True)))
    engine.add_request(EngineRequest("new", list(range(1, 9)), SamplingParams(max_tokens=12, ignore_eos=True)))
    outputs = run_to_completion(engine)
    assert engine.scheduler.num_preemptions >= 1
    assert len(outputs["old"]) == len(outputs["new"]) == 12
    victims = [sid for plan in worker.plans for sid in plan.finished_seq_ids]
    assert victims[0] == 1  # the newer sequence was the first dropped
    # Recompute resends the sequence as new with its generated tokens.
    resent = [s for plan in worker.plans for s in plan.new if s.seq_id == 1 and s.output_token_ids]
    assert resent


def test_outputs_do_not_depend_on_memory_pressure():
    def run(num_blocks):
        engine, _ = make_engine(num_blocks=num_blocks, block_size=4, budget=16)
        for i in range(6):
            engine.add_request(EngineRequest(f"r{i}", list(range(1, 3 + 5 * i)),
                                             SamplingParams(max_tokens=10, ignore_eos=True)))
        return run_to_completion(engine), engine.scheduler.num_preemptions

    relaxed, none = run(200)
    tight, some = run(12)
    assert none == 0 and some > 0
    assert relaxed == tight


def test_stop_conditions():
    engine, worker = make_engine(num_blocks=64)
    engine.add_request(EngineRequest("len", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True)))
    run_to_completion(engine)
    # A stop token id: the fake worker's first token for seq 1 with 2 tokens.
    token = worker.token_for({"seq_id": 1, "tokens": [5, 6]})
    engine.add_request(EngineRequest("stop", [5, 6], SamplingParams(max_tokens=8, stop_token_ids=[token])))
    updates = []
    while engine.has_unfinished():
        updates += engine.step()
    assert updates[-1].finish_reason == "stop" and updates[-1].stop_reason == token


def test_abort_frees_blocks_and_tells_the_worker():
    engine, worker = make_engine(num_blocks=64)
    engine.add_request(EngineRequest("a", list(range(1, 20)), SamplingParams(max_tokens=50, ignore_eos=True)))
    engine.step()
    assert engine.scheduler.blocks.num_used_blocks > 0
    engine.abort_request("a")
    assert engine.scheduler.blocks.num_free_blocks == 64
    engine.step()  # sends the drop although nothing runs
    assert worker.plans[-1].finished_seq_ids == [0] and not worker.seqs


@pytest.mark.parametrize("prompt, params, match", [
    ([], SamplingParams(), "empty"),
    ([1] * 600, SamplingParams(), "context length"),
    ([1, 2, 3], SamplingParams(max_tokens=510), "exceeds the context"),
    ([1, 2, 3], SamplingParams(max_tokens=None, min_tokens=510), "min_tokens"),
    ([1, 2, 1000], SamplingParams(), "outside the vocabulary"),
    ([1, 2], SamplingParams(stop_token_ids=[500]), "500 in stop_token_ids is outside the vocabulary"),
    ([1, 2], SamplingParams(logit_bias={600: 1.0}), "600 in logit_bias is outside the vocabulary"),
    ([1, 2], SamplingParams(max_tokens=400), "could never run"),
    ([1, 2], SamplingParams(logprobs=20, max_tokens=4), None),
])
def test_admission_refuses_what_could_never_run(prompt, params, match):
    engine, _ = make_engine(num_blocks=16, block_size=4)
    if match is None:
        engine.add_request(EngineRequest("ok", prompt, params))
        return
    with pytest.raises(ValueError, match=match):
        engine.add_request(EngineRequest("bad", prompt, params))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("block_size, window, budget", [(1, 3, 2), (4, 3, 4), (4, 12, 8), (8, 5, 16), (16, 40, 16),
                                                        (2, 1, 1)])
@pytest.mark.parametrize("n, pipelined", [(1, False), (1, True), (2, False)])
def test_a_pool_of_the_windowed_admission_bound_runs_a_sequence_longer_than_it(block_size, window, budget, n,
                                                                              pipelined):
    """With every layer windowed (and chunked prefill) admission asks only for the blocks a sequence holds
    at once. A pool of exactly that many must run a request needing several times more to the end (an
    unsound bound admits what then preempts itself forever: run_to_completion calls that a livelock)."""
    probe, _ = make_engine(block_size=block_size, budget=budget, window=window)
    num_blocks = probe.scheduler.blocks.most_blocks_held(200, budget)
    assert num_blocks < probe.scheduler.blocks.blocks_for(200)
    engine, worker = make_engine(num_blocks, block_size, budget=budget, max_model_len=256, window=window, caching=True,
                                 host_blocks=num_blocks)
    engine.add_request(EngineRequest("long", [1 + i % 50 for i in range(150)], SamplingParams(n=n, max_tokens=50)))
    engine.add_request(EngineRequest("other", [1 + i % 7 for i in range(60)], SamplingParams(max_tokens=20)))
    outputs = run_to_completion(engine, pipeline=Pipeline(engine) if pipelined else None)
    assert len(outputs["long"]) == 50 * n and len(outputs["other"]) == 20
    engine.step()  # tells the worker to drop the last finished sequence
    assert engine.scheduler.blocks.num_used_blocks == 0 and not worker.seqs
    with pytest.raises(ValueError, match="could never run"):  # one block fewer is refused
        make_engine(num_blocks - 1, block_size, budget=budget, max_model_len=256, window=window)[0].add_request(
            EngineRequest("long", [1] * 150, SamplingParams(max_tokens=50)))


def test_duplicate_request_id_is_refused():
    engine, _ = make_engine()
    engine.add_request(EngineRequest("a", [1], SamplingParams()))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("a", [1], SamplingParams()))


# --- property tests ---------------------------------------------------------------------------------

adds = st.tuples(st.sampled_from(["add", "add", "beam"]), st.integers(1, 40), st.integers(1, 20), st.integers(1, 3))
operations = st.lists(st.one_of(adds, st.tuples(st.just("step"), st.integers(1, 4)),
                                st.tuples(st.just("abort"), st.integers(0, 30))), min_size=1, max_size=40)


PREEMPTIONS: list[int] = []
SWAPS: list[int] = []
AHEAD: list[int] = []  # steps planned ahead, per pipelined example


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=st.lists(adds, min_size=2, max_size=6), ops=operations, block_size=st.sampled_from([1, 2, 4, 8]),
       num_blocks=st.integers(4, 20), budget=st.integers(1, 48), max_num_seqs=st.integers(1, 6), chunked=st.booleans(),
       caching=st.booleans(), prefixes=st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=40), min_size=1,
                                                max_size=3),
       host_blocks=st.sampled_from([0, 4, 40]), mode=st.sampled_from([None, "swap", "recompute"]),
       pipelined=st.booleans(), watermark=st.sampled_from([0.0, 0.0, 0.2]), window=st.sampled_from([None, None, 3, 12]))
def test_random_interleavings_keep_every_invariant(first, ops, block_size, num_blocks, budget, max_num_seqs, chunked,
                                                   caching, prefixes, host_blocks, mode, pipelined, watermark, window):
    max_model_len = 64
    if not chunked:
        budget = max(budget, max_model_len)  # else a long prompt could never be scheduled
    engine, worker = make_engine(num_blocks, block_size, max_num_seqs, budget, chunked, max_model_len, caching,
                                 host_blocks, mode, watermark, window=window)
    pipeline = Pipeline(engine) if pipelined else None
    driver = pipeline or engine
    added = []
    for op in first + ops:
        if op[0] in ("add", "beam"):
            kind, prompt_len, max_tokens, n = op
            # Prompts share prefixes, so the prefix cache has something to find.
            prefix = prefixes[prompt_len % len(prefixes)]
            prompt = (prefix + [1 + i % 50 for i in range(prompt_len)])[:prompt_len]
            params = SamplingParams(n=n, max_tokens=max_tokens) if kind == "add" else SamplingParams(
                use_beam_search=True, beam_width=n, n=1 + n // 2, max_tokens=max_tokens, stop_token_ids=[prompt[-1]])
            try:
                engine.add_request(EngineRequest(f"r{len(added)}", prompt, params))
                added.append(f"r{len(added)}")
            except ValueError:
                pass  # refused at admission: too long for the context or the cache
        elif op[0] == "step":
            for _ in range(op[1]):
                plan_budget = engine.scheduler.limits.max_num_batched_tokens
                driver.step()
                if worker.plans:
                    assert worker.plans[-1].num_scheduled_tokens <= plan_budget
                check_invariants(engine)
        elif added:
            engine.abort_request(added[op[1] % len(added)])  # with a step in flight, when pipelined
            check_invariants(engine)
    run_to_completion(engine, pipeline=pipeline)
    engine.step()
    PREEMPTIONS.append(engine.scheduler.num_preemptions)
    SWAPS.append(engine.scheduler.num_swaps_out)
    if pipeline is not None:
        AHEAD.append(pipeline.ahead)
    target(float(engine.scheduler.num_preemptions), label="preemptions")  # steer towards memory pressure
    target(float(engine.scheduler.num_swaps_out), label="swaps")
    assert engine.scheduler.blocks.num_free_blocks == num_blocks  # cached-free blocks count as free
    assert engine.scheduler.blocks.num_used_blocks == 0
    assert engine.scheduler.blocks.num_free_host_blocks == host_blocks
    assert not worker.seqs, "the worker still holds state of finished sequences"


def test_the_property_test_exercised_preemption():
    # Runs after the property test (file order): a property test that never preempts proves little.
    if not PREEMPTIONS:
        pytest.skip("the property test did not run in this session")
    assert sum(1 for n in PREEMPTIONS if n > 0) >= 3, PREEMPTIONS
    assert sum(1 for n in SWAPS if n > 0) >= 2, SWAPS
    # Of ~150 examples, 27-47 were pipelined and 9-24 of those planned ahead (6 runs; 400 are drawn now): the bar
    # sits well below that, so it fails only when the generator stops reaching the path.
    assert sum(1 for n in AHEAD if n > 0) >= 3, AHEAD


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.integers(1, 3), st.booleans()),
                         min_size=1, max_size=10),
       block_size=st.sampled_from([1, 4, 8]), num_blocks=st.integers(12, 40), budget=st.integers(4, 40),
       caching=st.booleans(), arrive_every=st.integers(1, 3), window=st.sampled_from([None, 3, 12]))
def test_planning_ahead_changes_no_output(requests, block_size, num_blocks, budget, caching, arrive_every, window):
    """The same requests, arriving at the same steps, give the same tokens whether each step is
    planned after the previous result or while it runs (the fake worker's tokens depend only on
    the sequence and its length). Stop tokens end some sequences one step into a plan made ahead."""
    runs = []
    for pipelined in (False, True):
        engine, _ = make_engine(num_blocks, block_size, max_num_seqs=4, budget=budget, max_model_len=64,
                                caching=caching, window=window)
        driver = Pipeline(engine) if pipelined else engine
        outputs: dict[tuple[str, int], list[int]] = {}
        for i, (prompt_len, max_tokens, n, stop) in enumerate(requests):
            if not add_numbered_request(engine, i, prompt_len, max_tokens, n, list(range(1, 30)) if stop else []):
                continue
            for _ in range(arrive_every):
                step_and_collect(driver, engine, outputs)
        while driver.has_unfinished():
            step_and_collect(driver, engine, outputs)
        runs.append(outputs)
    assert runs[0] == runs[1]


ACCEPTED: list[int] = []  # drafts accepted, per speculative example


@settings(max_examples=50, deadline=None)
@given(requests=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 16), st.integers(1, 3), st.booleans()),
                         min_size=1, max_size=8),
       block_size=st.sampled_from([1, 2, 4, 8]), num_blocks=st.integers(8, 40), budget=st.integers(2, 40),
       caching=st.booleans(), speculate=st.integers(1, 5), host_blocks=st.sampled_from([0, 40]),
       mode=st.sampled_from([None, "swap", "recompute"]), arrive_every=st.integers(1, 3),
       aborts=st.lists(st.integers(0, 30), max_size=2), window=st.sampled_from([None, 3, 12]))
def test_speculation_changes_no_output(requests, block_size, num_blocks, budget, caching, speculate, host_blocks,
                                       mode, arrive_every, aborts, window):
    """Drafts (some right, some wrong) verified under memory pressure, preemption, prefix caching, n > 1,
    stop tokens, max_tokens and aborts give the same tokens as plain decoding (the fake worker's tokens
    depend only on the sequence and its length), and every invariant holds after every step: the
    blocks of rejected drafts are released, and an accepted draft's KV reads as its token later."""
    runs, aborted = [], set()
    for k in (0, speculate):
        engine, worker = make_engine(num_blocks, block_size, max_num_seqs=4, budget=budget, max_model_len=64,
                                     caching=caching, host_blocks=host_blocks, preemption_mode=mode, speculate=k,
                                     window=window)
        outputs: dict[tuple[str, int], list[int]] = {}
        step = 0
        for i, (prompt_len, max_tokens, n, stop) in enumerate(requests):
            if not add_numbered_request(engine, i, prompt_len, max_tokens, n, list(range(1, 12)) if stop else []):
                continue
            for _ in range(arrive_every):
                step += 1
                if step in aborts:  # how far it got depends on the speed: only the others are compared
                    engine.abort_request(f"r{i}")
                    aborted.add(f"r{i}")
                step_and_collect(engine, engine, outputs)
        while engine.has_unfinished():
            step_and_collect(engine, engine, outputs)
        engine.step()  # the drops of the last step
        assert engine.scheduler.blocks.num_used_blocks == 0 and not worker.seqs
        if k:
            ACCEPTED.append(worker.num_accepted)
            stats = engine.get_stats()
            assert stats["spec_decode_num_accepted_tokens"] == worker.num_accepted
            assert stats["spec_decode_num_draft_tokens"] >= worker.num_accepted
            assert all(len(d.draft_token_ids) <= k for plan in worker.plans for d in plan.running)
            assert all(plan.num_scheduled_tokens <= budget for plan in worker.plans)
        runs.append(outputs)
    assert [{key: out for key, out in run.items() if key[0] not in aborted} for run in runs] == \
        [{key: out for key, out in run.items() if key[0] not in aborted} for run in runs[::-1]]
    assert runs[0].keys() - {key for key in runs[0] if key[0] in aborted} == \
        runs[1].keys() - {key for key in runs[1] if key[0] in aborted}


def test_the_speculation_property_test_accepted_drafts():
    if not ACCEPTED:
        pytest.skip("the property test did not run in this session")
    # Some examples must have accepted drafts for the property to mean anything: typically 25-40 of 50 do; a
    # third of them, the bar before, failed now and then with fresh examples.
    assert sum(1 for n in ACCEPTED if n > 0) >= min(5, len(ACCEPTED)), ACCEPTED


def test_rejected_drafts_give_their_blocks_back():
    engine, worker = make_engine(num_blocks=32, block_size=2, budget=64, speculate=4)
    engine.add_request(EngineRequest("a", [5, 6, 7], SamplingParams(max_tokens=30)))
    blocks, released = engine.scheduler.blocks, []
    trim = blocks.trim_slots
    blocks.trim_slots = lambda seq_id, num_tokens: released.append(trim(seq_id, num_tokens)) or released[-1]
    while engine.has_unfinished():
        engine.step()
        check_invariants(engine)  # the table covers the computed tokens, as without drafts
    drafted = [d for plan in worker.plans for d in plan.running if d.draft_token_ids]
    assert drafted and sum(released) > 0 and worker.num_accepted > 0
    assert not engine.can_plan_ahead()  # never with speculation: a result's drafts would be stale


def test_drafts_never_displace_a_running_sequence_s_token_nor_preempt():
    """Drafts are optional: the newer of two decoding sequences gets its token every step however
    many drafts the older was offered, and drafts that do not fit in the free blocks are cut rather
    than preempting anyone (found by review: both happened)."""
    for k in (0, 4):
        engine, worker = make_engine(num_blocks=64, block_size=4, budget=4, speculate=k)
        for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
            engine.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=40, ignore_eos=True)))
        while engine.has_unfinished():
            decoding = sum(1 for s in engine.scheduler.running if s.output_token_ids)
            engine.step()
            check_invariants(engine)
            assert decoding < 2 or len(worker.plans[-1].running) == 2, f"k={k}: a decoding sequence got no token"
        tight, _ = make_engine(num_blocks=4, block_size=4, budget=32, speculate=k)
        tight.add_request(EngineRequest("a", [1, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True)))
        tight.add_request(EngineRequest("b", [4, 5, 6], SamplingParams(max_tokens=4, ignore_eos=True)))
        run_to_completion(tight)
        assert tight.get_stats()["num_preemptions"] == 0, f"k={k}: drafts preempted a sequence"


def test_blocks_filled_by_accepted_drafts_are_cached_even_when_the_sequence_stops_there():
    """A chat's next turn (the prompt, the output and more) finds as many cached tokens after
    speculative decoding as after plain decoding (found by review: the last blocks were lost)."""
    hits = []
    for k in (0, 4):
        engine, worker = make_engine(num_blocks=64, block_size=4, caching=True, speculate=k)
        engine.add_request(EngineRequest("first", [1, 2, 3, 4, 5], SamplingParams(max_tokens=20, ignore_eos=True)))
        output = run_to_completion(engine)["first"]
        before = engine.get_stats()["prefix_cache_hits"]
        engine.add_request(EngineRequest("next", [1, 2, 3, 4, 5] + output + [7], SamplingParams(max_tokens=1)))
        run_to_completion(engine)
        hits.append(engine.get_stats()["prefix_cache_hits"] - before)
        assert k == 0 or worker.num_accepted > 0
    assert hits[0] == hits[1] == 24


# --- prefix caching ---------------------------------------------------------------------------------

def test_cached_free_blocks_are_evicted_deepest_first_and_revived_by_hits():
    pool = BlockPool(4, enable_caching=True)
    blocks = pool.allocate(3)
    for i, block in enumerate(blocks):
        pool.cache_block(block, bytes([i]))
    pool.free(blocks[::-1])  # a sequence frees last block first
    assert pool.num_cached_free == 3 and pool.free_queue.block_ids() == [3, 2, 1, 0]
    pool.touch([pool.cached_block(bytes([0]))])  # a hit takes the block back off the free queue
    assert pool.num_cached_free == 2 and pool.free_queue.block_ids() == [3, 2, 1]
    (fresh,) = pool.allocate(1)  # the never-cached block goes first ...
    assert fresh.block_id == 3
    (evicted,) = pool.allocate(1)  # ... then the deepest cached block, which loses its index entry
    assert evicted.block_id == 2 and pool.cached_block(bytes([2])) is None and evicted.block_hash is None
    assert pool.cached_block(bytes([1])) is blocks[1]


def test_a_prompt_extending_a_cached_one_computes_only_the_new_part():
    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64, caching=True)
    base = list(range(1, 18))  # 17 tokens: 4 full blocks
    engine.add_request(EngineRequest("a", base, SamplingParams(max_tokens=2, ignore_eos=True)))
    run_to_completion(engine)
    engine.add_request(EngineRequest("b", base + [30, 31, 32], SamplingParams(max_tokens=2, ignore_eos=True)))
    engine.step()
    (new,) = worker.plans[-1].new
    assert new.num_computed_tokens == 16 and new.num_scheduled_tokens == 4
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] == 16 and stats["prefix_cache_queries"] == 17 + 20
    run_to_completion(engine)


def test_at_least_one_token_is_always_computed():
    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64, caching=True)
    prompt = list(range(1, 17))  # exactly 4 blocks
    engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    run_to_completion(engine)
    engine.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1, ignore_eos=True)))
    engine.step()
    (new,) = worker.plans[-1].new
    assert new.num_computed_tokens == 12 and new.num_scheduled_tokens == 4


def test_cache_salt_separates_requests():
    engine, worker = make_engine(num_blocks=64, block_size=4, budget=64, caching=True)
    prompt = list(range(1, 18))
    engine.add_request(EngineRequest("a", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-1"))
    run_to_completion(engine)
    engine.add_request(EngineRequest("b", prompt, SamplingParams(max_tokens=1), cache_salt="tenant-2"))
    engine.step()
    assert worker.plans[-1].new[0].num_computed_tokens == 0


# --- forks, copy-on-write, swapping -------------------------------------------------------------------

def test_siblings_fork_from_the_prompt_and_copy_the_shared_last_block_on_write():
    engine, worker = make_engine(num_blocks=16, block_size=4, budget=64)
    engine.add_request(EngineRequest("r", [5, 6, 7, 8, 9, 10], SamplingParams(n=3, max_tokens=4, ignore_eos=True)))
    engine.step()  # the prompt, once; three first tokens
    assert len(worker.plans[-1].new) == 1 and worker.plans[-1].new[0].num_siblings == 2
    assert engine.scheduler.blocks.num_used_blocks == 2  # shared by all three
    engine.step()  # forks, then each writes into the shared, partly filled second block
    plan = worker.plans[-1]
    assert [(f.parent_seq_id, f.child_index) for f in plan.forks] == [(0, 1), (0, 2)]
    assert len(plan.copies) == 2  # two writers copy; the last holder writes in place
    assert engine.scheduler.blocks.num_used_blocks == 4
    outputs = run_to_completion(engine)
    assert engine.scheduler.blocks.num_free_blocks == 16
    assert len(outputs["r"]) == 3 * 4 - 6  # the two steps above produced six


def test_swapped_sequences_resume_with_their_kv_intact():
    engine, worker = make_engine(num_blocks=8, block_size=4, budget=64, host_blocks=16, preemption_mode="swap")
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", list(range(1 + i, 9 + i)),
                                         SamplingParams(max_tokens=10, ignore_eos=True)))
    outputs = run_to_completion(engine)  # the fake worker checks every context token after each move
    stats = engine.get_stats()
    assert stats["num_preemptions_swap"] > 0 and stats["num_swaps_in"] == stats["num_swaps_out"]
    assert stats["num_preemptions_recompute"] == 0
    assert all(len(tokens) == 10 for tokens in outputs.values())
    assert not any(p.swap_in and p.swap_out for p in worker.plans), "a step both swapped out and in"


def test_aborting_a_swapped_request_frees_its_host_blocks():
    engine, worker = make_engine(num_blocks=8, block_size=4, budget=64, host_blocks=16, preemption_mode="swap")
    for i in range(3):
        engine.add_request(EngineRequest(f"r{i}", list(range(1 + i, 9 + i)),
                                         SamplingParams(max_tokens=10, ignore_eos=True)))
    while not engine.scheduler.swapped:
        engine.step()
    victim = engine.scheduler.swapped[0]
    engine.abort_request(victim.request_id)
    assert engine.scheduler.blocks.num_free_host_blocks == 16
    run_to_completion(engine)
    engine.step()
    assert not worker.seqs and engine.scheduler.blocks.num_free_blocks == 8


def test_beam_search_forks_beams_and_frees_dead_ones():
    engine, worker = make_engine(num_blocks=32, block_size=4, budget=64)
    engine.add_request(EngineRequest("b", [5, 6, 7, 8, 9, 10], SamplingParams(use_beam_search=True, beam_width=3, n=2,
                                                                              max_tokens=6, ignore_eos=True)))
    updates = []
    for _ in range(50):
        if not engine.has_unfinished():
            break
        updates += engine.step()
        check_invariants(engine)
    finals = [u for u in updates if u.finish_reason is not None]
    assert sorted(u.seq_index for u in finals) == [0, 1]
    assert all(len(u.new_token_ids) == 6 and u.finish_reason == "length" for u in finals)
    assert any(plan.forks for plan in worker.plans) and any(plan.finished_seq_ids for plan in worker.plans)
    engine.step()
    assert engine.scheduler.blocks.num_free_blocks == 32 and not worker.seqs
