"""--scheduling-policy priority (vLLM's): requests ordered by their priority, lower first, then by arrival; the
lowest-priority running sequence is the preemption victim. Under fcfs a priority other than 0 is refused."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.invalid_parameter import InvalidParameter
from shared.request import EngineRequest
from shared.sampling_params import SamplingParams
from tests.scheduler.test_scheduler import check_invariants, make_engine, run_to_completion


def add(engine, name: str, priority: int, prompt_len: int = 8, max_tokens: int = 4) -> None:
    prompt = [1 + (sum(map(ord, name)) * 7 + j) % 40 for j in range(prompt_len)]
    engine.add_request(EngineRequest(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                     priority=priority))


def first_tokens_order(engine) -> list[str]:
    """Request ids in the order their first token came."""
    order: list[str] = []
    while engine.has_unfinished():
        for update in engine.step():
            if update.new_token_ids and update.request_id not in order:
                order.append(update.request_id)
        check_invariants(engine)
    return order


def test_waiting_requests_start_by_priority_then_arrival():
    # One prompt's worth of budget per step and one sequence at a time: requests start strictly in order.
    engine, _ = make_engine(num_blocks=64, budget=8, max_num_seqs=1, chunked=False, policy="priority")
    for name, priority in [("late-normal", 0), ("low", 5), ("urgent", -2), ("normal", 0), ("urgent-2", -2)]:
        add(engine, name, priority)
    assert first_tokens_order(engine) == ["urgent", "urgent-2", "late-normal", "normal", "low"]


def test_fcfs_keeps_arrival_order():
    engine, _ = make_engine(num_blocks=64, budget=8, max_num_seqs=1, chunked=False)
    for name in ("a", "b", "c"):
        add(engine, name, 0)
    assert first_tokens_order(engine) == ["a", "b", "c"]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_lowest_priority_running_sequence_is_preempted(mode):
    """Three requests grow past a pool that holds two: the one of lowest priority (the first to arrive) is
    preempted, though it is the oldest, and resumes only after the others."""
    engine, _ = make_engine(num_blocks=12, block_size=4, budget=64, max_num_seqs=4, policy="priority",
                            host_blocks=32 if mode == "swap" else 0, preemption_mode=mode)
    add(engine, "background", 9, prompt_len=8, max_tokens=12)
    add(engine, "interactive", 0, prompt_len=8, max_tokens=12)
    add(engine, "batch", 1, prompt_len=8, max_tokens=12)
    counts = {"background": 0, "interactive": 0, "batch": 0}
    while engine.scheduler.num_preemptions == 0:
        assert engine.has_unfinished(), "the pool never ran short"
        for update in engine.step():
            counts[update.request_id] += len(update.new_token_ids)
        check_invariants(engine)
    parked = engine.scheduler.swapped if mode == "swap" else engine.scheduler.waiting
    assert [seq.request_id for seq in parked] == ["background"]
    assert [seq.request_id for seq in engine.scheduler.running] == ["interactive", "batch"]
    for name, tokens in run_to_completion(engine).items():
        counts[name] += len(tokens)
    assert counts == {"background": 12, "interactive": 12, "batch": 12}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(-3, 3), st.integers(1, 20), st.integers(1, 12)), min_size=1,
                         max_size=10),
       num_blocks=st.integers(12, 40), chunked=st.booleans())
def test_priorities_change_the_order_not_the_tokens(requests, num_blocks, chunked):
    """Every request finishes with the tokens first come, first served gives it (the fake worker's tokens
    depend on the sequence alone), through preemption; the invariants hold at every step."""
    outputs = {}
    for policy in ("fcfs", "priority"):
        # Unchunked, a prompt (or a recomputed one: prompt and output) must fit the budget whole: 20 + 12.
        engine, _ = make_engine(num_blocks=num_blocks, block_size=4, budget=16 if chunked else 32, max_num_seqs=4,
                                chunked=chunked, policy=policy)
        for i, (priority, prompt_len, max_tokens) in enumerate(requests):
            add(engine, f"r{i}", priority if policy == "priority" else 0, prompt_len, max_tokens)
        outputs[policy] = run_to_completion(engine)
    assert outputs["priority"] == outputs["fcfs"]


def test_a_priority_needs_priority_scheduling_and_an_integer():
    fcfs, _ = make_engine()
    with pytest.raises(InvalidParameter, match="priority scheduling is not enabled") as refused:
        add(fcfs, "r", 1)
    assert refused.value.param == "priority"
    ordered, _ = make_engine(policy="priority")
    for bad in (True, 1.5, 1 << 31):
        with pytest.raises(InvalidParameter, match="must be an integer in"):
            add(ordered, f"r{bad}", bad)
    add(ordered, "fine", -(1 << 31))


def test_offline_generate_takes_one_priority_per_prompt(llama_dir):
    """LLM.generate(priority=[...]) as vLLM's: the order changes, each prompt's greedy tokens do not."""
    from pagedserve import LLM

    prompts = [{"prompt_token_ids": [3 + (5 * i + j) % 400 for j in range(6 + 3 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(llama_dir), scheduling_policy="priority", max_num_seqs=1, kv_cache_memory_bytes=4 << 20)
    try:
        plain = llm.generate(prompts, params, use_tqdm=False)
        ordered = llm.generate(prompts, params, use_tqdm=False, priority=[3, -1, 0, -1])
        with pytest.raises(ValueError, match="priority has 2 values for 4 prompts"):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in ordered] == [o.outputs[0].token_ids for o in plain]
    fcfs = LLM(str(llama_dir), kv_cache_memory_bytes=4 << 20)
    try:
        with pytest.raises(ValueError, match="priority scheduling is not enabled"):
            fcfs.generate(prompts[:1], params, use_tqdm=False, priority=[1])
    finally:
        fcfs.close()
