"""A gateway over several schedulers: the routing rule on stand-in clients, then two real
schedulers (each with its worker) behind one gateway, one of whose workers dies and comes back,
and one of which dies under a stream that goes on at the other."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import signal
import time

from tests import patient_http as httpx
import pytest

from benchmarks.serving import parse_engine_stats
from pagedserve import LLM, SamplingParams
from services.gateway.prefix_routing import PrefixIndex, prompt_keys
from services.gateway.scheduler_pool import BALANCE_SLACK, SchedulerPool, _affinity_key, _score
from shared.grpc_errors import ServiceUnavailable
from shared.proto import pagedserve_internal_pb2 as wire
from shared.request import EngineRequest
from tests.services_harness import START_LIMIT_S, Stack, http_get


class StandIn:
    """As much of a SchedulerClient as the pool uses for choosing, submitting and polling."""

    def __init__(self, address: str, reachable: bool = True, model: str = "/m/one", block_size: int = 0):
        self.address, self.num_in_flight, self.reachable, self.submitted = address, 0, reachable, []
        self.model, self.health_error, self.block_size = model, None, block_size
        self.prefix_index, self.sessions_opened = PrefixIndex(), 0

    async def open_session(self):
        self.sessions_opened += 1

    def cached_blocks(self, keys: list[int]) -> int:
        return self.prefix_index.cached_blocks(keys)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.prefix_index)

    async def submit(self, request: EngineRequest):
        if not self.reachable:
            raise ServiceUnavailable(f"{self.address} is down")
        self.submitted.append(request.request_id)
        return self.address

    async def healthy(self) -> bool:
        if self.health_error is not None:
            raise self.health_error
        return self.reachable

    async def info(self) -> wire.EngineInfo:
        return wire.EngineInfo(model=self.model, max_model_len=512, vocab_size=512, protocol_version=3,
                               block_size=self.block_size)


def polled(*clients: StandIn) -> SchedulerPool:
    """A pool over the stand-ins, after one health poll."""
    pool = SchedulerPool(list(clients))

    async def poll():
        for client in clients:
            await pool._poll_one(client)

    asyncio.run(poll())
    return pool


def request(prompt: list[int], cache_salt: str | None = None, request_id: str = "r") -> EngineRequest:
    return EngineRequest(request_id, prompt, cache_salt=cache_salt)


def prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(rng.randrange(1, 80))]


def test_prompts_sharing_a_head_meet_on_one_scheduler_and_the_rest_spread():
    clients = [StandIn(f"s{i}:1") for i in range(3)]
    pool = polled(*clients)
    rng = random.Random(0)
    head = prompt(rng)[:10] * 4  # 40 tokens: longer than what the hash reads
    first = pool.candidates(request(head + [1, 2]))[0]
    assert all(pool.candidates(request(head + prompt(rng)))[0] is first for _ in range(20))
    salted = (pool.candidates(request(head, salt))[0] for salt in ("salt", "other"))
    assert any(chosen is not first for chosen in salted)
    counts = {c.address: 0 for c in clients}
    for _ in range(600):
        counts[pool.candidates(request(prompt(rng)))[0].address] += 1
    assert all(150 < n < 250 for n in counts.values()), counts


def holding(client: StandIn, prompt_tokens: list[int], num_blocks: int) -> None:
    """The stand-in's session says its caches hold the prompt's first num_blocks blocks (and other prefixes)."""
    keys = prompt_keys(request(prompt_tokens), client.block_size)[:num_blocks]
    client.prefix_index.apply(wire.SessionEvents(cache_snapshot=True, cache_added=keys + [7, 8, 9]))


def test_a_request_goes_where_the_longest_start_of_its_prompt_is_cached_within_the_slack():
    clients = [StandIn(f"s{i}:1", block_size=4) for i in range(3)]
    pool = polled(*clients)
    assert [c.sessions_opened for c in clients] == [1, 1, 1]  # the poll opens each serving one's session
    tokens = prompt(random.Random(5))[:10] * 5  # 50 tokens: 12 full blocks before the last token
    by_hash = pool.candidates(request(tokens))  # nothing cached anywhere yet: rule 3's order
    second, third = [c for c in clients if c is not by_hash[0]]
    holding(second, tokens, 3)
    holding(third, tokens, 9)
    assert pool.candidates(request(tokens))[0] is third
    salted = request(tokens, cache_salt="other")  # another cache key: no hit, rule 3
    assert pool.candidates(salted)[0] is max(clients, key=lambda c: _score(c.address, _affinity_key(salted)))
    third.num_in_flight = BALANCE_SLACK + 1  # above the slack: the next longest within it
    assert pool.candidates(request(tokens))[0] is second
    second.num_in_flight = BALANCE_SLACK + 1
    by_hash[0].num_in_flight = 0
    assert pool.candidates(request(tokens))[0] is by_hash[0]  # nothing held within the slack: rule 3
    holding(by_hash[0], tokens, 9)
    by_hash[0].num_in_flight, third.num_in_flight = 1, 1
    assert pool.candidates(request(tokens))[0] is by_hash[0]  # equal holdings and loads: the hash order decides
    third.num_in_flight = 0
    assert pool.candidates(request(tokens))[0] is third  # equal holdings: the less loaded


def test_the_prefix_index_counts_each_cache_and_a_snapshot_starts_it_again():
    index = PrefixIndex()
    index.apply(wire.SessionEvents(cache_snapshot=True, cache_added=[1, 2, 3]))
    index.apply(wire.SessionEvents(cache_added=[2, 4], cache_removed=[2, 1]))  # 2 moved between caches; 1 left
    assert index.cached_blocks([3, 2, 4]) == 3 and index.cached_blocks([1, 2]) == 0 and len(index) == 3
    index.apply(wire.SessionEvents(cache_removed=[2]))
    assert index.cached_blocks([3, 2]) == 1
    index.apply(wire.SessionEvents(cache_snapshot=True, cache_added=[9]))
    assert index.cached_blocks([9, 3]) == 1 and len(index) == 1
    index.clear()
    assert len(index) == 0


def test_an_overloaded_preferred_scheduler_yields_to_the_least_loaded_and_down_ones_go_last():
    a, b, c = StandIn("a:1"), StandIn("b:1"), StandIn("c:1")
    pool = polled(a, b, c)
    tokens = next(p for p in ([i] * 5 for i in range(100)) if pool.candidates(request(p))[0] is a)
    a.num_in_flight, b.num_in_flight, c.num_in_flight = BALANCE_SLACK + 1, 1, 1
    assert pool.candidates(request(tokens))[0] is a  # within the slack: the prefix cache wins
    a.num_in_flight = BALANCE_SLACK + 2
    assert pool.candidates(request(tokens))[0] in (b, c) and pool.candidates(request(tokens))[2] is a
    c.num_in_flight = 0
    assert pool.candidates(request(tokens)) == [c, b, a]
    a.num_in_flight, b.num_in_flight, c.num_in_flight = 100, 80, 81  # the slack grows with the load
    assert pool.candidates(request(tokens))[0] is a
    pool._serving["c:1"] = False
    assert pool.candidates(request(tokens))[-1] is c
    pool._excluded["b:1"] = "another model"
    assert pool.candidates(request(tokens)) == [a, c]


def test_a_request_goes_to_the_next_scheduler_when_one_cannot_be_reached():
    down, up = StandIn("down:1"), StandIn("up:1")
    pool = polled(down, up)
    tokens = next(p for p in ([i] * 5 for i in range(100)) if pool.candidates(request(p))[0] is down)
    down.reachable = False  # since the poll
    assert asyncio.run(pool.submit(request(tokens, request_id="r1"))) == "up:1"
    # Marked until a poll says otherwise.
    assert not pool._serving["down:1"] and pool.candidates(request(tokens))[0] is up
    up.reachable = False
    with pytest.raises(ServiceUnavailable, match="down"):
        asyncio.run(pool.submit(request(tokens, request_id="r2")))
    # A resumed request tries the scheduler it was lost at last (it may be hung, unknown to the poll).
    down.reachable = up.reachable = True
    pool = polled(down, up)
    assert asyncio.run(pool.submit(request(tokens, request_id="r3"), avoid="down:1")) == "up:1"
    up.reachable = False  # last, not never
    assert asyncio.run(pool.submit(request(tokens, request_id="r4"), avoid="down:1")) == "down:1"
    with pytest.raises(ValueError, match="distinct"):
        SchedulerPool([StandIn("a:1"), StandIn("a:1")])


def test_a_scheduler_serving_another_model_is_never_used_and_a_failing_poll_means_not_serving():
    a, b, c = StandIn("a:1"), StandIn("b:1", model="/m/two"), StandIn("c:1")
    pool = polled(a, b, c)  # all healthy from the start: b is still compared
    assert "b:1" in pool._excluded and [x.address for x in pool.candidates(request([1]))] in (["a:1", "c:1"],
                                                                                          ["c:1", "a:1"])
    c.health_error = RuntimeError("UNIMPLEMENTED: no health service there")
    asyncio.run(pool._poll_one(c))
    assert not pool._serving["c:1"] and pool.candidates(request([1]))[0] is a
    c.health_error, c.model = None, "/m/three"  # back, on another model
    asyncio.run(pool._poll_one(c))
    assert "c:1" in pool._excluded and pool.candidates(request([1])) == [a]
    fresh = SchedulerPool([StandIn("x:1"), StandIn("y:1")])  # before any poll: every one, least loaded first
    assert len(fresh.candidates(request([1]))) == 2


# --- two real schedulers ------------------------------------------------------------------------------

WORKER_ARGS = ("--num-gpu-blocks-override", "256")


@pytest.fixture(scope="module")
def stacks(llama_dir, tmp_path_factory):
    second = Stack(llama_dir, tmp_path_factory.mktemp("pool-b"), worker_args=WORKER_ARGS).start_backend()
    try:
        first = Stack(llama_dir, tmp_path_factory.mktemp("pool-a"), worker_args=WORKER_ARGS,
                      gateway_args=("--scheduler", second.scheduler_address)).start()
        try:
            yield first, second
        finally:
            first.stop()
    finally:
        second.stop()


def per_metric(stack, name: str) -> dict[str, float]:
    text = http_get(f"{stack.base_url}/metrics")[1]
    found = {}
    for line in text.splitlines():
        if line.startswith(f"{name}{{"):
            found[line.split('scheduler="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


def per_scheduler(stack, stat: str) -> dict[str, float]:
    return per_metric(stack, f"pagedserve_engine_{stat}")


def wait_routable(stack, addresses: set[str], timeout_s: float = START_LIMIT_S) -> None:
    """Until the gateway's health poll sends new requests to exactly these schedulers."""
    deadline = time.monotonic() + timeout_s
    while {a for a, up in per_metric(stack, "pagedserve_scheduler_routable").items() if up} != addresses:
        assert time.monotonic() < deadline, per_metric(stack, "pagedserve_scheduler_routable")
        time.sleep(0.1)


def complete(stack, text: str, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{stack.base_url}/v1/completions", timeout=timeout,
                      json={"model": stack.model_name, "prompt": text, "max_tokens": 5, "temperature": 0})


def test_requests_spread_over_both_schedulers_with_the_offline_api_s_tokens(stacks, llama_dir):
    first, second = stacks
    rng = random.Random(1)
    texts = [" ".join(rng.choice(["alpha", "beta", "gamma", "delta", "eps"]) for _ in range(rng.randrange(2, 30)))
             for _ in range(24)]
    offline = LLM(str(llama_dir)).generate(texts, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    wait_routable(first, {first.scheduler_address, second.scheduler_address})
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda t: complete(first, t), texts))
    assert [r.status_code for r in replies] == [200] * len(texts)
    assert [r.json()["choices"][0]["text"] for r in replies] == [o.outputs[0].text for o in offline]
    steps = per_scheduler(first, "num_steps")
    assert set(steps) == {first.scheduler_address, second.scheduler_address} and all(steps.values()), steps
    # One prompt, again and again: always the same scheduler, whose prefix cache has it.
    hits = per_scheduler(first, "prefix_cache_hits")
    long_prompt = " ".join(["omega"] * 60)
    for _ in range(4):
        assert complete(first, long_prompt).status_code == 200
    gained = {a: n - hits.get(a, 0) for a, n in per_scheduler(first, "prefix_cache_hits").items()}
    assert sorted(v > 0 for v in gained.values()) == [False, True], gained


def test_a_prompt_sharing_one_cached_block_goes_where_that_block_is(stacks):
    first, second = stacks
    wait_routable(first, {first.scheduler_address, second.scheduler_address})
    block_size = 16  # the workers' default
    rng = random.Random(4)
    head = [rng.randrange(1, 500) for _ in range(block_size)]
    cached = head + [rng.randrange(1, 500) for _ in range(24)]
    holder = max(stacks, key=lambda s: _score(s.scheduler_address, _affinity_key(request(cached))))
    # A prompt that shares only its first block: its own first 32 tokens hash to the other scheduler.
    tail = next(t for t in ([rng.randrange(1, 500) for _ in range(24)] for _ in range(200))
                if max(stacks, key=lambda s: _score(s.scheduler_address, _affinity_key(request(head + t))))
                is not holder)
    known = per_metric(first, "pagedserve_scheduler_prefix_blocks").get(holder.scheduler_address, 0)
    assert complete(first, cached).status_code == 200
    deadline = time.monotonic() + 30  # (its session applies the blocks before the tokens that follow them)
    while per_metric(first, "pagedserve_scheduler_prefix_blocks").get(holder.scheduler_address, 0) < known + 2:
        assert time.monotonic() < deadline, "the gateway never heard what the scheduler caches"
        time.sleep(0.05)
    hits = per_scheduler(first, "prefix_cache_hits")
    assert complete(first, head + tail).status_code == 200
    gained = {a: n - hits.get(a, 0) for a, n in per_scheduler(first, "prefix_cache_hits").items()}
    assert gained[holder.scheduler_address] == block_size and sum(gained.values()) == block_size, gained


def test_a_dead_worker_s_scheduler_is_routed_around_then_used_again(stacks):
    first, second = stacks
    second.kill("worker")
    wait_routable(first, {first.scheduler_address})  # its scheduler says NOT_SERVING: the poll sees it
    # Its engine went with the worker, and so did the Session stream telling what its caches held.
    deadline = time.monotonic() + 20
    while per_metric(first, "pagedserve_scheduler_prefix_blocks").get(second.scheduler_address, 0):
        assert time.monotonic() < deadline, "the gateway still counts a lost engine's cache"
        time.sleep(0.1)
    rng = random.Random(2)
    statuses, deadline = [], time.monotonic() + 20
    while time.monotonic() < deadline and statuses[-10:] != [200] * 10:  # until the health poll has seen it
        statuses.append(complete(first, " ".join(str(rng.randrange(1000)) for _ in range(8))).status_code)
    assert statuses[-10:] == [200] * 10 and set(statuses) <= {200, 503}, statuses
    replies = [complete(first, " ".join(str(rng.randrange(1000)) for _ in range(8))) for _ in range(20)]
    assert [r.status_code for r in replies] == [200] * 20
    assert http_get(f"{first.base_url}/health")[0] == 200
    second.start_worker()  # the scheduler rebuilds its engine on it; the gateway's poll sees it serve
    wait_routable(first, {first.scheduler_address, second.scheduler_address})
    deadline = time.monotonic() + START_LIMIT_S
    while time.monotonic() < deadline and not per_scheduler(first, "num_steps").get(second.scheduler_address):
        assert complete(first, " ".join(str(rng.randrange(1000)) for _ in range(8))).status_code == 200
        time.sleep(0.1)
    assert per_scheduler(first, "num_steps").get(second.scheduler_address), "the second scheduler got no request"
    deadline = time.monotonic() + 60
    while not per_metric(first, "pagedserve_scheduler_prefix_blocks").get(second.scheduler_address):
        assert time.monotonic() < deadline, "the gateway never heard of the new engine's cache"
        assert complete(first, " ".join(str(rng.randrange(1000)) for _ in range(40))).status_code == 200


def test_a_stream_whose_scheduler_dies_goes_on_at_the_other(stacks, llama_dir):
    first, second = stacks
    wait_routable(first, {first.scheduler_address, second.scheduler_address})
    prompt = [random.Random(3).randrange(1, 500) for _ in range(40)]
    offline = LLM(str(llama_dir)).generate({"prompt_token_ids": prompt}, SamplingParams(
        max_tokens=300, temperature=0, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    # The scheduler the prompt hashes to (nothing else is running: the balance rule does not apply).
    key = _affinity_key(request(prompt))
    victim, survivor = sorted(stacks, key=lambda s: _score(s.scheduler_address, key), reverse=True)
    steps_before = per_scheduler(first, "num_steps")[survivor.scheduler_address]
    body = {"model": first.model_name, "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, finish = "", None
    with httpx.stream("POST", f"{first.base_url}/v1/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            if not text:
                victim.procs["scheduler"].send_signal(signal.SIGSTOP)  # no progress from here on
                victim.kill("scheduler")
            text += choice["text"]
            finish = choice["finish_reason"] or finish
    assert text == offline and finish == "length"
    assert per_scheduler(first, "num_steps")[survivor.scheduler_address] > steps_before + 250, "it went on elsewhere"
    victim.start_scheduler()  # back to two, for whatever runs next
    wait_routable(first, {first.scheduler_address, second.scheduler_address})
